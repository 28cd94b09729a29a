"""Bulk redelivery: catch-up after an outage, replay of a due-time range, reconcile with a business table.

Spark only spreads the work over partitions; what each partition runs is here, and nothing here delivers
by a second path: catch-up repeats the deliverers' own passes (`Store.deliver_level`, `Store.advance_wheel`),
whose advisory locks and checkpoints make it exactly-once and leave the Airflow deliverers to resume right
after; reconcile cancels through `Store.cancel_matching`. Replay writes `origin = 'replay'` rows, which the
exactly-once invariants do not count, and never replays a message into the same topic twice.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from delaywheel.config import Settings
from delaywheel.deliver.levels import TOPIC_SUMMARY
from delaywheel.deliver.runner import lane_name
from delaywheel.ops.cancel import Match
from delaywheel.ops.predicate import catalog_table, check_column, check_column_name, check_expression, split_table
from delaywheel.ops.progress import Progress
from delaywheel.partitions import HOUR, PartitionCache, floor_to
from delaywheel.pending import PENDING
from delaywheel.produce.validation import check_topic
from delaywheel.store import Store

REPLAY_LOCK = 0x64770050  # advisory lock class for replays (second key: the replayed hour)
BUSY_RETRIES = 600  # a live deliverer holds a lane for one pass at a time; catch-up waits its turn


@dataclass(frozen=True)
class LaneResult:
    """What catch-up did on one lane (a level, or the wheel when level is None)."""

    level: int | None
    delivered: int
    skipped_cancelled: int
    passes: int


def catch_up_lane(url: str, settings: Settings, level: int | None, *, now: datetime | None = None,
                  limit: int = 50_000) -> LaneResult:
    """Drain one lane with the deliverers' own passes until nothing due is left (its own connection), its counts
    on stderr as it goes."""
    delivered = cancelled = passes = busy = 0
    progress = Progress(f"catch-up, {lane_name(level)}", "delivered")
    with Store(url, settings) as store:
        while True:
            result = store.advance_wheel(now=now, limit=limit) if level is None else store.deliver_level(
                level, now=now, limit=limit)
            if result.busy:
                busy += 1
                if busy > BUSY_RETRIES:
                    raise RuntimeError(f"lane {level or 'wheel'} stayed busy: another process holds its lock")
                time.sleep(0.05)
                continue
            passes += 1
            delivered += result.delivered
            cancelled += result.skipped_cancelled
            progress.update(delivered, f"{cancelled:,} cancelled, {passes:,} passes", done=not result.more)
            if not result.more:
                return LaneResult(level, delivered, cancelled, passes)


def lanes(settings: Settings) -> list[int | None]:
    """Every level, then the wheel (None): one catch-up partition each."""
    return [*range(1, settings.max_level + 1), None]


# --- replay -----------------------------------------------------------------------------------------

_REPLAY = """
INSERT INTO delaywheel.topic_messages
    (topic, message_id, origin, level, key, tags, properties, body, is_json, reconsume_times, deliver_at, delivered_at)
SELECT coalesce(%(target)s, t.topic), t.message_id, 'replay', t.level, t.key, t.tags,
       coalesce(t.properties, '{}'::jsonb) || jsonb_build_object('REPLAY_ID', %(rid)s::text, 'REPLAY_OF_TOPIC', t.topic),
       t.body, t.is_json, t.reconsume_times, t.deliver_at, clock_timestamp()
FROM delaywheel.topic_messages t
WHERE t.origin IN ('level', 'wheel', 'direct')
  AND t.deliver_at >= %(lo)s AND t.deliver_at < %(hi)s
  AND t.delivered_at >= %(lo)s  -- never delivered early (invariant 1): prunes older partitions
  AND (%(source)s::text IS NULL OR t.topic = %(source)s)
  AND NOT EXISTS (SELECT 1 FROM delaywheel.topic_messages r
                  WHERE r.origin = 'replay' AND r.message_id = t.message_id AND r.topic = coalesce(%(target)s, t.topic))
ORDER BY t.deliver_at, t.message_id
"""
_ALREADY = """
SELECT count(*) FROM delaywheel.topic_messages t
WHERE t.origin IN ('level', 'wheel', 'direct') AND t.deliver_at >= %(lo)s AND t.deliver_at < %(hi)s
  AND t.delivered_at >= %(lo)s AND (%(source)s::text IS NULL OR t.topic = %(source)s)
"""


@dataclass(frozen=True)
class ReplayRequest:
    due_from: datetime
    due_until: datetime
    source_topic: str | None = None
    target_topic: str | None = None  # None: each message back into its own topic

    def __post_init__(self) -> None:
        if self.due_from >= self.due_until:
            raise ValueError(f"replay range is empty: {self.due_from} >= {self.due_until}")
        for topic in (self.source_topic, self.target_topic):
            if topic is not None:
                check_topic(topic)

    def slices(self) -> list[tuple[datetime, datetime]]:
        """The range cut at hour boundaries: one partition each, and the unit replays lock on."""
        cuts, at = [], self.due_from
        while at < self.due_until:
            nxt = min(floor_to(at, HOUR) + HOUR, self.due_until)
            cuts.append((at, nxt))
            at = nxt
        return cuts


def start_replay(conn: psycopg.Connection, request: ReplayRequest, requested_by: str) -> int:
    """Record the request (the audit row); returns the replay id the replayed rows carry."""
    row = conn.execute(
        "INSERT INTO delaywheel.replays (requested_by, due_from, due_until, source_topic, target_topic)"
        " VALUES (%s, %s, %s, %s, %s) RETURNING id",
        (requested_by, request.due_from, request.due_until, request.source_topic, request.target_topic),
    ).fetchone()
    assert row is not None
    return int(row[0])


def replay_slice(url: str, replay_id: int, request: ReplayRequest, lo: datetime, hi: datetime) -> tuple[int, int]:
    """Replay one slice in one transaction; returns (replayed, skipped as already replayed). The hour lock
    serialises concurrent replays of the same hour, so the NOT EXISTS dedup cannot race."""
    params = {"rid": replay_id, "lo": lo, "hi": hi, "source": request.source_topic, "target": request.target_topic}
    with psycopg.connect(url, autocommit=True, application_name="delaywheel-replay") as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (REPLAY_LOCK, int(floor_to(lo, HOUR).timestamp() // 3600)))
        clock = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        PartitionCache().ensure(conn, "topic_messages", [clock])
        replayed = conn.execute(  # type: ignore[index]
            f"WITH moved AS ({_REPLAY} RETURNING topic, queue_offset, xid) SELECT count(*), ({TOPIC_SUMMARY}) FROM moved",
            params,  # type: ignore[arg-type]
        ).fetchone()[0]
        candidates = conn.execute(_ALREADY, params).fetchone()[0]  # type: ignore[arg-type, index]
    return replayed, candidates - replayed


def finish_replay(conn: psycopg.Connection, replay_id: int, replayed: int, skipped: int) -> None:
    conn.execute(
        "UPDATE delaywheel.replays SET replayed = %s, skipped = %s, finished_at = clock_timestamp() WHERE id = %s",
        (replayed, skipped, replay_id),
    )


# --- reconcile --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reconcile:
    """Business rows (`table` WHERE `predicate` AND every `filters` column = value) need a timer in `topic` keyed
    by `key_column`. Nothing here is SQL text run as given: `table`, `key_column`, `due_column` and the filter columns
    are looked up in the catalog and quoted (`psycopg.sql.Identifier`), values are bound, and `predicate` is one
    expression over the table's own columns, checked like `cancel_matching`'s `where` (`predicate.check_expression`);
    empty or None: every row."""

    table: str
    key_column: str
    predicate: str | None
    topic: str
    due_column: str | None = None  # the timer's due time; else `delay`
    delay: timedelta | None = None
    filters: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        split_table(self.table)
        check_column_name(self.key_column, what="key column")
        if self.due_column:
            check_column_name(self.due_column, what="due column")
        for column in self.filters:
            check_column_name(column, what="filter column")
        if self.predicate and self.predicate.strip():
            check_expression(self.predicate, None, what="reconcile predicate")  # columns: checked in resolve()
        check_topic(self.topic)
        if (self.due_column is None) == (self.delay is None):
            raise ValueError("reconcile needs exactly one of a due column or a delay for the timers it creates")

    @property
    def label(self) -> str:
        conditions = [*([self.predicate.strip()] if self.predicate and self.predicate.strip() else []),
                      *(f"{c} = {v!r}" for c, v in sorted(self.filters.items()))]
        return f"{self.table}.{self.key_column} WHERE {' AND '.join(conditions) or 'true'}"

    def resolve(self, conn: psycopg.Connection) -> _Business:
        """The business table as the catalog has it: every name checked, the predicate checked over its columns."""
        schema, table, columns = catalog_table(conn, self.table, what="reconcile table")
        label = f"{schema}.{table}"
        key = check_column(self.key_column, columns, label, what="key column")
        due = check_column(self.due_column, columns, label, what="due column") if self.due_column else None
        conditions: list[sql.Composable] = []
        params: dict[str, object] = {"rc_topic": self.topic}
        if self.predicate and self.predicate.strip():
            checked = check_expression(self.predicate, columns, qualifier="b", what="reconcile predicate")
            conditions.append(sql.SQL("({})").format(sql.SQL(checked.replace("%", "%%"))))
        for i, (column, value) in enumerate(sorted(self.filters.items())):
            ident = sql.SQL("b.{}").format(sql.Identifier(check_column(column, columns, label, what="filter column")))
            if value is None:
                conditions.append(sql.SQL("{} IS NULL").format(ident))
            else:
                params[f"rc_{i}"] = value
                conditions.append(sql.SQL("{} = {}").format(ident, sql.Placeholder(f"rc_{i}")))
        where = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
        return _Business(sql.Identifier(schema, table), sql.Identifier(key), sql.Identifier(due) if due else None,
                         where, params)

    def needed_sql(self, conn: psycopg.Connection) -> str:
        """Keys (and due times) of the business rows that need a timer, and whether one was delivered already
        (then it is not missing: the business row is the consumer's to settle); one SELECT, values inlined by the
        client library (for Spark's JDBC reader, which runs it in a read-only session)."""
        b = self.resolve(conn)
        query = sql.SQL(
            "SELECT b.{key}::text AS key, {due} AS deliver_at,"
            " EXISTS (SELECT 1 FROM delaywheel.topic_messages t WHERE t.origin <> 'replay'"
            " AND t.topic = %(rc_topic)s AND t.key = b.{key}::text) AS delivered"
            " FROM {table} b WHERE {where}"
        ).format(key=b.key, due=sql.SQL("b.{}").format(b.due) if b.due else sql.SQL("NULL::timestamptz"),
                 table=b.table, where=b.where)
        return _inline(conn, query, b.params)

    def pending_sql(self, conn: psycopg.Connection) -> str:
        """Keys of the pending, not cancelled timers in the topic (the cancel module's idea of pending)."""
        query = sql.SQL(
            "SELECT DISTINCT p.key FROM ({pending}) p WHERE p.topic = %(rc_topic)s AND p.key IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = p.id)"
        ).format(pending=sql.SQL(PENDING))
        return _inline(conn, query, {"rc_topic": self.topic})

    def stale_match(self, conn: psycopg.Connection) -> Match:
        """`cancel_matching` condition: pending timers in the topic that no business row needs any more."""
        b = self.resolve(conn)
        return Match(sql.SQL(
            "p.topic = %(rc_topic)s AND p.key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM {table} b"
            " WHERE b.{key}::text = p.key AND {where})").format(table=b.table, key=b.key, where=b.where), b.params)


@dataclass(frozen=True)
class _Business:
    table: sql.Identifier
    key: sql.Identifier
    due: sql.Identifier | None
    where: sql.Composable
    params: dict[str, object]


def _inline(conn: psycopg.Connection, query: sql.Composable, params: Mapping[str, object]) -> str:
    """One statement's text with its values quoted by psycopg (for readers that take text only, like Spark's JDBC)."""
    return psycopg.ClientCursor(conn).mogrify(query, params)  # type: ignore[arg-type]  # a Composed


def record_reconcile(conn: psycopg.Connection, job: Reconcile, requested_by: str, *, missing: int, stale: int,
                     created: int, cancelled: int, sample: dict[str, list[str]]) -> int:
    row = conn.execute(
        "INSERT INTO delaywheel.reconcile_runs (requested_by, business, topic, missing, stale, created, cancelled,"
        " sample) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        (requested_by, job.label, job.topic, missing, stale, created, cancelled, Jsonb(sample)),
    ).fetchone()
    assert row is not None
    return int(row[0])
