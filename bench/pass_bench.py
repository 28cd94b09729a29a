"""One delivery pass per message (issue 19): what a level pass and a wheel pass cost for one due message, and an
idle level pass, beside a raw move of one row (DELETE ... RETURNING into INSERT, one autocommit statement: the
least a hand-written queue does to deliver a row) on the same server.

Each case runs in turn, round by round, so load hits them alike; the clock is injected, so every message is due
without waiting. With `--before REV` the same cases run for the code at a git revision (e.g. the commit before the
level pass was pipelined), exported and run in a process of its own on a database of its own, alternating with the
current code's process block by block.

    python -m bench.pass_bench [--count 1000] [--blocks 4] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from bench.common import Check, body, drop_database, fresh_database, log, print_section
from bench.send_bench import ROOT, export_revision, percentile
from delaywheel import Store

DBS = {"now": "delaywheel_bench_pass", "before": "delaywheel_bench_pass_before"}
TOPIC = "bench.pass"
RAW = """CREATE TABLE IF NOT EXISTS raw_queue (id bigserial PRIMARY KEY, topic text NOT NULL, body bytea NOT NULL,
    deliver_at timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS raw_topic (id bigint NOT NULL, topic text NOT NULL, body bytea NOT NULL,
    deliver_at timestamptz NOT NULL, delivered_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
RAW_MOVE = """WITH d AS (DELETE FROM raw_queue WHERE id = (SELECT min(id) FROM raw_queue) RETURNING *)
INSERT INTO raw_topic (id, topic, body, deliver_at) SELECT id, topic, body, deliver_at FROM d"""
CASES = ("level pass, one message", "wheel pass, one message", "idle level pass", "raw move, one row")


def measure(url: str, count: int) -> dict[str, list[float]]:
    """µs per pass, by case (CASES), `count` rounds of every case in turn, after a warm-up."""
    with Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
        raw.execute(RAW)
        start = raw.execute(  # after any earlier block's injected clock (it never goes back) and its last timer
            "SELECT greatest(clock_timestamp(), (SELECT cursor_at FROM delaywheel.wheel_state),"
            " (SELECT max(deliver_at) FROM delaywheel.wheel)) + interval '1 minute'"
        ).fetchone()
        assert start is not None
        t0: datetime = start[0]
        store.prepare(now=t0)
        store.advance_wheel(now=t0)  # an earlier block's last timer, delivered before this block's rounds
        # A wheel that holds timers beyond the one due: one more, due minutes after the last round (a pass's head)
        store.send(TOPIC, body(0), delay=timedelta(seconds=2 * (count + 50) + 600), now=t0)

        def level(i: int) -> Callable[[], object]:
            store.send(TOPIC, body(i), delay_level=1, now=t0 + timedelta(seconds=2 * i))
            return lambda: _one(store.deliver_level(1, now=t0 + timedelta(seconds=2 * i + 1)).delivered)

        def wheel(i: int) -> Callable[[], object]:
            store.send(TOPIC, body(i), delay=1000, now=t0 + timedelta(seconds=2 * i))
            return lambda: _one(store.advance_wheel(now=t0 + timedelta(seconds=2 * i + 1)).delivered)

        def idle(i: int) -> Callable[[], object]:
            return lambda: store.deliver_level(2, now=t0 + timedelta(seconds=2 * i + 1))

        def raw_move(i: int) -> Callable[[], object]:
            raw.execute(
                "INSERT INTO raw_queue (topic, body, deliver_at) VALUES (%s, %s, %s)",
                (TOPIC, body(i), t0 + timedelta(seconds=2 * i + 1)),
            )
            return lambda: _one(raw.execute(RAW_MOVE).rowcount)

        setups = dict(zip(CASES, (level, wheel, idle, raw_move), strict=True))
        times: dict[str, list[float]] = {name: [] for name in CASES}
        for i in range(count + 50):  # the first 50 rounds warm up: connections, prepared statements, partitions
            for name, setup in setups.items():
                call = setup(i)  # the message is sent before the timed pass, untimed
                started = time.perf_counter()
                call()
                if i >= 50:
                    times[name].append(1e6 * (time.perf_counter() - started))
    return times


def _one(delivered: int) -> None:
    assert delivered == 1, f"delivered {delivered}, not the one message due"


def _block(label: str, url: str, count: int, pythonpath: str | None) -> dict[str, list[float]]:
    """One block of `measure` in a process of its own (the code of `pythonpath` first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)}
    log(f"{label}: {count} rounds")
    out = subprocess.run(
        [sys.executable, "-m", "bench.pass_bench", "--measure", url, "--count", str(count)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode:
        sys.exit(f"{label}: the block failed:\n{out.stderr}")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main() -> list[Check]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="rounds per block (default 1000)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per code version, alternating (default 4)")
    parser.add_argument("--before", metavar="REV", help="also time the code of this git revision")
    parser.add_argument("--measure", metavar="URL", help=argparse.SUPPRESS)  # one block, as JSON (a subprocess)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.count)))
        return []
    started = datetime.now(UTC)
    load = os.getloadavg()
    labels = ["now", "before"] if args.before else ["now"]
    urls = {label: fresh_database(DBS[label]) for label in labels}
    times: dict[str, dict[str, list[float]]] = {label: {name: [] for name in CASES} for label in labels}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            paths = {"now": None, "before": export_revision(args.before, Path(tmp)) if args.before else None}
            for _ in range(args.blocks):
                for label in labels:
                    for name, values in _block(label, urls[label], args.count, paths[label]).items():
                        times[label][name] += values
    finally:
        for label in labels:
            drop_database(DBS[label])
    p50 = {label: {name: percentile(v, 50) for name, v in cases.items()} for label, cases in times.items()}
    p99 = {label: {name: percentile(v, 99) for name, v in cases.items()} for label, cases in times.items()}
    ours = p50["now"]
    checks = [
        Check(
            "level pass p50, one message, against a wheel pass (µs)",
            ours["level pass, one message"],
            ours["wheel pass, one message"],
            "ratio <= 1.00",
            ours["level pass, one message"] <= ours["wheel pass, one message"],
        )
    ]
    if args.before:
        checks += [
            Check(
                f"{name} p50 against {args.before} (µs)",
                ours[name],
                p50["before"][name],
                "ratio < 1.00",
                ours[name] < p50["before"][name],
            )
            for name in CASES[:3]
        ]
    notes = [
        f"load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min), 2 cores;"
        f" {args.blocks} blocks of {args.count:,} rounds per code version, every case once per round"
    ]
    for label in labels:
        code = "this code" if label == "now" else f"code at {args.before}"
        raw = p50[label]["raw move, one row"]
        notes += [
            f"{code}, {name}: p50 {p50[label][name]:,.0f} µs, p99 {p99[label][name]:,.0f} µs"
            + ("" if name == "raw move, one row" else f" (x{p50[label][name] / raw:.2f} the raw move's p50)")
            for name in CASES
        ]
    print_section(
        "One delivery pass per message (issue 19)",
        checks,
        notes,
        started,
        "python -m bench.pass_bench" + (f" --before {args.before}" if args.before else ""),
    )
    return checks


if __name__ == "__main__":
    main()
