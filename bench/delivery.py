"""Delivery passes against the raw move of the same rows, on the same server in the same run.

A due backlog of `1M x scale` level-1 messages, delivered by level passes, and one of `500k x scale` wheel timers
due in the same second, delivered by wheel passes (the clock injected, so both are due without waiting); each
against a raw `DELETE ... RETURNING` into `INSERT` of the same rows from a plain table with a primary key into
another, the same batch size, interleaved pass by pass so both see the same load. Targets: >= 0.50 x the raw move.
The loop's lateness on the real clock is the consumer benchmarks' (`python -m bench consumer_lateness`).

    python -m bench delivery [--scale 0.1] [--batch 20000]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from delaywheel import Message, Store

from .common import RAW_MOVE, Check, at_least, body, chunks, database, log, options, raw_source, report, scaled

DB = "delaywheel_bench_delivery"
TOPIC = "bench.orders"
T0 = datetime(2031, 1, 1, tzinfo=UTC)  # the injected clock's origin: empty partitions


def interleaved(pass_: Callable[[], Any], raw: psycopg.Connection, count: int, batch: int) -> tuple:
    """Ours (`pass_`, one pass) and the raw move, pass by pass until each moved `count`: their rates, and how many
    of ours found nothing while messages remained (another transaction held the horizon)."""
    ours = base = 0.0  # seconds
    delivered = moved = waits = 0
    while delivered < count or moved < count:
        if delivered < count:
            started = time.perf_counter()
            result = pass_()
            ours += time.perf_counter() - started
            delivered += result.delivered
            if not result.more and delivered < count:
                waits += 1
                if waits > 3000:
                    raise RuntimeError(f"stuck at {delivered}/{count}")
                time.sleep(0.02)  # untimed
        if moved < count:
            started = time.perf_counter()
            step = raw.execute(RAW_MOVE, (batch,)).rowcount
            base += time.perf_counter() - started
            if not step:
                raise RuntimeError(f"raw move: {moved} of {count}")
            moved += step
    return count / ours, count / base, waits


def main(argv: list[str], name: str) -> list[Check]:
    args = options(__doc__).parse_args(argv)
    n_level, n_wheel = scaled(1_000_000, args.scale), scaled(500_000, args.scale)
    checks: list[Check] = []
    notes: list[str] = []
    with database(DB) as url, Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
        batch = store.settings.batch_size
        store.prepare(now=T0)
        log(f"level pass vs raw move: {n_level} due level-1 messages")
        for start, size in chunks(n_level, args.batch):
            store.send_many([Message(TOPIC, body(i), 1, key=f"l-{i}") for i in range(start, start + size)], now=T0)
        raw_source(raw, "delaywheel.level_queue WHERE level = 1")
        ours, base, waits = interleaved(
            lambda: store.deliver_level(1, now=T0 + timedelta(minutes=1)), raw, n_level, batch
        )
        checks.append(at_least("level pass / raw move (msg/s)", ours, base, 0.50))
        notes.append(f"level: {n_level:,} due, {batch:,} a pass; passes that waited on the horizon: {waits}")

        log(f"wheel pass vs raw move: {n_wheel} timers due in the same second")
        due, sent_at = T0 + timedelta(minutes=10), T0 + timedelta(minutes=5)
        store.prepare(now=sent_at)
        for start, size in chunks(n_wheel, args.batch):
            timers = [Message(TOPIC, body(i), deliver_at=due, key=f"w-{i}") for i in range(start, start + size)]
            store.send_many(timers, now=sent_at)
        raw_source(raw, "delaywheel.wheel")
        ours, base, waits = interleaved(
            lambda: store.advance_wheel(now=due + timedelta(seconds=1)), raw, n_wheel, batch
        )
        checks.append(at_least("wheel pass / raw move (msg/s)", ours, base, 0.50))
        notes.append(f"wheel: {n_wheel:,} due at once, {batch:,} a pass; passes that waited: {waits}")
    return report(name, "Delivery passes against the raw move", checks, notes, argv)
