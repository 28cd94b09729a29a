"""Input rows as messages: the column mapping, the coercion of a row's values, and the two ways a chunk becomes columns.

A chunk of input rows arrives as an Arrow batch and a column mapping (`ColumnMap`) says which column feeds which
message field. A regular chunk is checked by `send`'s rules column by column and converted as a whole
(`arrow_columns`); any other is turned into one `Message` per row and checked by the same rules
(`validation.prepare`, by `columns.prepare_columns`), each bad row kept with the rule it breaks (`row_by_row`).
Writing them is `bulk`'s. Nothing here imports Spark or touches the database.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from delaywheel.config import Settings
from delaywheel.produce.columns import (
    Columns,
    Irregular,
    Placed,
    micros,
    placed_at,
    placed_by_delay_ms,
    placed_by_level,
    placed_now,
    plain_json,
    prepare_columns,
    storable_column,
)
from delaywheel.produce.validation import MAX_KEY_CHARS, MAX_TAGS_CHARS, InvalidMessage, Message, checked_topic, prepare

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
        auto = {
            f: f
            for f in FIELDS
            if f in present and f not in self.columns and not (explicit_delay and f in DELAY_FIELDS)
        }
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


def _coerce_body(value: object, body_format: BodyFormat) -> object:
    if body_format == "bytes" and isinstance(value, str):
        return value.encode()
    if body_format == "json" and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise InvalidMessage("bad_body", f"body is not valid JSON text: {exc}") from None
        except RecursionError:
            raise InvalidMessage("bad_body", "body is nested too deeply to read as JSON") from None
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
    level, delay_ms, deliver_at = (None if _blank(v) else v for v in (level, delay_ms, deliver_at))
    if level is None and delay_ms is None and deliver_at is None:
        mapped = [c for f, c in zip(FIELDS, mapping.sources, strict=True) if f in DELAY_FIELDS and c is not None]
        if mapped:  # a blank is not "no delay": an order-timeout file's blank would mean "cancel now"
            raise InvalidMessage(
                "missing_delay",
                f"the delay column {' / '.join(mapped)} is blank in this row: write 0 as the delay_level to deliver"
                " at once",
            )
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


def _blank(value: object) -> bool:
    """A delay value that is not there: NULL, or text of nothing but whitespace (as CSV readers may give)."""
    return value is None or (isinstance(value, str) and not value.strip())


def arrow_columns(rows: pa.RecordBatch, mapping: ColumnMap, now: datetime, settings: Settings) -> Columns | None:
    """The chunk's messages straight from its Arrow columns, or None: then each row goes through `to_message` and the
    rules one by one, which name what a bad row breaks. Row by row, a chunk costs as much in Python before the database
    sees it (a dict per row, its Message, the rules) as the database's own work.

    Like `columns._simple`, this path only ever accepts: it takes a chunk whose columns are of a regular kind (text
    topics and keys, integer or text-of-integer levels and delays, zoned timestamps, no properties) and whose every
    value passes every rule, and builds the same columns the rows would give; anything else returns None."""
    n = rows.num_rows
    topic, key, body, tags, properties, level, delay_ms, deliver_at = (
        None if name is None else rows.column(name) for name in mapping.sources
    )
    try:
        if CORRUPT_COLUMN in rows.schema.names and rows.column(CORRUPT_COLUMN).null_count < n:
            raise Irregular
        if properties is not None and properties.null_count < n:
            raise Irregular
        data, is_json = _arrow_bodies(body, mapping.body_format, settings.max_body_bytes)
        return Columns(
            _arrow_topics(topic, mapping.default_topic, n),
            _arrow_keys(key, n),
            pa.nulls(n, pa.string()) if tags is None else storable_column(_text(tags), MAX_TAGS_CHARS),
            pa.nulls(n, pa.string()),
            data,
            is_json,
            *_arrow_placed(level, delay_ms, deliver_at, micros(now), settings, n),
            np.zeros(n, np.int32),
        )
    except Exception:  # any surprise at all: the rows go one by one, and the rules name it
        return None


def _text(column: pa.Array) -> pa.Array:
    if pa.types.is_large_string(column.type):
        return column.cast(pa.string())
    if not pa.types.is_string(column.type):
        raise Irregular
    return column


def _arrow_topics(column: pa.Array | None, default: str | None, n: int) -> pa.Array:
    if column is None:
        return pa.repeat(pa.scalar(checked_topic(default), pa.string()), n)
    column = _text(column)
    if column.null_count:
        raise Irregular
    for name in pc.unique(column).to_pylist():
        checked_topic(name)
    return column


def _arrow_keys(column: pa.Array | None, n: int) -> pa.Array:
    if column is None or column.null_count == n:
        return pa.nulls(n, pa.string())
    if pa.types.is_integer(column.type):
        column = column.cast(pa.string())  # numeric business keys are keys too, as str() writes them
    column = _text(column)
    shortest, longest = pc.min_max(pc.utf8_length(column)).values()
    if shortest.as_py() == 0 or longest.as_py() > MAX_KEY_CHARS:
        raise Irregular
    return storable_column(column)


def _arrow_bodies(column: pa.Array | None, body_format: BodyFormat, max_bytes: int) -> tuple[pa.Array, pa.Array]:
    if column is None or column.null_count:
        raise Irregular
    if body_format == "bytes":
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            column = _text(column)
        data, is_json = column.cast(pa.binary()), pa.repeat(False, len(column))
    else:
        texts = _text(column).to_pylist()
        values = map(json.loads, texts) if body_format == "json" else texts
        data = plain_json(
            pa.array([json.dumps(v, allow_nan=False, separators=(",", ":")).encode() for v in values], pa.binary())
        )
        is_json = pa.repeat(True, len(column))
    if pc.max(pc.binary_length(data)).as_py() > max_bytes:
        raise Irregular
    return data, is_json


def _arrow_placed(
    level: pa.Array | None,
    delay_ms: pa.Array | None,
    deliver_at: pa.Array | None,
    now: int,
    settings: Settings,
    n: int,
) -> Placed:
    if level is None and delay_ms is None and deliver_at is None:
        return placed_now(n, now)  # no delay column mapped: every row is delivered at once
    given = [
        (c, kind)
        for c, kind in ((level, "level"), (delay_ms, "delay"), (deliver_at, "at"))
        if c is not None and c.null_count < n
    ]
    if not given:
        raise Irregular  # mapped delay columns with nothing in them: each row is quarantined, row by row
    if len(given) > 1 or given[0][0].null_count:
        raise Irregular
    column, kind = given[0]
    if kind == "at":
        if not pa.types.is_timestamp(column.type) or column.type.tz is None:
            raise Irregular  # naive times are refused row by row
        return placed_at(column.cast(pa.timestamp("us", column.type.tz)).cast(pa.int64()).to_numpy(), now, settings)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = pc.utf8_trim_whitespace(column)  # text from CSV; anything but an integer raises: row by row
    elif not pa.types.is_integer(column.type):
        raise Irregular
    values = column.cast(pa.int64()).to_numpy()
    return placed_by_level(values, now, settings) if kind == "level" else placed_by_delay_ms(values, now, settings)


def _raw(row: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in (FILE_COLUMN, ROW_COLUMN)}, default=str)


@dataclass(frozen=True)
class Rejected:
    """A row the rules refused, as `bulk` writes it into `delaywheel.quarantine`: where it came from, the rule's
    reason code and sentence, and the row itself (JSON, without the provenance columns)."""

    source_file: str
    row_number: int
    reason: str
    detail: str
    raw: str


def row_by_row(
    rows: list[dict[str, Any]],
    mapping: ColumnMap,
    clock: datetime,
    settings: Settings,
) -> tuple[np.ndarray, Columns | None, list[Rejected]]:
    """(positions of the good rows, their columns, the bad rows with their reasons); columns None if none is good."""
    bad: list[Rejected] = []
    messages, positions = [], []
    for position, row in enumerate(rows):
        try:
            messages.append(to_message(row, mapping))
            positions.append(position)
        except InvalidMessage as exc:
            bad.append(_rejected(row, exc))
    try:
        columns = prepare_columns(messages, clock, settings) if messages else None
    except InvalidMessage:  # some row breaks a rule: sort the rows out one by one, then check the rest at once
        kept = []
        for message, position in zip(messages, positions, strict=True):
            try:
                prepare(message, clock, settings)
                kept.append((message, position))
            except InvalidMessage as exc:
                bad.append(_rejected(rows[position], exc))
        messages, positions = [m for m, _ in kept], [p for _, p in kept]
        columns = prepare_columns(messages, clock, settings) if messages else None
    return np.asarray(positions, np.int64), columns, bad


def _rejected(row: Mapping[str, Any], exc: InvalidMessage) -> Rejected:
    return Rejected(str(row[FILE_COLUMN]), int(row[ROW_COLUMN]), exc.reason, str(exc), _raw(row))
