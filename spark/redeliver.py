"""Redeliver: catch up a backlog, replay a due-time range, or reconcile timers with a business table.

    spark-submit spark/redeliver.py --db-url URL --mode catch-up
    spark-submit spark/redeliver.py --db-url URL --mode replay --from 2030-01-01T00:00Z --until 2030-01-01T01:00Z \
        [--source-topic orders] [--target-topic orders.replay]
    spark-submit --jars /usr/share/java/postgresql.jar spark/redeliver.py --db-url URL --mode reconcile \
        --table shop.orders --key-column order_id --predicate "status = 'pending'" --topic order.timeout \
        --due-column deadline

Reconcile's table and columns are looked up in the catalog and quoted, and its predicate is one expression over
that table's columns, checked by `delaywheel.predicate` (no subqueries, only pure functions): the business rows are
read in a READ ONLY JDBC session with a statement timeout.

Each mode spreads library calls over partitions (`delaywheel.batch.catchup`, `.replay`, `.reconcile`): catch-up
runs the deliverers' own passes, one partition per level and one for the wheel; replay one partition per hour of
the range; reconcile joins the business keys with the pending timers and writes the missing ones with the bulk
writer (`delaywheel.batch.bulk`).
Each prints one JSON line with its figures.

With several stores (DELAYWHEEL_STORES, docs/stores.md) each mode works on one store's own backlog, history and
timers: `--store NAME` (its URL from the configuration; an Airflow task passes its connections there), or `--db-url`
for a database given by URL. Catch-up without either drains every store's lanes in one job, one partition per
store and lane, each store's passes under that store's own lane locks (the same exactly-once passes, so running it on
a store with no backlog costs a pass per lane and delivers nothing). Replay and reconcile refuse a store their
topic's consumers do not read (`routed_to`).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from typing import Any

import sparkjob
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from delaywheel import Store
from delaywheel.batch import bulk, catchup, input_rows
from delaywheel.batch.reconcile import Reconcile, record_reconcile
from delaywheel.batch.replay import ReplayRequest, finish_replay, replay_slice, start_replay
from delaywheel.config import Settings, load_settings
from delaywheel.db import connect
from delaywheel.lanes import all_lanes, lane_key
from delaywheel.routing import Router

SAMPLE = 20


def catch_up(
    spark: SparkSession, urls: dict[str, str], settings: Settings, now: datetime | None, limit: int
) -> dict[str, Any]:
    """Every lane of every store in `urls`, one partition each; the figures of each store too when there are
    several."""
    work = [(name, lane) for name in urls for lane in all_lanes(settings)]
    results = (
        spark.sparkContext.parallelize(work, len(work))
        .map(lambda job: (job[0], catchup.catch_up_lane(urls[job[0]], settings, job[1], now=now, limit=limit)))
        .collect()
    )

    def figures(results: list[catchup.LaneResult]) -> dict[str, Any]:
        return {
            "delivered": sum(r.delivered for r in results),
            "skipped_cancelled": sum(r.skipped_cancelled for r in results),
            "lanes": {lane_key(r.lane): r.delivered for r in results if r.delivered},
        }

    report = {"mode": "catch-up", **figures([r for _, r in results])}
    if len(urls) > 1:
        report["stores"] = {name: figures([r for n, r in results if n == name]) for name in urls}
    return report


def routed_to(settings: Settings, store: str, topic: str, *, current: bool) -> str | None:
    """Why `store` is the wrong one for writing `topic` (None when it is, or when no stores are configured or the
    store was given by URL): replay writes into a topic, which its consumers read only in the topic's sources
    (`Router.sources`); reconcile creates timers, which belong in the topic's current store (`current`)."""
    names = [name for name, _ in settings.stores]
    if store not in names or len(names) < 2:
        return None
    router = Router.configured(settings)
    wanted = (router.store_for(topic),) if current else router.sources(topic)
    if store in wanted:
        return None
    return f"topic {topic!r} lives in store {' / '.join(wanted)}, not {store!r}: run it with --store {wanted[0]}"


def replay(spark: SparkSession, url: str, request: ReplayRequest, requested_by: str) -> dict[str, Any]:
    with connect(url, autocommit=True) as conn:
        replay_id = start_replay(conn, request, requested_by)
    slices = request.slices()
    counts = (
        spark.sparkContext.parallelize(slices, len(slices))
        .map(lambda s: replay_slice(url, replay_id, request, *s))
        .collect()
    )
    replayed, skipped = sum(c[0] for c in counts), sum(c[1] for c in counts)
    with connect(url, autocommit=True) as conn:
        finish_replay(conn, replay_id, replayed, skipped)
    return {"mode": "replay", "replay_id": replay_id, "replayed": replayed, "skipped_already_replayed": skipped}


def missing_timers(needed: DataFrame, pending: DataFrame, job: Reconcile) -> DataFrame:
    """Business rows with no pending timer, as bulk-writer input rows (key, due time or delay, body)."""
    rows = needed.where(~F.col("delivered")).join(pending, "key", "left_anti")
    body = F.to_json(F.struct(F.col("key"), F.lit(job.table).alias("table"), F.lit("reconcile").alias("origin")))
    columns = [
        F.col("key"),
        body.alias("body"),
        F.lit(job.table).alias(input_rows.FILE_COLUMN),
        F.monotonically_increasing_id().alias(input_rows.ROW_COLUMN),
    ]
    if job.due_column:
        columns.append(F.col("deliver_at"))
    else:
        columns.append(F.lit(job.delay.total_seconds() * 1000 if job.delay else 0.0).alias("delay_ms"))
    return rows.select(*columns)


def reconcile(
    spark: SparkSession, url: str, settings: Settings, job: Reconcile, requested_by: str, now: datetime | None
) -> dict[str, Any]:
    with connect(url, autocommit=True) as conn:  # names checked against the catalog, the predicate over its columns
        needed_sql, pending_sql = job.needed_sql(conn), job.pending_sql(conn)
    needed = sparkjob.read_only_sql(spark, url, needed_sql, settings.match_timeout).cache()
    pending = sparkjob.read_only_sql(spark, url, pending_sql, settings.match_timeout).cache()
    missing = missing_timers(needed, pending, job).cache()
    stale = pending.join(needed.select("key"), "key", "left_anti").cache()
    missing_count, stale_count = missing.count(), stale.count()
    sample = {
        "missing": [r.key for r in missing.limit(SAMPLE).collect()],
        "stale": [r.key for r in stale.limit(SAMPLE).collect()],
    }
    run_source = f"reconcile:{job.table}:{datetime.now().isoformat()}"  # dedup within this run only
    mapping = input_rows.ColumnMap.parse("", job.topic).with_defaults(
        c for c in missing.columns if not c.startswith("_")
    )
    created = (
        bulk.Counts.total(
            sparkjob.write_rows(
                missing,
                {sparkjob.ONE_STORE: url},
                settings,
                mapping,
                run_source,
                now=now,
                job="reconcile: missing timers",
            ).values()
        )
        if missing_count
        else bulk.Counts()
    )
    with Store(url, settings) as store:
        cancelled = (
            store.cancel_matching(match=job.stale_match(store.conn), reason=f"reconcile {job.table}")
            if stale_count
            else 0
        )
        run_id = record_reconcile(
            store.conn,
            job,
            requested_by,
            missing=missing_count,
            stale=stale_count,
            created=created.enqueued,
            cancelled=cancelled,
            sample=sample,
        )
    return {
        "mode": "reconcile",
        "run_id": run_id,
        "missing": missing_count,
        "created": created.enqueued,
        "rejected": created.rejected,
        "stale": stale_count,
        "cancelled": cancelled,
        "sample": sample,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = sparkjob.parser("Catch up, replay, or reconcile delayed messages.")
    p.add_argument("--now", type=sparkjob.instant, help="inject the clock (tests); default: the database's")
    p.add_argument("--mode", choices=["catch-up", "replay", "reconcile"], required=True)
    c = p.add_argument_group("catch-up: deliver every overdue message, all lanes in parallel")
    c.add_argument("--batch", type=int, default=50_000, help="messages per delivery pass")
    r = p.add_argument_group("replay: deliver again every message due in [--from, --until)")
    r.add_argument("--from", dest="due_from", type=sparkjob.instant)
    r.add_argument("--until", dest="due_until", type=sparkjob.instant)
    r.add_argument("--source-topic", type=sparkjob.text, help="only messages of this topic (default: all)")
    r.add_argument("--target-topic", type=sparkjob.text, help="replay into this topic (default: each message's own)")
    k = p.add_argument_group("reconcile: create missing and cancel stale timers against a business table")
    k.add_argument("--table", type=sparkjob.text, help="schema.table of the business rows")
    k.add_argument("--key-column", type=sparkjob.text, help="the column whose text is the timer's key")
    k.add_argument(
        "--predicate",
        type=sparkjob.text,
        help="which rows need a timer: one expression over the table's columns, e.g. status = 'pending'"
        " (checked: no subqueries, only pure functions; empty: every row)",
    )
    k.add_argument("--topic", type=sparkjob.text, help="the timers' topic")
    k.add_argument("--due-column", type=sparkjob.text, help="timestamptz column: when the timer fires")
    k.add_argument("--delay-seconds", type=sparkjob.number, help="or: fire this long after the timer is created")
    args = p.parse_args(argv)
    needs = {"replay": ["due_from", "due_until"], "reconcile": ["table", "key_column", "topic"]}
    missing = [f"--{name.replace('_', '-')}" for name in needs.get(args.mode, []) if getattr(args, name) is None]
    if missing:
        p.error(f"--mode {args.mode} needs {', '.join(missing)}")
    if args.mode == "reconcile" and (args.due_column is None) == (args.delay_seconds is None):
        p.error("--mode reconcile needs exactly one of --due-column and --delay-seconds")
    settings = load_settings()
    urls = sparkjob.stores(p, args, settings, every=args.mode == "catch-up")  # several stores: catch-up drains all
    name, url = next(iter(urls.items()))  # replay and reconcile: the one store
    topic = args.topic if args.mode == "reconcile" else args.target_topic or args.source_topic
    wrong = topic and args.mode != "catch-up" and routed_to(settings, name, topic, current=args.mode == "reconcile")
    if wrong:
        p.error(f"--mode {args.mode}: {wrong}")
    job = None
    if args.mode == "reconcile":
        delay = timedelta(seconds=args.delay_seconds) if args.delay_seconds is not None else None
        try:
            job = Reconcile(args.table, args.key_column, args.predicate, args.topic, args.due_column, delay)
            with connect(url, autocommit=True) as conn:
                job.resolve(conn)  # every name and the predicate checked before Spark starts
        except ValueError as exc:  # UnsafeSQL and InvalidMessage among them: a clear error, not a traceback
            p.error(str(exc))
    spark = sparkjob.session(f"delaywheel redeliver ({args.mode})")
    spark.sparkContext.setJobDescription(f"delaywheel {args.mode}")
    if args.mode == "catch-up":
        report = catch_up(spark, urls, settings, args.now, args.batch)
    elif args.mode == "replay":
        request = ReplayRequest(args.due_from, args.due_until, args.source_topic, args.target_topic)
        report = replay(spark, url, request, args.requested_by)
    else:
        assert job is not None
        report = reconcile(spark, url, settings, job, args.requested_by, args.now)
    print(json.dumps({"job": "redeliver", **report}, default=str), flush=True)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
