"""The lease and turn protocol (`consume.lease.LeasedConsumer`), without Airflow: two leased consumers of one group
overlap, the successor waits for its turn and takes over at the old one's lease end with every message handled once;
alone, a consumer past its lease waits up to its grace for a successor and then stops."""

from __future__ import annotations

import threading
import time
from typing import Any

from delaywheel import Store
from delaywheel.consume.lease import LeasedConsumer

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
