"""Idempotency claims of the bulk writer (`bulk.write_chunk`, what every Spark partition calls), without Spark.

A chunk claims its keys by COPY and falls back to claiming row by row when one is taken: a re-run, a key repeated
within the input, a concurrent writer holding the same key. Each case must enqueue every key exactly once.
"""

from __future__ import annotations

import threading
from datetime import datetime

import psycopg
import pyarrow as pa

from delaywheel import Store
from delaywheel.batch import bulk, input_rows
from delaywheel.partitions import PartitionCache

MAPPING = input_rows.ColumnMap.parse("", "orders", "text").with_defaults(["key", "body", "delay_level"])


def rows(keys: range | list[int], file: str = "orders.csv") -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [
            {
                "key": f"order-{k}",
                "body": f"cancel {k}",
                "delay_level": 3,
                input_rows.FILE_COLUMN: file,
                input_rows.ROW_COLUMN: n + 1,
            }
            for n, k in enumerate(keys)
        ]
    )


def queued_keys(store: Store) -> list[str]:
    return [k for (k,) in store.conn.execute("SELECT key FROM delaywheel.level_queue ORDER BY key")]


def write(url: str, store: Store, chunk: pa.RecordBatch, t0: datetime) -> bulk.Counts:
    with psycopg.connect(url, autocommit=True) as conn:
        return bulk.write_chunk(conn, store.settings, PartitionCache(), chunk, MAPPING, "orders.csv", now=t0)


def test_a_rerun_and_a_repeated_key_are_claimed_once(store: Store, db_url: str, t0: datetime) -> None:
    first = write(db_url, store, rows(range(100)), t0)
    assert (first.enqueued, first.skipped) == (100, 0)
    again = write(db_url, store, rows(range(50, 150)), t0)  # half of it enqueued already
    assert (again.enqueued, again.skipped) == (50, 50)
    repeated = write(db_url, store, rows([200, 201, 200, 202, 201]), t0)  # the input names a key twice
    assert (repeated.enqueued, repeated.skipped) == (3, 2)
    assert queued_keys(store) == sorted(f"order-{k}" for k in [*range(150), 200, 201, 202])
    claims = store.conn.execute("SELECT count(*), count(DISTINCT message_id) FROM delaywheel.idempotency").fetchone()
    assert claims == (153, 153)


def test_a_concurrent_writer_of_the_same_keys_waits_and_skips_them(store: Store, db_url: str, t0: datetime) -> None:
    """Writer A claims keys 0-99 and has not committed; writer B, with keys 50-149, waits on A's claims, then finds
    50-99 taken: each key is enqueued once, by whichever writer committed its claim."""
    results: dict[str, bulk.Counts] = {}
    with psycopg.connect(db_url, autocommit=True) as a, a.transaction():
        results["a"] = bulk.write_chunk(
            a, store.settings, PartitionCache(), rows(range(100)), MAPPING, "orders.csv", now=t0
        )
        b = threading.Thread(target=lambda: results.__setitem__("b", write(db_url, store, rows(range(50, 150)), t0)))
        b.start()
        b.join(timeout=2)
        assert b.is_alive()  # blocked on A's uncommitted claims
    b.join(timeout=30)
    assert not b.is_alive()
    assert (results["a"].enqueued, results["a"].skipped) == (100, 0)
    assert (results["b"].enqueued, results["b"].skipped) == (50, 50)
    assert queued_keys(store) == sorted(f"order-{k}" for k in range(150))


def test_a_blank_delay_level_is_quarantined_not_delivered_at_once(store: Store, db_url: str, t0: datetime) -> None:
    """An order-timeout file whose delay level is blank (NULL, as Spark reads an empty CSV field, or whitespace)
    must not mean "cancel now": the row is quarantined with its reason; level 0 only when written as 0."""
    levels: list[object] = [3, None, "0", "  ", None]
    chunk = pa.RecordBatch.from_pylist(
        [
            {
                "key": f"order-{n}",
                "body": f"cancel {n}",
                "delay_level": None if level is None else str(level),
                input_rows.FILE_COLUMN: "orders.csv",
                input_rows.ROW_COLUMN: n + 1,
            }
            for n, level in enumerate(levels)
        ]
    )
    counts = write(db_url, store, chunk, t0)
    assert (counts.enqueued, counts.rejected) == (2, 3)
    assert counts.reasons == {"missing_delay": 3}
    assert queued_keys(store) == ["order-0"]
    delivered = store.conn.execute("SELECT key FROM delaywheel.topic_messages").fetchall()
    assert delivered == [("order-2",)]  # written as 0: delivered at once
    quarantined = store.conn.execute(
        "SELECT row_number, reason, detail FROM delaywheel.quarantine ORDER BY row_number"
    ).fetchall()
    assert [(r, reason) for r, reason, _ in quarantined] == [
        (2, "missing_delay"),
        (4, "missing_delay"),
        (5, "missing_delay"),
    ]
    assert "delay_level" in quarantined[0][2] and "write 0" in quarantined[0][2]


def test_a_delay_column_with_nothing_in_it_is_quarantined_row_by_row(store: Store, db_url: str, t0: datetime) -> None:
    """The column path too: a mapped delay column of nothing but NULLs is not a chunk of "no delay"."""
    chunk = pa.RecordBatch.from_pydict(
        {
            "key": pa.array(["a", "b"]),
            "body": pa.array(["x", "y"]),
            "delay_level": pa.nulls(2, pa.int32()),
            input_rows.FILE_COLUMN: pa.array(["orders.csv"] * 2),
            input_rows.ROW_COLUMN: pa.array([1, 2], pa.int64()),
        }
    )
    assert input_rows.arrow_columns(chunk, MAPPING, t0, store.settings) is None
    counts = write(db_url, store, chunk, t0)
    assert (counts.enqueued, counts.rejected, dict(counts.reasons)) == (0, 2, {"missing_delay": 2})
    assert store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone() == (0,)


def test_bodies_jsonb_refuses_are_quarantined_not_delivered(store: Store, db_url: str, t0: datetime) -> None:
    """A JSON body holding NUL or a lone surrogate in a string is delivered as bytes a consumer's `::jsonb` refuses:
    bulk rows holding one are quarantined as `bad_body`, whatever the body format, and the good rows go in."""
    bodies = {
        "json": ['"\\u0000"', '{"a": "x\\u0000"}', '{"a": "\\ud800"}', '["\\udc80"]', '{"ok": "\\u00e9"}'],
        "text": ["a\x00b", "ok"],
    }
    for body_format, texts in bodies.items():
        mapping = input_rows.ColumnMap.parse("", "orders", body_format).with_defaults(["key", "body", "delay_level"])  # type: ignore[arg-type]
        chunk = pa.RecordBatch.from_pylist(
            [
                {
                    "key": f"{body_format}-{n}",
                    "body": text,
                    "delay_level": 0,
                    input_rows.FILE_COLUMN: f"{body_format}.csv",
                    input_rows.ROW_COLUMN: n + 1,
                }
                for n, text in enumerate(texts)
            ]
        )
        with psycopg.connect(db_url, autocommit=True) as conn:
            counts = bulk.write_chunk(conn, store.settings, PartitionCache(), chunk, mapping, body_format, now=t0)
        assert (counts.enqueued, dict(counts.reasons)) == (1, {"bad_body": len(texts) - 1}), body_format
    assert store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages WHERE is_json").fetchone() == (2,)
    stored = (
        "SELECT count(*) FROM delaywheel.topic_messages WHERE is_json AND convert_from(body, 'UTF8')::jsonb IS NOT NULL"
    )
    assert store.conn.execute(stored).fetchone() == (2,)  # what a consumer casts to jsonb casts
