"""Wheel pass cost under an old transaction (issue 19, item 2): before and after migrations/021's cursor log.

Each run passes the wheel N times back to back on the real clock, on a fresh store, with a trickle of timers falling
due (10 messages due 1 ms ahead every 100 passes), and times every pass. It is run four times: the wheel code at
BEFORE (loaded with `git show`, on a store migrated without migrations/021, as bench/cancel_bench.py loads old cancel code)
and the current code, each without and with a session left `idle in transaction`. By default (--old-in store) that
session holds a REPEATABLE READ snapshot in the store's database and no xid (a report or an application that read and
went idle): it holds no delivery back, but neither the passes nor autovacuum may remove what was deleted or updated
after its snapshot. With --old-in other it holds an xid in another database of the cluster (as Airflow's metadata
may): every pass's snapshot is below it, so the passes cannot prune, but autovacuum may when it finds the store
between statements. Before, each pass's UPDATE of the cursor row left a version that the next passes' reads walked.
Printed: pass p50/p99 over the first and the last 1,000 passes, and last / first. A run stops early after
--budget seconds (before, under the old transaction, a pass slows down without bound).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from delaywheel import Message, Store
from delaywheel.migrate import available, migrate

from .common import drop_database, log, server_url

BEFORE = "a0c5a2a"  # main when issue 19's item 2 work on the cursor started
CURSOR_LOG = "021_"  # the migration the code before does not know
DB = "delaywheel_bench_cursor"
WINDOW = 1000  # passes in each percentile window
ROOT = Path(__file__).resolve().parents[1]  # the checkout (`git show` runs there)


def _wheel_before() -> types.ModuleType:
    """wheel.py at BEFORE, loaded beside the current one."""
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:plugins/delaywheel/wheel.py"], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout
    module = types.ModuleType("delaywheel._wheel_before")
    module.__package__ = "delaywheel"
    sys.modules[module.__name__] = module
    exec(compile(source, "wheel_before.py", "exec"), module.__dict__)
    return module


def _store_db(with_log: bool) -> str:
    """A fresh store database, migrated with or without the cursor log; its URL."""
    drop_database(DB)
    with psycopg.connect(server_url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    url = make_conninfo(server_url(), dbname=DB)
    with tempfile.TemporaryDirectory() as sql_dir:
        for migration in available():  # (package data: read, not copied as files)
            if with_log or not migration.path.name.startswith(CURSOR_LOG):
                (Path(sql_dir) / migration.path.name).write_bytes(migration.path.read_bytes())
        migrate(url, Path(sql_dir))
    return url


def _percentiles(ms: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    return cuts[49], cuts[98]


def run(code: str, old_in: str | None, passes: int, budget: float) -> dict[str, float]:
    """N wheel passes of `code` ('before' or 'after'), an old transaction in `old_in` ('store', 'other' or None); the
    first and last windows' p50/p99 in ms."""
    url = _store_db(with_log=code == "after")
    advance = _wheel_before().advance_wheel if code == "before" else None
    timings: list[float] = []
    with Store(url) as store, psycopg.connect(url if old_in == "store" else server_url()) as old:
        if old_in == "store":
            old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            old.execute("SELECT 1")  # its snapshot; then idle in transaction until the run ends
        elif old_in == "other":
            old.execute("SELECT pg_current_xact_id()")
        started = time.monotonic()
        for i in range(passes):
            if i % 100 == 0:
                store.send_many([Message("bench.cursor", b"x", delay=timedelta(milliseconds=1)) for _ in range(10)])
            t = time.perf_counter()
            if advance is None:
                store.advance_wheel()
            else:
                advance(store.conn, store.settings, store._cache)
            timings.append(1000 * (time.perf_counter() - t))
            if time.monotonic() - started > budget:
                break
        delivered = store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone()
        pages = store.conn.execute(
            "SELECT pg_relation_size(%s) / 8192", ("delaywheel.wheel_state" if advance else "delaywheel.wheel_cursor",)
        ).fetchone()
        old.rollback()
    first, last = _percentiles(timings[:WINDOW]), _percentiles(timings[-WINDOW:])
    result = {
        "passes": len(timings),
        "first_p50": first[0],
        "first_p99": first[1],
        "last_p50": last[0],
        "last_p99": last[1],
        "seconds": time.monotonic() - started,
        "delivered": delivered[0] if delivered else 0,
        "pages": pages[0] if pages else 0,
    }
    log(f"{code}, old transaction in {old_in}: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--passes", type=int, default=60_000, help="wheel passes per run")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds a run may take before it stops early")
    parser.add_argument(
        "--old-in",
        choices=("store", "other"),
        default="store",
        help="the idle-in-transaction session: a snapshot in the store's database, or an xid in another",
    )
    args = parser.parse_args()
    started = datetime.now(UTC)
    rows = [
        (code, old, run(code, old, args.passes, args.budget))
        for old in (None, args.old_in)
        for code in ("before", "after")
    ]
    drop_database(DB)
    print(
        f"\nCommand: `python -m bench.wheel_state_bench --passes {args.passes} --budget {args.budget:g}"
        f" --old-in {args.old_in}` — started {started:%Y-%m-%d %H:%M} UTC\n"
    )
    print(
        "| code | old transaction | passes | first 1,000 p50 / p99 (ms) | last 1,000 p50 / p99 (ms) |"
        " last / first p50 | p99 | cursor pages | delivered |"
    )
    print("|---|---|---:|---|---|---:|---:|---:|---:|")
    for code, old, r in rows:
        print(
            f"| {code} | {f'idle in transaction ({old})' if old else 'none'} | {r['passes']:,.0f} |"
            f" {r['first_p50']:.2f} / {r['first_p99']:.2f} | {r['last_p50']:.2f} / {r['last_p99']:.2f} |"
            f" {r['last_p50'] / r['first_p50']:.2f} | {r['last_p99'] / r['first_p99']:.2f} | {r['pages']:,.0f} |"
            f" {r['delivered']:,.0f} |"
        )


if __name__ == "__main__":
    main()
