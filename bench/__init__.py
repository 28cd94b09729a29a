"""Benchmarks: every figure is printed as a ratio against a baseline measured in the same run on the same
PostgreSQL (raw COPY, raw batched move, the naive polling design), because absolute rates on a shared machine
say little. Run one with `python -m bench.<module> --scale 0.1`, or all with `make bench`."""
