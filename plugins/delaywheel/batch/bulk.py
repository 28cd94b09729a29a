"""Bulk enqueue of rows from files or queries (the Spark job's writer; nothing here imports Spark).

A chunk of input rows becomes messages as `input_rows` says (the column mapping, the rules). Good rows are written by
the producer's COPY path, bad rows go to `delaywheel.quarantine` with the rule's reason, the source file and the row
number. A chunk is one transaction: ids, idempotency claims, the COPY and the quarantine rows commit together, so a
retried Spark task or a re-run of the same input enqueues nothing twice (claims are keyed by (source, key)).

With several stores (docs/stores.md) each row goes to its topic's store (`StoreSplit`), and a chunk becomes one
transaction in each store it has rows for, with that store's claims and quarantine: exactly once holds store by store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import errors

from delaywheel.batch.input_rows import FILE_COLUMN, ROW_COLUMN, ColumnMap, Rejected, arrow_columns, row_by_row
from delaywheel.config import Settings
from delaywheel.partitions import PartitionCache
from delaywheel.produce.arrow_copy import copy_arrow, write_columns
from delaywheel.produce.producer import clock_and_ids, collector_paused
from delaywheel.produce.validation import InvalidMessage
from delaywheel.routing import Router


@dataclass
class Counts:
    """What a chunk (or a whole job, summed) did; `rejected` rows are in the quarantine."""

    rows: int = 0
    enqueued: int = 0
    skipped: int = 0  # already enqueued by an earlier run (or earlier in this input): idempotency
    rejected: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, other: Counts) -> Counts:
        self.rows += other.rows
        self.enqueued += other.enqueued
        self.skipped += other.skipped
        self.rejected += other.rejected
        self.reasons.update(other.reasons)
        return self

    def summary(self) -> str:
        return f"{self.enqueued:,} enqueued, {self.skipped:,} already enqueued, {self.rejected:,} quarantined"

    def as_rows(self) -> list[tuple[str, str, int]]:
        """(kind, reason, n) triples: the shape the Spark job collects from its partitions."""
        rows = [("rows", "", self.rows), ("enqueued", "", self.enqueued), ("skipped", "", self.skipped)]
        return rows + [("rejected", reason, n) for reason, n in self.reasons.items()]

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, str, int]]) -> Counts:
        total = cls()
        for kind, reason, n in rows:
            if kind == "rejected":
                total.rejected += n
                total.reasons[reason] += n
            else:
                setattr(total, kind, getattr(total, kind) + n)
        return total

    @classmethod
    def total(cls, parts: Iterable[Counts]) -> Counts:
        """The sum of several stores' counts: a job's figures."""
        total = cls()
        for part in parts:
            total.add(part)
        return total


class StoreSplit:
    """Which store each input row goes to, with several stores: its topic's (`Router.store_for`, so a topic moving
    `a>b` goes to b, as `Stores.send` sends it). Every executor builds the same split from the same names and routes,
    and a re-run of the same input with the same routing sends each row to the same store, whose claims of the source
    then skip it: that is what keeps a re-run from enqueueing twice. (A topic's route changed between two runs would
    send its rows to a store whose claims have not seen them: re-run an input only under the routing it ran with.)
    Claims are per store, so two rows of one input with the same key in topics of different stores are each enqueued
    once, in their own store; with one store the second would count as already enqueued.

    A row whose topic is refused by the topic rule (missing, not text, malformed) has no store: it goes to the
    first configured store, whose quarantine then holds it with its reason. Every other row, good or bad, goes to
    its topic's store, so a topic's rejected rows sit in the quarantine beside the topic's messages, where whoever
    owns the topic looks, and a re-run finds each quarantined row in the same store (its `ON CONFLICT` skips it)."""

    def __init__(self, names: Iterable[str], routes: Iterable[tuple[str, tuple[str, ...]]], mapping: ColumnMap):
        self.router = Router(tuple(names), routes)
        self.first = self.router.names[0]
        self.mapping = mapping

    def store_of(self, topic: object) -> str:
        """The store of a row's topic value; the first store for a value the topic rule refuses."""
        if not isinstance(topic, str):
            return self.first
        try:
            return self.router.store_for(topic)
        except InvalidMessage:
            return self.first

    def split(self, rows: pa.RecordBatch) -> list[tuple[str, pa.RecordBatch]]:
        """The rows by store, in input order within each: one (store, rows) pair per store that gets rows."""
        column = self.mapping.sources[0]
        if column is None:
            return [(self.store_of(self.mapping.default_topic), rows)]
        topics = rows.column(column)
        if not (pa.types.is_string(topics.type) or pa.types.is_large_string(topics.type)):
            return [(self.first, rows)]  # no text topic: each row is refused, as `input_rows` says why
        by_store: dict[str, list[str | None]] = {}
        for topic in pc.unique(topics).to_pylist():
            by_store.setdefault(self.store_of(topic), []).append(topic)
        if len(by_store) == 1:
            return [(next(iter(by_store)), rows)]
        return [
            (name, rows.filter(pc.is_in(topics, value_set=pa.array(values, topics.type), skip_nulls=False)))
            for name, values in by_store.items()
        ]


def chunks(batches: Iterable[pa.RecordBatch], size: int) -> Iterator[pa.RecordBatch]:
    """The batches' rows again, in batches of `size` rows (the last one shorter): one transaction each."""
    pending: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        pending.append(batch)
        count += batch.num_rows
        while count >= size:
            table = pa.Table.from_batches(pending)
            yield pa.concat_batches(table.slice(0, size).to_batches())
            pending, count = table.slice(size).to_batches(), count - size
    if count:
        yield pa.concat_batches(pending)


def write_chunk(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    rows: pa.RecordBatch,
    mapping: ColumnMap,
    source: str,
    *,
    now: datetime | None = None,
) -> Counts:
    """Validate and write one chunk of input rows in one transaction (see the module docstring): column by column
    when the chunk is regular (`arrow_columns`), else row by row."""
    counts = Counts(rows=rows.num_rows)
    if not rows.num_rows:
        return counts

    ids: list[int] = []

    def write() -> tuple[np.ndarray, np.ndarray, list[Rejected]]:
        with collector_paused(), conn.transaction():
            clock = clock_and_ids(conn, ids, rows.num_rows, now, settings)
            columns = arrow_columns(rows, mapping, clock, settings)
            if columns is not None:
                positions, bad = np.arange(rows.num_rows), list[Rejected]()
            else:
                positions, columns, bad = row_by_row(rows.to_pylist(), mapping, clock, settings)
            kept = np.asarray(ids, np.int64)[positions]
            fresh = np.zeros(0, bool)
            if columns is not None:
                keys = (
                    columns.key
                    if not columns.key.null_count
                    else pc.coalesce(columns.key, _provenance(rows).take(pa.array(positions)))
                )
                fresh = _claim(conn, source, kept, keys)
                if fresh.any():
                    write_columns(
                        conn,
                        settings,
                        cache,
                        kept[fresh],
                        columns if fresh.all() else columns.take(np.flatnonzero(fresh)),
                        clock,
                    )
            _quarantine(conn, source, bad)
        return positions, fresh, bad

    positions, fresh, bad = cache.without_ddl(conn, write)  # partitions created before the write, each committed
    counts.enqueued = int(fresh.sum())
    counts.skipped = len(positions) - counts.enqueued
    counts.rejected = len(bad)
    counts.reasons.update(b.reason for b in bad)
    return counts


def _provenance(rows: pa.RecordBatch) -> pa.Array:
    """'file#row' for each row: the idempotency key of a row without a key."""
    return pc.binary_join_element_wise(
        rows.column(FILE_COLUMN).cast(pa.string()), rows.column(ROW_COLUMN).cast(pa.string()), "#"
    )


def _claim(conn: psycopg.Connection, source: str, ids: np.ndarray, keys: pa.Array) -> np.ndarray:
    """Claim (source, key) for each message id and key; returns which claims are new. A key claimed by a concurrent
    transaction waits for it to finish, then counts as taken: no two writers enqueue the same key.

    A first run claims every key, so the chunk's claims are COPYed (each a unique-index insert at a random
    place); only when one is taken (a re-run, a key repeated in the input, a concurrent writer) does the chunk claim
    row by row with ON CONFLICT DO NOTHING, whose speculative inserts cost about twice as much."""
    source_id = _source_id(conn, source)
    try:
        with conn.transaction():
            copy_arrow(
                conn,
                "bulk_claims",
                pa.RecordBatch.from_pydict(
                    {"source_id": pa.repeat(pa.scalar(source_id, pa.int32()), len(ids)), "key": keys, "message_id": ids}
                ),
            )
        return np.ones(len(ids), bool)
    except errors.UniqueViolation:
        pass  # the savepoint rolled the COPY back
    cur = conn.execute(
        "INSERT INTO delaywheel.bulk_claims (source_id, key, message_id)"
        " SELECT %s, k, i FROM unnest(%s::text[], %s::int8[]) AS u(k, i)"
        " ON CONFLICT DO NOTHING RETURNING message_id",
        (source_id, keys.to_pylist(), ids.tolist()),
    )
    return np.isin(ids, [r[0] for r in cur.fetchall()])


def _source_id(conn: psycopg.Connection, source: str) -> int:
    """The number of a claims source, registered on first use: looked up first, so that every later chunk neither
    tries an insert nor spends an identity value. A source another writer registers concurrently is waited for by
    ON CONFLICT, which then returns nothing: the next lookup, a new statement, sees it."""
    for _ in range(3):
        row = (
            conn.execute("SELECT id FROM delaywheel.bulk_sources WHERE source = %s", (source,)).fetchone()
            or conn.execute(
                "INSERT INTO delaywheel.bulk_sources (source) VALUES (%s) ON CONFLICT (source) DO NOTHING RETURNING id",
                (source,),
            ).fetchone()
        )
        if row is not None:
            return int(row[0])
    raise RuntimeError(f"claims source {source!r} could not be registered")


def _quarantine(conn: psycopg.Connection, source: str, bad: list[Rejected]) -> None:
    if not bad:
        return
    conn.execute(
        "INSERT INTO delaywheel.quarantine (source, source_file, row_number, reason, detail, raw)"
        " SELECT %s, * FROM unnest(%s::text[], %s::int8[], %s::text[], %s::text[], %s::text[])"
        " ON CONFLICT DO NOTHING",
        (
            source,
            [b.source_file for b in bad],
            [b.row_number for b in bad],
            [b.reason for b in bad],
            [b.detail for b in bad],
            [b.raw for b in bad],
        ),
    )
