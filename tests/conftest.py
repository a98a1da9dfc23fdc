import os
import sys

# Benchmarks and examples import the test models by package path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
