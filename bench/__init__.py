"""Benchmarks backing the recorded figures (bench/RESULTS.md), each as ratios against a baseline of the same run, as
absolute rates on a shared machine say little: `python -m bench --list`, docs/benchmarks.md."""
