"""Consumers: pull/ack, redelivery of unacked batches, RocketMQ's retry ladder and dead-letter topic."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pytest

from delaywheel import Settings, Store
from delaywheel.consume.retry import dlq_topic, retry_topic
from delaywheel.consume.topics import AckResult
from delaywheel.produce.validation import Message
from tests.helpers import at


def test_pull_ack_and_redelivery_of_unacked(store: Store, t0: datetime) -> None:
    ids = store.send_many([Message("orders", {"n": i}) for i in range(5)], now=t0)
    first = store.pull("orders", "billing", 3)
    assert [m.message_id for m in first.messages] == ids[:3]
    assert store.pull("orders", "billing", 3).messages == []  # leased: no other pull gets its queues meanwhile
    store.release(first)
    again = store.pull("orders", "billing", 3)  # given back without an ack: the same batch again
    assert [m.message_id for m in again.messages] == ids[:3]
    assert store.ack(again) == AckResult(acked=3, retried=0, already_acked=0)
    rest = store.pull("orders", "billing", 10)
    assert [m.message_id for m in rest.messages] == ids[3:]
    store.ack(rest)
    assert len(store.pull("orders", "billing", 10)) == 0
    assert [m.message_id for m in store.pull("orders", "shipping", 10).messages] == ids  # groups are independent


def test_failed_messages_walk_the_retry_ladder_then_dead_letter(db_url: str, t0: datetime) -> None:
    settings = Settings(max_reconsume_times=2)
    with Store(db_url, settings) as store:
        original = store.send("orders", {"order": 7}, key="o-7", now=t0)
        batch = store.pull("orders", "g")
        assert [m.message_id for m in batch.messages] == [original]
        store.ack(batch, failed={original})
        retry_row = store.conn.execute(
            "SELECT level, topic, reconsume_times FROM delaywheel.level_queue ORDER BY id"
        ).fetchall()
        assert retry_row == [(3, retry_topic("g"), 1)]  # retry 1 waits level 3 + 0
        seen = []
        for attempt in range(1, 3):
            level = 3 + attempt - 1
            store.deliver_due(now=at(t0, 24 * 3600 * attempt))
            batch = store.pull("orders", "g")
            (m,) = batch.messages
            seen.append(m)
            assert (m.source_topic, m.topic, m.reconsume_times, m.idempotency_id, m.key) == (
                retry_topic("g"),
                "orders",
                attempt,
                original,
                "o-7",
            )
            assert m.message_id != original and m.body == {"order": 7}
            queued = store.conn.execute("SELECT max(level) FROM delaywheel.level_queue").fetchone()
            assert queued is not None and queued[0] == level
            store.ack(batch, failed={m.message_id})
        dead = store.conn.execute(
            "SELECT topic, reconsume_times, properties->>'ORIGIN_MESSAGE_ID' FROM delaywheel.topic_messages"
            " WHERE topic = %s",
            (dlq_topic("g"),),
        ).fetchall()
        assert dead == [(dlq_topic("g"), 3, str(original))]
        (dlq,) = store.pull(dlq_topic("g"), "ops").messages
        assert dlq.idempotency_id == original
        store.deliver_due(now=at(t0, 10 * 24 * 3600))
        assert len(store.pull("orders", "g")) == 0  # nothing comes back after the dead letter


def test_retry_delay_follows_the_level_table(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"x", now=t0)
    store.ack(store.pull("orders", "g"), failed={mid})
    row = store.conn.execute("SELECT deliver_at - enqueued_at FROM delaywheel.level_queue").fetchone()
    assert row is not None and row[0] == timedelta(seconds=10)  # level 3 = 10s


def _retries(store: Store) -> list[tuple[str, int]]:
    """(topic, reconsume_times) of every retry or dead letter waiting or delivered."""
    return store.conn.execute(
        "SELECT topic, reconsume_times FROM delaywheel.level_queue WHERE topic LIKE '\\%%RETRY\\%%%%'"
        " UNION ALL SELECT topic, reconsume_times FROM delaywheel.topic_messages WHERE topic LIKE '\\%%DLQ\\%%%%'"
    ).fetchall()


def test_acking_a_batch_twice_retries_its_failures_once(store: Store, t0: datetime) -> None:
    ids = store.send_many([Message("orders", {"n": i}) for i in range(3)], now=t0)
    batch = store.pull("orders", "g")
    assert store.ack(batch, failed={ids[1]}) == AckResult(acked=3, retried=1, already_acked=0)
    assert store.ack(batch, failed={ids[1]}) == AckResult(acked=0, retried=0, already_acked=3)  # a retried ack
    assert _retries(store) == [(retry_topic("g"), 1)]
    offset = store.conn.execute("SELECT sum(acked)::int FROM delaywheel.consumer_offsets WHERE grp = 'g'").fetchone()
    assert offset == (3,)  # counted once


def test_a_stale_ack_moves_nothing_and_retries_nothing(store: Store, t0: datetime) -> None:
    """Two consumers of one group pull the same messages (the first gave its queues back, as when its lease ends);
    the one that acks second (and less far) changes nothing: its failure was the other consumer's success, already
    committed."""
    ids = store.send_many([Message("orders", {"n": i}) for i in range(4)], now=t0)
    slow = store.pull("orders", "g", 2)
    store.release(slow)
    with Store(store.url, store.settings) as other:
        fast = other.pull("orders", "g", 4)
        assert other.ack(fast) == AckResult(acked=4)
    assert store.ack(slow, failed={ids[0]}) == AckResult(acked=0, retried=0, already_acked=2)
    assert _retries(store) == []
    assert len(store.pull("orders", "g")) == 0  # the offset stayed where the faster consumer left it


def test_an_ack_overlapping_a_newer_one_retries_only_what_it_moves_past(store: Store, t0: datetime) -> None:
    ids = store.send_many([Message("orders", {"n": i}) for i in range(4)], now=t0)
    whole = store.pull("orders", "g", 4)
    store.release(whole)
    store.ack(store.pull("orders", "g", 2))  # another consumer acked the first two meanwhile
    assert store.ack(whole, failed={ids[0], ids[3]}) == AckResult(acked=2, retried=1, already_acked=2)
    assert _retries(store) == [(retry_topic("g"), 1)]
    retry = store.conn.execute(
        "SELECT properties->>'ORIGIN_MESSAGE_ID' FROM delaywheel.level_queue WHERE topic = %s", (retry_topic("g"),)
    ).fetchone()
    assert retry == (str(ids[3]),)


def test_failed_ids_not_in_the_batch_are_an_error_and_ack_nothing(store: Store, t0: datetime) -> None:
    ids = store.send_many([Message("orders", {"n": i}) for i in range(2)], now=t0)
    batch = store.pull("orders", "g")
    with pytest.raises(ValueError, match=r"1 id\(s\) that are not messages of this batch: 999"):
        store.ack(batch, failed={ids[0], 999})
    assert _retries(store) == []
    store.release(batch)
    look = store.pull("orders", "g")
    assert [m.message_id for m in look.messages] == ids  # nothing acked
    store.release(look)
    assert store.ack(store.pull("orders", "g"), failed=set()) == AckResult(acked=2)
    assert store.ack(store.pull("orders", "g")) == AckResult()  # an empty batch


def test_a_hand_written_body_that_does_not_decode_reaches_the_consumer_as_bytes(store: Store, t0: datetime) -> None:
    """A topic row written by SQL whose body is marked JSON but is not (bad UTF-8): the group gets it as raw bytes,
    between the good messages around it, and moves on (it used to raise on every pull, stopping the group)."""
    first = store.send("orders", {"n": 1}, now=t0)
    store.conn.execute(
        "INSERT INTO delaywheel.topic_messages (topic, message_id, origin, body, is_json, deliver_at, delivered_at)"
        " VALUES ('orders', 999, 'direct', %s, true, %s, %s)",
        (b"\xff{not json", t0, t0),
    )
    last = store.send("orders", {"n": 2}, now=t0)
    batch = store.pull("orders", "billing", 10)
    assert [(m.message_id, m.body) for m in batch.messages] == [
        (first, {"n": 1}),
        (999, b"\xff{not json"),
        (last, {"n": 2}),
    ]
    assert store.ack(batch).acked == 3
    assert len(store.pull("orders", "billing", 10)) == 0


def test_a_batch_takes_the_topic_first_then_the_retry_topic_and_its_ack_moves_both(store: Store, t0: datetime) -> None:
    """One read serves both sources: the topic's messages first, the group's retries after them while there is
    room. An ack covers each source by the common move (the offset where the last ack left it) or, for a source the
    group never acked, by the general path; the group's counts add up either way."""
    failing = store.send_many([Message("orders", {"n": i}) for i in range(2)], now=t0)
    assert store.ack(store.pull("orders", "g"), failed=set(failing)) == AckResult(acked=2, retried=2)
    store.deliver_due(now=at(t0, 3600))  # the two retries reach %RETRY%g
    fresh = store.send_many([Message("orders", {"n": i}) for i in range(3)], now=at(t0, 3600))
    batch = store.pull("orders", "g", 4)
    assert [m.source_topic for m in batch.messages] == ["orders"] * 3 + [retry_topic("g")]
    assert [m.message_id for m in batch.messages[:3]] == fresh
    assert batch.messages[3].idempotency_id == failing[0] and batch.messages[3].topic == "orders"
    assert store.ack(batch) == AckResult(acked=4)
    last = store.pull("orders", "g", 4)
    assert [m.idempotency_id for m in last.messages] == [failing[1]]
    assert store.ack(last, failed={last.messages[0].message_id}) == AckResult(acked=1, retried=1)
    newest = store.send("orders", {"n": 9}, now=at(t0, 7200))
    store.deliver_due(now=at(t0, 7200))  # its second retry
    both = store.pull("orders", "g", 4)  # one of each source, both offsets moved by the common ack
    assert [(m.message_id if m.source_topic == "orders" else m.idempotency_id) for m in both.messages] == [
        newest,
        failing[1],
    ]
    assert store.ack(both) == AckResult(acked=2)
    assert len(store.pull("orders", "g", 4)) == 0
    counts = store.conn.execute(
        "SELECT topic, sum(acked)::int FROM delaywheel.consumer_offsets WHERE grp = 'g' GROUP BY topic ORDER BY topic"
    )
    assert counts.fetchall() == [(retry_topic("g"), 3), ("orders", 6)]


def test_a_pulled_message_carries_what_was_sent(store: Store, t0: datetime) -> None:
    """Every field as sent: a JSON body decoded, a bytes body as is, properties ({} without), key and tags, times."""
    ids = [
        store.send("orders", {"a": [1, "ü"]}, key="k1", tags="t1", properties={"region": "eu"}, now=t0),
        store.send("orders", b"\x00raw", now=t0),
    ]
    first, second = store.pull("orders", "g").messages
    assert [m.message_id for m in (first, second)] == ids
    assert (first.topic, first.body, first.key, first.tags, first.properties, first.reconsume_times) == (
        "orders",
        {"a": [1, "ü"]},
        "k1",
        "t1",
        {"region": "eu"},
        0,
    )
    assert (second.body, second.key, second.tags, second.properties) == (b"\x00raw", None, None, {})
    assert first.deliver_at == t0 and first.delivered_at >= t0 and first.source_topic == "orders"
    assert first.idempotency_id == ids[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.body = None  # type: ignore[misc]
