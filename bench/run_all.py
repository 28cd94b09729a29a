"""Runs every benchmark in sequence (`make bench`, `BENCH_ARGS="--scale 0.1"` for a smaller run) and prints
each module's markdown section; exits non-zero when any target is missed."""

from __future__ import annotations

import sys

from . import consumer_drain, consumer_lateness, stats_bench, store_bench, wheel_bench
from .common import log


def main() -> int:
    checks = []
    for module in (store_bench, wheel_bench, stats_bench, consumer_lateness, consumer_drain):
        log(f"running {module.__name__}")
        checks += module.main()
    missed = [c.name for c in checks if not c.passed]
    log(f"{len(checks) - len(missed)}/{len(checks)} targets met" + (f"; missed: {'; '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
