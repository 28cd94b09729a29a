"""The shared SQL of pending.py: a segment's messages spelled one way, and each lane's head read the same by the pass
that moved its cursor, by the sensors and triggers (LEVEL_HEAD, WHEEL_HEAD) and by stats."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from delaywheel import Store
from delaywheel.deliver import wheel
from delaywheel.pending import LEVEL_HEAD, WHEEL_HEAD, segment_messages
from delaywheel.produce.validation import Message
from tests.conftest import at


def test_a_segment_unnests_the_arrays_asked_for_in_one_order() -> None:
    assert segment_messages("key", "id").as_string() == 'unnest("s"."ids", "s"."keys") AS "m"("id", "key")'
    assert segment_messages("topic", "due", segment="f", alias="q").as_string() == (
        'unnest(delaywheel.spread("f"."topics", "f".n), "f"."deliver_ats") AS "q"("topic", "due")'
    )
    for wrong in ((), ("id", "bodies")):
        with pytest.raises(ValueError):
            segment_messages(*wrong)


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
