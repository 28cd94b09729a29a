"""One message at a time (issue 19, item 5): a single `Store.send` beside a single-row INSERT, and the CLI's start.

1. `send` p50/p99 against a single-row INSERT into a comparable plain table (every field a message carries, a bigint
   primary key and a due-time index: what a hand-written delayed-jobs table has), on the same server, interleaved
   call by call so both see the same load: each on its own (autocommit: the statement is the transaction), and
   inside a caller's transaction (BEGIN, the send or INSERT, COMMIT: the web application's case, the order row's
   transaction). The target is p50 within 2 x the INSERT's. For reference, the batch path with one message
   (`send_many([m])`: six round trips and Arrow arrays, what `send` was before migrations/019) is timed in the same run.
2. CLI start: wall and CPU time of `delaywheel --help` and of a `delaywheel send`, median of several runs; with
   `--before REV`, the same for the code at a git revision (e.g. the commit before this change), run from an export.

    python -m bench.send_bench [--count 2000] [--cli-runs 7] [--before REV]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from bench.common import Check, body, drop_database, fresh_database, log, print_section
from delaywheel import Message, Store

DB = "delaywheel_bench_send"
TOPIC = "bench.orders"
ROOT = Path(__file__).resolve().parents[1]  # the checkout
RAW_TABLE = """CREATE TABLE raw_timers (id bigserial PRIMARY KEY, topic text NOT NULL, key text, tags text,
    properties jsonb, body bytea NOT NULL, is_json boolean NOT NULL, deliver_at timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
RAW_INDEX = "CREATE INDEX raw_timers_due ON raw_timers (deliver_at)"
INSERT = (
    "INSERT INTO raw_timers (topic, key, tags, body, is_json, deliver_at)"
    " VALUES (%s, %s, %s, %s, false, clock_timestamp() + %s * interval '1 millisecond') RETURNING id"
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return 1e6 * (time.perf_counter() - started)  # µs


def single_sends(store: Store, raw: psycopg.Connection, count: int) -> dict[str, list[float]]:
    """µs per call, by case. Each round runs every case once, in turn, so that load hits them alike."""
    raw.execute(RAW_TABLE)
    raw.execute(RAW_INDEX)
    cases: dict[str, Callable[[int], object]] = {
        "send, level": lambda i: store.send(TOPIC, body(i), delay_level=3, key=f"l-{i}", tags="created"),
        "send, wheel": lambda i: store.send(TOPIC, body(i), delay=30_000, key=f"w-{i}", tags="created"),
        "INSERT": lambda i: raw.execute(INSERT, (TOPIC, f"r-{i}", "created", body(i), 30_000)).fetchone(),
        "send in tx, wheel": lambda i: _in(
            store.conn, lambda: store.send(TOPIC, body(i), delay=30_000, key=f"t-{i}", tags="created")
        ),
        "INSERT in tx": lambda i: _in(
            raw, lambda: raw.execute(INSERT, (TOPIC, f"x-{i}", "created", body(i), 30_000)).fetchone()
        ),
        "send_many([m]), wheel": lambda i: store.send_many(
            [Message(TOPIC, body(i), delay=30_000, key=f"m-{i}", tags="created")]
        ),
    }
    for i in range(50):  # warm up: connections, prepared statements, partitions
        for call in cases.values():
            call(i)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(count):
        for name, call in cases.items():
            times[name].append(_timed(lambda call=call, i=i: call(i)))  # type: ignore[misc]
    return times


def _in(conn: psycopg.Connection, call: Callable[[], object]) -> None:
    with conn.transaction():  # BEGIN ... COMMIT around the one call, as the caller's own transaction
        call()


def cli_start(env: dict[str, str], runs: int, pythonpath: str | None = None) -> dict[str, tuple[float, float]]:
    """Median (wall ms, CPU ms) of `delaywheel --help` and of one `delaywheel send`."""
    if pythonpath:
        env = {**env, "PYTHONPATH": pythonpath}
    commands = {
        "--help": [sys.executable, "-m", "delaywheel.cli", "--help"],
        "send": [sys.executable, "-m", "delaywheel.cli", "send", "--topic", TOPIC, "--body", '{"n": 1}', "--in", "30s"],
    }
    out = {}
    for name, argv in commands.items():
        walls, cpus = [], []
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            subprocess.run(argv, env=env, check=True, capture_output=True, cwd=tempfile.gettempdir())
            walls.append(1000 * (time.perf_counter() - started))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(1000 * (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime))
        out[name] = (statistics.median(walls), statistics.median(cpus))
    return out


def export_revision(rev: str, into: Path, paths: tuple[str, ...] = ("plugins",)) -> str:
    """The plugins folder of a git revision (and any other `paths` of it), exported under `into`; returns the plugins
    folder, for PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return str(into / "plugins")


def main() -> list[Check]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="calls per case (default 2000)")
    parser.add_argument("--cli-runs", type=int, default=7)
    parser.add_argument("--before", metavar="REV", help="also time the CLI of this git revision")
    args = parser.parse_args()
    started = datetime.now(UTC)
    load = os.getloadavg()
    url = fresh_database(DB)
    try:
        with Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
            store.prepare()
            log(f"single sends: {args.count} rounds of {6} cases")
            times = single_sends(store, raw, args.count)
        env = {**os.environ, "DELAYWHEEL_DATABASE_URL": url}
        log("CLI start")
        cli = cli_start(env, args.cli_runs)
        before = None
        if args.before:
            with tempfile.TemporaryDirectory() as tmp:
                before = cli_start(env, args.cli_runs, export_revision(args.before, Path(tmp)))
    finally:
        drop_database(DB)
    p50 = {name: percentile(values, 50) for name, values in times.items()}
    p99 = {name: percentile(values, 99) for name, values in times.items()}
    checks = [
        Check(
            "send p50, level (µs)",
            p50["send, level"],
            p50["INSERT"],
            "ratio <= 2.00",
            p50["send, level"] <= 2 * p50["INSERT"],
        ),
        Check(
            "send p50, wheel (µs)",
            p50["send, wheel"],
            p50["INSERT"],
            "ratio <= 2.00",
            p50["send, wheel"] <= 2 * p50["INSERT"],
        ),
        Check(
            "send p50 in a caller's tx, wheel (µs)",
            p50["send in tx, wheel"],
            p50["INSERT in tx"],
            "ratio <= 2.00",
            p50["send in tx, wheel"] <= 2 * p50["INSERT in tx"],
        ),
    ]
    notes = [
        f"load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min), 2 cores;"
        f" {args.count:,} calls per case, interleaved"
    ]
    for name in times:
        base = "INSERT in tx" if "tx" in name else "INSERT"
        notes.append(
            f"{name}: p50 {p50[name]:,.0f} µs, p99 {p99[name]:,.0f} µs"
            + (
                ""
                if name.startswith("INSERT")
                else f" (x{p50[name] / p50[base]:.2f} / x{p99[name] / p99[base]:.2f} the {base}'s p50 / p99)"
            )
        )
    for label, figures in (("CLI", cli), (f"CLI at {args.before}", before)):
        if figures:
            notes.append(
                f"{label} start, median of {args.cli_runs}: "
                + "; ".join(
                    f"`delaywheel {name}` {wall:,.0f} ms wall, {cpu:,.0f} ms CPU"
                    for name, (wall, cpu) in figures.items()
                )
            )
    print_section(
        "Single send and CLI start (issue 19, item 5)",
        checks,
        notes,
        started,
        "python -m bench.send_bench" + (f" --before {args.before}" if args.before else ""),
    )
    return checks


if __name__ == "__main__":
    main()
