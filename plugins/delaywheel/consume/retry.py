"""Failed messages: RocketMQ's retry ladder and the dead-letter topic.

A failed message goes, in its ack's transaction, to the group's retry topic `%RETRY%<group>` after a delay, as a new
message carrying its original's id and topic (ORIGIN_MESSAGE_ID, ORIGIN_TOPIC), and after too many tries to the
group's dead-letter topic `%DLQ%<group>`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import psycopg

from delaywheel.config import Settings
from delaywheel.partitions import PartitionCache
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import DLQ_PREFIX, RETRY_PREFIX, Message, checked_group

if TYPE_CHECKING:  # topics imports this module: the class is named for mypy only
    from delaywheel.consume.topics import Delivered

FIRST_RETRY_LEVEL = 3  # RocketMQ: retry n is delayed by level 3 + n


def retry_topic(group: str) -> str:
    """The group's retry topic; a group whose retry topic would not be a topic name raises (`check_group`): so pull,
    ack and a consumer refuse it before anything is read or written, and its failures can always be acked."""
    return RETRY_PREFIX + checked_group(group)


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + checked_group(group)


def reconsume_later(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, group: str, messages: list[Delivered]
) -> None:
    outgoing, times = [], []
    for m in messages:
        times.append(m.reconsume_times + 1)
        # as strings: a row written some other way may hold other JSON values, and its retry must not fail the ack
        properties = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (m.properties or {}).items()}
        properties.setdefault("ORIGIN_TOPIC", m.topic)
        properties.setdefault("ORIGIN_MESSAGE_ID", str(m.message_id))
        if times[-1] > settings.max_reconsume_times:
            outgoing.append(Message(dlq_topic(group), m.body, key=m.key, tags=m.tags, properties=properties))
        else:
            level = FIRST_RETRY_LEVEL + m.reconsume_times
            outgoing.append(
                Message(retry_topic(group), m.body, delay_level=level, key=m.key, tags=m.tags, properties=properties)
            )
    send_for_store(conn, settings, cache, outgoing, times)  # the store's own: reserved topics and properties
