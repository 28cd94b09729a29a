"""Consumer group names: a group is refused at pull, ack and consume unless its retry and dead-letter topics
(`%RETRY%<group>`, `%DLQ%<group>`) are valid topic names, so that a group, once it pulls, can always ack a failure."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from delaywheel import Message, Store
from delaywheel.consume import retry
from delaywheel.produce.validation import MAX_GROUP_CHARS, InvalidMessage, check_group, check_topic

BAD_GROUPS = [
    "",
    "g" * (MAX_GROUP_CHARS + 1),
    "g" * 200,
    "g\x00",
    "bad group",
    "g\n",
    "g\udcff",
    "gé",
    "g/1",
    None,
    7,
    b"g",
]


@hsettings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=140), st.text(string.ascii_letters + string.digits + "%|._-", max_size=140)))
def test_every_accepted_group_has_valid_retry_and_dlq_topic_names(group: str) -> None:
    try:
        accepted = check_group(group)
    except InvalidMessage as refused:
        assert refused.reason == "bad_group"
        return
    assert accepted == group
    assert check_topic(retry.retry_topic(group)) and check_topic(retry.dlq_topic(group))


@given(st.text(string.ascii_letters + string.digits + "%|._-", min_size=1, max_size=MAX_GROUP_CHARS))
def test_every_group_of_topic_characters_up_to_the_limit_is_accepted(group: str) -> None:
    assert check_group(group) == group


@pytest.mark.parametrize("group", BAD_GROUPS)
def test_a_bad_group_is_refused_at_pull_and_consume_before_anything_is_read(store: Store, group: object) -> None:
    store.send("orders", {"n": 1})
    with pytest.raises(InvalidMessage, match="group") as refused:
        store.pull("orders", group)  # type: ignore[arg-type]
    assert refused.value.reason == "bad_group"
    with pytest.raises(ValueError, match="group"):
        store.consume("orders", group, lambda _messages: None, idle_s=0.1)  # type: ignore[arg-type]
    assert store.conn.execute("SELECT count(*) FROM delaywheel.consumer_offsets").fetchone() == (0,)


def test_a_batch_with_a_bad_group_is_not_acked(store: Store) -> None:
    store.send("orders", {"n": 1})
    batch = store.pull("orders", "g")
    batch.group = "g" * 200
    with pytest.raises(InvalidMessage, match="group"):
        store.ack(batch, failed={batch.messages[0].message_id})
    batch.group = "g"
    store.release(batch)
    assert len(store.pull("orders", "g")) == 1  # not acked: handed out again


def test_the_longest_group_acks_a_failure_into_its_retry_topic(store: Store) -> None:
    group = "g" * MAX_GROUP_CHARS
    store.send("orders", {"n": 1})
    batch = store.pull("orders", group)
    result = store.ack(batch, failed={batch.messages[0].message_id})
    assert (result.acked, result.retried) == (1, 1)
    queued = store.conn.execute("SELECT topic FROM delaywheel.level_queue").fetchall()
    assert queued == [(retry.retry_topic(group),)]
    store.send_many([Message("orders", {"n": 2})])
    assert len(store.pull("orders", group)) == 1
