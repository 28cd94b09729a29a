"""A batch of messages as columns: `validation`'s rules checked once per column, not once per message.

`prepare` applies the rules one message at a time in Python, which costs about as much as PostgreSQL takes to
store the message. The usual batch is simple: str topics (a handful of distinct ones), bytes or JSON bodies, one
kind of delay for every message (levels, delays or due times). For such a batch each rule is a check over a whole
column (the distinct topics, the longest key and body, numpy range checks on levels and due times), and the
columns go straight into Arrow arrays for the COPY (`producer`). Anything else, and every batch that breaks a
rule, goes through `prepare` message by message: the fast path only ever accepts, so a rejection is always the
error `prepare` gives for the first bad message, with nothing written.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from delaywheel.config import Settings
from delaywheel.produce.validation import (
    MAX_KEY_CHARS,
    MAX_PROPERTIES_BYTES,
    MAX_REQUESTED_LEVEL,
    MAX_TAGS_CHARS,
    RESERVED_PROPERTIES,
    Message,
    Placement,
    checked_any_topic,
    checked_topic,
    encode_body,
    prepare,
    storable,
)

DIRECT, LEVEL, WHEEL = 0, 1, 2  # lanes, as stored in Columns.lane
LANES = {"direct": DIRECT, "level": LEVEL, "wheel": WHEEL}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)
TIMESTAMP = pa.timestamp("us", "UTC")
# pyarrow imports pandas, when it is installed (a slow import), the first time it converts a Python sequence:
# pa.array asks whether the sequence is a pandas object. Done here, at import, which send_many does before it opens its
# transaction. Left to the first batch, it would run inside a caller's transaction (the shop's order generator sends
# its timers inside the order's), holding back the store's commit horizon for that long in every new producer process.
pa.array((), pa.string())


def micros(ts: datetime) -> int:
    """An aware datetime as microseconds since the Unix epoch (how Columns holds due times)."""
    return (ts - EPOCH) // US


class Columns(NamedTuple):
    """Validated messages, column by column, in input order. Due times are µs since the Unix epoch."""

    topic: pa.Array  # string
    key: pa.Array  # string, null = no key
    tags: pa.Array  # string
    properties: pa.Array  # string holding JSON (written as jsonb), null = none
    body: pa.Array  # binary
    is_json: pa.Array  # bool
    lane: np.ndarray  # int8: DIRECT, LEVEL or WHEEL
    due: np.ndarray  # int64
    level: np.ndarray  # int16, 0 outside the level lane
    requested_level: np.ndarray  # int32
    reconsume_times: np.ndarray  # int32

    def take(self, rows: np.ndarray) -> Columns:
        """The given rows (positions), in that order."""
        picked = pa.array(rows)
        return Columns(*(c.take(picked) if isinstance(c, pa.Array) else c[rows] for c in self))

    def slice(self, start: int, stop: int) -> Columns:
        """Rows start..stop-1, without copying."""
        return Columns(*(c.slice(start, stop - start) if isinstance(c, pa.Array) else c[start:stop] for c in self))


def prepare_columns(
    messages: Sequence[Message],
    now: datetime,
    settings: Settings,
    reconsume_times: Sequence[int] | None = None,
    *,
    internal: bool = False,
) -> Columns:
    """Every message checked against every rule; raises InvalidMessage naming the first bad one. `internal`: the
    store's own retry path, which may use reserved topics and properties (validation.prepare)."""
    retries = np.zeros(len(messages), np.int32) if reconsume_times is None else np.asarray(reconsume_times, np.int32)
    fast = _simple(messages, now, settings, retries, internal=internal)
    return fast if fast is not None else _one_by_one(messages, now, settings, retries, internal=internal)


def _one_by_one(
    messages: Sequence[Message],
    now: datetime,
    settings: Settings,
    retries: np.ndarray,
    *,
    internal: bool = False,
) -> Columns:
    placements: dict[int, Placement] = {}
    rows = [
        prepare(m, now, settings, int(r), placements, internal=internal) for m, r in zip(messages, retries, strict=True)
    ]
    topic, key, tags, properties, body, is_json, placement, _ = zip(*rows, strict=True)
    lane, due, level, requested = zip(*placement, strict=True)
    return Columns(
        pa.array(topic, pa.string()),
        pa.array(key, pa.string()),
        pa.array(tags, pa.string()),
        pa.array([json.dumps(p) if p else None for p in properties], pa.string()),
        pa.array(body, pa.binary()),
        pa.array(is_json, pa.bool_()),
        np.fromiter((LANES[x] for x in lane), np.int8, len(rows)),
        pa.array(due, TIMESTAMP).cast(pa.int64()).to_numpy(),
        np.fromiter((x or 0 for x in level), np.int16, len(rows)),
        np.fromiter((x or 0 for x in requested), np.int32, len(rows)),
        retries,
    )


class Irregular(Exception):
    """The batch is not one the column checks cover (or breaks a rule): `prepare` decides, one by one."""


def _simple(
    messages: Sequence[Message],
    now: datetime,
    settings: Settings,
    retries: np.ndarray,
    *,
    internal: bool = False,
) -> Columns | None:
    n = len(messages)
    if n == 0 or set(map(type, messages)) != {Message}:
        return None
    topic, body, level, delay, deliver_at, key, tags, properties = zip(*messages, strict=True)
    try:
        topics = _text_column(topic, check=checked_any_topic if internal else checked_topic)
        if (
            not set(map(type, key)) <= {str, type(None)}
            or "" in key
            or max(map(len, filter(None, key)), default=0) > MAX_KEY_CHARS
        ):
            raise Irregular
        keys = pa.array(key, pa.string())  # a lone surrogate raises (UnicodeEncodeError): the rules name it
        if pc.any(pc.match_substring(keys, "\x00")).as_py():
            raise Irregular
        lane, due, levels, requested = _placed(level, delay, deliver_at, micros(now), settings)
        data, flags = _bodies(body, settings.max_body_bytes)
        columns = Columns(
            topics,
            keys,
            _text_column(tags, nullable=True, check=_tags_ok),
            _properties(properties, internal),
            data,
            flags,
            lane,
            due,
            levels,
            requested,
            retries,
        )
    except Exception:  # any surprise at all: the per-message rules decide, and name it
        return None
    return columns


def _text_column(
    values: tuple[Any, ...], nullable: bool = False, check: Callable[[str], object] | None = None
) -> pa.Array:
    """A column of str (or None), each distinct value passed to `check`; one repeated value, as topics and tags
    usually are, is not converted n times."""
    distinct = set(values)
    if not {type(v) for v in distinct} <= ({str, type(None)} if nullable else {str}):
        raise Irregular
    if check is not None:
        for value in distinct - {None}:
            check(value)
    if len(distinct) == 1:
        return pa.repeat(pa.scalar(values[0], pa.string()), len(values))
    return pa.array(values, pa.string())


def _bodies(body: tuple[Any, ...], max_bytes: int) -> tuple[pa.Array, pa.Array]:
    if set(map(type, body)) == {bytes}:
        data: Sequence[bytes] = body
        flags = pa.repeat(False, len(body))
    else:
        encoded = [encode_body(b, max_bytes) for b in body]  # raises: _simple falls back to the per-message rules
        data = [e[0] for e in encoded]
        flags = pa.array([e[1] for e in encoded], pa.bool_())
    column = pa.array(data, pa.binary())
    if pc.max(pc.binary_length(column)).as_py() > max_bytes:
        raise Irregular
    return column, flags


def _tags_ok(tags: str) -> None:
    if len(tags) > MAX_TAGS_CHARS or not storable(tags):
        raise Irregular


# In properties' JSON text (json.dumps escapes every non-ASCII character): \u0000 (NUL) or a surrogate, paired or
# lone. It may also match an escaped backslash followed by "u0000": the rules then decide, which is never wrong.
_ODD_ESCAPE = r"\\u(?:0000|[dD][89a-fA-F])"


def storable_column(column: pa.Array, max_chars: int | None = None) -> pa.Array:
    """A text column as is, if every value is text PostgreSQL can store (Arrow strings are UTF-8, so only NUL is
    left to refuse) of at most `max_chars`; Irregular otherwise (also for `bulk`'s column path)."""
    if pc.any(pc.match_substring(column, "\x00")).as_py():
        raise Irregular
    if max_chars is not None and (pc.max(pc.utf8_length(column)).as_py() or 0) > max_chars:
        raise Irregular
    return column


def plain_json(texts: pa.Array) -> pa.Array:
    """JSON texts (binary, as json.dumps writes them) as they are, if none holds \\u0000 or a surrogate escape;
    Irregular otherwise, so that the rules decide (validation.encode_body)."""
    if pc.any(pc.match_substring_regex(texts.cast(pa.string()), _ODD_ESCAPE)).as_py():
        raise Irregular
    return texts


def _properties(properties: tuple[Any, ...], internal: bool = False) -> pa.Array:
    if properties.count(None) + properties.count({}) == len(properties):
        return pa.nulls(len(properties), pa.string())
    for p in properties:
        if not (p is None or (type(p) is dict and all(type(k) is str and type(v) is str for k, v in p.items()))):
            raise Irregular
        if p and not internal and not RESERVED_PROPERTIES.isdisjoint(p):
            raise Irregular
    column = pa.array([json.dumps(p) if p else None for p in properties], pa.string())
    if (
        pc.max(pc.binary_length(column)).as_py() > MAX_PROPERTIES_BYTES
        or pc.any(pc.match_substring_regex(column, _ODD_ESCAPE)).as_py()
    ):
        raise Irregular
    return column


@functools.cache
def _level_delays(levels: tuple[timedelta, ...]) -> np.ndarray:
    """µs of delay by level number (0: none)."""
    return np.array([0, *(d // US for d in levels)], np.int64)


Placed = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (lane, due, level, requested level)


def _placed(
    level: tuple[Any, ...],
    delay: tuple[Any, ...],
    deliver_at: tuple[Any, ...],
    now: int,
    settings: Settings,
) -> Placed:
    """(lane, due, level, requested level) for a batch with one kind of delay, as `validation.place` decides."""
    n = len(level)
    no_level, no_delay, no_at = level.count(None) == n, delay.count(None) == n, deliver_at.count(None) == n
    if no_level and no_delay and no_at:
        return placed_now(n, now)
    if no_delay and no_at:
        if set(map(type, level)) != {int}:
            raise Irregular
        return placed_by_level(np.fromiter(level, np.int64, n), now, settings)  # OverflowError beyond int64: irregular
    if no_level and no_at:
        kinds = set(map(type, delay))
        if kinds == {timedelta}:
            return placed_by_delay(pa.array(delay, pa.duration("us")).cast(pa.int64()).to_numpy(), now, settings)
        if kinds == {int}:  # milliseconds; floats round as timedelta does, so they take the per-message path
            return placed_by_delay_ms(np.fromiter(delay, np.int64, n), now, settings)
        raise Irregular
    if no_level and no_delay:
        if set(map(type, deliver_at)) != {datetime} or None in set(map(datetime.utcoffset, deliver_at)):
            raise Irregular  # naive datetimes would be read as UTC
        return placed_at(pa.array(deliver_at, TIMESTAMP).cast(pa.int64()).to_numpy(), now, settings)
    raise Irregular  # several kinds of delay in one batch


# One kind of delay for a whole batch, as numpy arrays (also what `bulk` reads from Arrow columns); each raises
# Irregular for anything `validation.place` might refuse, so that it names the reason.


def placed_now(n: int, now: int) -> Placed:
    """No delay: straight into the topic."""
    return _no_level(np.full(n, DIRECT, np.int8), np.full(n, now, np.int64))


def _no_level(lanes: np.ndarray, due: np.ndarray) -> Placed:
    return lanes, due, np.zeros(len(due), np.int16), np.zeros(len(due), np.int32)


def placed_by_level(asked: np.ndarray, now: int, settings: Settings) -> Placed:
    if asked.min() < 0 or asked.max() > MAX_REQUESTED_LEVEL:
        raise Irregular
    effective = np.minimum(asked, settings.max_level)
    lanes = np.where(asked == 0, DIRECT, LEVEL).astype(np.int8)
    return lanes, now + _level_delays(settings.levels)[effective], effective.astype(np.int16), asked.astype(np.int32)


def placed_by_delay_ms(ms: np.ndarray, now: int, settings: Settings) -> Placed:
    if ms.max() > settings.wheel_max_delay // US // 1000 + 1:  # before `* 1000`, which could overflow
        raise Irregular
    return placed_by_delay(ms * 1000, now, settings)


def placed_by_delay(ahead: np.ndarray, now: int, settings: Settings) -> Placed:
    if ahead.min() < 0 or ahead.max() > settings.wheel_max_delay // US:
        raise Irregular
    return _no_level(np.where(ahead == 0, DIRECT, WHEEL).astype(np.int8), now + ahead)


def placed_at(due: np.ndarray, now: int, settings: Settings) -> Placed:
    if (due - now).max() > settings.wheel_max_delay // US or (now - due).max() > settings.past_tolerance // US:
        raise Irregular
    return _no_level(np.where(due <= now, DIRECT, WHEEL).astype(np.int8), due)
