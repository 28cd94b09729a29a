"""A lane with due messages and no live deliverer shows: `stats` flags it (the JSON, the CLI's text and the page take
it from there), and a delivery loop of another lane logs it. Before, a lane left without a deliverer (an Airflow
restart whose lane tasks had ended `success`) showed only as a growing lag, and nothing said that nobody delivered
it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import psycopg
import pytest

from delaywheel import Store
from delaywheel.deliver import presence, runner
from delaywheel.locks import LANE_PRESENCE_LOCK
from delaywheel.ops.stats import as_json

T = TypeVar("T")


def eventually(read: Callable[[], T], expected: T, within_s: float = 10.0) -> T:
    """`read()` once it gives `expected`, or its last value after `within_s`:
    a closed connection's session, and its locks, end on the server a moment after the client lets go."""
    deadline = time.monotonic() + within_s
    value = read()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def _due_on_level_2_and_the_wheel(store: Store) -> None:
    """A level-2 message (5 s) and a wheel timer, both due a few seconds ago, and nothing delivering them."""
    now = store.clock()
    store.send("orders", {"n": 1}, delay_level=2, now=now - timedelta(seconds=8))
    store.send("timers", {"n": 2}, deliver_at=now - timedelta(seconds=2), now=now - timedelta(seconds=8))


def test_stats_flag_a_lane_with_due_messages_and_no_live_deliverer(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _due_on_level_2_and_the_wheel(store)
    figures = store.stats()
    levels = {row["level"]: row for row in figures["levels"]}
    assert (levels[2]["deliverers"], levels[2]["unserved"]) == (0, True)
    assert (levels[1]["deliverers"], levels[1]["unserved"]) == (0, False)  # nothing due there: not flagged
    assert (figures["wheel"]["deliverers"], figures["wheel"]["unserved"]) == (0, True)
    assert figures["unserved"] == ["level 2", "wheel"]
    assert as_json(figures)["unserved"] == ["level 2", "wheel"]

    # `delaywheel stats` says so at the top of its text
    from delaywheel.cli import main

    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    capsys.readouterr()
    assert main(["stats"]) == 0
    assert "UNSERVED: level 2, wheel: messages due and no live deliverer" in capsys.readouterr().out

    # a live holder of the lane's presence lock (what every delivery loop takes) is its deliverer: no longer flagged
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock_shared(%s, 2)", (LANE_PRESENCE_LOCK,))
        figures = store.stats()
        level2 = next(row for row in figures["levels"] if row["level"] == 2)
        assert (level2["deliverers"], level2["unserved"], figures["unserved"]) == (1, False, ["wheel"])
    # its session gone (a crashed deliverer), the lane is unserved again (once the server has ended the session)
    assert eventually(lambda: store.stats()["unserved"], ["level 2", "wheel"]) == ["level 2", "wheel"]


def test_stats_count_the_live_delivery_loops_of_each_lane(store: Store, db_url: str) -> None:
    _due_on_level_2_and_the_wheel(store)
    stop = threading.Event()
    ready = threading.Event()
    loops = []
    for lanes in ([1], [1, None]):

        def loop(lanes: list[int | None] = lanes) -> None:
            with Store(db_url) as own:
                runner.run(own, lanes, 60, stop=stop, ready=ready.set)

        loops.append(threading.Thread(target=loop))
        loops[-1].start()
        assert ready.wait(30)
        ready.clear()
    try:
        deadline = time.monotonic() + 15
        while store.stats()["wheel"]["unserved"] and time.monotonic() < deadline:  # delivered by the second loop
            time.sleep(0.1)
        figures = store.stats()
        levels = {row["level"]: row for row in figures["levels"]}
        assert (levels[1]["deliverers"], figures["wheel"]["deliverers"], levels[2]["deliverers"]) == (2, 1, 0)
        assert figures["unserved"] == ["level 2"]
    finally:
        stop.set()
        for thread in loops:
            thread.join(30)
    assert eventually(lambda: store.stats()["levels"][0]["deliverers"], 0) == 0  # their sessions ended with them


def test_a_delivery_loop_logs_the_lanes_nobody_delivers(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop of level 1 finds level 2 and the wheel due with no deliverer at two looks in a row and warns, naming
    them; once a deliverer takes them it says every lane is served again. Its own lane is never named."""
    monkeypatch.setattr(presence, "CHECK_EVERY_S", 0.2)
    monkeypatch.setattr(runner, "SAFETY_WAKE_S", 0.5)  # an idle loop looks (and checks) at its wakes: not 5 s apart
    _due_on_level_2_and_the_wheel(store)
    stop = threading.Event()

    def loop(lanes: list[int | None], seconds: float) -> None:
        with Store(db_url) as own:
            runner.run(own, lanes, seconds, stop=stop)

    level_1 = threading.Thread(target=loop, args=([1], 60))
    with caplog.at_level(logging.INFO, logger="delaywheel.deliver.presence"):
        level_1.start()
        try:
            deadline = time.monotonic() + 15
            while not [r for r in caplog.records if "no live deliverer" in r.getMessage()]:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
            (warning,) = [r for r in caplog.records if "no live deliverer" in r.getMessage()]
            assert warning.levelno == logging.WARNING
            assert "level 2 (due " in warning.getMessage() and "wheel (due " in warning.getMessage()
            assert "level 1" not in warning.getMessage()
            rest = threading.Thread(target=loop, args=([2, None], 60))  # a deliverer for them starts
            rest.start()
            while not [r for r in caplog.records if "every lane has a live deliverer again" in r.getMessage()]:
                assert time.monotonic() < deadline + 15, caplog.text
                time.sleep(0.1)
        finally:
            stop.set()
            level_1.join(30)
            if "rest" in locals():
                rest.join(30)
    assert len([r for r in caplog.records if "no live deliverer" in r.getMessage()]) == 1  # not once a look
