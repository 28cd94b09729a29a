"""Spark bulk enqueue: the job end to end from Parquet, against a raw COPY and Spark's JDBC writer.

One Parquet file of N rows (topic, key, JSON body, delay level 1-18) loaded three ways in one run: ours
(`spark/bulk_enqueue.py`: the library's validation, idempotency claims, the producer's COPY, a connection per
partition); a raw COPY of the same rows as CSV into a plain table (no validation, no indexes); Spark's JDBC writer
(`df.write.jdbc`, default options) into the same plain table. Targets: ours >= 0.5 x raw COPY and >= 3 x JDBC.
Each contender first loads a small file once into a scratch database: rates of the steady state, not of the first
use of Spark's Python workers or of JVM code that whoever ran first would pay for everyone.

    python -m bench spark_bulk [--scale 0.1]
"""

from __future__ import annotations

import io
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from .common import Check, at_least, body, drop_database, fresh_database, log, parse_args, report, scaled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spark"))
import bulk_enqueue  # a spark/ script, imported by module name like the tests do
import sparkjob

DB = "delaywheel_bench_spark"
ROWS = 10_000_000
WARM_UP_ROWS = 200_000
PLAIN = "CREATE TABLE {name} (topic text, key text, body text, delay_level int)"


def write_parquet(path: Path, count: int) -> None:
    """The input: ten row groups (of at most 1M rows), levels 1-18, a ~90-byte JSON body, unique keys."""
    schema = pa.schema(
        [("topic", pa.string()), ("key", pa.string()), ("body", pa.string()), ("delay_level", pa.int32())]
    )
    with pq.ParquetWriter(path, schema) as writer:
        group = min(1_000_000, max(1, count // 10))
        for start in range(0, count, group):
            ids = range(start, min(count, start + group))
            writer.write_table(
                pa.table(
                    {
                        "topic": ["bench.orders"] * len(ids),
                        "key": [f"order-{i}" for i in ids],
                        "body": [body(i).decode() for i in ids],
                        "delay_level": [1 + i % 18 for i in ids],
                    },
                    schema=schema,
                )
            )


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


def jdbc_write(spark: object, url: str, path: Path, table: str) -> float:
    options = sparkjob.jdbc_options(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(PLAIN.format(name=table))
    jdbc_url = options.pop("url")  # default options, as the target is set against
    started = time.perf_counter()
    spark.read.parquet(str(path)).write.mode("append").jdbc(jdbc_url, table, properties=options)  # type: ignore[attr-defined]
    return time.perf_counter() - started


def enqueue(url: str, path: Path) -> float:
    started = time.perf_counter()
    counts = bulk_enqueue.main(
        [
            "--db-url",
            url,
            "--input",
            str(path),
            "--topic",
            "bench.orders",
            "--body-format",
            "bytes",  # common.body() is raw bytes
        ]
    )
    elapsed = time.perf_counter() - started
    assert counts.enqueued == counts.rows, counts
    return elapsed


BENCH_INPUT = Path("/tmp")


def parquet(count: int) -> Path:
    path = BENCH_INPUT / f"delaywheel_bench_{count}.parquet"
    if not path.exists():
        log(f"writing {count:,} rows to {path}")
        write_parquet(path, count)
    return path


def warm_up(spark: object, path: Path, count: int) -> str:
    """Every contender once over `path`, untimed as far as the checks go, each in a scratch database."""
    contenders = (
        lambda url: enqueue(url, path),
        lambda url: raw_copy(url, path),
        lambda url: jdbc_write(spark, url, path, "jdbc_plain"),
    )
    times = []
    for contender in contenders:
        try:
            times.append(contender(fresh_database(DB + "_warm_up")))
        finally:
            drop_database(DB + "_warm_up")
    return (
        "warm-up, {:,} rows in a scratch database first, each contender once: ours {:.1f} s, raw COPY {:.1f} s, "
        "JDBC writer {:.1f} s"
    ).format(min(WARM_UP_ROWS, count), *times)


def main(argv: list[str] | None = None, name: str = "spark_bulk") -> list[Check]:
    args = parse_args(__doc__.splitlines()[0], argv)
    count = scaled(ROWS, args.scale)
    os.environ.setdefault("DELAYWHEEL_INPUT_ROOTS", str(BENCH_INPUT))  # bulk enqueue reads only under an input root
    started_at = datetime.now(UTC)
    path = parquet(count)
    spark = sparkjob.session("delaywheel bench: bulk enqueue")
    spark.sparkContext.setLogLevel("ERROR")
    spark.read.parquet(str(path)).count()  # the file cache, for every contender alike
    warmed = warm_up(spark, parquet(min(count, WARM_UP_ROWS)), count)
    log(warmed)

    url = fresh_database(DB)
    log("ours: bulk_enqueue")
    ours = enqueue(url, path)
    log(f"ours {ours:.1f}s; raw COPY")
    raw = raw_copy(url, path)
    log(f"raw {raw:.1f}s; JDBC writer")
    jdbc = jdbc_write(spark, url, path, "jdbc_plain")
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
    report(
        name,
        f"Bulk enqueue from Parquet, {count:,} rows",
        checks,
        [
            f"ours {ours:.1f} s ({count / ours:,.0f} rows/s), raw COPY {raw:.1f} s, Spark JDBC writer {jdbc:.1f} s",
            "ours validates every row with the library's rules, claims (source, key) for idempotency and COPYs level "
            "segments (migrations/011); the baselines write 4 columns into an unindexed plain table",
            f"Spark local[*] on {spark.sparkContext.defaultParallelism} cores; all rows in every table counted afterwards",
            warmed,
        ],
        started_at,
        argv,
    )
    spark.stop()
    return checks
