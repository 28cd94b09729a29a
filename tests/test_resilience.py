"""PostgreSQL restarts under load: the delivery loop reconnects and goes on, losing, duplicating and hurrying
nothing; a producer's call cut by the restart raises OperationalError and its Store works again on the next call.
PostgreSQL crashes right after passes (whose commits do not wait for their flush): what a crash undoes is delivered
again, once, and a cancel's `already_delivered` answer still holds.

These tests restart a throwaway cluster of their own (a temporary folder, a free port), never the shared one.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.deliver import runner
from delaywheel.dev import embedded
from delaywheel.migrate import migrate
from tests.conftest import free_ports

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[embedded.Cluster]:
    root = Path(tempfile.mkdtemp(prefix="delaywheel-restart-", dir="/var/tmp"))
    root.chmod(0o755)  # the postgres user (we may be root) must reach it
    cluster = embedded.Cluster(root=root, port=free_ports(1)[0])
    embedded.start(cluster)
    try:
        migrate(cluster.url())
        with Store(cluster.url()) as store:
            store.prepare()
        yield cluster
    finally:
        embedded.stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def _in_topic(conn: psycopg.Connection, topic: str) -> list[tuple[int, datetime, datetime]]:
    """(message_id, deliver_at, delivered_at) of every delivery into `topic`."""
    return conn.execute(
        "SELECT message_id, deliver_at, delivered_at FROM delaywheel.topic_messages WHERE topic = %s", (topic,)
    ).fetchall()


def restart(cluster: embedded.Cluster, down_s: float = 1.0) -> None:
    """A fast shutdown (sessions are terminated, in-flight transactions roll back), some downtime, a start."""
    embedded.stop(cluster)
    time.sleep(down_s)
    embedded.start(cluster)


def test_a_store_recovers_on_the_next_call_after_a_restart(own_cluster: embedded.Cluster) -> None:
    with Store(own_cluster.url()) as store:
        store.send("resilience.producer", {"n": 0})
        restart(own_cluster, down_s=0.2)
        with pytest.raises(psycopg.OperationalError):  # the connection this call had is gone: the caller may retry
            store.send("resilience.producer", {"n": 1})
        second = store.send("resilience.producer", {"n": 2})  # a fresh connection (not delayed: in the topic)
        (row,) = store.conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE message_id = %s", (second,)
        ).fetchall()
        assert row == (1,)


def test_the_delivery_loop_rides_out_restarts_under_load(own_cluster: embedded.Cluster) -> None:
    url = own_cluster.url()
    topic = "resilience.load"
    stop_loop, stop_producing = threading.Event(), threading.Event()
    loop_out: dict[str, object] = {}
    sent: list[int] = []  # ids of sends that returned: each must be delivered exactly once
    failures: list[BaseException] = []
    sent_after_restarts: list[int] = []
    restarts_done = threading.Event()

    def deliver() -> None:
        try:
            with Store(url) as store:
                loop_out["totals"] = runner.run(store, [1, 2, None], 90, stop=stop_loop)
        except BaseException as exc:  # the test fails below, with this
            loop_out["error"] = exc

    def produce() -> None:
        rng = random.Random(7)
        with Store(url) as store:
            n = 0
            while not stop_producing.is_set():
                n += 1
                try:
                    if n % 10 == 0:  # a batch on the wheel, due within 2 s
                        ids = store.send_many(
                            [
                                Message(
                                    topic,
                                    {"n": n, "i": i},
                                    key=f"{n}-{i}",
                                    delay=timedelta(seconds=rng.uniform(0.1, 2.0)),
                                )
                                for i in range(50)
                            ]
                        )
                    elif n % 3 == 0:
                        ids = [store.send(topic, {"n": n}, key=str(n), delay_level=rng.choice((1, 2)))]
                    else:
                        ids = [store.send(topic, {"n": n}, key=str(n), delay=timedelta(seconds=rng.uniform(0, 1.5)))]
                except psycopg.OperationalError as exc:  # cut by a restart: may or may not have committed
                    failures.append(exc)
                    time.sleep(0.05)
                    continue
                sent.extend(ids)
                if restarts_done.is_set():
                    sent_after_restarts.extend(ids)
                time.sleep(0.01)

    deliverer = threading.Thread(target=deliver, name="deliverer")
    producer = threading.Thread(target=produce, name="producer")
    deliverer.start()
    producer.start()
    try:
        for _ in range(2):
            time.sleep(3.0)
            restart(own_cluster)
            assert deliverer.is_alive(), f"the delivery loop ended: {loop_out}"
        restarts_done.set()
        time.sleep(3.0)
        stop_producing.set()
        producer.join(timeout=30)
        assert sent_after_restarts, "the producer's Store did not recover"
        # everything sent is due within 5 s (level 2); give the loop time to deliver the rest
        with Store(url) as check:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                enqueued = {
                    r[0]
                    for r in check.conn.execute(
                        "SELECT id FROM delaywheel.level_queue WHERE topic = %(t)s"
                        " UNION ALL SELECT id FROM delaywheel.wheel WHERE topic = %(t)s",
                        {"t": topic},
                    )
                }
                delivered = _in_topic(check.conn, topic)
                if {r[0] for r in delivered} >= enqueued:
                    break
                time.sleep(0.5)
        assert deliverer.is_alive(), f"the delivery loop ended: {loop_out}"
    finally:
        stop_producing.set()
        stop_loop.set()
        producer.join(timeout=30)
        deliverer.join(timeout=30)
    assert "error" not in loop_out, loop_out.get("error")
    totals = loop_out["totals"]
    assert isinstance(totals, runner.RunTotals)
    assert totals.reconnects >= 2
    ids = [r[0] for r in delivered]
    assert len(ids) == len(set(ids)), "a message was delivered twice"
    assert set(ids) == enqueued, f"{len(enqueued - set(ids))} message(s) not delivered"
    assert set(sent) <= enqueued  # every send that returned was enqueued ...
    early = [r for r in delivered if r[2] < r[1]]
    assert not early, f"{len(early)} message(s) delivered before their due time"
    assert len(sent) > 200 and failures  # ... under load, and the restarts did cut producer calls


@pytest.mark.airflow
def test_the_triggers_reconnect_after_a_restart(
    own_cluster: embedded.Cluster, airflow_db: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both triggers wait on LISTEN with a 10-minute poll; after a restart they must reconnect and LISTEN again,
    or the announcements below would not wake them in time."""
    import asyncio

    from delaywheel.airflow.triggers import DueMessagesTrigger, TopicMessagesTrigger
    from delaywheel.dev.local_airflow import as_url

    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", as_url(own_cluster.url()))
    topic = "resilience.trigger"

    async def go():
        due = DueMessagesTrigger(poll_interval=600).run()
        watch = TopicMessagesTrigger(topic, poll_interval=600).run()
        due_event = asyncio.ensure_future(due.__anext__())
        watch_event = asyncio.ensure_future(watch.__anext__())
        await asyncio.sleep(1.5)  # both asleep on LISTEN
        await asyncio.to_thread(restart, own_cluster)
        await asyncio.sleep(6.0)  # backoff: reconnected by now
        assert not due_event.done() and not watch_event.done()
        with Store(own_cluster.url()) as store:
            await asyncio.to_thread(store.send, topic, {"n": 1}, delay=timedelta(seconds=1))
            fired = await asyncio.wait_for(due_event, 20)
            delivered = await asyncio.to_thread(store.advance_wheel)
            announced = await asyncio.wait_for(watch_event, 20)
        await due.aclose()
        await watch.aclose()
        return fired, delivered, announced

    fired, delivered, announced = asyncio.run(go())
    assert fired.payload["lane"] == "wheel" and delivered.delivered == 1
    assert announced.payload["topic"] == topic and announced.payload["count"] == 1


def test_the_deliver_command_rides_out_a_restart_and_stops_on_sigterm(own_cluster: embedded.Cluster) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": own_cluster.url()}
    loop = subprocess.Popen(
        [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", "60s", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)
        restart(own_cluster)
        assert loop.poll() is None, loop.communicate()
        with Store(own_cluster.url()) as store:
            sent = store.send("resilience.cli", {"n": 1}, delay=timedelta(seconds=1))
            deadline = time.monotonic() + 20
            while (
                time.monotonic() < deadline
                and not store.conn.execute(
                    "SELECT 1 FROM delaywheel.topic_messages WHERE message_id = %s", (sent,)
                ).fetchone()
            ):
                time.sleep(0.2)
            assert store.conn.execute(
                "SELECT count(*) FROM delaywheel.topic_messages WHERE message_id = %s", (sent,)
            ).fetchone() == (1,)
        loop.send_signal(signal.SIGTERM)
        out, err = loop.communicate(timeout=30)
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.communicate()
    assert loop.returncode == 0, err
    result = json.loads(out)
    assert result["reconnects"] >= 1 and result["stopped_by_signal"] is True and result["delivered"] >= 1
    assert "Traceback" not in err


# --- Crashes of PostgreSQL (an immediate stop): a pass commits without waiting for its flush (migrations/030) ------


@pytest.fixture
def lazy_wal_writer(own_cluster: embedded.Cluster) -> Iterator[embedded.Cluster]:
    """The cluster with its WAL writer waking every 10 s (its longest), so that a commit that did not wait for its
    flush stays in PostgreSQL's memory, where a crash loses it, for seconds rather than a fraction of one."""

    def wal_writer_delay(value: str | None) -> None:
        with psycopg.connect(own_cluster.admin_url(), autocommit=True) as conn:
            if value is None:
                conn.execute("ALTER SYSTEM RESET wal_writer_delay")
            else:
                conn.execute(sql.SQL("ALTER SYSTEM SET wal_writer_delay = {}").format(sql.Literal(value)))
            conn.execute("SELECT pg_reload_conf()")

    wal_writer_delay("10s")
    try:
        yield own_cluster
    finally:
        wal_writer_delay(None)


def crash(cluster: embedded.Cluster) -> None:
    """An immediate stop (every process of the server ends at once, no checkpoint), then a start (crash recovery)."""
    embedded.stop(cluster, mode="immediate")
    embedded.start(cluster)


def _deliver_until(store: Store, topic: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(_in_topic(store.conn, topic)) < count:
        assert time.monotonic() < deadline, f"{count} messages not delivered in 30 s"
        store.deliver_due()
        time.sleep(0.05)


def test_a_crash_right_after_passes_loses_and_duplicates_nothing(lazy_wal_writer: embedded.Cluster) -> None:
    url, topic = lazy_wal_writer.url(), "resilience.crash"
    sent: list[int] = []
    undone = 0  # deliveries a crash undid (a pass's commit not flushed yet), each delivered again after it
    for _ in range(3):  # the WAL writer may wake between the passes and the crash: then no pass is undone
        with Store(url) as store:
            sent += [store.send(topic, {"n": n}, delay=timedelta(milliseconds=300)) for n in range(20)]  # the wheel
            sent += [store.send(topic, {"n": n}, delay_level=1) for n in range(20)]  # level 1 (1 s)
            _deliver_until(store, topic, len(sent))
        crash(lazy_wal_writer)
        with Store(url) as store:
            undone += len(sent) - len(_in_topic(store.conn, topic))
            _deliver_until(store, topic, len(sent))
            delivered = _in_topic(store.conn, topic)
        if undone:
            break
    ids = [row[0] for row in delivered]
    assert len(ids) == len(set(ids)), "a message was delivered twice"
    assert set(ids) == set(sent), f"{len(set(sent) - set(ids))} message(s) lost"
    assert not [row for row in delivered if row[2] < row[1]], "a message was delivered before its due time"
    assert undone, "no crash undid a delivery: the passes' commits waited for their flush"


def test_an_already_delivered_answer_holds_after_a_crash(lazy_wal_writer: embedded.Cluster) -> None:
    """The cancel that answers `already_delivered` makes the delivery it read durable first (ops/cancel.py,
    durable_answer): without that, the crash undoes the delivery, and a second cancel finds the message pending
    and answers `cancelled`, so that the first answer was false."""
    url, topic = lazy_wal_writer.url(), "resilience.crash.cancel"
    with Store(url) as store:
        sent = store.send(topic, {"order": 1}, key="order-crash", delay=timedelta(milliseconds=300))
        _deliver_until(store, topic, 1)
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-crash")] == [(sent, "already_delivered")]
    crash(lazy_wal_writer)
    with Store(url) as store:
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-crash")] == [(sent, "already_delivered")]
        assert [row[0] for row in _in_topic(store.conn, topic)] == [sent]
