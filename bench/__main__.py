"""One entry point for the benchmarks: `python -m bench <name> [options]`, `python -m bench --list`.

Each benchmark backs a recorded figure (bench/RESULTS.md); each prints its ratios against a baseline measured in the
same run and writes its JSON under bench/results/ (`--results DIR` before the name writes it elsewhere, e.g. for a
check that is not a measurement). `python -m bench contract [--scale S]` runs the contract set in sequence. Exits
non-zero when a target is missed."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from . import common

BENCHMARKS = {
    "send": "send: a single send against a single-row INSERT, send_many against a raw COPY (levels and wheel)",
    "delivery": "delivery: a level pass and a wheel pass against the raw DELETE ... RETURNING move",
    "consumer_lateness": "consumer lateness at a steady 1,000 msg/s, against delivery-only lateness",
    "consumer_drain": "one consumer draining delivered messages, against delivery alone and a raw drain",
    "cancel": "cancel(key=...) p50 against a durable INSERT; delivery p99 with cancels racing against without",
    "spark_bulk": "the Spark bulk enqueue job from Parquet, against a raw COPY and Spark's JDBC writer",
    "spark_catchup": "the Spark catch-up job, against a raw batched move",
    "spark_lateness": "the Spark lateness-quality job over N deliveries, against its time budget",
    "demo": "the example shop's order-timeout sweep against a raw UPDATE, and the demo's wall time",
    "group": "a consumer group's members: 1-8 consumers' throughput, lateness with 4, a consumer killed",
    "capacity": "bytes, WAL and CPU per pending timer and per delivered message, extrapolated to 1 billion",
}
CONTRACT = ("send", "delivery", "cancel", "consumer_lateness", "consumer_drain")  # `contract`: every --scale'd one


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--list", action="store_true", help="list the benchmarks")
    parser.add_argument("--results", type=Path, help="write the JSON here instead of bench/results/")
    parser.add_argument("name", nargs="?", choices=[*BENCHMARKS, "contract"])
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's (`--help` after its name)")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for name, text in BENCHMARKS.items():
            print(f"{name:18} {text}")
        print(f"{'contract':18} {', '.join(CONTRACT)} in sequence (--scale S passed to each)")
        return 0
    # The benchmarks inject clocks, as the tests do (backlogs due without waiting), each in a database of its own.
    os.environ.setdefault("DELAYWHEEL_TEST_CLOCK", "1")
    if args.results:
        common.RESULTS = args.results
    checks = []
    for name in CONTRACT if args.name == "contract" else [args.name]:
        common.log(f"running {name}")
        common.STARTED = datetime.now(UTC)
        module = importlib.import_module(f"bench.{name.split('_')[0]}")  # spark_bulk: bench.spark
        checks += module.main(args.options, name)
    missed = [c.name for c in checks if not c.passed]
    which = f"; missed: {'; '.join(missed)}" if missed else ""
    common.log(f"{len(checks) - len(missed)}/{len(checks)} targets met{which}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
