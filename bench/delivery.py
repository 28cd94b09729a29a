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

import psycopg

from delaywheel import Message, Store

from .common import (
    Check,
    Stopwatch,
    at_least,
    body,
    chunks,
    drop_database,
    fresh_database,
    log,
    parse_args,
    report,
    scaled,
)

DB = "delaywheel_bench_delivery"
TOPIC = "bench.orders"
T0 = datetime(2031, 1, 1, tzinfo=UTC)  # the injected clock's origin: empty partitions
COLUMNS = "id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at"
RAW_TABLE = """CREATE TABLE {name} (id bigint, topic text, key text, tags text, properties jsonb, body bytea,
    is_json boolean, deliver_at timestamptz, enqueued_at timestamptz)"""
RAW_MOVE = """WITH m AS (DELETE FROM raw_src WHERE id IN (SELECT id FROM raw_src ORDER BY id LIMIT %s) RETURNING *)
    INSERT INTO raw_dst SELECT * FROM m"""
SOURCES = {  # the backlog's rows, as the raw side's plain table holds them
    "level": f"SELECT {COLUMNS} FROM delaywheel.level_queue WHERE level = 1",
    "wheel": f"SELECT {COLUMNS} FROM delaywheel.wheel",
}


def raw_source(conn: psycopg.Connection, kind: str) -> None:
    conn.execute("DROP TABLE IF EXISTS raw_src, raw_dst")
    conn.execute(RAW_TABLE.format(name="raw_src"))
    conn.execute(f"INSERT INTO raw_src {SOURCES[kind]}")
    conn.execute("ALTER TABLE raw_src ADD PRIMARY KEY (id)")
    conn.execute(RAW_TABLE.format(name="raw_dst"))
    conn.execute("ANALYZE raw_src")


def interleaved(pass_: Callable[[], tuple[int, bool]], raw: psycopg.Connection, count: int, batch: int) -> tuple:
    """Ours (`pass_` returns (delivered, more)) and the raw move, pass by pass until each moved `count`: their
    rates, and how many of ours found nothing while messages remained (another transaction held the horizon)."""
    ours, base, waits = Stopwatch(), Stopwatch(), 0
    delivered = moved = 0
    while delivered < count or moved < count:
        if delivered < count:
            with ours.run():
                n, more = pass_()
            ours.count += n
            delivered += n
            if not more and delivered < count:
                waits += 1
                if waits > 3000:
                    raise RuntimeError(f"stuck at {delivered}/{count}")
                time.sleep(0.02)  # untimed
        if moved < count:
            with base.run():
                step = raw.execute(RAW_MOVE, (batch,)).rowcount
            base.count += step
            moved += step
            if not step:
                raise RuntimeError(f"raw move: {moved} of {count}")
    return ours.rate, base.rate, waits


def main(argv: list[str] | None = None, name: str = "delivery") -> list[Check]:
    args = parse_args(__doc__ or "", argv)
    started = datetime.now(UTC)
    n_level, n_wheel = scaled(1_000_000, args.scale), scaled(500_000, args.scale)
    url = fresh_database(DB)
    checks: list[Check] = []
    notes: list[str] = []
    try:
        with Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
            batch = store.settings.batch_size
            store.prepare(now=T0)
            log(f"level pass vs raw move: {n_level} due level-1 messages")
            for start, size in chunks(n_level, args.batch):
                store.send_many(
                    [Message(TOPIC, body(start + j), delay_level=1, key=f"l-{start + j}") for j in range(size)],
                    now=T0,
                )
            raw_source(raw, "level")
            now = T0 + timedelta(minutes=1)

            def level_pass() -> tuple[int, bool]:
                result = store.deliver_level(1, now=now)
                return result.delivered, result.more

            ours, base, waits = interleaved(level_pass, raw, n_level, batch)
            checks.append(at_least("level pass / raw move (msg/s)", ours, base, 0.50))
            notes.append(f"level: {n_level:,} due, {batch:,} a pass; passes that waited on the horizon: {waits}")

            log(f"wheel pass vs raw move: {n_wheel} timers due in the same second")
            due = T0 + timedelta(minutes=10)
            store.prepare(now=due - timedelta(minutes=5))
            for start, size in chunks(n_wheel, args.batch):
                store.send_many(
                    [Message(TOPIC, body(start + j), deliver_at=due, key=f"w-{start + j}") for j in range(size)],
                    now=due - timedelta(minutes=5),
                )
            raw_source(raw, "wheel")

            def wheel_pass() -> tuple[int, bool]:
                result = store.advance_wheel(now=due + timedelta(seconds=1))
                return result.delivered, result.more

            ours, base, waits = interleaved(wheel_pass, raw, n_wheel, batch)
            checks.append(at_least("wheel pass / raw move (msg/s)", ours, base, 0.50))
            notes.append(f"wheel: {n_wheel:,} due at once, {batch:,} a pass; passes that waited: {waits}")
    finally:
        drop_database(DB)
    report(name, "Delivery passes against the raw move", checks, notes, started, argv)
    return checks
