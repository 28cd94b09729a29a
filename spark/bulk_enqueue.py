"""Bulk enqueue: CSV, JSON lines or Parquet files (a path or a glob) or a PostgreSQL query → delayed messages.

    spark-submit --jars /usr/share/java/postgresql.jar spark/bulk_enqueue.py --db-url URL \
        --input 'orders/*.parquet' --map key=order_id,body=payload,delay_level=lvl --topic orders

Each row is checked by the rules of `send` and written by its COPY path, a chunk per transaction in each
partition (`delaywheel.batch.bulk`); bad rows land in `delaywheel.quarantine` with the reason, the file and the
row number; a re-run of the same input (same --source) enqueues nothing new. The counts are printed at the
end as one JSON line; each partition prints its counts to stderr every 10 s (the task log in local mode) and shows
as a task in the Spark UI. Local Parquet files are read by pyarrow in the Python workers, each its share of the
row groups, which skips the JVM's rows between Parquet and Arrow (`delaywheel.row_groups`; `--parquet-reader spark` for
Spark's reader, which also reads whatever that path leaves to it).

What a form may give is checked first (`delaywheel.inputs`, `delaywheel.predicate`): `--input` only under the
configured input roots (DELAYWHEEL_INPUT_ROOTS), `--query` only one read-only SELECT (run in a READ ONLY session with
a statement timeout), `--source-url` only an allowed source (DELAYWHEEL_ALLOWED_SOURCES; empty: the store).

With several stores (DELAYWHEEL_STORES, docs/stores.md) the job takes no --db-url: each row goes to its topic's
store, by the routing table (DELAYWHEEL_ROUTES) and the hash, each store keeping its own claims of the source and the
quarantine of the rows it was sent (`delaywheel.batch.bulk.StoreSplit`), so a re-run under the same routing
enqueues nothing twice in any store. A query is then read from the first configured store unless --source-url says
otherwise. The printed counts add each store's.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import astuple
from datetime import timedelta

import sparkjob  # first: it runs the driver under the library's Python (sparkjob._run_driver_under_library_python)

# isort: split
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StringType, StructField, StructType

from delaywheel.batch import bulk, input_rows, inputs, row_groups
from delaywheel.config import load_settings
from delaywheel.ops import predicate

FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet"}


def input_format(path: str, given: str | None) -> str:
    if given and given != "auto":
        if given not in FORMATS.values():
            raise SystemExit(f"unknown format {given!r}: use csv, json or parquet")
        return given
    for suffix, fmt in FORMATS.items():
        if path.lower().endswith(suffix):
            return fmt
    raise SystemExit(f"cannot tell the format of {path!r}: pass --format csv|json|parquet")


def read_files(spark: SparkSession, path: str, fmt: str) -> DataFrame:
    """The files with `_file` and `_row` (1-based record number within its file, header excluded).
    Unparsable CSV/JSON records are kept, with their text in `_corrupt_record`."""
    if fmt == "parquet":
        df = spark.read.parquet(path)
        return df.select(
            "*",
            F.col("_metadata.file_path").alias(input_rows.FILE_COLUMN),
            (F.col("_metadata.row_index") + 1).alias(input_rows.ROW_COLUMN),
        )
    if fmt == "csv":
        csv = spark.read.option("header", True).option("escape", '"')  # RFC 4180 quoting: "" inside quotes
        header = csv.csv(path).schema  # every column as text
        schema = StructType([*header.fields, StructField(input_rows.CORRUPT_COLUMN, StringType())])
        df = (
            csv.option("mode", "PERMISSIVE")
            .schema(schema)
            .option("columnNameOfCorruptRecord", input_rows.CORRUPT_COLUMN)
            .csv(path)
        )
    else:
        df = (
            spark.read.option("mode", "PERMISSIVE")
            .option("columnNameOfCorruptRecord", input_rows.CORRUPT_COLUMN)
            .json(path)
        )
    # A file may be split over tasks: order by the split's offset, then by position within the split.
    df = df.select(
        "*",
        F.col("_metadata.file_path").alias(input_rows.FILE_COLUMN),
        F.col("_metadata.file_block_start").alias("_block"),
        F.monotonically_increasing_id().alias("_pos"),
    )
    order = Window.partitionBy(input_rows.FILE_COLUMN).orderBy("_block", "_pos")
    return df.withColumn(input_rows.ROW_COLUMN, F.row_number().over(order)).drop("_block", "_pos")


def read_query(spark: SparkSession, url: str, query: str, timeout: timedelta) -> DataFrame:
    """A checked query (`predicate.check_query`: one read-only SELECT), read in a READ ONLY session."""
    df = sparkjob.read_only_sql(spark, url, query, timeout)
    order = Window.orderBy(F.monotonically_increasing_id())
    return df.select(
        "*", F.lit("query").alias(input_rows.FILE_COLUMN), F.row_number().over(order).alias(input_rows.ROW_COLUMN)
    )


def mapped(df: DataFrame, mapping: input_rows.ColumnMap) -> tuple[DataFrame, input_rows.ColumnMap]:
    """Only the columns the mapping uses (plus provenance) travel to the writers."""
    mapping = mapping.with_defaults(c for c in df.columns if not c.startswith("_"))
    keep = [*mapping.input_columns, input_rows.FILE_COLUMN, input_rows.ROW_COLUMN]
    if input_rows.CORRUPT_COLUMN in df.columns:
        keep.append(input_rows.CORRUPT_COLUMN)
    return df.select(*keep), mapping


def row_group_tasks(
    spark: SparkSession, df: DataFrame, mapping: input_rows.ColumnMap, writers: int, batch_rows: int
) -> tuple[DataFrame, Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]] | None:
    """A Parquet input as its row groups over `writers` partitions and the reader that turns them into rows in the
    workers (`delaywheel.row_groups`); None when Spark's reader should read it: files `row_groups.plan` leaves to
    Spark, or fewer row groups than writers (Spark's reader and a repartition keep every writer busy)."""
    wanted = to_arrow_schema(
        df.select(*mapping.input_columns).schema,
        timezone=spark.conf.get("spark.sql.session.timeZone"),
        prefers_large_types=spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes") == "true",
    )
    groups = row_groups.plan(df.inputFiles(), wanted)
    if groups is None or len(groups) < writers:
        return None
    tasks = spark.createDataFrame(
        spark.sparkContext.parallelize([astuple(g) for g in groups], writers), row_groups.SCHEMA
    )
    return tasks, functools.partial(row_groups.read, wanted=wanted, batch_rows=batch_rows)


def figures(counts: bulk.Counts) -> dict[str, object]:
    """The printed figures of a job, or of one store's part of it."""
    return {
        "rows": counts.rows,
        "enqueued": counts.enqueued,
        "skipped_already_enqueued": counts.skipped,
        "quarantined": counts.rejected,
        "reasons": dict(counts.reasons),
    }


def main(argv: list[str] | None = None) -> bulk.Counts:
    p = sparkjob.parser("Enqueue delayed messages in bulk from files or a query.")
    p.add_argument("--input", type=sparkjob.text, help="a file, directory or glob")
    p.add_argument("--query", type=sparkjob.text, help="or: a PostgreSQL query (over JDBC, from --source-url)")
    p.add_argument(
        "--source-url", type=sparkjob.text, help="database of --query (default: the store's; several: the first's)"
    )
    p.add_argument("--format", type=sparkjob.text, help="csv, json or parquet (default, or auto: from the file name)")
    p.add_argument(
        "--map",
        default="",
        help="FIELD=COLUMN,… for topic, key, body, tags, properties, "
        "delay_level | delay_ms | deliver_at (default: same-named columns)",
    )
    p.add_argument("--topic", type=sparkjob.text, help="the topic of every row, when no topic column is mapped")
    p.add_argument(
        "--body-format",
        choices=["json", "text", "bytes"],
        default="json",
        help="a text body column holds JSON (default), plain text, or raw bytes as UTF-8",
    )
    p.add_argument(
        "--source",
        type=sparkjob.text,
        help="idempotency source: a re-run with the same source skips rows already "
        "enqueued (default: the input path or the query)",
    )
    p.add_argument("--chunk", type=int, default=50_000, help="rows per transaction in each partition")
    p.add_argument(
        "--partitions",
        type=sparkjob.integer,
        help="repartition the input to this many writers (default: at least one per core)",
    )
    p.add_argument(
        "--parquet-reader",
        choices=["auto", "spark"],
        default="auto",
        help="auto (default): local Parquet files are read by pyarrow in the Python workers, by row "
        "group, when their columns read as Spark would read them; spark: always Spark's reader",
    )
    p.add_argument("--now", type=sparkjob.instant, help="inject the clock (tests); default: the database's")
    args = p.parse_args(argv)
    if (args.input is None) == (args.query is None):
        p.error("give exactly one of --input and --query")
    if args.source_url and not args.query:
        p.error("--source-url is the database of --query; give --query too")
    settings = load_settings()
    if len(settings.stores) > 1 and (args.db_url or args.store):
        p.error(
            f"several stores are configured ({', '.join(n for n, _ in settings.stores)}): bulk enqueue sends each"
            " row to its topic's store; give neither --db-url nor --store (their URLs come from DELAYWHEEL_STORES)"
        )
    urls = sparkjob.stores(p, args, settings, every=True)
    try:  # what the form gave, checked before Spark starts: a clear error, never a traceback
        query = predicate.check_query(args.query) if args.query else None
        source_url = inputs.check_source(args.source_url, settings, to_url=sparkjob.db_url) if query else None
        if args.input:
            inputs.check_input(args.input, settings)
    except ValueError as exc:  # predicate.UnsafeSQL, inputs.NotAllowed
        p.error(str(exc))
    spark = sparkjob.session("delaywheel bulk enqueue")
    spark.sparkContext.setJobDescription(f"delaywheel bulk enqueue of {args.input or 'query'}")
    fmt = input_format(args.input, args.format) if args.input else "query"
    df = (
        read_files(spark, args.input, fmt)
        if args.input
        else read_query(spark, source_url or next(iter(urls.values())), str(query), settings.match_timeout)
    )
    df, mapping = mapped(df, input_rows.ColumnMap.parse(args.map, args.topic, args.body_format))
    writers = args.partitions or spark.sparkContext.defaultParallelism
    by_row_group = (
        row_group_tasks(spark, df, mapping, writers, args.chunk)
        if fmt == "parquet" and args.parquet_reader == "auto"
        else None
    )
    if by_row_group:
        df, read = by_row_group
        partitions, how = writers, "row groups read by pyarrow"
    else:
        read, partitions, how = None, df.rdd.getNumPartitions(), "Spark's reader"
        if args.partitions or partitions < writers:  # e.g. one Parquet row group: use every core
            df, partitions = df.repartition(writers), writers
    print(
        f"bulk enqueue of {args.input or 'a query'}: {partitions} partitions ({how}), {args.chunk:,} rows "
        "per transaction; each partition reports its counts every 10 s",
        flush=True,
    )
    by_store = sparkjob.write_rows(
        df, urls, settings, mapping, args.source or args.input or args.query, now=args.now, chunk=args.chunk, read=read
    )
    counts = bulk.Counts.total(by_store.values())
    report = figures(counts)
    if len(urls) > 1:
        report["stores"] = {name: figures(c) for name, c in by_store.items()}
    print(json.dumps({"job": "bulk_enqueue", **report}), flush=True)
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
