"""The delivery loop's lease end: it hands its lane over only to a live successor (real clock).

Bounds are wide on purpose (CI machines are loaded): each one still separates the behaviours compared,
e.g. a run without grace ends seconds before one that waits out a 30-s grace."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from delaywheel import Message, Store, partitions
from delaywheel.channels import NOTIFY_CHANNEL, lane_channel
from delaywheel.deliver import runner
from tests.helpers import deliveries


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


def test_the_loop_summarizes_the_topic_it_delivers_into_within_seconds(store: Store) -> None:
    """Every cancel by key reads the delivered rows no summary covers: the loop summarizes the current topic
    partitions each second it delivered (not only with its every-minute pass over every partition), so that tail is
    a second of deliveries, not a minute's."""
    store.send_many([Message("orders", b"x" * 100, delay_level=1, key=f"order-{i}") for i in range(5000)])
    assert runner.SUMMARIZE_EVERY_S >= 60  # only the topics' pass runs in this test
    assert runner.run(store, [1], 4.0).delivered == 5000  # due after 1 s, then 2-3 seconds of the loop
    topics = partitions.current_topic_indexes(store.conn)
    assert topics
    assert partitions.summarize(store.conn, topics) == 0  # the loop left nothing, not even the last, partial range


def test_due_hint_parses_due_times_and_nothing_else() -> None:
    assert runner.due_hint("1700000000.25") == 1700000000.25
    for bad in ("not-a-number", "", "nan", "inf", "-inf", "1e999", "1,5", "\x00"):
        assert runner.due_hint(bad) is None, bad


def test_a_bad_notify_payload_neither_stops_the_loop_nor_floods_its_log(
    db_url: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone may NOTIFY the producers' channel: the payload is a hint, and one that is not a due time is ignored
    (logged once per loop). The loop goes on and still wakes for a real announcement."""
    stop = threading.Event()
    out: dict[str, runner.RunTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = runner.run(own, [1], 60, stop=stop)

    thread = threading.Thread(target=loop)
    with caplog.at_level(logging.WARNING, logger="delaywheel.deliver.runner"):
        thread.start()
        try:
            time.sleep(1.0)  # asleep on LISTEN by now (nothing pending: a 5-s safety wake)
            with psycopg.connect(db_url, autocommit=True) as other:
                for payload in ("not-a-number", "nan", "", "1e999", "not-a-number"):
                    other.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, payload))
            time.sleep(1.0)
            assert thread.is_alive(), "a bad NOTIFY payload ended the delivery loop"
            store.send("hints", {"n": 1}, delay_level=1)  # due in 1 s: its announcement wakes the loop
            deadline = time.monotonic() + 15
            while not deliveries(store, "hints") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(deliveries(store, "hints")) == 1
            assert thread.is_alive()
        finally:
            stop.set()
            thread.join(timeout=15)
    assert not thread.is_alive() and out["totals"].delivered == 1
    warnings = [r for r in caplog.records if "ignoring a NOTIFY" in r.getMessage()]
    assert len(warnings) == 1  # once per loop, not per notice


def _counting_level_passes(store: Store) -> list[int]:
    """The levels `store` passes from now on, in order (its `deliver_level` wrapped)."""
    passes: list[int] = []
    deliver_level = store.deliver_level

    def counted(level: int, **kw: object) -> object:
        passes.append(level)
        return deliver_level(level, **kw)  # type: ignore[arg-type]

    store.deliver_level = counted  # type: ignore[method-assign, assignment]
    return passes


def test_idle_levels_are_not_passed_while_the_wheel_is_busy(db_url: str, store: Store) -> None:
    """A round passes only the lanes due by now: with timers falling due every 50 ms on the wheel, the 18 idle
    levels are looked at once at start (and at a safety wake), not once per wheel pass as they used to be. A level
    message announced meanwhile is still delivered on time."""
    from datetime import timedelta

    store.send_many([Message("busy", {"n": i}, delay=timedelta(seconds=0.5 + 0.05 * i)) for i in range(40)])

    def send_later() -> None:  # after the loop's first round: only its announcement tells the loop
        with Store(db_url) as other:
            other.send("idle", {"n": 1}, delay_level=1)

    later = threading.Timer(0.5, send_later)
    later.start()
    with Store(db_url) as own:
        level_passes = _counting_level_passes(own)
        totals = runner.run(own, [*range(1, 19), None], 20, until_idle=True)
    assert totals.delivered == 41
    assert len(level_passes) <= 18 * 3, f"{len(level_passes)} level passes"
    later.join()
    (late,) = [d for d in deliveries(store, "idle")]
    assert late[2] >= late[1]  # never early
    assert (late[2] - late[1]).total_seconds() < 2.5  # woken by its announcement, not the 5-s safety wake


def test_a_message_whose_announcement_is_lost_is_found_by_the_safety_wake_without_passing_idle_levels(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A safety wake reads the levels' heads in one query and passes the wheel, so a level message nobody announced
    is still delivered within the safety wake, and the 17 idle levels are not passed at every wake before the wheel
    (they were: a periodic stall of every wheel timer due then)."""

    def deaf(listener: object, seconds: float, stop: threading.Event, *args: object) -> None:
        stop.wait(seconds)  # every notification lost

    monkeypatch.setattr(runner, "_sleep_or_notified", deaf)
    monkeypatch.setattr(runner, "SAFETY_WAKE_S", 0.5)
    later = threading.Timer(1.0, lambda: store.send("unannounced", {"n": 1}, delay_level=1))
    with Store(db_url) as own:
        level_passes = _counting_level_passes(own)
        later.start()
        totals = runner.run(own, [*range(1, 19), None], 5.0)
    later.join()
    assert totals.delivered == 1
    (late,) = deliveries(store, "unannounced")
    assert late[2] >= late[1]  # never early
    assert (late[2] - late[1]).total_seconds() < 2.0  # found by a safety wake, every 0.5 s
    idle = [level for level in level_passes if level != 1]
    assert len(idle) == len(set(idle)), level_passes  # an idle level at most once (at start), not at every wake


def test_a_lane_hears_only_its_own_announcements(db_url: str, store: Store) -> None:
    """A deliverer of level 3 wakes for level 3's new due times and for a producer that does not say the lane, not
    for the wheel's or another level's: under Airflow each lane is a task, and 18 level tasks used to wake for
    every batch of wheel timers."""
    with runner._Listener(db_url, [3]) as listener:
        store.send("lanes", {"n": 1}, delay=timedelta(seconds=30))  # the wheel (send_one, migrations/022)
        store.send_many(
            [Message("lanes", {"n": 2}, delay_level=4), Message("lanes", {"n": 3}, delay=timedelta(seconds=40))]
        )
        assert list(listener.conn.notifies(timeout=0.5)) == []
        store.send("lanes", {"n": 4}, delay_level=3)
        store.send_many([Message("lanes", {"n": 5}, delay_level=3), Message("lanes", {"n": 6}, delay_level=5)])
        with psycopg.connect(db_url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, "1.5"))
        heard = [(n.channel, n.payload) for n in listener.conn.notifies(timeout=0.5)]
    assert [channel for channel, _ in heard] == ["delaywheel_enqueue_3", "delaywheel_enqueue_3", NOTIFY_CHANNEL]
    assert all(runner.due_hint(payload) is not None for _, payload in heard)


def test_the_loop_holds_announcements_only_up_to_its_next_safety_wake(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone who may connect may NOTIFY a deliverer's channels, and ordinary 30-day timers announce themselves too:
    a due time past the loop's next safety wake is not held (that wake reads every head and finds it), and of the
    nearer ones at most ANNOUNCED_MAX, the earliest. A near announcement still wakes the loop on time."""
    monkeypatch.setattr(runner, "SAFETY_WAKE_S", 30.0)  # within the test, only an announcement wakes the loop
    held: list[object] = []  # the loop's announced due times (what it passes to each sleep)
    parsed = [0]
    sleep, hint = runner._sleep_or_notified, runner.due_hint

    def spying(*args: object) -> None:
        if not held:
            held.append(args[5])
        sleep(*args)  # type: ignore[arg-type]

    def counting(payload: str) -> float | None:
        parsed[0] += 1
        return hint(payload)

    monkeypatch.setattr(runner, "_sleep_or_notified", spying)
    monkeypatch.setattr(runner, "due_hint", counting)

    def flood(conn: psycopg.Connection, channel: str, first_s: float, step_s: float, n: int) -> None:
        conn.execute(
            "SELECT count(pg_notify(%s, (extract(epoch FROM clock_timestamp()) + %s + i * %s)::text))"
            " FROM generate_series(1, %s) i",
            (channel, first_s, step_s, n),
        )

    def parsed_by(n: int) -> None:
        deadline = time.monotonic() + 60
        while parsed[0] < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parsed[0] >= n, f"the loop read {parsed[0]} of {n} announcements"

    stop = threading.Event()
    out: dict[str, runner.RunTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = runner.run(own, [1], 90, stop=stop)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not held and time.monotonic() < deadline:
            time.sleep(0.05)
        (announced,) = held
        with psycopg.connect(db_url, autocommit=True) as other:
            for channel in (NOTIFY_CHANNEL, lane_channel(1)):  # 30 days out and later
                flood(other, channel, 30 * 86400, 0.001, 100_000)
            parsed_by(200_000)
            assert len(announced) == 0  # type: ignore[arg-type]
            flood(other, lane_channel(1), 18, 0.0004, 10_000)  # before the next safety wake: held, up to the cap
            parsed_by(210_000)
            assert 0 < len(announced) <= runner.ANNOUNCED_MAX  # type: ignore[arg-type]
        store.send("bounded", {"n": 1}, delay_level=1)  # due in 1 s: its announcement wakes the loop
        deadline = time.monotonic() + 15
        while not deliveries(store, "bounded") and time.monotonic() < deadline:
            time.sleep(0.05)
        (late,) = deliveries(store, "bounded")
        assert late[2] >= late[1]  # never early
        assert (late[2] - late[1]).total_seconds() < 1.5  # woken by its announcement, not the 30-s safety wake
    finally:
        stop.set()
        thread.join(timeout=30)
    assert out["totals"].delivered == 1
