"""The delivery loop's lease end: it hands its lane over only to a live successor (real clock).

Bounds are wide on purpose (CI machines are loaded): each one still separates the behaviours compared,
e.g. a run without grace ends seconds before one that waits out a 30-s grace."""

from __future__ import annotations

import threading
import time

import pytest

from delaywheel import Message, Store, runner
from tests.conftest import deliveries


def _timed_run(db_url: str, duration_s: float, grace_s: float, out: dict[str, float]) -> None:
    with Store(db_url) as own:
        started = time.monotonic()  # after connecting: only the run itself is timed
        out["delivered"] = runner.run(own, [1], duration_s, handover_grace_s=grace_s).delivered
        out["elapsed"] = time.monotonic() - started


def test_without_grace_the_run_ends_at_its_duration(db_url: str) -> None:
    out: dict[str, float] = {}
    _timed_run(db_url, 0.5, 0.0, out)
    assert 0.5 <= out["elapsed"] < 5.0


def test_without_a_successor_the_lane_stays_served_through_the_grace(db_url: str, store: Store) -> None:
    out: dict[str, float] = {}
    alone = threading.Thread(target=_timed_run, args=(db_url, 0.3, 4.0, out))
    alone.start()
    time.sleep(1.0)  # past the run's duration: it is only still here for want of a successor
    assert alone.is_alive()
    store.send("handover", {"n": 1}, delay_level=1)  # due one second later, inside the grace
    alone.join(timeout=15)
    assert not alone.is_alive()
    assert out["delivered"] == 1 and len(deliveries(store, "handover")) == 1
    assert 4.0 <= out["elapsed"] < 12.0  # gave up once the grace ran out


def test_the_lane_is_handed_over_as_soon_as_a_successor_runs(db_url: str) -> None:
    old: dict[str, float] = {}
    new: dict[str, float] = {}
    first = threading.Thread(target=_timed_run, args=(db_url, 0.3, 30.0, old))
    first.start()
    time.sleep(1.5)
    assert first.is_alive()
    successor = threading.Thread(target=_timed_run, args=(db_url, 6.0, 0.0, new))
    successor.start()
    first.join(timeout=20)
    assert not first.is_alive(), "the old run did not see its successor"
    assert old["elapsed"] < 15.0  # left once the successor ran, far before its 30-s grace
    successor.join(timeout=20)


def test_the_loop_keeps_brin_summaries_up_to_date(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancel searches level queues, far blocks and topics by BRIN summaries; autovacuum never summarizes a
    partly filled range, and drops requests past 256, so the delivery loop summarizes on a thread of its own."""
    store.send_many([Message("orders", b"x" * 100, key=f"order-{i}") for i in range(5000)])  # delivered at once
    monkeypatch.setattr(runner, "SUMMARIZE_EVERY_S", 0.2)
    runner.run(store, [1], 1.5)
    assert store.summarize() == 0  # the loop left nothing to summarize, not even the topic's last, partial range
