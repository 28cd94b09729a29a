"""Spark catch-up (issue 5): N overdue messages delivered by `spark/redeliver.py --mode catch-up` against a raw
batched move of the same rows.

The backlog (levels 1-18 and wheel times within two hours, 1/19 each) is enqueued with an injected clock,
then the job delivers it with the clock three hours later: one partition per level and one for the wheel,
each running the deliverers' own passes (checkpoint in the same transaction, cancellation anti-join).
The baseline moves the same rows from a plain table with a primary key into another plain table by
`DELETE ... RETURNING` into `INSERT`, in batches of the same size, on one connection.
Target: ours >= 0.5 x the raw move rate.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from delaywheel import Message, Settings, Store

from .common import Check, at_least, body, chunks, fresh_database, log, parse_args, report, scaled
from .delivery import RAW_MOVE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spark"))
import redeliver  # a spark/ script, imported by module name like the tests do
import sparkjob

DB = "delaywheel_bench_spark"
ROWS = 5_000_000
T0 = datetime(2031, 1, 1, tzinfo=UTC)
PASS = 50_000  # messages per delivery pass, and per raw move batch


def enqueue(store: Store, count: int, batch: int) -> None:
    for start, size in chunks(count, batch):
        messages = []
        for i in range(start, start + size):
            lane = i % 19
            if lane == 18:
                due = T0 + timedelta(seconds=1 + (i * 7919) % 7200)
                messages.append(Message("bench.orders", body(i), deliver_at=due, key=f"o{i}"))
            else:
                messages.append(Message("bench.orders", body(i), delay_level=lane + 1, key=f"o{i}"))
        store.send_many(messages, now=T0)


def raw_move(url: str, count: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE raw_src AS SELECT id, topic, key, tags, properties, body, is_json, deliver_at"
            " FROM delaywheel.level_queue UNION ALL SELECT id, topic, key, tags, properties, body, is_json,"
            " deliver_at FROM delaywheel.wheel"
        )
        conn.execute("ALTER TABLE raw_src ADD PRIMARY KEY (id)")
        conn.execute("CREATE TABLE raw_dst (LIKE raw_src)")
        conn.execute("ANALYZE raw_src")
        started = time.perf_counter()
        moved = 0
        while moved < count:
            with conn.transaction():
                moved += conn.execute(RAW_MOVE, (PASS,)).rowcount
        return time.perf_counter() - started


def main(argv: list[str] | None = None, name: str = "spark_catchup") -> list[Check]:
    args = parse_args(__doc__.splitlines()[0], argv)
    count = scaled(ROWS, args.scale)
    started_at = datetime.now(UTC)
    url = fresh_database(DB)
    settings = Settings()
    with Store(url, settings) as store:
        store.prepare(now=T0)  # the maintenance DAG's job: the near wheel is rolled before producers write
        log(f"enqueueing {count:,} messages")
        enqueue(store, count, args.batch)
    log("raw move")
    raw = raw_move(url, count)
    log(f"raw {raw:.1f}s; catch-up")
    spark = sparkjob.session("delaywheel bench: catch-up")
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(1).count()  # the JVM is warm before the clock starts
    t = time.perf_counter()
    job = redeliver.main(
        ["--db-url", url, "--now", (T0 + timedelta(hours=3)).isoformat(), "--mode", "catch-up", "--batch", str(PASS)]
    )
    ours = time.perf_counter() - t
    with psycopg.connect(url) as conn:
        delivered = conn.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM delaywheel.topic_messages"
        ).fetchone()
    assert job["delivered"] == count and delivered == (count, count), (job["delivered"], delivered)
    checks = [at_least("catch-up vs raw batched move (messages/s)", count / ours, count / raw, 0.5)]
    report(
        name,
        f"Catch-up of {count:,} overdue messages",
        checks,
        [
            f"ours {ours:.1f} s ({count / ours:,.0f} msg/s over 19 lanes in parallel), raw move {raw:.1f} s "
            f"({count / raw:,.0f} rows/s, one connection), batches of {PASS:,}",
            "every message delivered exactly once (count = distinct message ids = backlog)",
            f"Spark local[*] on {spark.sparkContext.defaultParallelism} cores",
        ],
        started_at,
        argv,
    )
    spark.stop()
    return checks
