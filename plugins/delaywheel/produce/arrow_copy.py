"""The batch path of `producer.send_many`: validated columns (`columns.Columns`) written by binary COPY.

Arrow record batches are encoded into PostgreSQL's binary COPY format column by column by pgpq, rather than
row by row through psycopg's `write_row` in Python. The encoding is written in slices, so the server stores one
slice while the next is encoded. Kept apart from `producer` so that what needs no Arrow (a single `send`, the CLI's
other commands) never imports pyarrow, numpy or pgpq.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta

import numpy as np
import pgpq
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import errors, sql

from delaywheel.channels import TOPIC_CHANNEL, lane_channel
from delaywheel.config import Settings
from delaywheel.db import DURABLE_COMMIT
from delaywheel.lanes import Lane
from delaywheel.partitions import DAY, WIDTH, PartitionCache, floor_to
from delaywheel.produce.columns import DIRECT, EPOCH, LEVEL, TIMESTAMP, US, WHEEL, Columns, micros
from delaywheel.produce.keyblooms import MIN_MESSAGES, far_filters, segment_blooms
from delaywheel.produce.producer import SEGMENT_MAX

SLICE_BYTES = 1 << 20  # COPY data per write: the server stores a slice while the next one is encoded
UTC_WALL_TIME = pa.timestamp("us")  # far blocks' due times: `timestamp`, read AT TIME ZONE 'UTC' (wheel_far_segments)


def write_columns(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    ids: Sequence[int] | np.ndarray,
    columns: Columns,
    clock: datetime,
) -> None:
    """COPY validated messages into their lanes (inside the caller's transaction)."""
    all_ids = np.asarray(ids, np.int64)
    near_until = _announce(conn, _earliest(columns))  # (None: no delayed lane, so no wheel timer)
    wheel = functools.partial(_write_wheel, near_until=near_until)
    for lane, write in ((DIRECT, _write_direct), (LEVEL, _write_levels), (WHEEL, wheel)):
        rows = np.flatnonzero(columns.lane == lane)
        if len(rows) == len(all_ids):
            write(conn, settings, cache, all_ids, columns, clock)
        elif len(rows):
            write(conn, settings, cache, all_ids[rows], columns.take(rows), clock)


def _write_direct(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    ids: np.ndarray,
    c: Columns,
    clock: datetime,
) -> None:
    """Level 0, a zero delay or a due time already past: straight into the topic (its lateness shows)."""
    n = len(ids)
    cache.ensure(conn, "topic_messages", [clock])
    conn.execute(f"SELECT {DURABLE_COMMIT}")
    copy_arrow(
        conn,
        "topic_messages",
        pa.RecordBatch.from_pydict(
            {
                "topic": c.topic,
                "message_id": ids,
                "origin": pa.repeat("direct", n),
                "level": pa.repeat(pa.scalar(0, pa.int16()), n),
                "key": c.key,
                "tags": c.tags,
                "properties": _jsonb(c.properties),
                "body": c.body,
                "is_json": c.is_json,
                "reconsume_times": c.reconsume_times,
                "deliver_at": _timestamps(c.due),
                "delivered_at": _timestamps(np.full(n, micros(clock))),
            }
        ),
    )
    _notify_topics(conn, pc.unique(c.topic).to_pylist())


def _write_levels(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    ids: np.ndarray,
    c: Columns,
    clock: datetime,
) -> None:
    """Segments of each level's messages (level_segments)."""
    ids, c, starts, counts = _segments(ids, c, c.level, c.requested_level, c.reconsume_times, c.due)
    cache.ensure(conn, "level_segments", [clock])
    copy_arrow(
        conn,
        "level_segments",
        pa.RecordBatch.from_pydict(
            {
                "level": c.level[starts],
                "requested_level": c.requested_level[starts],
                "reconsume_times": c.reconsume_times[starts],
                "deliver_at": _timestamps(c.due[starts]),
                "enqueued_at": _timestamps(np.full(len(starts), micros(clock))),
                **_segment_columns(ids, c, starts, counts, segment_blooms(c.key, counts)),
            }
        ),
    )


def _segments(ids: np.ndarray, c: Columns, *keys: np.ndarray) -> tuple[np.ndarray, Columns, np.ndarray, np.ndarray]:
    """Group the messages by `keys` (the first one sorted on, stably), cut into runs of equal keys of at most
    SEGMENT_MAX; returns the messages in that order, and each segment's first position and size. Input order
    holds within a group, so the segments one transaction writes for a group hold ascending, disjoint id ranges:
    a queue read in (xid, id) order runs through them segment by segment (level_segments)."""
    n = len(ids)
    order = np.argsort(keys[0], kind="stable")
    if (order[1:] < order[:-1]).any():  # several groups: bring each together, in input order
        ids, c, keys = ids[order], c.take(order), tuple(k[order] for k in keys)
    stacked = np.stack(keys)
    runs = np.flatnonzero(np.concatenate(([True], (stacked[:, 1:] != stacked[:, :-1]).any(axis=0), [True])))
    starts = np.concatenate([np.arange(a, b, SEGMENT_MAX) for a, b in itertools.pairwise(runs)])
    return ids, c, starts, np.diff(np.append(starts, n))


def _segment_columns(
    ids: np.ndarray, c: Columns, starts: np.ndarray, counts: np.ndarray, blooms: pa.Array
) -> dict[str, pa.Array]:
    """The columns every segment table has: its id range and count, its messages as lists, its keys' filter."""
    offsets = pa.array(np.append(starts, len(ids)).astype(np.int32))
    return {
        "id_first": ids[starts],
        "id_last": ids[starts + counts - 1],
        "n": counts.astype(np.int32),
        "ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
        "keys": pa.ListArray.from_arrays(offsets, c.key),
        "bodies": pa.ListArray.from_arrays(offsets, c.body),
        "topics": _spread(c.topic, starts, counts),
        "tags": _spread(c.tags, starts, counts),
        "properties": _spread(c.properties, starts, counts),
        "is_json": _spread(c.is_json, starts, counts),
        "key_bloom": blooms,
    }


def _spread(values: pa.Array, starts: np.ndarray, counts: np.ndarray) -> pa.ListArray:
    """One list per segment, of one element where all of the segment's values are the same (delaywheel.spread
    reads it back as n copies): the server then stores one value, not a thousand."""
    if len(starts) == len(values):  # segments of one (a single send): nothing to spread
        return pa.ListArray.from_arrays(pa.array(np.arange(len(values) + 1, dtype=np.int32)), values)
    first = pa.array(np.repeat(starts, counts))
    same = pc.fill_null(pc.equal(values, values.take(first)), False).to_numpy(zero_copy_only=False)
    same |= np.repeat(np.add.reduceat(values.is_null().to_numpy(zero_copy_only=False), starts) == counts, counts)
    uniform = np.logical_and.reduceat(same, starts)
    keep = ~np.repeat(uniform, counts)
    keep[starts] = True
    lengths = np.where(uniform, 1, counts)
    return pa.ListArray.from_arrays(
        pa.array(np.append(0, np.cumsum(lengths)).astype(np.int32)), values.filter(pa.array(keep))
    )


def _write_wheel(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    ids: np.ndarray,
    c: Columns,
    clock: datetime,
    *,
    near_until: datetime | None,
) -> None:
    """Timers due within the near window as rows of the near wheel; later ones as segments of far blocks, one per
    far day (wheel_far_segments). `near_until`: the roll's bound as read, unlocked, before the send's first write
    (`_announce`)."""
    assert near_until is not None  # (read with the wheel lane's notification)
    ids, c, place, split = _place(settings, ids, c, clock, near_until)
    if split < len(ids):
        # A far timer goes into a far block, so the bound must be the roll's current one, and stay so until the
        # send commits: FOR KEY SHARE waits for a roll in progress (it holds the row FOR UPDATE), reads its new
        # near_until and keeps the next roll out (a stale bound would put rows into a far block after the roll
        # moved it, stranding them until the next roll). The wheel deliverer's per-pass UPDATE does not conflict.
        # A send of near timers only takes no lock: a near row is in the right place whatever the roll does (it
        # only moves far blocks in), so its transaction takes its xid, and holds every consumer back (the commit
        # horizon), only from its COPY to its commit.
        locked = conn.execute("SELECT near_until FROM delaywheel.wheel_state FOR KEY SHARE").fetchone()
        assert locked is not None
        if locked[0] != near_until:
            ids, c, place, split = _place(settings, ids, c, clock, locked[0])
    enqueued = micros(clock)
    far = functools.cache(lambda: _far_segments(ids[split:], c.slice(split, len(ids)), place[split:], enqueued))
    if split:
        near = c.slice(0, split)
        _copy_wheel_part(
            conn,
            cache,
            "wheel",
            near.due,
            pa.RecordBatch.from_pydict(
                {
                    "id": ids[:split],
                    "topic": near.topic,
                    "key": near.key,
                    "tags": near.tags,
                    "properties": _jsonb(near.properties),
                    "body": near.body,
                    "is_json": near.is_json,
                    "deliver_at": _timestamps(near.due),
                    "enqueued_at": _timestamps(np.full(split, enqueued)),
                }
            ),
            meanwhile=far if split < len(ids) else None,
        )  # far segments built while the server stores near rows
    if split < len(ids):
        due, segments, summary = far()
        _copy_wheel_part(conn, cache, "wheel_far_segments", due, segments)
        if summary:
            conn.execute(_SUMMARIZE, summary)


def _place(
    settings: Settings, ids: np.ndarray, c: Columns, clock: datetime, near_until: datetime
) -> tuple[np.ndarray, Columns, np.ndarray, int]:
    """(ids, columns, place, split): the timers in writing order, each one's place (its due time in the near wheel,
    its far day's start in a far block) and how many lead as near rows."""
    # Far blocks only hold rows beyond the near window, even before the first roll or after days without one
    # (near_until behind the clock): the wheel's head takes near_until as the far blocks' lower bound
    # (pending.WHEEL_HEAD), so a timer due within the window must be in the near wheel to be waited for exactly.
    bound = micros(max(near_until, floor_to(clock + settings.wheel_near_window, DAY)))
    # Near timers first, in due order (a COPY into the near wheel's partitions then fills one partition at a time, and
    # the due-time index in order), then far ones by day, each day in input order (its segments' id ranges).
    day = DAY // US
    place = np.where(c.due < bound, c.due, c.due // day * day)
    order = np.argsort(place, kind="stable")
    if (order[1:] < order[:-1]).any():
        ids, c, place = ids[order], c.take(order), place[order]
    split = int(np.searchsorted(place, bound))
    return ids, c, place, split


# A send's far-key summaries (far_key_summaries), and out with summaries whose far days were all rolled into the near wheel
# (a few at a time, skipping those another producer is deleting).
_SUMMARIZE = """
WITH rolled AS (
    DELETE FROM delaywheel.far_key_summaries WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM delaywheel.far_key_summaries
        WHERE last_block < (SELECT near_until FROM delaywheel.wheel_state)
        LIMIT 1000 FOR UPDATE SKIP LOCKED)))
INSERT INTO delaywheel.far_key_summaries (slot, id_lo, id_hi, last_block, bloom)
SELECT t.slot, %(lo)s, %(hi)s, %(last)s, t.bloom FROM unnest(%(slots)s::int[], %(blooms)s::bytea[]) AS t(slot, bloom)
"""


def _far_segments(
    ids: np.ndarray, c: Columns, day_of: np.ndarray, enqueued: int
) -> tuple[np.ndarray, pa.RecordBatch, dict[str, object] | None]:
    """(due times, segment rows, summary rows' parameters or None) of far timers: one segment per far day, in input
    order within it; the summaries cover the segments with a key filter."""
    ids, c, starts, counts = _segments(ids, c, day_of)
    day = DAY // US
    blocks = c.due[starts] // day * day
    blooms, slots, filters = far_filters(c.key, counts)
    summary = None
    if slots:
        summarized = counts >= MIN_MESSAGES
        covered = ids[np.repeat(summarized, counts)]
        summary = {
            "slots": slots,
            "blooms": filters,
            "lo": int(covered.min()),
            "hi": int(covered.max()),
            "last": EPOCH + timedelta(microseconds=int(blocks[summarized].max())),
        }
    return (
        c.due,
        pa.RecordBatch.from_pydict(
            {
                "block": _timestamps(blocks),
                "enqueued_at": _timestamps(np.full(len(starts), enqueued)),
                "deliver_ats": pa.ListArray.from_arrays(
                    pa.array(np.append(starts, len(ids)).astype(np.int32)), _timestamps(c.due, UTC_WALL_TIME)
                ),
                **_segment_columns(ids, c, starts, counts, blooms),
            }
        ),
        summary,
    )


def _copy_wheel_part(
    conn: psycopg.Connection,
    cache: PartitionCache,
    table: str,
    due: np.ndarray,
    batch: pa.RecordBatch,
    meanwhile: Callable[[], object] | None = None,
) -> None:
    partitions = _one_per_partition(table, due)
    for attempt in range(3):
        try:
            with conn.transaction():  # a savepoint: a roll may drop a far block between ensure and COPY
                cache.ensure(conn, table, partitions)
                copy_arrow(conn, table, batch, meanwhile)
            return
        except (errors.CheckViolation, errors.UndefinedTable):
            for start in partitions:
                cache.forget(table, start)
            if attempt == 2:
                raise


def _one_per_partition(table: str, due: np.ndarray) -> list[datetime]:
    """The start of each partition the rows fall into."""
    width = WIDTH[table] // US
    return [EPOCH + timedelta(microseconds=int(lo)) for lo in np.unique(due // width) * width]


def _timestamps(micros_since_epoch: np.ndarray, kind: pa.DataType = TIMESTAMP) -> pa.Array:
    values = np.ascontiguousarray(micros_since_epoch, np.int64)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])  # no copy, no cast


def _jsonb(json_text: pa.Array) -> pa.Array:
    """JSON text in jsonb's binary COPY format (a version byte, then the text) for a scalar jsonb column: Arrow
    binary, which pgpq writes as is (its jsonb encoder took longer to set up than a whole single send)."""
    return pc.binary_join_element_wise(pa.scalar(b"\x01"), json_text.cast(pa.binary()), pa.scalar(b""))


@functools.cache
def _copy_statement(table: str, columns: tuple[str, ...]) -> str:
    """`COPY delaywheel.<table> (<columns>) FROM STDIN (FORMAT BINARY)`, names quoted, rendered once per shape."""
    return (
        sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)")
        .format(sql.Identifier("delaywheel", table), sql.SQL(", ").join(map(sql.Identifier, columns)))
        .as_string()
    )


def copy_arrow(
    conn: psycopg.Connection, table: str, batch: pa.RecordBatch, meanwhile: Callable[[], object] | None = None
) -> None:
    """COPY a record batch into delaywheel.<table>, its columns by name, in slices of about SLICE_BYTES.
    `meanwhile` runs once every slice is sent, before the COPY ends: client work the server's storing hides."""
    encoder = pgpq.ArrowToPostgresBinaryEncoder(batch.schema)
    step = max(1, batch.num_rows * SLICE_BYTES // max(batch.nbytes, 1))
    with conn.cursor().copy(_copy_statement(table, tuple(batch.schema.names))) as copy:
        data = encoder.write_header()  # a small batch goes out in one write: each write waits on the socket
        for offset in range(0, batch.num_rows, step):
            data += encoder.write_batch(batch.slice(offset, step))
            if len(data) >= SLICE_BYTES:
                copy.write(data)
                data = b""
        copy.write(data + encoder.finish())
        if meanwhile is not None:
            meanwhile()


def _earliest(c: Columns) -> dict[Lane, int]:
    """Each delayed lane's earliest due time (µs) among the messages: a level lane's per level, the wheel's."""
    levels = c.lane == LEVEL
    earliest: dict[Lane, int] = {
        int(level): int(c.due[levels & (c.level == level)].min()) for level in np.unique(c.level[levels])
    }
    wheel = c.lane == WHEEL
    if wheel.any():
        earliest[None] = int(c.due[wheel].min())
    return earliest


def _announce(conn: psycopg.Connection, earliest: dict[Lane, int]) -> datetime | None:
    """Tell each lane's sleeping deliverers its earliest new due time (µs; sent at COMMIT), so they can wake sooner
    (the other lanes' deliverers sleep on, channels.lane_channel), and read the roll's near_until, unlocked, for
    the wheel's writer. One statement for a send's lanes, before its first write: neither a NOTIFY nor a read takes a
    transaction id, and from its first write to its commit a producer's transaction holds back every consumer (the
    commit horizon), so a round trip spent before it costs them nothing, where one spent after it would hold them
    back for its whole length."""
    if not earliest:
        return None
    row = conn.execute(
        "SELECT (SELECT near_until FROM delaywheel.wheel_roll),"
        " (SELECT count(pg_notify(c, d)) FROM unnest(%s::text[], %s::text[]) AS n(c, d))",
        ([lane_channel(lane) for lane in earliest], [str(due / 1e6) for due in earliest.values()]),
    ).fetchone()
    assert row is not None
    return row[0]


def _notify_topics(conn: psycopg.Connection, topics: Iterable[str]) -> None:
    """Tell topic watchers (the Asset triggers) which topics got messages; sent at COMMIT, when they become
    readable, so a consumer DAG starts without waiting for the watcher's next look."""
    names = sorted(set(topics))
    if names:
        conn.execute("SELECT pg_notify(%s, t) FROM unnest(%s::text[]) t", (TOPIC_CHANNEL, names))
