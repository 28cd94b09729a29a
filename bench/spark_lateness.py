"""Spark lateness quality (issue 5): the whole `spark/lateness_quality.py` job over N deliveries.

A 15-minute due window holds N level messages (levels 1-18, 4 topics) and their N deliveries, each 0-400 ms
late, written straight into the store's tables by SQL (the job only reads them). The job reads both over
JDBC, aggregates per minute, lane and topic, runs the Great Expectations contract on Spark, saves the
result and renders the report. Target: under 2 minutes for 10M deliveries.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from delaywheel import Settings
from delaywheel.partitions import HOUR, PartitionCache

from .common import Check, fresh_database, log, parse_args, report, scaled, smaller

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spark"))
import lateness_quality  # a spark/ script, imported by module name like the tests do
import sparkjob

DB = "delaywheel_bench_spark"
ROWS = 10_000_000
W0 = datetime(2031, 2, 1, tzinfo=UTC)
WINDOW = timedelta(minutes=15)
BUDGET_S = 120.0

# level segments as send_many writes them: 1,000 messages of one level and due time each (migrations/011)
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
        cache.ensure(conn, "level_segments", [W0 - max(settings.levels) - HOUR + HOUR * i for i in range(5)])
        cache.ensure(conn, "topic_messages", [W0])
        for lo in range(1, count + 1, 1_000_000):
            hi = min(count, lo + 999_999)
            params = {"lo": lo, "hi": hi, "w0": W0, "span": span, "delays": delays}
            conn.execute(QUEUE, params)
            conn.execute(DELIVERIES, params)
            log(f"  {hi:,} written")
        conn.execute("ANALYZE delaywheel.level_segments; ANALYZE delaywheel.topic_messages")


def main(argv: list[str] | None = None, name: str = "spark_lateness") -> list[Check]:
    args = parse_args(__doc__.splitlines()[0], argv)
    count = scaled(ROWS, args.scale)
    started_at = datetime.now(UTC)
    url = fresh_database(DB)
    log(f"writing {count:,} due messages and deliveries")
    populate(url, count)
    spark = sparkjob.session("delaywheel bench: lateness quality")
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(1).count()
    t = time.perf_counter()
    result = lateness_quality.main(
        [
            "--db-url",
            url,
            "--start",
            W0.isoformat(),
            "--end",
            (W0 + WINDOW).isoformat(),
            "--p99-ms",
            "5000",
            "--report-dir",
            "/tmp/delaywheel_bench_reports",
        ]
    )
    took = time.perf_counter() - t
    assert result.success, result.message()
    checks = [smaller("lateness job over the window (seconds)", took, BUDGET_S)]
    report(
        name,
        f"Lateness quality over {count:,} deliveries",
        checks,
        [
            f"the whole job: JDBC reads of {count:,} deliveries and {count:,} due messages, per-minute aggregates, "
            f"4 GX expectations on Spark, result saved, HTML report: {took:.1f} s (budget {BUDGET_S:.0f} s)",
            f"Spark local[*] on {spark.sparkContext.defaultParallelism} cores",
        ],
        started_at,
        argv,
    )
    spark.stop()
    return checks
