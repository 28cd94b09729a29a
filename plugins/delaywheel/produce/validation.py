"""The rules a message must pass before anything is written; shared by `send`, `send_many` and Spark.

Each rule raises `InvalidMessage` with a stable `reason` code (what the quarantine table records)
and a sentence a person can act on.
"""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from delaywheel.config import Settings
from delaywheel.lanes import LaneKind

TOPIC_PATTERN = re.compile(r"[%|A-Za-z0-9_.-]{1,127}")  # RocketMQ's topic charset, plus '.'; used with fullmatch
MAX_KEY_CHARS = 1024
MAX_TAGS_CHARS = 1024
MAX_PROPERTIES_BYTES = 32767  # RocketMQ's limit; here the properties as stored: their JSON text (ASCII, \u escapes)
# Written by the store itself: the retry ladder (ORIGIN_*, RECONSUME_TIME) and replay (REPLAY_*). A producer setting
# them would change what consumers deduplicate on (Delivered.idempotency_id), where a message seems to come from, or
# how many retries it has left.
RECONSUME_TIME = "RECONSUME_TIME"  # a retry's count when the wheel carries it (retry.retries_so_far)
RESERVED_PROPERTIES = frozenset({"ORIGIN_MESSAGE_ID", "ORIGIN_TOPIC", "REPLAY_ID", "REPLAY_OF_TOPIC", RECONSUME_TIME})
RETRY_PREFIX = "%RETRY%"  # + a consumer group: the group's retry topic (retry.retry_topic)
DLQ_PREFIX = "%DLQ%"  # + a consumer group: its dead-letter topic (retry.dlq_topic)
RESERVED_TOPIC_PREFIXES = (RETRY_PREFIX, DLQ_PREFIX)  # written by the store's retry ladder only
MAX_GROUP_CHARS = 127 - len(RETRY_PREFIX)  # a group's retry topic is a topic name too (check_group)
_ZERO = timedelta(0)
MAX_REQUESTED_LEVEL = 2**31 - 1  # the stored requested level is an int4; above the table's maximum it is clamped


# How far an injected `now=` may lie from the database's clock, unless `Settings.test_clock`: ahead by little (a
# `now` ahead puts its level messages at the head of a FIFO lane, holding back every later one), behind by a few
# minutes (a caller that read the clock once for a series of calls), never enough to slip past `past_tolerance`.
NOW_AHEAD = timedelta(seconds=1)
NOW_BEHIND = timedelta(minutes=5)


class InvalidMessage(ValueError):
    """A message delaywheel refuses; nothing of the call that raised it was written."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Message(NamedTuple):
    """What a producer hands over. At most one of delay_level, delay and deliver_at is set. A NamedTuple, not a
    frozen dataclass: bulk writers build one per input row, and a frozen dataclass's __init__ costs a few times as
    much."""

    topic: str
    body: Any
    delay_level: int | None = None
    delay: timedelta | int | float | None = None  # a timedelta, or milliseconds
    deliver_at: datetime | None = None
    key: str | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None


class Placement(NamedTuple):
    """Where a valid message goes and when it falls due (fixed here, at enqueue). A NamedTuple: the wheel
    lane builds one per message."""

    lane: LaneKind
    deliver_at: datetime
    level: int | None = None
    requested_level: int | None = None


def check_now(now: object) -> datetime | None:
    """An injected clock's type: None (the database's clock decides) or a timezone-aware datetime, test or not."""
    if now is None:
        return None
    if not isinstance(now, datetime):
        raise InvalidMessage("bad_now", f"now must be a datetime, got {type(now).__name__} {now!r}")
    if now.tzinfo is None or now.utcoffset() is None:
        raise InvalidMessage("bad_now", "now must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return now


def check_now_near(now: datetime, clock: datetime, settings: Settings) -> None:
    """An injected clock within NOW_AHEAD / NOW_BEHIND of the database's `clock`, unless the caller is a test
    (`Settings.test_clock`): any other `now` changes what every producer, deliverer and consumer of the store sees."""
    if settings.test_clock or -NOW_BEHIND <= now - clock <= NOW_AHEAD:
        return
    raise InvalidMessage(
        "bad_now",
        f"now={now.isoformat()} is {abs(now - clock)} {'ahead of' if now > clock else 'behind'} the database's clock"
        f" ({clock.isoformat()}); an injected clock may be at most {NOW_AHEAD} ahead and {NOW_BEHIND} behind it."
        " Only tests inject others: Settings(test_clock=True) or DELAYWHEEL_TEST_CLOCK=1",
    )


def check_topic(topic: object) -> str:
    """A topic's name: RocketMQ's charset (which holds neither NUL nor anything beyond ASCII)."""
    if not isinstance(topic, str) or not topic:
        raise InvalidMessage("bad_topic", f"topic must be a non-empty string, got {topic!r}")
    if not TOPIC_PATTERN.fullmatch(topic):  # fullmatch: `$` would let a trailing newline through
        raise InvalidMessage(
            "bad_topic", f"topic {topic!r} is malformed: use 1-127 characters from A-Z a-z 0-9 . _ - | %"
        )
    return topic


def check_group(group: object) -> str:
    """A consumer group's name: one whose retry and dead-letter topics (RETRY_PREFIX / DLQ_PREFIX + the group) are
    topic names, so that its failures can always be handed to the retry ladder. ValueError (InvalidMessage) else."""
    if not isinstance(group, str) or not group:
        raise InvalidMessage("bad_group", f"group must be a non-empty string, got {group!r}")
    for prefix in RESERVED_TOPIC_PREFIXES:
        if not TOPIC_PATTERN.fullmatch(prefix + group):
            raise InvalidMessage(
                "bad_group",
                f"group {group[:40]!r} is malformed: use 1-{MAX_GROUP_CHARS} characters from A-Z a-z 0-9 . _ - | %"
                f" (its retry topic, {RETRY_PREFIX}<group>, must be a topic name)",
            )
    return group


def check_sendable_topic(topic: object) -> str:
    """A topic a producer may send into: a well-formed name, and not one of the store's own."""
    check_topic(topic)
    assert isinstance(topic, str)
    if topic.startswith(RESERVED_TOPIC_PREFIXES):
        raise InvalidMessage(
            "reserved_topic",
            f"topic {topic!r} is reserved: topics starting with %RETRY% or %DLQ% are written by the"
            " store's retry ladder only",
        )
    return topic


def storable(text: str) -> bool:
    """Can PostgreSQL store this text? A UTF-8 database holds every Unicode character but NUL; a lone surrogate
    (e.g. from bytes decoded with surrogateescape) has no UTF-8 form at all."""
    if "\x00" in text:
        return False
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _unstorable(reason: str, what: str, value: str) -> InvalidMessage:
    return InvalidMessage(
        reason,
        f"{what} {value[:40]!r} cannot be stored: it holds NUL or a lone surrogate (PostgreSQL text holds neither)",
    )


# A \u0000 escape in JSON text (ASCII, as json.dumps writes it): preceded by an even run of backslashes, so it is an
# escape and not the text "\u0000" (whose backslash is itself escaped).
_JSON_NUL = re.compile(rb"(?:^|[^\\])(?:\\\\)*\\u0000")


def encode_body(body: object, max_bytes: int) -> tuple[bytes, bool]:
    """(bytes, is_json): bytes stay bytes; anything else must be JSON-serialisable, and its text castable to
    jsonb (no NUL, no lone surrogate in any string: PostgreSQL's jsonb refuses both)."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        data, is_json = bytes(body), False
    else:
        try:
            data, is_json = json.dumps(body, allow_nan=False, separators=(",", ":")).encode(), True
        except (TypeError, ValueError) as exc:
            raise InvalidMessage("bad_body", f"body must be bytes or JSON-serialisable: {exc}") from None
        except RecursionError:
            raise InvalidMessage("bad_body", "body is nested too deeply to encode as JSON") from None
        if b"\\u" in data:  # a character outside printable ASCII: rare, so the checks below cost nothing usually
            _check_json_text(data, body)
    if len(data) > max_bytes:
        raise InvalidMessage("body_too_large", f"body is {len(data)} bytes, above the limit of {max_bytes} bytes")
    return data, is_json


def _check_json_text(data: bytes, body: object) -> None:
    if _JSON_NUL.search(data):
        raise InvalidMessage("bad_body", "body holds NUL (\\u0000) in a string: PostgreSQL's jsonb cannot store it")
    try:  # the same text without escapes: a surrogate, paired or not, has no UTF-8 form
        json.dumps(body, allow_nan=False, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise InvalidMessage(
            "bad_body", "body holds a lone surrogate in a string: PostgreSQL's jsonb cannot store it"
        ) from None


def check_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise InvalidMessage("bad_key", f"key must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    if not storable(key):
        raise _unstorable("bad_key", "key", key)
    return key


def check_tags(tags: object, internal: bool = False) -> str | None:
    """A string of at most MAX_TAGS_CHARS (not checked for the store's own retries: what it stored before the limit
    existed must still reach the retry topic), every character storable."""
    if tags is None:
        return None
    if not isinstance(tags, str):
        raise InvalidMessage("bad_tags", f"tags must be a string, got {tags!r}")
    if len(tags) > MAX_TAGS_CHARS and not internal:
        raise InvalidMessage("bad_tags", f"tags are {len(tags)} characters, above the limit of {MAX_TAGS_CHARS}")
    if not storable(tags):
        raise _unstorable("bad_tags", "tags", tags)
    return tags


def check_properties(properties: object, internal: bool = False) -> dict[str, str]:
    """A dict of str to str, every name and value storable, at most MAX_PROPERTIES_BYTES as stored, and no name in
    RESERVED_PROPERTIES (neither of the last two for `internal`: the store's own retry path)."""
    if properties is None:
        return {}
    if not isinstance(properties, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in properties.items()
    ):
        raise InvalidMessage("bad_properties", "properties must be a dict of strings to strings")
    for k, v in properties.items():
        if not storable(k):
            raise _unstorable("bad_properties", "property name", k)
        if not storable(v):
            raise _unstorable("bad_properties", f"property {k!r} value", v)
    if not internal and not RESERVED_PROPERTIES.isdisjoint(properties):
        names = ", ".join(sorted(RESERVED_PROPERTIES.intersection(properties)))
        raise InvalidMessage("reserved_property", f"properties {names} are reserved: the store writes them")
    size = 0 if internal else len(json.dumps(properties))
    if size > MAX_PROPERTIES_BYTES:
        raise InvalidMessage(
            "properties_too_large",
            f"properties are {size} bytes as stored (JSON text), above the limit of {MAX_PROPERTIES_BYTES} bytes",
        )
    return properties


def _delay_as_timedelta(delay: object) -> timedelta:
    if isinstance(delay, timedelta):
        return delay
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        raise InvalidMessage("bad_delay", f"delay must be a timedelta or milliseconds, got {delay!r}")
    if math.isnan(delay) or math.isinf(delay):
        raise InvalidMessage("bad_delay", f"delay must be a finite number of milliseconds, got {delay!r}")
    try:
        return timedelta(milliseconds=delay)
    except OverflowError:  # beyond timedelta's ~2.7 million years: too far by any maximum
        raise InvalidMessage("too_far", f"delay of {delay!r} ms is beyond any due time delaywheel accepts") from None


def _too_far(ahead: timedelta, settings: Settings) -> InvalidMessage:
    return InvalidMessage(
        "too_far", f"due time is {ahead} ahead, more than {settings.wheel_max_delay} (wheel_max_delay)"
    )


def place(
    now: datetime,
    settings: Settings,
    *,
    delay_level: object = None,
    delay: object = None,
    deliver_at: object = None,
) -> Placement:
    """Decide the lane and due time. `now` is the database clock (or a test's injected one)."""
    if (delay_level is not None) + (delay is not None) + (deliver_at is not None) > 1:  # once per message: no list
        given = [
            name
            for name, v in (("delay_level", delay_level), ("delay", delay), ("deliver_at", deliver_at))
            if v is not None
        ]
        raise InvalidMessage(
            "conflicting_delay", f"give only one of delay_level, delay, deliver_at (got {', '.join(given)})"
        )
    if delay is not None:  # the common bulk case, kept short: a due time from a delay is never in the past
        ahead = delay if type(delay) is timedelta else _delay_as_timedelta(delay)
        if ahead < _ZERO:
            raise InvalidMessage("bad_delay", f"delay must not be negative, got {ahead}")
        if ahead > settings.wheel_max_delay:  # checked before `now + delay`, which can overflow datetime
            raise _too_far(ahead, settings)
        return Placement("wheel", now + ahead) if ahead else Placement("direct", now)
    if deliver_at is not None:
        if not isinstance(deliver_at, datetime):
            raise InvalidMessage("bad_deliver_at", f"deliver_at must be a datetime, got {deliver_at!r}")
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise InvalidMessage(
                "naive_deliver_at", "deliver_at must be timezone-aware (e.g. datetime.now(timezone.utc))"
            )
        ahead = deliver_at - now
        if ahead > settings.wheel_max_delay:
            raise _too_far(ahead, settings)
        due = deliver_at
        if now - due > settings.past_tolerance:
            raise InvalidMessage(
                "too_old",
                f"due time {due.isoformat()} is more than {settings.past_tolerance} in the past (past_tolerance)",
            )
        # a due time already past goes straight to its topic, keeping its due time (its lateness shows)
        return Placement("direct", due) if due <= now else Placement("wheel", due)
    level = 0 if delay_level is None else delay_level
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidMessage("bad_level", f"delay_level must be an integer, got {level!r}")
    if level < 0 or level > MAX_REQUESTED_LEVEL:
        raise InvalidMessage("bad_level", f"delay_level must be between 0 and {MAX_REQUESTED_LEVEL}, got {level}")
    if level == 0:
        return Placement("direct", now, 0, 0)
    effective = min(level, settings.max_level)  # RocketMQ clamps a level above the maximum
    return Placement("level", now + settings.level_delay(effective), effective, level)


class Prepared(NamedTuple):
    """A validated message, ready to write. A NamedTuple, not a frozen dataclass: one is built per message,
    and a frozen dataclass's __init__ costs about as much as all the rules together."""

    topic: str
    key: str | None
    tags: str | None
    properties: dict[str, str]
    body: bytes
    is_json: bool
    placement: Placement
    reconsume_times: int = 0


def prepare(
    message: Message,
    now: datetime,
    settings: Settings,
    reconsume_times: int = 0,
    level_placements: dict[int, Placement] | None = None,
    *,
    internal: bool = False,
) -> Prepared:
    """Apply every rule to one message; raises InvalidMessage naming the first it breaks.
    `level_placements` lets one batch (one clock reading) share the placement of each delay level.
    `internal` is the store's own retry path (retry.reconsume_later), which may write reserved names."""
    if not isinstance(message, Message):
        raise InvalidMessage("bad_message", f"messages must be delaywheel.Message values, got {type(message).__name__}")
    body, is_json = encode_body(message.body, settings.max_body_bytes)
    topic_rule = checked_any_topic if internal else checked_topic
    return Prepared(  # positional: a NamedTuple built from keywords costs noticeably more, once per message
        topic_rule(message.topic) if isinstance(message.topic, str) else check_topic(message.topic),
        check_key(message.key),
        check_tags(message.tags, internal),
        _NO_PROPERTIES
        if message.properties is None or (type(message.properties) is dict and not message.properties)
        else check_properties(message.properties, internal),
        body,
        is_json,
        _place(message, now, settings, level_placements),
        reconsume_times,
    )


def _place(message: Message, now: datetime, settings: Settings, shared: dict[int, Placement] | None) -> Placement:
    level = message.delay_level
    if shared is None or type(level) is not int or message.delay is not None or message.deliver_at is not None:
        return place(now, settings, delay_level=level, delay=message.delay, deliver_at=message.deliver_at)
    hit = shared.get(level)
    if hit is None:  # an invalid level raises here, every time, and is never stored
        hit = shared[level] = place(now, settings, delay_level=level)
    return hit


_NO_PROPERTIES: dict[str, str] = {}  # shared, never mutated: rows without properties are written as NULL
# A batch usually has few distinct topics: producers' (reserved names refused) and the store's own (any name).
checked_topic = functools.lru_cache(maxsize=4096)(check_sendable_topic)
checked_any_topic = functools.lru_cache(maxsize=1024)(check_topic)
_checked_group = functools.lru_cache(maxsize=1024)(check_group)


def checked_group(group: object) -> str:
    """`check_group`, remembered for text (checked at every pull and ack); anything else is refused uncached."""
    return _checked_group(group) if type(group) is str else check_group(group)
