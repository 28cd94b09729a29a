"""Failed messages: retries by the group's policy or RocketMQ's ladder, then the dead-letter topic.

A failed message goes, in its ack's transaction, to the group's retry topic `%RETRY%<group>` after a delay, as a new
message carrying its original's id and topic (ORIGIN_MESSAGE_ID, ORIGIN_TOPIC), and after its last retry to the
group's dead-letter topic `%DLQ%<group>`. How many retries and which delays: the group's retry policy
(`group_retry_policies`, read once per ack that has failures, in its transaction, so a change applies from the next
ack on), else RocketMQ's ladder, retry n after delay level 2 + n, `Settings.max_reconsume_times` of them.

A scheduled delay that is a configured level's goes to that level's queue; any other goes to the wheel, which keeps no
retry count, so such a retry carries its count in the RECONSUME_TIME property (RocketMQ's name) and a pull reads it
from there (`retries_so_far`).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from delaywheel.config import ConfigError, Settings, format_duration, parse_duration
from delaywheel.partitions import PartitionCache
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import DLQ_PREFIX, RECONSUME_TIME, RETRY_PREFIX, Message, checked_group

if TYPE_CHECKING:  # topics imports this module: the class is named for mypy only
    from delaywheel.consume.topics import Delivered

FIRST_RETRY_LEVEL = 3  # RocketMQ: retry n is delayed by level 3 + n
MAX_RETRY_ATTEMPTS = 1000  # the most retries a policy may give (a typo such as 10**9 is refused, not stored)
MAX_SCHEDULE = 100  # the most delays a policy's schedule may list
_MS = timedelta(milliseconds=1)


class InvalidRetryPolicy(ValueError):
    """A retry policy delaywheel refuses, with the reason; nothing was written."""


def retry_topic(group: str) -> str:
    """The group's retry topic; a group whose retry topic would not be a topic name raises (`check_group`): so pull,
    ack and a consumer refuse it before anything is read or written, and its failures can always be acked."""
    return RETRY_PREFIX + checked_group(group)


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + checked_group(group)


@dataclass(frozen=True)
class RetryPolicy:
    """A consumer group's retries. `max_attempts`: how many retries a failed message gets before the dead-letter
    topic (RocketMQ's maxReconsumeTimes; 0: none), None for the store's `max_reconsume_times`. `delays`: the delay
    before retry 1, 2, ...; a schedule shorter than the retries repeats its last delay; None for RocketMQ's ladder."""

    group: str
    max_attempts: int | None = None
    delays: tuple[timedelta, ...] | None = None
    updated_at: datetime | None = None


def parse_delays(text: str) -> list[timedelta]:
    """A schedule as text: durations separated by commas or spaces, in the settings' syntax ('4m,10m,1h')."""
    items = text.replace(",", " ").split()
    if not items:
        raise InvalidRetryPolicy("delays: empty; give durations separated by commas, e.g. '4m,10m,1h'")
    try:
        return [parse_duration(item, "delays") for item in items]
    except ConfigError as exc:
        raise InvalidRetryPolicy(str(exc)) from None


def checked_policy(settings: Settings, group: str, max_attempts: object, delays: object) -> RetryPolicy:
    """The policy `set_policy` would store, every rule applied: a group name; at least one of `max_attempts` (a whole
    number from 0 to MAX_RETRY_ATTEMPTS) and `delays` (1 to MAX_SCHEDULE durations, as a list of timedeltas or
    duration texts, or one text of them; each a positive whole number of milliseconds up to the store's longest delay,
    `wheel_max_delay`). InvalidRetryPolicy (or InvalidMessage for the group), naming what is wrong, else."""
    checked_group(group)
    if max_attempts is None and delays is None:
        raise InvalidRetryPolicy(
            "give max_attempts, delays or both (a group without a policy follows RocketMQ's ladder: clear it instead)"
        )
    if max_attempts is not None and (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 0 <= max_attempts <= MAX_RETRY_ATTEMPTS
    ):
        raise InvalidRetryPolicy(
            f"max_attempts must be a whole number from 0 to {MAX_RETRY_ATTEMPTS} (retries before the dead-letter"
            f" topic), not {max_attempts!r}"
        )
    return RetryPolicy(group, max_attempts, None if delays is None else _checked_delays(settings, delays))


def _checked_delays(settings: Settings, delays: object) -> tuple[timedelta, ...]:
    if isinstance(delays, str):
        delays = parse_delays(delays)
    if not isinstance(delays, Iterable) or isinstance(delays, (bytes, Mapping)):
        raise InvalidRetryPolicy(f"delays must be a list of durations, not {type(delays).__name__}")
    items = list(itertools.islice(delays, MAX_SCHEDULE + 1))  # (an endless iterator: one too many)
    if not 1 <= len(items) <= MAX_SCHEDULE:
        count = "more" if items else "none"
        raise InvalidRetryPolicy(f"delays: give 1 to {MAX_SCHEDULE} delays, not {count}")
    checked = []
    for position, item in enumerate(items, start=1):
        delay = item
        if isinstance(item, str):
            try:
                delay = parse_duration(item, f"delays: item {position}")
            except ConfigError as exc:
                raise InvalidRetryPolicy(str(exc)) from None
        if not isinstance(delay, timedelta):
            raise InvalidRetryPolicy(
                f"delays: item {position} ({item!r}) is not a duration: give a timedelta or a text such as '4m'"
            )
        if delay <= timedelta(0) or delay % _MS or delay > settings.wheel_max_delay:
            shown = item if isinstance(item, str) else str(delay) if delay % _MS else format_duration(delay)
            raise InvalidRetryPolicy(
                f"delays: item {position} ({shown}) must be a positive whole number of milliseconds up to"
                f" {format_duration(settings.wheel_max_delay)} (wheel_max_delay, the store's longest delay)"
            )
        checked.append(delay)
    return tuple(checked)


# The policies' statements, one per operation.
_SET = """
INSERT INTO delaywheel.group_retry_policies (grp, max_attempts, delays_ms) VALUES (%(group)s, %(attempts)s, %(delays)s)
ON CONFLICT (grp) DO UPDATE
SET max_attempts = excluded.max_attempts, delays_ms = excluded.delays_ms, updated_at = clock_timestamp()
RETURNING updated_at
"""
_READ = "SELECT max_attempts, delays_ms, updated_at FROM delaywheel.group_retry_policies WHERE grp = %s"
_CLEAR = "DELETE FROM delaywheel.group_retry_policies WHERE grp = %s"


def set_policy(
    conn: psycopg.Connection, settings: Settings, group: str, *, max_attempts: object = None, delays: object = None
) -> RetryPolicy:
    """Give `group` this policy (`checked_policy`'s rules), replacing any it had whole: an option not given is the
    store's default (max_reconsume_times, the ladder). The next ack with failures follows it."""
    policy = checked_policy(settings, group, max_attempts, delays)
    delays_ms = None if policy.delays is None else [d // _MS for d in policy.delays]
    row = conn.execute(_SET, {"group": group, "attempts": policy.max_attempts, "delays": delays_ms}).fetchone()
    assert row is not None
    return RetryPolicy(group, policy.max_attempts, policy.delays, row[0])


def read_policy(conn: psycopg.Connection, group: str) -> RetryPolicy | None:
    """The group's policy; None: it has none (RocketMQ's ladder, max_reconsume_times)."""
    row = conn.execute(_READ, (checked_group(group),)).fetchone()
    if row is None:
        return None
    delays = None if row[1] is None else tuple(timedelta(milliseconds=ms) for ms in row[1])
    return RetryPolicy(group, row[0], delays, row[2])


def clear_policy(conn: psycopg.Connection, group: str) -> bool:
    """Remove the group's policy (RocketMQ's ladder again from the next ack on); False: it had none."""
    return conn.execute(_CLEAR, (checked_group(group),)).rowcount > 0


@functools.lru_cache(maxsize=8)
def _levels_by_delay(levels: tuple[timedelta, ...]) -> dict[timedelta, int]:
    """Each configured delay's level (the lowest, if two levels share a delay)."""
    return {delay: level for level, delay in reversed(list(enumerate(levels, start=1)))}


def attempts(policy: RetryPolicy | None, settings: Settings) -> int:
    """The retries a failed message of the group gets before the dead-letter topic."""
    return settings.max_reconsume_times if policy is None or policy.max_attempts is None else policy.max_attempts


def next_retry(policy: RetryPolicy | None, settings: Settings, tries: int) -> int | timedelta | None:
    """Where a message goes that failed after `tries` retries: None, the dead-letter topic (it had its last); a
    delay level (the ladder's 3 + tries, or a scheduled delay that is a configured level's); or a delay for the wheel
    (at most wheel_max_delay, which may have been lowered since the policy was set)."""
    if tries >= attempts(policy, settings):
        return None
    if policy is None or policy.delays is None:
        return FIRST_RETRY_LEVEL + tries
    delay = policy.delays[min(tries, len(policy.delays) - 1)]
    return _levels_by_delay(settings.levels).get(delay) or min(delay, settings.wheel_max_delay)


def schedule(policy: RetryPolicy | None, settings: Settings) -> list[timedelta]:
    """The delay before each retry a failed message of the group gets, in order (then the dead-letter topic)."""
    delays = []
    for tries in range(attempts(policy, settings)):
        step = next_retry(policy, settings, tries)
        assert step is not None
        delays.append(settings.level_delay(min(step, settings.max_level)) if isinstance(step, int) else step)
    return delays


def describe(delays: Iterable[timedelta]) -> list[str]:
    """A schedule as text, runs of one delay folded: ['1 after 4m', '2-3 after 10m']."""
    runs: list[tuple[int, int, timedelta]] = []
    for n, delay in enumerate(delays, start=1):
        if runs and runs[-1][2] == delay:
            runs[-1] = (runs[-1][0], n, delay)
        else:
            runs.append((n, n, delay))
    return [f"{a if a == b else f'{a}-{b}'} after {format_duration(d)}" for a, b, d in runs]


def retries_so_far(stored: int, properties: Mapping[str, Any]) -> int:
    """A delivered message's retries: `stored` (its row's count) or, for a retry the wheel delivered, the
    RECONSUME_TIME property the retry path wrote; a value that is not a count (a row written by hand) is ignored."""
    value = properties.get(RECONSUME_TIME)
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        return max(stored, int(value))
    return stored


def reconsume_later(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, group: str, messages: list[Delivered]
) -> None:
    """Hand failed `messages` on, in the caller's (the ack's) transaction: each to the group's retry topic after the
    delay its policy (read here, once) or the ladder gives for its tries so far, or to the dead-letter topic."""
    policy = read_policy(conn, group)
    outgoing, times = [], []
    for m in messages:
        times.append(m.reconsume_times + 1)
        # as strings: a row written some other way may hold other JSON values, and its retry must not fail the ack
        properties = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (m.properties or {}).items()}
        properties.setdefault("ORIGIN_TOPIC", m.topic)
        properties.setdefault("ORIGIN_MESSAGE_ID", str(m.message_id))
        properties.pop(RECONSUME_TIME, None)  # the row's count says it, but on the wheel (below)
        step = next_retry(policy, settings, m.reconsume_times)
        if step is None:
            outgoing.append(Message(dlq_topic(group), m.body, key=m.key, tags=m.tags, properties=properties))
        elif isinstance(step, int):
            outgoing.append(
                Message(retry_topic(group), m.body, delay_level=step, key=m.key, tags=m.tags, properties=properties)
            )
        else:
            properties[RECONSUME_TIME] = str(times[-1])  # the wheel keeps no count (retries_so_far reads it)
            outgoing.append(
                Message(retry_topic(group), m.body, delay=step, key=m.key, tags=m.tags, properties=properties)
            )
    send_for_store(conn, settings, cache, outgoing, times)  # the store's own: reserved topics and properties
