"""Competing consumers: members of one group share its queues under leases (consume/topics.py, sql/consume.sql)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from datetime import datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaywheel import Store
from delaywheel.consume import topics
from delaywheel.consume.topics import AckResult, LeaseLost, dlq_topic, retry_topic
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import Message
from tests.helpers import at


def test_a_joining_member_gets_its_share_at_the_next_pulls(store: Store, db_url: str) -> None:
    """Consume loops (`ack_and_pull`) stay members while idle; a member alone holds every queue, two hold half each."""
    store.send_many([Message("t", {"n": i}, key=f"k{i}") for i in range(64)])
    a, b = topics.new_holder(), topics.new_holder()

    def loop_pull(s: Store, done: topics.Batch | None, holder: str) -> topics.Batch:
        return topics.ack_and_pull(s.conn, s.settings, s._cache, done, None, "t", "g", 1000, holder)[1]

    with Store(db_url) as other:
        first = loop_pull(store, None, a)
        assert first.queues == tuple(range(topics.QUEUES)) and len(first) == 64  # alone: every queue
        assert loop_pull(other, None, b).queues == ()  # all held: b waits, a member now
        held_a = loop_pull(store, first, a).queues  # acks, keeps its share, gives back the rest
        held_b = loop_pull(other, None, b).queues
    assert len(held_a) == len(held_b) == topics.QUEUES // 2 and not set(held_a) & set(held_b)


def test_members_taking_queues_at_the_same_instant_neither_deadlock_nor_share_a_queue(db_url: str) -> None:
    """Four members' first pulls of a fresh group at once (a hand-over of several long-running consumers: each sees
    itself alone, and takes every free queue): they lock the queues' rows in one order, so none fails with a
    deadlock, and no queue goes to two of them. With an order that differed by member, some of these pulls deadlocked.
    """
    members = 4

    def first_pull(
        group: str, barrier: threading.Barrier, held: list[tuple[int, ...]], errors: list[Exception]
    ) -> None:
        with Store(db_url) as own:
            own.conn  # noqa: B018  # connected before the barrier: the pulls start together
            holder = topics.new_holder()
            barrier.wait()
            try:
                _, batch = topics.ack_and_pull(own.conn, own.settings, own._cache, None, None, "t", group, 10, holder)
                held.append(batch.queues)
            except Exception as exc:
                errors.append(exc)
            barrier.wait()  # alive until every member has pulled: a member whose connection ended loses its queues

    for round_ in range(15):
        barrier = threading.Barrier(members)
        held: list[tuple[int, ...]] = []
        errors: list[Exception] = []
        threads = [
            threading.Thread(target=first_pull, args=(f"g{round_}", barrier, held, errors)) for _ in range(members)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == [], errors
        taken = [q for queues in held for q in queues]
        assert len(taken) == len(set(taken)) and set(taken) == set(range(topics.QUEUES)), held


def test_an_ack_after_the_lease_passed_to_another_member_is_refused_and_acks_nothing(store: Store, db_url: str) -> None:
    ids = store.send_many([Message("t", {"n": i}, key="one-key") for i in range(3)])
    slow = store.pull("t", "g", 10, lease_s=0.2)
    time.sleep(0.3)  # its handler outlives the lease
    with Store(db_url) as other:
        fast = other.pull("t", "g", 10)
        assert [m.message_id for m in fast.messages] == ids  # the queue passed to the other member
        with pytest.raises(LeaseLost, match="passed to another member: nothing acked"):
            store.ack(slow, failed={ids[0]})
        assert other.ack(fast) == AckResult(acked=3)
    assert len(store.pull("t", "g")) == 0
    retries = store.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone()
    assert retries == (0,)  # the refused ack retried nothing


def test_an_expired_lease_nobody_took_still_acks(store: Store) -> None:
    store.send_many([Message("t", {"n": i}) for i in range(3)])
    batch = store.pull("t", "g", 10, lease_s=0.1)
    time.sleep(0.2)
    assert store.ack(batch) == AckResult(acked=3)


def test_a_member_whose_connection_ended_loses_its_queues_at_once(store: Store, db_url: str) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(5)])
    with Store(db_url) as dying:
        assert len(dying.pull("t", "g", 10, lease_s=3600)) == 5  # holds every queue for an hour, then dies
    deadline = time.monotonic() + 5
    batch = store.pull("t", "g", 10)
    while not batch.messages and time.monotonic() < deadline:  # (its server process ends just after the close)
        time.sleep(0.05)
        batch = store.pull("t", "g", 10)
    assert [m.message_id for m in batch.messages] == ids


@pytest.mark.parametrize("lease_s", [0, 0.05, -1, 86_401, float("nan"), True, "30"])
def test_a_lease_out_of_range_is_refused_before_anything_is_read(store: Store, lease_s: object) -> None:
    with pytest.raises(ValueError, match="lease_s must be a number of seconds"):
        store.pull("t", "g", lease_s=lease_s)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_s must be a number of seconds"):
        store.consume("t", "g", lambda ms: None, lease_s=lease_s)  # type: ignore[arg-type]


def test_a_groups_retry_topic_pulled_as_a_topic_is_read_once(store: Store, t0: datetime) -> None:
    """Pulling `%RETRY%g` as g read the same source twice: every message came twice, and failing both made two."""
    send_for_store(
        store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"n": i}) for i in range(3)], [1] * 3
    )
    batch = store.pull(retry_topic("g"), "g", 10)
    assert len(batch) == 3 and len({m.message_id for m in batch.messages}) == 3
    assert store.ack(batch, failed={batch.messages[0].message_id}) == AckResult(acked=3, retried=1)


def test_a_groups_dlq_pulled_as_a_topic_leaves_its_retries_to_the_group(store: Store, t0: datetime) -> None:
    """Pulling `%DLQ%g` as g read g's retry topic too, and its ack consumed g's pending retries."""
    send_for_store(store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"retry": 1})], [1])
    send_for_store(store.conn, store.settings, store._cache, [Message(dlq_topic("g"), {"dead": 1})], [4])
    dead = store.pull(dlq_topic("g"), "g", 10)
    assert [m.body for m in dead.messages] == [{"dead": 1}]
    store.ack(dead)
    retries = store.pull("orders", "g", 10)
    assert [m.body for m in retries.messages] == [{"retry": 1}]  # still the group's


# The model: members pull, ack (some failed), give back or die, in any order; the store against a model of offsets.
_OPS = st.lists(
    st.tuples(st.sampled_from(["pull", "ack", "release", "die"]), st.integers(0, 2), st.integers(1, 6)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_members_in_any_interleaving_hand_out_each_key_in_order_and_nothing_after_its_ack(
    db_url: str, t0: datetime, ops: list[tuple[str, int, int]]
) -> None:
    """Each message handled at least once; per key, never a message before the earlier ones of its key were handed
    out; never one handed out again after an ack moved past it; concurrent batches never share a key."""
    topic = f"m{time.monotonic_ns()}"
    stores = [Store(db_url) for _ in range(3)]
    try:
        ids = stores[0].send_many([Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(30)], now=t0)
        key_of = {mid: f"k{i % 5}" for i, mid in enumerate(ids)}
        in_hand: dict[int, topics.Batch] = {}
        acked: set[int] = set()
        seen_per_key: dict[str, list[int]] = defaultdict(list)
        for op, who, n in ops:
            store = stores[who]
            if op == "pull" and who not in in_hand:
                batch = store.pull(topic, "g", n)
                got = [m.message_id for m in batch.messages]
                assert not set(got) & acked, "handed out after its ack"
                others = {key_of[m.message_id] for b in in_hand.values() for m in b.messages}
                assert not {key_of[i] for i in got} & others, "one key in two members' hands"
                for mid in got:
                    key = key_of[mid]
                    earlier = [i for i in ids if key_of[i] == key and i < mid]
                    assert set(earlier) <= set(seen_per_key[key]), "a key out of order"
                    seen_per_key[key].append(mid)
                in_hand[who] = batch
            elif op == "ack" and who in in_hand:
                batch = in_hand.pop(who)
                store.ack(batch)
                acked |= {m.message_id for m in batch.messages}
            elif op == "release" and who in in_hand:
                store.release(in_hand.pop(who))
            elif op == "die":
                in_hand.pop(who, None)
                store.close()  # its connection ends: its queues are free once its server process is gone
                stores[who] = Store(db_url)
        for who, batch in in_hand.items():
            stores[who].ack(batch)
            acked |= {m.message_id for m in batch.messages}
        rest: list[int] = []
        deadline = time.monotonic() + 10
        while set(ids) - acked - set(rest) and time.monotonic() < deadline:  # a dead member's process may linger
            rest += [m.message_id for m in stores[0].messages(topic, "g", idle_s=0.3, max_messages=7)]
        assert set(ids) <= acked | set(rest), "lost"
    finally:
        for s in stores:
            s.close()


def test_retries_of_a_key_stay_with_its_queue(store: Store, t0: datetime) -> None:
    mid = store.send("orders", {"n": 1}, key="order-42", now=t0)
    store.ack(store.pull("orders", "g"), failed={mid})
    store.deliver_due(now=at(t0, 3600))
    qids = store.conn.execute("SELECT DISTINCT qid FROM delaywheel.topic_messages WHERE key = 'order-42'").fetchall()
    assert len(qids) == 1  # the original and its retry: one queue, one member at a time
