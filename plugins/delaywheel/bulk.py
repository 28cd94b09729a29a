"""Bulk enqueue of rows from files or queries (the Spark job's writer; nothing here imports Spark).

Each input row is turned into a `Message` by a column mapping and checked by the same rules as `send`
(`validation.prepare`, by `columns.prepare_columns`); good rows are written by the producer's COPY path, bad rows go to
`delaywheel.quarantine` with the rule's reason, the source file and the row number. A chunk is one
transaction: ids, idempotency claims, the COPY and the quarantine rows commit together, so a retried
Spark task or a re-run of the same input enqueues nothing twice (claims are keyed by (source, key)).
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import errors

from .columns import prepare_columns
from .config import Settings
from .partitions import PartitionCache
from .producer import clock_and_ids, collector_paused, copy_arrow, write_columns
from .validation import InvalidMessage, Message, prepare

BodyFormat = Literal["json", "text", "bytes"]
FILE_COLUMN = "_file"  # the source file of a row (added by the reader)
ROW_COLUMN = "_row"  # its 1-based record number within that file
CORRUPT_COLUMN = "_corrupt_record"  # set by Spark's PERMISSIVE readers for unparsable records
DELAY_FIELDS = ("delay_level", "delay_ms", "deliver_at")
FIELDS = ("topic", "key", "body", "tags", "properties", *DELAY_FIELDS)
_INTEGER = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class ColumnMap:
    """Which input column feeds which message field; `topic` may instead be fixed for every row."""

    columns: dict[str, str] = field(default_factory=dict)  # message field -> input column
    default_topic: str | None = None
    body_format: BodyFormat = "json"

    @classmethod
    def parse(cls, text: str, default_topic: str | None = None, body_format: BodyFormat = "json") -> ColumnMap:
        """'topic=t,key=order_id,body=payload,delay_level=lvl' -> ColumnMap; unmapped fields default to
        the input column of the same name when the reader has one (see `with_defaults`)."""
        columns: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, column = part.partition("=")
            if not sep or name.strip() not in FIELDS or not column.strip():
                raise ValueError(f"column mapping {part!r}: expected FIELD=COLUMN with FIELD in {', '.join(FIELDS)}")
            columns[name.strip()] = column.strip()
        return cls(columns, default_topic, body_format)

    def with_defaults(self, available: Iterable[str]) -> ColumnMap:
        """Map each unmapped field to the input column of the same name, if there is one (a delay field
        only when no delay field was mapped explicitly); fail now, not per row, on a mapping that cannot work."""
        present = set(available)
        explicit_delay = any(f in self.columns for f in DELAY_FIELDS)
        auto = {f: f for f in FIELDS if f in present and f not in self.columns
                and not (explicit_delay and f in DELAY_FIELDS)}
        columns = auto | self.columns
        missing = sorted(c for c in columns.values() if c not in present)
        if missing:
            raise ValueError(f"column mapping names columns the input does not have: {', '.join(missing)}")
        if "topic" not in columns and self.default_topic is None:
            raise ValueError("no topic: map a topic column (topic=COLUMN) or give a fixed topic")
        return ColumnMap(columns, self.default_topic, self.body_format)

    @property
    def input_columns(self) -> list[str]:
        return sorted(set(self.columns.values()))

    @functools.cached_property
    def sources(self) -> tuple[str | None, ...]:
        """The input column of each field, in FIELDS order (None: unmapped), looked up once, not per row."""
        return tuple(self.columns.get(name) for name in FIELDS)


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


def _coerce_body(value: object, body_format: BodyFormat) -> object:
    if body_format == "bytes" and isinstance(value, str):
        return value.encode()
    if body_format == "json" and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise InvalidMessage("bad_body", f"body is not valid JSON text: {exc}") from None
    return value


def _coerce_properties(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise InvalidMessage("bad_properties", "properties must be a JSON object of strings to strings") from None
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        return dict(value)  # an Arrow map arrives as a list of (key, value) pairs
    return value


def _coerce_number(value: object, kind: type) -> object:
    """Text from CSV becomes a number when it is one; anything else goes to the rule unchanged, so the
    rule (not this mapping) names what is wrong with it."""
    if isinstance(value, str):
        text = value.strip()
        if kind is int and _INTEGER.match(text):
            return int(text)
        if kind is float:
            try:
                return float(text)
            except ValueError:
                return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _coerce_instant(value: object) -> object:
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            return value
    return value


def to_message(row: Mapping[str, Any], mapping: ColumnMap) -> Message:
    """Build the Message a row describes; raises InvalidMessage for values no rule could even look at."""
    if row.get(CORRUPT_COLUMN) is not None:
        raise InvalidMessage("malformed_record", f"the reader could not parse this record: {row[CORRUPT_COLUMN]!r}")
    topic, key, body, tags, properties, level, delay_ms, deliver_at = (
        None if column is None else row.get(column) for column in mapping.sources
    )
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)  # numeric business keys (order ids) are keys too
    values: tuple[Any, ...] = (  # unchecked on purpose, whatever their type: `prepare` judges them
        topic if mapping.sources[0] is not None else mapping.default_topic,
        _coerce_body(body, mapping.body_format),
        None if level is None else _coerce_number(level, int),
        None if delay_ms is None else _coerce_number(delay_ms, float),
        None if deliver_at is None else _coerce_instant(deliver_at),
        key,
        tags,
        None if properties is None else _coerce_properties(properties),
    )
    return Message(*values)


def _raw(row: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in (FILE_COLUMN, ROW_COLUMN)}, default=str)


@dataclass(frozen=True)
class _Bad:
    source_file: str
    row_number: int
    reason: str
    detail: str
    raw: str


def write_chunk(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    rows: list[dict[str, Any]],
    mapping: ColumnMap,
    source: str,
    *,
    now: datetime | None = None,
) -> Counts:
    """Validate and write one chunk of input rows in one transaction (see the module docstring)."""
    counts = Counts(rows=len(rows))
    if not rows:
        return counts
    with collector_paused(), conn.transaction():
        clock, ids = clock_and_ids(conn, len(rows), now)
        bad: list[_Bad] = []
        messages, positions = [], []
        for position, row in enumerate(rows):
            try:
                messages.append(to_message(row, mapping))
                positions.append(position)
            except InvalidMessage as exc:
                bad.append(_bad(row, exc))
        try:
            columns = prepare_columns(messages, clock, settings)
        except InvalidMessage:  # some row breaks a rule: sort the rows out one by one, then check the rest at once
            kept = []
            for message, position in zip(messages, positions, strict=True):
                try:
                    prepare(message, clock, settings)
                    kept.append((message, position))
                except InvalidMessage as exc:
                    bad.append(_bad(rows[position], exc))
            messages, positions = [m for m, _ in kept], [p for _, p in kept]
            columns = prepare_columns(messages, clock, settings)
        claimed = _claim(conn, source, [
            (ids[p], m.key or f"{rows[p][FILE_COLUMN]}#{rows[p][ROW_COLUMN]}") for m, p in zip(messages, positions, strict=True)
        ])
        fresh = [j for j, p in enumerate(positions) if ids[p] in claimed]
        if fresh:
            write_columns(conn, settings, cache, [ids[positions[j]] for j in fresh],
                          columns if len(fresh) == len(positions) else columns.take(np.asarray(fresh)), clock)
        _quarantine(conn, source, bad)
    counts.enqueued = len(fresh)
    counts.skipped = len(positions) - len(fresh)
    counts.rejected = len(bad)
    counts.reasons.update(b.reason for b in bad)
    return counts


def _bad(row: Mapping[str, Any], exc: InvalidMessage) -> _Bad:
    return _Bad(str(row[FILE_COLUMN]), int(row[ROW_COLUMN]), exc.reason, str(exc), _raw(row))


def _claim(conn: psycopg.Connection, source: str, claims: list[tuple[int, str]]) -> set[int]:
    """Claim (source, key) for each (message id, key); returns the ids whose claim is new. A key claimed by a
    concurrent transaction waits for it to finish, then counts as taken: no two writers enqueue the same key.

    A first run claims every key, so the chunk's claims are COPYed (2.4 µs a row); only when one is taken (a re-run,
    a key repeated in the input, a concurrent writer) does the chunk claim row by row with ON CONFLICT DO NOTHING,
    whose speculative inserts cost 6.4 µs a row: the larger part of a bulk enqueue's database time."""
    if not claims:
        return set()
    ids, keys = zip(*claims, strict=True)
    try:
        with conn.transaction():
            copy_arrow(conn, "idempotency", pa.RecordBatch.from_pydict({
                "source": pa.repeat(source, len(claims)), "key": pa.array(keys, pa.string()),
                "message_id": pa.array(ids, pa.int64())}))
        return set(ids)
    except errors.UniqueViolation:
        pass  # the savepoint rolled the COPY back
    cur = conn.execute(
        "INSERT INTO delaywheel.idempotency (source, key, message_id)"
        " SELECT %s, k, i FROM unnest(%s::text[], %s::int8[]) AS u(k, i)"
        " ON CONFLICT DO NOTHING RETURNING message_id",
        (source, list(keys), list(ids)),
    )
    return {r[0] for r in cur.fetchall()}


def _quarantine(conn: psycopg.Connection, source: str, bad: list[_Bad]) -> None:
    if not bad:
        return
    conn.execute(
        "INSERT INTO delaywheel.quarantine (source, source_file, row_number, reason, detail, raw)"
        " SELECT %s, * FROM unnest(%s::text[], %s::int8[], %s::text[], %s::text[], %s::text[])"
        " ON CONFLICT DO NOTHING",
        (source, [b.source_file for b in bad], [b.row_number for b in bad], [b.reason for b in bad],
         [b.detail for b in bad], [b.raw for b in bad]),
    )

