"""The daily roll, whole vs in slices (issue 21, item 4; docs/capacity.md, "The roll"), measured in one run.

Two far day blocks of `--rows` timers each (sends of 20,000, so segments of 1,000), in a database of its own. The
first is rolled the old way, the whole block in one transaction holding the wheel's lane lock and ACCESS EXCLUSIVE
on both wheel parents (that is the roll's last step, `wheel._roll`, given the whole block); the second by
`wheel.roll` steps, as the wheel's passes drive it, `--slice` messages a slice. Each of the roll's transactions
is timed (wheel's functions wrapped): each holds the lane's lock; the last step and the one creating the block's
partitions also hold a wheel parent's. Meanwhile two probes stand for what the roll holds up: a
pass taking the lane's lock (a 1 ms transaction under it, every 10 ms) and a producer sending a near timer (every
10 ms). Printed: the longest hold of each lock, the probes' longest waits, and the ratios whole / sliced.

    flock /tmp/delaywheel-bench.lock .venv/bin/python -m bench.roll_bench [--rows 1000000] [--slice 10000]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from delaywheel import Message, Settings, Store
from delaywheel.deliver import wheel
from delaywheel.locks import WHEEL_LOCK
from delaywheel.partitions import DAY

from .common import chunks, drop_database, fresh_database, log

DB = "delaywheel_roll_bench"
T0 = datetime(2031, 3, 1, tzinfo=UTC)
CALL = 20_000
# Each timed transaction of the roll: wheel function -> seconds of each call.
TIMES: dict[str, list[float]] = {}


def _timed(name: str) -> None:
    """Wrap wheel.`name` (looked up at each call by the roll) to record each call's seconds in TIMES[name]."""
    inner = getattr(wheel, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter() - started)

    setattr(wheel, name, timed)


class Probe:
    """Repeats `action` every 10 ms on its own thread, keeping each call's duration (the wait it met)."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.action = action
        self.waits: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            self.action()
            self.waits.append(time.perf_counter() - started)
            self.stop.wait(0.01)

    def __enter__(self) -> Probe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _send_block(store: Store, block: datetime, rows: int) -> None:
    for start, size in chunks(rows, CALL):
        messages = [
            Message("roll.bench", {"i": i}, deliver_at=block + timedelta(seconds=(i * 7919) % 86400))
            for i in range(start, start + size)
        ]
        store.send_many(messages, now=T0)


def _near_until(store: Store) -> datetime:
    return store.conn.execute("SELECT near_until FROM delaywheel.wheel_roll").fetchone()[0]  # type: ignore[index]


def _measure(url: str, clock: datetime, roll_step: Callable[[], float | None]) -> dict[str, float]:
    """Run `roll_step` (one call; returns its seconds, or None when the roll is done) under both probes."""
    TIMES.clear()
    lane = psycopg.connect(url, autocommit=True)

    def take_lane() -> None:
        with lane.transaction():
            lane.execute("SELECT pg_advisory_xact_lock(%s, %s), pg_sleep(0.001)", WHEEL_LOCK)

    with Store(url) as producer:
        near = clock + timedelta(minutes=5)
        producer.send("roll.probe", b"warm", deliver_at=near, now=clock)  # its partition exists before timing

        def send() -> None:
            producer.send("roll.probe", b"x", deliver_at=near, now=clock)

        steps: list[float] = []
        started = time.perf_counter()
        with Probe(take_lane) as passes, Probe(send) as sends:
            while (seconds := roll_step()) is not None:
                steps.append(seconds)
        total = time.perf_counter() - started
    lane.close()
    held = {name: max(seconds) for name, seconds in TIMES.items()}
    return {
        "lane_s": max(held.get("_slice", 0.0), held.get("_roll_partitions", 0.0), held["_roll"]),
        "parents_s": max(held.get("_roll_partitions", 0.0), held["_roll"]),
        "slice_s": held.get("_slice", held["_roll"]),
        "last_s": held["_roll"],
        "partitions_s": held.get("_roll_partitions", 0.0),
        "total_s": total,
        "steps": len(steps),
        "pass_wait_max_s": max(passes.waits),
        "pass_wait_p50_ms": 1000 * statistics.median(passes.waits),
        "send_wait_max_s": max(sends.waits),
        "send_wait_p50_ms": 1000 * statistics.median(sends.waits),
        "passes": len(passes.waits),
        "sends": len(sends.waits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="timers in each far block")
    parser.add_argument("--slice", type=int, default=Settings().wheel_roll_slice, help="wheel_roll_slice")
    args = parser.parse_args()
    for name in ("_roll_partitions", "_slice", "_roll"):
        _timed(name)
    url = fresh_database(DB)
    settings = Settings(wheel_roll_slice=args.slice)
    try:
        with Store(url, settings) as store:
            store.advance_wheel(now=T0)  # near_until: the first far day
            whole_block = _near_until(store)
            sliced_block = whole_block + DAY
            log(
                f"sending 2 x {args.rows:,} timers into the far days {whole_block:%Y-%m-%d} and {sliced_block:%Y-%m-%d}"
            )
            _send_block(store, whole_block, args.rows)
            _send_block(store, sliced_block, args.rows)
            store.conn.execute("VACUUM (ANALYZE) delaywheel.wheel_far_segments")
            store.conn.execute("CHECKPOINT")

            def whole() -> float | None:
                if _near_until(store) != whole_block:
                    return None
                clock = whole_block - settings.wheel_near_window
                started = time.perf_counter()
                wheel._roll(store.conn, settings, store._cache, clock, wheel._roll_target(clock, settings), "")
                return time.perf_counter() - started

            def sliced() -> float | None:
                if _near_until(store) != sliced_block:
                    return None
                started = time.perf_counter()
                wheel.roll(store.conn, settings, store._cache, sliced_block - settings.wheel_near_window)
                return time.perf_counter() - started

            log("the whole block in one transaction")
            before = _measure(url, whole_block - settings.wheel_near_window, whole)
            store.conn.execute("CHECKPOINT")
            log(f"the next block in slices of {args.slice:,}")
            after = _measure(url, sliced_block - settings.wheel_near_window, sliced)
            moved = store.conn.execute("SELECT count(*) FROM delaywheel.wheel WHERE topic = 'roll.bench'").fetchone()
            assert moved == (2 * args.rows,), moved
    finally:
        drop_database(DB)
    print(f"\nroll of {args.rows:,} timers (segments of 1,000), whole vs slices of {args.slice:,}\n")
    print("| measure | whole | sliced | whole / sliced |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("lane_s", "longest hold of the lane's lock, s"),
        ("parents_s", "longest hold of a wheel parent's lock, s"),
        ("pass_wait_max_s", "longest wait of a pass for the lane, s"),
        ("send_wait_max_s", "longest near-timer send, s"),
        ("slice_s", "longest slice, s"),
        ("last_s", "last step (lane + both parents), s"),
        ("partitions_s", "partitions created (wheel parent; whole: inside its one transaction), s"),
        ("total_s", "whole roll, s"),
        ("steps", "roll calls (steps)"),
        ("pass_wait_p50_ms", "pass wait, median, ms"),
        ("send_wait_p50_ms", "send, median, ms"),
        ("passes", "probe passes"),
        ("sends", "probe sends"),
    ):
        ratio = before[key] / after[key] if after[key] else float("inf")
        print(f"| {label} | {before[key]:,.3f} | {after[key]:,.3f} | {ratio:,.1f} |")


if __name__ == "__main__":
    main()
