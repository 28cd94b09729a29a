"""The lease and turn protocol (`consume.lease.LeasedConsumer`), without Airflow: two leased consumers of one group
overlap, the successor waits for its turn and takes over at the old one's lease end with every message handled once;
alone, a consumer past its lease waits up to its grace for a successor and then stops; consumers in two member slots
consume side by side, each handing over to its own successor; slots and member counts out of range are refused."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from delaywheel import Store
from delaywheel.consume.lease import MAX_MEMBERS, LeasedConsumer, checked_slot, member_slots
from tests.helpers import Handled, check_slots_handed_over

TOPIC, GROUP = "jobs", "workers"


def test_the_successor_takes_over_at_the_lease_end_with_nothing_handled_twice(db_url: str, store: Store) -> None:
    seen: list[tuple[int, str, float]] = []  # (message_id, consumer, handled at)
    lock = threading.Lock()
    sent: list[int] = []
    leased: dict[str, LeasedConsumer] = {}
    totals: dict[str, Any] = {}

    def consume(name: str, lease_s: float, grace_s: float) -> None:
        def handle(messages: list[Any]) -> None:
            now = time.monotonic()
            with lock:
                seen.extend((m.message_id, name, now) for m in messages)

        with Store(db_url) as own:
            leased[name] = LeasedConsumer(own, TOPIC, GROUP, lease_s=lease_s, grace_s=grace_s)
            totals[name] = leased[name].run(handle, max_messages=20)

    def produce() -> None:
        with Store(db_url) as own:
            end = time.monotonic() + 5
            while time.monotonic() < end:  # throughout the hand-over; no delay: straight into the topic
                sent.append(own.send(TOPIC, {"n": len(sent)}))
                time.sleep(0.02)

    producer = threading.Thread(target=produce)
    old = threading.Thread(target=consume, args=("old", 2.5, 10.0))  # keeps the group until a successor is present
    new = threading.Thread(target=consume, args=("new", 6.0, 0.0))
    producer.start()
    old.start()
    time.sleep(1.0)
    new.start()  # waits for its turn while the old one consumes
    for thread in (producer, old, new):
        thread.join(60)
        assert not thread.is_alive()

    ids = [message_id for message_id, _, _ in seen]
    assert sorted(ids) == sorted(sent), "every message handled, none twice"
    assert leased["old"].lease_ended and leased["old"].handed_over
    assert not leased["new"].handed_over  # no successor of its own: it stopped at its lease end
    old_times = [at for _, name, at in seen if name == "old"]
    new_times = [at for _, name, at in seen if name == "new"]
    assert old_times and new_times
    assert max(old_times) <= min(new_times), "the successor handled nothing while the old consumer held its turn"
    assert min(new_times) - max(old_times) < 2.0
    for name in ("old", "new"):
        assert totals[name].messages == len([1 for _, who, _ in seen if who == name]) and totals[name].retried == 0
    assert len(store.pull(TOPIC, GROUP, 1000)) == 0  # the group's offset is past every message


def test_alone_past_its_lease_it_waits_its_grace_for_a_successor_then_stops(store: Store) -> None:
    leased = LeasedConsumer(store, TOPIC, GROUP, lease_s=0.5, grace_s=1.0)
    started = time.monotonic()
    totals = leased.run(lambda messages: None)
    took = time.monotonic() - started
    assert leased.lease_ended and not leased.handed_over
    assert 1.5 <= took < 5.0, took
    assert totals.messages == 0

    stopped = threading.Event()
    stopped.set()  # stopped before it starts (SIGTERM while starting): takes nothing, returns at once
    early = LeasedConsumer(store, TOPIC, GROUP, lease_s=600, stop=stopped)
    started = time.monotonic()
    early.run(lambda messages: None)
    assert time.monotonic() - started < 5.0 and not early.lease_ended


def test_two_slots_consume_side_by_side_and_each_hands_over_to_its_own_successor(db_url: str, store: Store) -> None:
    """Slot 0's lease ends at 2.5 s, slot 1's at 3.5 s, their successors wait from 1 s: each successor takes over
    its own slot's turn (slot 0's while slot 1's old consumer still consumes), the members share the queues, and
    every message is handled once, each key's in order."""
    seen: list[Handled] = []
    lock = threading.Lock()
    leased: dict[str, LeasedConsumer] = {}
    totals: dict[str, Any] = {}

    def consume(name: str, slot: int, lease_s: float, grace_s: float) -> None:
        def handle(messages: list[Any]) -> None:
            now = time.monotonic()
            with lock:
                seen.extend(Handled(m.message_id, m.key, name, now) for m in messages)

        with Store(db_url) as own:
            leased[name] = LeasedConsumer(own, TOPIC, GROUP, lease_s=lease_s, grace_s=grace_s, slot=slot)
            totals[name] = leased[name].run(handle, max_messages=10)

    def produce() -> None:
        with Store(db_url) as own:
            end, n = time.monotonic() + 5.5, 0
            while time.monotonic() < end:  # half keyed (in order per key), half spread over every queue by id
                own.send(TOPIC, {"n": n}, key=f"k{n % 8}" if n % 2 else None)
                n += 1
                time.sleep(0.01)

    olds = [threading.Thread(target=consume, args=(f"old{k}", k, 2.5 + k, 10.0)) for k in (0, 1)]
    news = [threading.Thread(target=consume, args=(f"new{k}", k, 6.0, 0.0)) for k in (0, 1)]
    producer = threading.Thread(target=produce)
    for thread in (producer, *olds):
        thread.start()
    time.sleep(1.0)
    for thread in news:
        thread.start()  # each waits for its slot's turn
    for thread in (producer, *olds, *news):
        thread.join(60)
        assert not thread.is_alive()

    check_slots_handed_over(seen, store, TOPIC, slots=2, max_gap=2.0)
    slot0_taken = min(h.at for h in seen if h.name == "new0")
    assert any(h.name == "old1" and h.at > slot0_taken for h in seen), "slot 0 handed over while slot 1 consumed"
    for k in (0, 1):
        assert leased[f"old{k}"].lease_ended and leased[f"old{k}"].handed_over
        assert not leased[f"new{k}"].handed_over  # no successor of its own slot: it stopped at its lease end
    for name, total in totals.items():
        assert total.messages == len([h for h in seen if h.name == name]) and total.retried == 0
    assert len(store.pull(TOPIC, GROUP, 1000)) == 0  # the group's offset is past every message


def test_a_successor_in_another_slot_does_not_count_as_this_slots(store: Store, db_url: str) -> None:
    """A consumer past its lease whose only other consumer is in another slot does not hand over to it: it waits
    its grace, then stops (its slot's successor never came)."""
    with Store(db_url) as other:
        beside = LeasedConsumer(other, TOPIC, GROUP, lease_s=30, slot=1)
        running = threading.Thread(target=beside.run, args=(lambda messages: None,))
        running.start()
        try:
            alone = LeasedConsumer(store, TOPIC, GROUP, lease_s=0.5, grace_s=1.0, slot=0)
            started = time.monotonic()
            alone.run(lambda messages: None)  # takes its own turn at once, beside slot 1's
            took = time.monotonic() - started
        finally:
            beside.stop.set()
            running.join(30)
    assert alone.lease_ended and not alone.handed_over
    assert 1.5 <= took < 5.0, took


@pytest.mark.parametrize("slot", [-1, MAX_MEMBERS, 2**31, True, 1.0, "x", "", "1e3", "٣", None])
def test_a_slot_out_of_range_is_refused_before_anything_is_taken(store: Store, slot: object) -> None:
    with pytest.raises(ValueError, match="slot must be a whole number from 0 to 15"):
        LeasedConsumer(store, TOPIC, GROUP, lease_s=1, slot=slot)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot must be a whole number"):
        checked_slot(slot)


def test_members_are_1_to_the_topics_queues() -> None:
    assert member_slots(1) == [0] and member_slots("3") == [0, 1, 2] and member_slots(16) == list(range(16))
    assert checked_slot("15") == 15 and checked_slot(0) == 0
    for bad in (0, 17, -1, True, "0", "17", " ", 2.0, None, "1; DROP TABLE x"):
        with pytest.raises(ValueError, match="members must be a whole number from 1 to 16"):
            member_slots(bad)
