"""Sending: ids, level 0, clamping, every rejection (with nothing written), body round trips."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from delaywheel import Settings, Store
from delaywheel.validation import InvalidMessage, Message
from tests.conftest import at, deliveries, table_counts

EMPTY = {"level_queue": 0, "wheel": 0, "wheel_far": 0, "topic_messages": 0, "cancellations": 0}


def test_send_and_send_many_return_ids_in_order(store: Store, t0: datetime) -> None:
    one = store.send("orders", {"n": 0}, delay_level=1, now=t0)
    many = store.send_many(
        [Message("orders", {"n": i}, delay_level=1 + i % 3) for i in range(5)]
        + [Message("orders", b"w", delay=timedelta(seconds=3)), Message("orders", b"d")],
        now=t0,
    )
    assert len(many) == 7 and len(set(many)) == 7 and one not in many
    assert many == sorted(many) and one < many[0]
    queued = dict(store.conn.execute("SELECT id, level FROM delaywheel.level_queue").fetchall())
    assert queued == {one: 1, **{mid: 1 + i % 3 for i, mid in enumerate(many[:5])}}
    assert table_counts(store)["topic_messages"] == 1  # the level-0 one
    assert store.send_many([], now=t0) == []


def test_level_zero_delivers_immediately(store: Store, t0: datetime) -> None:
    mid = store.send("orders", {"paid": True}, now=t0)
    mid0 = store.send("orders", {"paid": False}, delay_level=0, now=t0)
    assert deliveries(store, "orders") == [(mid, t0, t0, "orders"), (mid0, t0, t0, "orders")]
    assert [m.message_id for m in store.pull("orders", "g").messages] == [mid, mid0]
    assert table_counts(store)["level_queue"] == 0


def test_level_above_maximum_is_clamped_and_recorded(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"x", delay_level=25, now=t0)
    row = store.conn.execute(
        "SELECT level, requested_level, deliver_at FROM delaywheel.level_queue WHERE id = %s", (mid,)
    ).fetchone()
    assert row == (18, 25, t0 + timedelta(hours=2))
    assert store.deliver_level(18, now=at(t0, 7199.999)).delivered == 0
    assert store.deliver_level(18, now=at(t0, 7200)).delivered == 1
    assert [d[0] for d in deliveries(store)] == [mid]


def test_time_in_the_past_within_tolerance_delivers_at_once(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"late", deliver_at=t0 - timedelta(hours=3), now=t0)
    assert [d[0] for d in deliveries(store)] == [mid]


def test_delay_in_milliseconds_and_timedelta(store: Store, t0: datetime) -> None:
    a = store.send("orders", b"a", delay=1500, now=t0)
    b = store.send("orders", b"b", delay=timedelta(minutes=2), now=t0)
    assert store.advance_wheel(now=at(t0, 1.499)).delivered == 0
    assert store.advance_wheel(now=at(t0, 1.5)).delivered == 1
    assert store.advance_wheel(now=at(t0, 120)).delivered == 1
    assert [(d[0], d[1]) for d in deliveries(store)] == [(a, at(t0, 1.5)), (b, at(t0, 120))]


def test_limits_are_inclusive(store: Store, t0: datetime) -> None:
    limit = Settings().wheel_max_delay
    store.send("orders", b"x", delay=limit, now=t0)
    store.send("orders", b"x", deliver_at=t0 - Settings().past_tolerance, now=t0)
    assert table_counts(store)["wheel_far"] + table_counts(store)["wheel"] == 1
    assert table_counts(store)["topic_messages"] == 1


def _rejections(t0: datetime) -> list[tuple[str, dict[str, Any]]]:
    naive = datetime(2030, 1, 1, 0, 0, 5)
    return [
        ("bad_level", {"delay_level": -1}),
        ("bad_level", {"delay_level": 1.5}),
        ("bad_level", {"delay_level": "2"}),
        ("bad_level", {"delay_level": True}),
        ("bad_level", {"delay_level": False}),
        ("bad_topic", {"topic": ""}),
        ("bad_topic", {"topic": "has space"}),
        ("bad_topic", {"topic": "a" * 128}),
        ("bad_topic", {"topic": "tópico"}),
        ("bad_topic", {"topic": "semi;colon"}),
        ("bad_topic", {"topic": None}),
        ("body_too_large", {"body": b"x" * 65}),
        ("body_too_large", {"body": "y" * 63}),  # 63 chars + 2 quotes as JSON
        ("bad_body", {"body": {1, 2}}),
        ("bad_body", {"body": object()}),
        ("bad_body", {"body": {"x": float("nan")}}),
        ("naive_deliver_at", {"deliver_at": naive}),
        ("bad_deliver_at", {"deliver_at": "2030-01-01T00:00:05+00:00"}),
        ("bad_delay", {"delay": float("nan")}),
        ("bad_delay", {"delay": float("inf")}),
        ("bad_delay", {"delay": -1}),
        ("bad_delay", {"delay": timedelta(seconds=-1)}),
        ("bad_delay", {"delay": "5s"}),
        ("bad_delay", {"delay": True}),
        ("too_far", {"delay": timedelta(days=365, milliseconds=1)}),
        ("too_far", {"deliver_at": t0 + timedelta(days=366)}),
        ("too_far", {"delay": 1e18}),  # beyond what a timedelta can hold
        ("too_far", {"delay": timedelta(days=4_000_000)}),  # beyond what a datetime can hold
        ("bad_level", {"delay_level": 2**40}),  # too large to store, not merely above the table
        ("too_old", {"deliver_at": t0 - timedelta(days=1, seconds=1)}),
        ("conflicting_delay", {"delay_level": 3, "deliver_at": t0 + timedelta(minutes=1)}),
        ("conflicting_delay", {"delay_level": 3, "delay": 1000}),
        ("conflicting_delay", {"delay": 1000, "deliver_at": t0 + timedelta(minutes=1)}),
        ("bad_key", {"key": ""}),
        ("bad_key", {"key": 42}),
        ("bad_properties", {"properties": {"a": 1}}),
        ("bad_tags", {"tags": ["a"]}),
    ]


def test_every_rejection_names_its_reason_and_writes_nothing(db_url: str, t0: datetime) -> None:
    with Store(db_url, Settings(max_body_bytes=64)) as store:
        store.send("warmup", b"x" * 64, delay_level=1, now=t0)  # exactly the limit is fine
        store.conn.execute("TRUNCATE delaywheel.level_segments")
        for reason, override in _rejections(t0):
            args: dict[str, Any] = {"topic": "orders", "body": {"ok": 1}, **override}
            topic, body = args.pop("topic"), args.pop("body")
            with pytest.raises(InvalidMessage) as info:
                store.send(topic, body, now=t0, **args)
            assert info.value.reason == reason, (override, info.value.reason, str(info.value))
            assert str(info.value)  # a sentence a person can act on
            assert table_counts(store) == EMPTY, override


def test_send_many_with_one_bad_message_writes_nothing(store: Store, t0: datetime) -> None:
    good = [
        Message("orders", {"n": 1}),
        Message("orders", {"n": 2}, delay_level=2),
        Message("orders", {"n": 3}, delay=timedelta(seconds=30)),
        Message("orders", {"n": 4}, delay=timedelta(days=200)),
    ]
    for bad in (Message("orders", {"n": 5}, delay_level=-3), Message("bad topic", {}),
                Message("orders", {}, deliver_at=datetime(2030, 1, 1))):
        with pytest.raises(InvalidMessage):
            store.send_many([*good[:2], bad, *good[2:]], now=t0)
        assert table_counts(store) == EMPTY
    assert len(store.send_many(good, now=t0)) == 4
    assert sum(table_counts(store).values()) == 4


BODIES: list[Any] = [b"", b"\x00\xffbinary\x80", {"order": 42, "items": [1, 2, {"x": None}]}, "text é ✓", 12.5, [], None]


def test_bodies_round_trip_through_pull(store: Store, t0: datetime) -> None:
    ids = [store.send("bodies", body, delay_level=1 if i % 2 else 0, now=t0) for i, body in enumerate(BODIES)]
    store.deliver_level(1, now=at(t0, 1))
    batch = store.pull("bodies", "g", 100)
    got = {m.message_id: m.body for m in batch.messages}
    assert got == dict(zip(ids, BODIES, strict=True))
    assert isinstance(got[ids[1]], bytes)


def test_properties_tags_and_key_are_kept(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"x", delay=timedelta(seconds=2), key="order-42", tags="timeout",
                     properties={"tenant": "acme"}, now=t0)
    store.advance_wheel(now=at(t0, 2))
    (m,) = store.pull("orders", "g").messages
    assert (m.message_id, m.key, m.tags, m.properties, m.topic) == (mid, "order-42", "timeout", {"tenant": "acme"}, "orders")
    assert m.deliver_at == at(t0, 2) and m.delivered_at == at(t0, 2)


def test_aware_datetime_in_any_zone(store: Store, t0: datetime) -> None:
    plus2 = timezone(timedelta(hours=2))
    mid = store.send("orders", b"x", deliver_at=(t0 + timedelta(seconds=10)).astimezone(plus2), now=t0)
    assert store.advance_wheel(now=at(t0, 9.9)).delivered == 0
    assert store.advance_wheel(now=at(t0, 10)).delivered == 1
    assert deliveries(store)[0][:2] == (mid, at(t0, 10))
