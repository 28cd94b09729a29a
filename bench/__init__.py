"""Benchmarks that back the recorded contract figures (bench/RESULTS.md): each prints ours as a ratio against a
baseline measured in the same run on the same PostgreSQL, because absolute rates on a shared machine say little.
`python -m bench --list`; docs/benchmarks.md."""
