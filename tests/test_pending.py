"""The shared SQL of pending.py: a segment's messages spelled one way, and each lane's head read the same by the pass
that moved its cursor, by the sensors and triggers (LEVEL_HEAD, WHEEL_HEAD) and by stats."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from delaywheel import Store
from delaywheel.deliver import wheel
from delaywheel.pending import LEVEL_HEAD, WHEEL_HEAD, segment_elements, segment_messages
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
        with pytest.raises(ValueError):
            segment_elements(sql.SQL("ARRAY[1]"), *wrong)


def test_a_segments_elements_at_positions_are_its_messages_with_that_id_or_key(store: Store) -> None:
    """segment_elements (a cancel's find, migrations/032) reads the same rows as segment_messages filtered: a property
    over segments of 1-8 messages with keys repeated or missing, each shared column (one element) or not."""
    columns = ("id", "topic", "key", "tags", "properties", "is_json", "due")
    segment = sql.SQL(
        "(SELECT %(ids)s::bigint[] AS ids, %(topics)s::text[] AS topics, %(keys)s::text[] AS keys,"
        " %(tags)s::text[] AS tags, %(properties)s::text[] AS properties, %(is_json)s::boolean[] AS is_json,"
        " %(dues)s::timestamp[] AS deliver_ats, %(n)s::int AS n) s"
    )

    def rows(messages: sql.Composable, where: sql.Composable, params: dict[str, object]) -> list[tuple[object, ...]]:
        query = sql.SQL("SELECT m.* FROM {} CROSS JOIN LATERAL {} WHERE {}").format(segment, messages, where)
        return store.conn.execute(query, params).fetchall()

    def column(draw: st.DrawFn, n: int, values: st.SearchStrategy[object]) -> list[object]:
        return draw(st.lists(values, min_size=1, max_size=1) | st.lists(values, min_size=n, max_size=n))

    @st.composite
    def segments(draw: st.DrawFn) -> dict[str, object]:
        n = draw(st.integers(1, 8))
        return {
            "n": n,
            "ids": list(range(100, 100 + n)),
            "keys": draw(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=n, max_size=n)),
            "topics": column(draw, n, st.sampled_from(["t1", "t2"])),
            "tags": column(draw, n, st.sampled_from(["x", "", "y||z"])),
            "properties": column(draw, n, st.sampled_from(["{}", '{"p": 1}'])),
            "is_json": column(draw, n, st.booleans()),
            "dues": [datetime(2030, 1, 1) + timedelta(seconds=i) for i in range(n)],
        }

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(segments())
    def check(params: dict[str, object]) -> None:
        for key in ("a", "b", "c"):
            wanted = {**params, "v": key}
            assert rows(
                segment_elements(sql.SQL("array_positions(s.keys, %(v)s::text)"), *columns), sql.SQL("true"), wanted
            ) == rows(segment_messages(*columns), sql.SQL("m.key = %(v)s"), wanted)
        for mid in (99, 100, 100 + int(params["n"]) - 1):  # type: ignore[call-overload]
            wanted = {**params, "v": mid}
            assert rows(
                segment_elements(sql.SQL("array_positions(s.ids, %(v)s::bigint)"), *columns), sql.SQL("true"), wanted
            ) == rows(segment_messages(*columns), sql.SQL("m.id = %(v)s"), wanted)

    check()


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
