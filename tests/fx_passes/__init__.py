"""Tests of the torch side: capture, measuring, lowering, the compiled and eager runtimes."""
