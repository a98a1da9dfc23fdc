"""Tests of the user's calls and the plans they make: memory terms, reports, plan files,
parallel jobs, Hugging Face models and trainers."""
