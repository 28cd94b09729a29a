"""The shared SQL of pending.py: a segment's messages spelled one way, "pending" read the same by a cancel's finds,
and each lane's head read the same by the pass that moved its cursor, by the sensors and triggers (LEVEL_HEAD,
WHEEL_HEAD) and by stats."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest
from psycopg.types.numeric import Int8

from delaywheel import Store
from delaywheel.deliver import wheel
from delaywheel.ops.cancel import find, key_params
from delaywheel.pending import LEVEL_HEAD, PENDING, WHEEL_HEAD, segment_messages
from delaywheel.produce.validation import Message
from tests.helpers import at


def test_a_segment_unnests_the_arrays_asked_for_in_one_order() -> None:
    assert segment_messages("key", "id").as_string() == 'unnest("s"."ids", "s"."keys") AS "m"("id", "key")'
    assert segment_messages("topic", "due", segment="f", alias="q").as_string() == (
        'unnest(delaywheel.spread("f"."topics", "f".n), "f"."deliver_ats") AS "q"("topic", "due")'
    )
    for wrong in ((), ("id", "bodies")):
        with pytest.raises(ValueError):
            segment_messages(*wrong)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_cancels_finds_are_the_pending_messages_with_the_id_or_key(store: Store, t0: datetime, seed: int) -> None:
    """A cancel's finds (sql/cancel.sql: segments by their id ranges and key filters, messages read at the id's or
    key's positions) return exactly the rows of PENDING with that id or key: a property over random placements, with
    a level's checkpoint inside a segment, the wheel's cursor among its rows, far blocks with a key filter and
    without (single sends)."""
    rng = random.Random(seed)
    keys = [f"k{seed}-{i}" for i in range(12)]
    store.advance_wheel(now=t0)  # the first roll sets near_until
    sends = [
        [Message("orders", {"i": i}, key=rng.choice(keys), delay_level=rng.randint(1, 3)) for i in range(60)],
        [
            Message("orders", {"i": i}, key=rng.choice(keys), delay=timedelta(seconds=rng.randint(1, 600)))
            for i in range(60)
        ],
        [
            Message(
                "orders",
                {"i": i},
                key=rng.choice(keys) if i % 7 == 0 else f"far-{i}",
                delay=timedelta(days=rng.uniform(5, 25)),
            )
            for i in range(2000)
        ],
    ]
    ids = [mid for batch in sends for mid in store.send_many(batch, now=t0)]
    ids += [
        store.send("orders", {"single": i}, key=rng.choice(keys), delay=timedelta(days=9), now=t0) for i in range(5)
    ]
    assert store.deliver_level(1, now=at(t0, 60), limit=rng.randint(1, 10)).more  # the checkpoint inside a segment
    assert store.advance_wheel(now=at(t0, 300), limit=rng.randint(1, 10)).delivered > 0  # the cursor among the rows
    pending = "SELECT p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text FROM ({}) p WHERE p.{} = %s"
    lanes: set[tuple[str, int | None]] = set()
    for key in [*keys, "far-3", "far-7", "nobody"]:
        found = find(store.conn, "key", key_params(key))
        assert sorted(found) == sorted(store.conn.execute(pending.format(PENDING, "key"), (key,)).fetchall()), key
        lanes |= {(row[3], row[4]) for row in found}
    for mid in [*rng.sample(ids, 300), 0, max(ids) + 1]:
        found = find(store.conn, "id", {"v": Int8(mid)})
        assert found == store.conn.execute(pending.format(PENDING, "id"), (mid,)).fetchall(), mid
    assert lanes >= {("level", 1), ("level", 2), ("wheel", None)}  # every kind of place was searched
    delivered = {mid for (mid,) in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages")}
    assert delivered and not delivered & {row[0] for key in keys for row in find(store.conn, "key", key_params(key))}


def test_every_reader_of_a_level_head_reads_the_same(store: Store, t0: datetime) -> None:
    store.send_many([Message("orders", b"a", delay_level=1)], now=t0)
    later = store.send_many([Message("orders", b"b", delay_level=1)], now=at(t0, 10))  # a second segment
    result = store.deliver_level(1, now=at(t0, 5))
    assert result.delivered == 1
    (head,) = store.conn.execute(LEVEL_HEAD, {"level": 1}).fetchone()  # type: ignore[misc]
    assert result.next_due == head
    assert [row["head_due"] for row in store.stats(now=at(t0, 5))["levels"] if row["level"] == 1] == [head]
    assert store.deliver_level(1, now=at(t0, 20)).delivered == len(later)
    assert store.conn.execute(LEVEL_HEAD, {"level": 1}).fetchone() is None


def test_the_wheel_pass_and_its_waiters_read_the_same_head(store: Store, t0: datetime) -> None:
    store.advance_wheel(now=t0)  # the first roll sets near_until
    store.send("orders", b"far", delay=timedelta(days=20), now=t0)
    result = store.advance_wheel(now=at(t0, 1))
    assert result.next_due is not None and result.next_due > t0  # only far blocks pending: near_until
    assert store.conn.execute(WHEEL_HEAD).fetchone() == (result.next_due,)
    store.send("orders", b"later", delay=wheel.HEAD_WINDOW * 5, now=t0)  # past the pass's first, bounded look
    result = store.advance_wheel(now=at(t0, 2))
    assert result.next_due == t0 + wheel.HEAD_WINDOW * 5
    assert store.conn.execute(WHEEL_HEAD).fetchone() == (result.next_due,)
    store.send("orders", b"near", delay=timedelta(minutes=5), now=t0)
    result = store.advance_wheel(now=at(t0, 3))
    assert result.next_due == t0 + timedelta(minutes=5)
    assert store.conn.execute(WHEEL_HEAD).fetchone() == (result.next_due,)
