"""The Spark jobs (spark/) end to end on local Spark, each against what a hand-written load or move of the same
rows costs in the same run, or its time budget.

spark_bulk: one Parquet file of N rows (topic, key, JSON body, level 1-18) loaded by `spark/bulk_enqueue.py` (the
library's validation, idempotency claims, the producer's COPY, a connection per partition), by a raw COPY of the
same rows as CSV into a plain table, and by Spark's JDBC writer (default options) into the same plain table, each
after a small untimed load (the first use of Spark's Python workers and JVM code is paid once for everyone).
Targets: >= 0.5 x the raw COPY, >= 3 x the JDBC writer.
spark_catchup: N overdue messages (1/19 at each level and in the wheel, enqueued with an injected clock) delivered
by `spark/redeliver.py --mode catch-up` (a partition per lane, each running the deliverers' passes), against the raw
move of the same rows (common.RAW_MOVE) in batches of the same size on one connection. Target: >= 0.5 x.
spark_lateness: `spark/lateness_quality.py` over a 15-minute window of N level messages and their deliveries, 0-400
ms late, written straight into the store's tables by SQL (the job only reads them). Target: < 2 minutes for 10M.

    python -m bench spark_bulk|spark_catchup|spark_lateness [--scale 0.1]
"""

from __future__ import annotations

import io
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from delaywheel import Message, Settings, Store
from delaywheel.partitions import HOUR, PartitionCache

from .common import RAW_MOVE, Check, at_least, body, chunks, database, log, options, raw_source, report, scaled, spark

DB = "delaywheel_bench_spark"
T0 = datetime(2031, 1, 1, tzinfo=UTC)  # the injected clock's origin: empty partitions
WARM_UP_ROWS = 200_000
PLAIN = "CREATE TABLE {name} (topic text, key text, body text, delay_level int)"
INPUT = Path("/tmp")  # bulk enqueue reads only under an input root (DELAYWHEEL_INPUT_ROOTS)
PASS = 50_000  # catch-up: messages per delivery pass, and per raw move batch
WINDOW = timedelta(minutes=15)  # lateness: the job's window, from T0
BUDGET_S = 120.0


def main(argv: list[str], name: str) -> list[Check]:
    scale = options(__doc__, "multiply the row count (1.0: 10M, catch-up 5M)", batch=False).parse_args(argv).scale
    return {"spark_bulk": bulk, "spark_catchup": catchup, "spark_lateness": lateness}[name](scale, name, argv)


# --- spark_bulk -----------------------------------------------------------------------------------------------------


def raw_copy(url: str, path: Path) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(PLAIN.format(name="raw_copy"))
        started = time.perf_counter()
        with conn.transaction(), conn.cursor().copy("COPY raw_copy FROM STDIN (FORMAT CSV)") as copy:
            for batch in pq.ParquetFile(path).iter_batches(100_000):
                buffer = io.BytesIO()
                pcsv.write_csv(batch, buffer, pcsv.WriteOptions(include_header=False))
                copy.write(buffer.getvalue())
        return time.perf_counter() - started


def jdbc_write(session: Any, url: str, path: Path) -> float:
    import sparkjob

    properties = sparkjob.jdbc_options(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(PLAIN.format(name="jdbc_plain"))
    jdbc_url = properties.pop("url")  # default options, as the target is set against
    started = time.perf_counter()
    session.read.parquet(str(path)).write.mode("append").jdbc(jdbc_url, "jdbc_plain", properties=properties)
    return time.perf_counter() - started


def enqueue(url: str, path: Path) -> float:
    import bulk_enqueue

    started = time.perf_counter()
    counts = bulk_enqueue.main(
        ["--db-url", url, "--input", str(path), "--topic", "bench.orders", "--body-format", "bytes"]  # body() is bytes
    )
    elapsed = time.perf_counter() - started
    assert counts.enqueued == counts.rows, counts
    return elapsed


def parquet(count: int) -> Path:
    """The input, written once a size: ten row groups (1M rows at most), levels 1-18, ~90-byte JSON bodies."""
    path = INPUT / f"delaywheel_bench_{count}.parquet"
    if path.exists():
        return path
    log(f"writing {count:,} rows to {path}")
    schema = pa.schema(
        [("topic", pa.string()), ("key", pa.string()), ("body", pa.string()), ("delay_level", pa.int32())]
    )
    with pq.ParquetWriter(path, schema) as writer:
        group = min(1_000_000, max(1, count // 10))
        for start in range(0, count, group):
            ids = range(start, min(count, start + group))
            columns = [["bench.orders"] * len(ids), [f"order-{i}" for i in ids], [body(i).decode() for i in ids]]
            writer.write_table(pa.table([*columns, [1 + i % 18 for i in ids]], schema=schema))
    return path


def warm_up(session: Any, count: int) -> str:
    """Every contender once over `count` rows, untimed as far as the checks go, each in a scratch database."""
    path, times = parquet(count), []
    for contender in (enqueue, raw_copy, lambda url, path: jdbc_write(session, url, path)):
        with database(DB + "_warm_up") as url:
            times.append(contender(url, path))
    ours, raw, jdbc = times
    return (
        f"warm-up, {count:,} rows in a scratch database first, each contender once: ours {ours:.1f} s,"
        f" raw COPY {raw:.1f} s, JDBC writer {jdbc:.1f} s"
    )


def bulk(scale: float, name: str, argv: list[str]) -> list[Check]:
    count = scaled(10_000_000, scale)
    os.environ.setdefault("DELAYWHEEL_INPUT_ROOTS", str(INPUT))
    path = parquet(count)
    session = spark("bulk enqueue")
    session.read.parquet(str(path)).count()  # the file cache, for every contender alike
    log(warmed := warm_up(session, min(count, WARM_UP_ROWS)))
    with database(DB) as url:
        log("ours: bulk_enqueue")
        ours = enqueue(url, path)
        log(f"ours {ours:.1f}s; raw COPY")
        raw = raw_copy(url, path)
        log(f"raw {raw:.1f}s; JDBC writer")
        jdbc = jdbc_write(session, url, path)
        with psycopg.connect(url) as conn:
            written = conn.execute(
                "SELECT (SELECT count(*) FROM raw_copy), (SELECT count(*) FROM jdbc_plain),"
                " (SELECT count(*) FROM delaywheel.level_queue)"
            ).fetchone()
    assert written == (count, count, count), written
    checks = [
        at_least("bulk enqueue vs raw COPY (rows/s)", count / ours, count / raw, 0.5),
        at_least("bulk enqueue vs Spark JDBC writer (rows/s)", count / ours, count / jdbc, 3.0),
    ]
    notes = [
        f"ours {ours:.1f} s ({count / ours:,.0f} rows/s), raw COPY {raw:.1f} s, Spark JDBC writer {jdbc:.1f} s",
        "ours validates every row with the library's rules, claims (source, key) for idempotency and COPYs level "
        "segments; the baselines write 4 columns into an unindexed plain table",
        f"Spark local[*] on {session.sparkContext.defaultParallelism} cores; all rows in every table counted after",
        warmed,
    ]
    session.stop()
    return report(name, f"Bulk enqueue from Parquet, {count:,} rows", checks, notes, argv)


# --- spark_catchup --------------------------------------------------------------------------------------------------


def backlog(store: Store, count: int) -> None:
    """1/19 of the backlog at each level and in the wheel (due within two hours of T0)."""
    for start, size in chunks(count, 20_000):
        messages = [
            Message("bench.orders", body(i), deliver_at=T0 + timedelta(seconds=1 + (i * 7919) % 7200), key=f"o{i}")
            if i % 19 == 18
            else Message("bench.orders", body(i), delay_level=i % 19 + 1, key=f"o{i}")
            for i in range(start, start + size)
        ]
        store.send_many(messages, now=T0)


def catchup(scale: float, name: str, argv: list[str]) -> list[Check]:
    count = scaled(5_000_000, scale)
    with database(DB) as url:
        with Store(url) as store:
            store.prepare(now=T0)  # the maintenance DAG's job: the near wheel is rolled before producers write
            log(f"enqueueing {count:,} messages")
            backlog(store, count)
        log("raw move")
        with psycopg.connect(url, autocommit=True) as conn:
            raw_source(conn, "delaywheel.level_queue", "delaywheel.wheel")
            started, moved = time.perf_counter(), 0
            while moved < count:
                with conn.transaction():
                    moved += conn.execute(RAW_MOVE, (PASS,)).rowcount
            raw = time.perf_counter() - started
        log(f"raw {raw:.1f}s; catch-up")
        session = spark("catch-up")
        import redeliver

        t = time.perf_counter()
        now = (T0 + timedelta(hours=3)).isoformat()
        job = redeliver.main(["--db-url", url, "--now", now, "--mode", "catch-up", "--batch", str(PASS)])
        ours = time.perf_counter() - t
        with psycopg.connect(url) as conn:
            delivered = conn.execute(
                "SELECT count(*), count(DISTINCT message_id) FROM delaywheel.topic_messages"
            ).fetchone()
    assert job["delivered"] == count and delivered == (count, count), (job["delivered"], delivered)
    checks = [at_least("catch-up vs raw batched move (messages/s)", count / ours, count / raw, 0.5)]
    notes = [
        f"ours {ours:.1f} s ({count / ours:,.0f} msg/s over 19 lanes in parallel), raw move {raw:.1f} s "
        f"({count / raw:,.0f} rows/s, one connection), batches of {PASS:,}",
        "every message delivered exactly once (count = distinct message ids = backlog)",
        f"Spark local[*] on {session.sparkContext.defaultParallelism} cores",
    ]
    session.stop()
    return report(name, f"Catch-up of {count:,} overdue messages", checks, notes, argv)


# --- spark_lateness -------------------------------------------------------------------------------------------------

# level segments as send_many writes them: 1,000 messages of one level and due time each
QUEUE = """
INSERT INTO delaywheel.level_segments (id_first, id_last, level, requested_level, reconsume_times, deliver_at,
                                       enqueued_at, n, ids, topics, keys, tags, properties, bodies, is_json)
SELECT min(i), max(i), lv, lv, 0, due, due - make_interval(secs => (%(delays)s::float8[])[lv]), count(*),
       array_agg(i ORDER BY i), array_agg('bench.t' || (i %% 4) ORDER BY i), array_agg('k' || i ORDER BY i),
       ARRAY[NULL::text], ARRAY[NULL::text], array_fill('\\x7b7d'::bytea, ARRAY[count(*)::int]), ARRAY[true]
FROM (SELECT i, (i - 1) / 1000 AS g, 1 + ((i - 1) / 1000 %% 18) AS lv,
             %(w0)s::timestamptz + make_interval(secs => (((i - 1) / 1000 * 7919) %% %(span)s) / 1000.0) AS due
      FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) i) g
GROUP BY g, lv, due
"""
DELIVERIES = """
INSERT INTO delaywheel.topic_messages (topic, message_id, origin, level, key, body, is_json, deliver_at, delivered_at)
SELECT m.topic, m.id, 'level', s.level, m.key, m.body, true, s.deliver_at,
       s.deliver_at + make_interval(secs => ((m.id * 7919) %% 400) / 1000.0)
FROM delaywheel.level_segments s, unnest(s.ids, s.topics, s.keys, s.bodies) AS m(id, topic, key, body)
WHERE s.id_first BETWEEN %(lo)s AND %(hi)s
"""


def populate(url: str, count: int) -> None:
    settings = Settings()
    delays = [d.total_seconds() for d in settings.levels]
    span = int(WINDOW.total_seconds() * 1000)
    with psycopg.connect(url, autocommit=True) as conn:
        cache = PartitionCache()
        cache.ensure(conn, "level_segments", [T0 - max(settings.levels) - HOUR + HOUR * i for i in range(5)])
        cache.ensure(conn, "topic_messages", [T0])
        for lo in range(1, count + 1, 1_000_000):
            hi = min(count, lo + 999_999)
            params = {"lo": lo, "hi": hi, "w0": T0, "span": span, "delays": delays}
            conn.execute(QUEUE, params)
            conn.execute(DELIVERIES, params)
            log(f"  {hi:,} written")
        conn.execute("ANALYZE delaywheel.level_segments; ANALYZE delaywheel.topic_messages")


def lateness(scale: float, name: str, argv: list[str]) -> list[Check]:
    count = scaled(10_000_000, scale)
    with database(DB) as url:
        log(f"writing {count:,} due messages and deliveries")
        populate(url, count)
        session = spark("lateness quality")
        import lateness_quality

        window = ["--start", T0.isoformat(), "--end", (T0 + WINDOW).isoformat()]
        t = time.perf_counter()
        result = lateness_quality.main(
            ["--db-url", url, *window, "--p99-ms", "5000", "--report-dir", "/tmp/delaywheel_bench_reports"]
        )
        took = time.perf_counter() - t
    assert result.success, result.message()
    checks = [Check("lateness job over the window (seconds)", took, BUDGET_S, "ours < baseline", took < BUDGET_S)]
    notes = [
        f"the whole job: JDBC reads of {count:,} deliveries and {count:,} due messages, per-minute aggregates, "
        f"4 GX expectations on Spark, result saved, HTML report: {took:.1f} s (budget {BUDGET_S:.0f} s)",
        f"Spark local[*] on {session.sparkContext.defaultParallelism} cores",
    ]
    session.stop()
    return report(name, f"Lateness quality over {count:,} deliveries", checks, notes, argv)
