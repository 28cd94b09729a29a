"""The bulk writer's column path (`input_rows.arrow_columns`) against its row path (`to_message` and the rules, one by one).

A Spark partition hands the writer Arrow batches. A regular chunk is checked and converted column by column; any
other goes row by row, where each bad row is quarantined with its reason. The column path may decline any chunk,
but what it accepts must be exactly what the rows give: the same topics, keys, bodies (JSON normalised the same
way), lanes and due times to the microsecond, and no row the rules would refuse. Hypothesis draws chunks of
every column type a reader produces, with good values and, in at most one field, anything at all.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from delaywheel import Settings
from delaywheel.batch import bulk, input_rows
from delaywheel.produce.columns import Columns

NOW = datetime(2030, 1, 1, 12, 0, 0, 250_000, tzinfo=UTC)
SETTINGS = Settings(max_body_bytes=64)
YEAR_MS = 365 * 86_400_000
UTC_US, MINUS_5 = pa.timestamp("us", "UTC"), pa.timestamp("us", "-05:00")
JSON_TEXTS = ['{"a": 1}', "[1, 2]", '"x"', "3.5", "true", "null", '{"é": "ü"}', ' {"b" : [ ] } ']
Option = tuple[pa.DataType, st.SearchStrategy[Any]]


def _times(lo: timedelta, hi: timedelta, naive: bool = False) -> st.SearchStrategy[datetime]:
    """Instants from NOW + lo to NOW + hi (naive ones for a zone-less column)."""
    base = NOW.replace(tzinfo=None)
    return st.datetimes(base + lo, base + hi, timezones=st.none() if naive else st.just(UTC))


GOOD: dict[str, list[Option]] = {
    "topic": [(pa.string(), st.sampled_from(["orders", "orders.timeout"]))],
    "key": [(pa.string(), st.one_of(st.none(), st.text(min_size=1, max_size=4))), (pa.int64(), st.integers(-99, 99))],
    "tags": [(pa.string(), st.sampled_from([None, "created"]))],
    "properties": [(pa.string(), st.none())],
    "delay_level": [(pa.int32(), st.integers(0, 20)), (pa.string(), st.sampled_from(["3", " 5", "18 ", "0"]))],
    "delay_ms": [(pa.int64(), st.integers(0, YEAR_MS)), (pa.string(), st.sampled_from(["1500", " 60000 "]))],
    "deliver_at": [
        (UTC_US, _times(timedelta(seconds=-1), timedelta(days=365))),
        (MINUS_5, _times(timedelta(0), timedelta(days=30))),
    ],
}
BODIES: dict[str, list[Option]] = {
    "bytes": [(pa.binary(), st.binary(max_size=64)), (pa.string(), st.text(max_size=16))],
    "json": [(pa.string(), st.sampled_from(JSON_TEXTS))],
    "text": [(pa.string(), st.text(max_size=16))],
}
WILD: dict[str, list[Option]] = {
    "topic": [
        (pa.string(), st.sampled_from(["orders", "", "bad topic", "x" * 128, None, "orders\n", "%RETRY%g", "%DLQ%g"])),
        (pa.large_string(), st.just("orders")),
        (pa.int32(), st.just(1)),
    ],
    "key": [
        (pa.string(), st.sampled_from(["", "k" * 1024, "k" * 1025, None, "k", "k\x00", "\x00"])),
        (pa.large_string(), st.sampled_from(["k", None])),
        (pa.bool_(), st.booleans()),
        (pa.float64(), st.just(1.0)),
    ],
    "body": [
        (
            pa.string(),
            st.sampled_from(
                [
                    "not json",
                    "NaN",
                    "-Infinity",
                    "{",
                    "é" * 32,
                    "é" * 33,
                    "x" * 65,
                    None,
                    '"%s"' % ("é" * 20),
                    *JSON_TEXTS,
                    '"\\u0000"',
                    '{"a": "\\ud800"}',
                    '"\\ud83d\\ude00"',
                    '["\\\\u0000"]',
                    "[" * 5000 + "]" * 5000,
                    "\x00",
                ]
            ),
        ),
        (pa.binary(), st.binary(max_size=80)),
        (pa.large_binary(), st.just(b"x")),
        (pa.int64(), st.integers(-99, 99)),
    ],
    "tags": [
        (pa.int32(), st.integers(-99, 99)),
        (pa.large_string(), st.sampled_from(["paid", None])),
        (pa.string(), st.sampled_from(["t\x00", "t" * 1024, "t" * 1025, None])),
    ],
    "properties": [(pa.string(), st.sampled_from(['{"a": "1"}', None, "x", '{"a": 1}']))],
    "delay_level": [
        (pa.int64(), st.sampled_from([-1, 0, 18, 19, 2**31 - 1, 2**31, None])),
        (pa.string(), st.sampled_from(["x", "+3", " 4 ", "1.5", "\u0663", "-1", ""])),
        (pa.float64(), st.sampled_from([1.0, 2.5])),
        (pa.bool_(), st.booleans()),
    ],
    "delay_ms": [
        (pa.int64(), st.sampled_from([-1, 0, YEAR_MS, YEAR_MS + 1, 2**62, None])),
        (pa.float64(), st.sampled_from([0.5, 1000.0, float("nan")])),
        (pa.string(), st.sampled_from(["1.5", "nan", "7"])),
    ],
    "deliver_at": [
        (
            UTC_US,
            st.sampled_from(
                [
                    NOW - timedelta(days=1),
                    NOW - timedelta(days=1, microseconds=1),
                    NOW + timedelta(days=365),
                    NOW + timedelta(days=365, microseconds=1),
                    None,
                ]
            ),
        ),
        (pa.timestamp("us"), _times(timedelta(0), timedelta(days=1), naive=True)),
        (pa.timestamp("ms", "UTC"), _times(timedelta(0), timedelta(days=1))),
    ],
    "_corrupt_record": [(pa.string(), st.sampled_from([None, 'a,b,"c']))],
}
DELAYS = ("delay_level", "delay_ms", "deliver_at")


@st.composite
def chunks(draw: st.DrawFn) -> tuple[pa.RecordBatch, input_rows.ColumnMap]:
    """An input chunk and its mapping: good columns, except that at most one field draws from anything (a second
    bad field would mask the first), and sometimes two delay columns at once."""
    n = draw(st.integers(1, 8))
    body_format = draw(st.sampled_from(["bytes", "json", "text"]))
    wild = draw(st.sampled_from([None, "topic", "key", "body", "tags", "properties", "when", "_corrupt_record"]))
    delays = draw(st.sampled_from([[], *([d] for d in DELAYS), ["delay_level", "delay_ms"]]))
    fields = [f for f in ("topic", "key", "tags", "properties") if draw(st.booleans())] + ["body", *delays]
    if wild == "_corrupt_record":
        fields.append(wild)
    columns: dict[str, pa.Array] = {}
    for name in fields:
        wild_here = wild == name or (wild == "when" and name in DELAYS)
        options = (WILD[name] if name in WILD and wild_here else []) + (
            BODIES[body_format] if name == "body" else GOOD.get(name, [])
        )
        kind, values = draw(st.sampled_from(options))
        columns[name] = pa.array([draw(values) for _ in range(n)], kind)
    columns[input_rows.FILE_COLUMN] = pa.array(["in.parquet"] * n)
    columns[input_rows.ROW_COLUMN] = pa.array(range(1, n + 1), pa.int64())
    batch = pa.RecordBatch.from_pydict(columns)
    mapping = input_rows.ColumnMap.parse("", "orders", body_format).with_defaults(  # type: ignore[arg-type]
        c for c in columns if not c.startswith("_")
    )
    return batch, mapping


def _as_lists(c: Columns) -> list[list[object]]:
    return [col.to_pylist() if isinstance(col, pa.Array) else col.tolist() for col in c]


@settings(max_examples=800, deadline=None)
@given(chunks())
def test_what_the_column_path_accepts_is_what_the_rows_give(chunk: tuple[pa.RecordBatch, input_rows.ColumnMap]) -> None:
    batch, mapping = chunk
    fast = input_rows.arrow_columns(batch, mapping, NOW, SETTINGS)
    positions, rows, bad = input_rows.row_by_row(batch.to_pylist(), mapping, NOW, SETTINGS)
    if fast is not None:
        assert [b.reason for b in bad] == []  # the column path never takes a chunk with a row the rules refuse
        assert positions.tolist() == list(range(batch.num_rows))
        assert rows is not None and _as_lists(fast) == _as_lists(rows)


def test_the_usual_chunks_take_the_column_path() -> None:
    """The equivalence above would hold trivially if every chunk declined; the readers' usual chunks must not."""
    n = 1000
    provenance = {
        input_rows.FILE_COLUMN: pa.array(["in.parquet"] * n),
        input_rows.ROW_COLUMN: pa.array(range(1, n + 1)),
    }
    usual = [
        (
            {
                "key": pa.array([f"order-{i}" for i in range(n)]),
                "body": pa.array(['{"n": 1}'] * n),
                "delay_level": pa.array([1 + i % 18 for i in range(n)], pa.int32()),
            },
            "json",
        ),
        (
            {
                "key": pa.array(range(n)),
                "body": pa.array([b"x"] * n),
                "delay_ms": pa.array([i * 1000 for i in range(n)]),
            },
            "bytes",
        ),
        (
            {
                "body": pa.array(["cancel"] * n),
                "deliver_at": pa.array([NOW + timedelta(minutes=i) for i in range(n)], UTC_US),
            },
            "text",
        ),
        ({"key": pa.array(["k"] * n), "body": pa.array(["{}"] * n), "delay_level": pa.array(["3"] * n)}, "json"),  # CSV
    ]
    for columns, body_format in usual:
        batch = pa.RecordBatch.from_pydict(columns | provenance)
        mapping = input_rows.ColumnMap.parse("", "orders", body_format).with_defaults(columns)  # type: ignore[arg-type]
        assert input_rows.arrow_columns(batch, mapping, NOW, SETTINGS) is not None, columns.keys()


def test_chunks_regroup_the_batches_rows_in_order() -> None:
    batches = [
        pa.RecordBatch.from_pydict({"i": pa.array(range(a, b))}) for a, b in ((0, 3), (3, 10), (10, 11), (11, 25))
    ]
    out = list(bulk.chunks(batches, 4))
    assert [b.num_rows for b in out] == [4, 4, 4, 4, 4, 4, 1]
    assert np.concatenate([b.column("i").to_numpy() for b in out]).tolist() == list(range(25))
    assert list(bulk.chunks([], 4)) == []
