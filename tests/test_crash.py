"""Crashes and bursts: a deliverer or wheel advancer SIGKILLed mid-batch and restarted loses and duplicates
nothing; 500,000 timers due in the same second are all delivered exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta

import psycopg

from delaywheel import Store
from delaywheel.produce.validation import Message

# Delivers (real clock) until `expected` messages of the topic are in it. deliver_due() skips a lane that
# is busy (the killed process's transaction may still be rolling back), so it loops rather than stopping.
CHILD = """
import sys, time
from delaywheel import Settings, Store
url, topic, expected = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Store(url, Settings(batch_size=2000)) as store:
    while True:
        store.deliver_due()
        done = store.conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = %s", (topic,)).fetchone()[0]
        if done >= expected:
            break
        time.sleep(0.05)
"""
TOTAL = 50_000


def _delivered(url: str, topic: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM delaywheel.topic_messages WHERE topic = %s", (topic,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _kill_mid_run_then_finish(url: str, topic: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, topic, str(TOTAL)])
    deadline = time.monotonic() + 240
    while _delivered(url, topic)[0] < 4000:  # a couple of batches committed, more to come
        assert child.poll() is None, "the deliverer finished before it could be killed; raise TOTAL"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    partial = _delivered(url, topic)
    assert partial[0] == partial[1] and partial[0] < TOTAL, partial
    restarted = subprocess.run([sys.executable, "-c", CHILD, url, topic, str(TOTAL)], timeout=300, check=True)
    assert restarted.returncode == 0
    assert _delivered(url, topic) == (TOTAL, TOTAL)


def test_level_deliverer_killed_mid_batch(store: Store, db_url: str) -> None:
    enqueued = store.clock() - timedelta(hours=1)  # everything is overdue
    for start in range(0, TOTAL, 10_000):
        store.send_many([Message("crash", {"i": i}, delay_level=1) for i in range(start, start + 10_000)], now=enqueued)
    _kill_mid_run_then_finish(db_url, "crash")


def test_wheel_advancer_killed_mid_slot(store: Store, db_url: str) -> None:
    now = store.clock()
    base = now - timedelta(minutes=50)
    for start in range(0, TOTAL, 10_000):
        store.send_many(
            [
                Message("crash", {"i": i}, deliver_at=base + timedelta(milliseconds=12 * i))  # 10 minutes of slots
                for i in range(start, start + 10_000)
            ],
            now=now - timedelta(hours=1),
        )
    _kill_mid_run_then_finish(db_url, "crash")
    with psycopg.connect(db_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE delivered_at < deliver_at"
        ).fetchone() == (0,)


def test_burst_of_500k_due_in_the_same_second(store: Store, t0: datetime) -> None:
    total, chunk = 500_000, 50_000
    store.prepare(now=t0)
    for start in range(0, total, chunk):
        store.send_many(
            [
                Message("burst", b"", deliver_at=t0 + timedelta(seconds=10, microseconds=(i * 2) % 1_000_000))
                for i in range(start, start + chunk)
            ],
            now=t0,
        )
    assert store.advance_wheel(now=t0 + timedelta(seconds=9.999)).delivered == 0
    delivered = 0
    while True:
        result = store.advance_wheel(now=t0 + timedelta(seconds=11), limit=50_000)
        delivered += result.delivered
        if not result.more:
            break
    assert delivered == total
    row = store.conn.execute(
        "SELECT count(*), count(DISTINCT message_id), count(*) FILTER (WHERE delivered_at < deliver_at)"
        " FROM delaywheel.topic_messages WHERE topic = 'burst'"
    ).fetchone()
    assert row == (total, total, 0)
