"""PostgreSQL restarts under load: the delivery loop reconnects and goes on, losing, duplicating and hurrying
nothing; a producer's call cut by the restart raises OperationalError and its Store works again on the next call.
PostgreSQL crashes (the WAL writer, background writer and checkpointer stopped from a pass to the crash): a delivery a
consumer or a cancel could read survives it, so no group skips a message and no handled message is cancelled.

These tests restart a throwaway cluster of their own (a temporary folder, a free port), never the shared one.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.deliver import runner
from delaywheel.dev import embedded

pytestmark = pytest.mark.timeout(120)


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


# --- Crashes of PostgreSQL: every transaction that writes topic rows commits durably (db.DURABLE_COMMIT) ----------


@pytest.fixture
def lazy_wal_writer(own_cluster: embedded.Cluster) -> Iterator[embedded.Cluster]:
    """The cluster with its WAL writer waking every 10 s (its longest), so that a commit that did not wait for its
    flush would stay in PostgreSQL's memory, where a crash loses it, for seconds rather than a fraction of one."""

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


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def frozen_wal(cluster: embedded.Cluster) -> Iterator[Callable[[], None]]:
    """The WAL writer, background writer and checkpointer stopped (SIGSTOP), so that nothing but a committing backend
    flushes the WAL: what commits without waiting for its flush stays in memory, deterministically, until the crash
    this yields (every process of the server SIGKILLed, then a start: crash recovery)."""
    with psycopg.connect(cluster.admin_url(), autocommit=True) as conn:
        helpers = [
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE backend_type IN ('walwriter', 'background writer', 'checkpointer')"
            )
        ]
    assert len(helpers) == 3, helpers
    for pid in helpers:
        os.kill(pid, signal.SIGSTOP)
    crashed = False

    def crash_now() -> None:
        nonlocal crashed
        postmaster = int((cluster.data_dir / "postmaster.pid").read_text().split()[0])
        doomed = [postmaster, *_children(postmaster)]
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in doomed):
            assert time.monotonic() < deadline, "the server's processes did not die"
            time.sleep(0.05)
        crashed = True
        embedded.start(cluster)

    try:
        yield crash_now
    finally:
        if not crashed:
            for pid in helpers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def _burn_xids(url: str, n: int = 200) -> None:
    """`n` transaction ids taken and committed without waiting for their flush: a crash hands them out again, so that
    a transaction after it gets an id lower than one taken after these (a delivery's, were it not durable)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for _ in range(n):
            conn.execute("SELECT pg_current_xact_id()")


def _deliver_until(store: Store, topic: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(_in_topic(store.conn, topic)) < count:
        assert time.monotonic() < deadline, f"{count} messages not delivered in 30 s"
        store.deliver_due()
        time.sleep(0.05)


def _due_now(store: Store, topic: str, n: int, key: str | None = None) -> list[int]:
    """`n` messages on the wheel and on level 1, due by the time this returns."""
    ids = [store.send(topic, {"n": i}, key=key, delay=timedelta(milliseconds=200)) for i in range(n)]
    ids += [store.send(topic, {"n": i}, key=key, delay_level=1) for i in range(n)]
    time.sleep(1.1)
    return ids


def _drain(store: Store, topic: str, group: str, handed: set[int]) -> None:
    """Deliver and pull for `group` until nothing more comes for a second, every batch acked."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        store.deliver_due()
        batch = store.pull(topic, group, 1000)
        if batch.messages:
            handed.update(m.message_id for m in batch.messages)
            store.ack(batch)
            quiet_since = time.monotonic()
        time.sleep(0.05)


def test_a_crash_right_after_passes_loses_and_duplicates_nothing(lazy_wal_writer: embedded.Cluster) -> None:
    url, topic = lazy_wal_writer.url(), "resilience.crash"
    with Store(url) as store:
        sent = _due_now(store, topic, 20)
        _deliver_until(store, topic, len(sent))
    crash(lazy_wal_writer)
    with Store(url) as store:
        delivered = _in_topic(store.conn, topic)
    ids = [row[0] for row in delivered]
    assert len(ids) == len(set(ids)), "a message was delivered twice"
    assert set(ids) == set(sent), f"{len(set(sent) - set(ids))} delivery(ies) undone by the crash"
    assert not [row for row in delivered if row[2] < row[1]], "a message was delivered before its due time"


def test_a_batch_pulled_before_a_crash_and_acked_after_it_skips_nothing(own_cluster: embedded.Cluster) -> None:
    """A consumer reads a pass's rows and the server crashes; after the restart it acks what it held (as a caller
    told it may retry, or Store.consume after reconnecting). The messages delivered after the restart must still
    reach the group: a delivery it read cannot be undone by the crash, so its ack never passes a position that
    transactions after the restart can write below."""
    url, topic, group = own_cluster.url(), "resilience.crash.pull", "g"
    with Store(url) as store:
        sent = set(_due_now(store, topic, 10))
        with frozen_wal(own_cluster) as crash_now:
            _burn_xids(url)
            _deliver_until(store, topic, len(sent))
            held = store.pull(topic, group, 1000)
            crash_now()
    handed = {m.message_id for m in held.messages}
    assert handed == sent
    with Store(url) as store:
        store.ack(held)
        more = set(_due_now(store, topic, 10))  # delivered by passes after the restart
        _drain(store, topic, group, handed)
    assert handed == sent | more, f"{len((sent | more) - handed)} message(s) never handed to the group"


def test_store_consume_across_a_crash_skips_nothing(own_cluster: embedded.Cluster) -> None:
    """The waiting consumer holds a batch in its handler while the server crashes; it acks that batch after
    reconnecting, then goes on: every message sent reaches its handler."""
    url, topic, group = own_cluster.url(), "resilience.crash.consume", "g"
    handed: set[int] = set()
    in_handler, crashed, stop = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def handler(batch: list[Any]) -> None:
        handed.update(m.message_id for m in batch)
        in_handler.set()
        crashed.wait(30)

    def consume() -> None:
        try:
            with Store(url) as own:
                own.consume(topic, group, handler, stop=stop, safety_wake_s=0.2)
        except BaseException as exc:
            errors.append(exc)

    with Store(url) as store:
        sent = set(_due_now(store, topic, 10))
        consumer = threading.Thread(target=consume)
        with frozen_wal(own_cluster) as crash_now:
            _burn_xids(url)
            _deliver_until(store, topic, len(sent))
            consumer.start()
            assert in_handler.wait(30), "the consumer got nothing"
            crash_now()
    crashed.set()
    try:
        with Store(url) as store:
            more = set(_due_now(store, topic, 5))
            deadline = time.monotonic() + 30
            while not (sent | more) <= handed and time.monotonic() < deadline:
                store.deliver_due()
                time.sleep(0.1)
    finally:
        stop.set()
        consumer.join(30)
    assert not errors, errors
    assert (sent | more) <= handed, f"{len((sent | more) - handed)} message(s) never handed to the consumer"


def test_a_cancel_after_a_crash_does_not_cancel_a_handled_message(own_cluster: embedded.Cluster) -> None:
    """A consumer handled a delivered message, then the server crashed: a cancel of that message after the restart
    must answer `already_delivered`, never `cancelled` (an order both timed out and paid)."""
    url, topic = own_cluster.url(), "resilience.crash.cancel.handled"
    with Store(url) as store:
        sent = store.send(topic, {"order": 1}, key="order-handled", delay=timedelta(milliseconds=200))
        time.sleep(0.3)
        with frozen_wal(own_cluster) as crash_now:
            _burn_xids(url)
            _deliver_until(store, topic, 1)
            assert [m.message_id for m in store.pull(topic, "sweeper").messages] == [sent]
            crash_now()
    with Store(url) as store:
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-handled")] == [(sent, "already_delivered")]


def test_an_already_delivered_answer_holds_after_a_crash(lazy_wal_writer: embedded.Cluster) -> None:
    url, topic = lazy_wal_writer.url(), "resilience.crash.cancel"
    with Store(url) as store:
        sent = store.send(topic, {"order": 1}, key="order-crash", delay=timedelta(milliseconds=300))
        _deliver_until(store, topic, 1)
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-crash")] == [(sent, "already_delivered")]
    crash(lazy_wal_writer)
    with Store(url) as store:
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-crash")] == [(sent, "already_delivered")]
        assert [row[0] for row in _in_topic(store.conn, topic)] == [sent]


def test_a_message_sent_straight_into_its_topic_is_durable_whatever_the_session_says(
    own_cluster: embedded.Cluster,
) -> None:
    """A send with no delay writes its topic row at once (send_one, and send_many's COPY): a session that commits
    without waiting for its flush must not make that row one a consumer can read and a crash then undo."""
    url, topic = own_cluster.url(), "resilience.crash.direct"
    with Store(url) as store:
        store.conn.execute("SET synchronous_commit = off")
        store.conn.commit()
        with frozen_wal(own_cluster) as crash_now:
            sent = [store.send(topic, {"n": 0})]
            sent += store.send_many([Message(topic, {"n": n}) for n in range(1, 6)])
            assert len(_in_topic(store.conn, topic)) == len(sent)
            crash_now()
    with Store(url) as store:
        assert sorted(row[0] for row in _in_topic(store.conn, topic)) == sorted(sent)


@pytest.fixture
def lazy_database(own_cluster: embedded.Cluster) -> Iterator[embedded.Cluster]:
    """The store's database with synchronous_commit off by default, as an operator might set it for speed."""

    def default(value: str | None) -> None:
        with psycopg.connect(own_cluster.admin_url(), autocommit=True) as conn:
            action = "RESET synchronous_commit" if value is None else f"SET synchronous_commit = {value}"
            conn.execute(f"ALTER DATABASE delaywheel {action}")

    default("off")
    try:
        yield own_cluster
    finally:
        default(None)


def test_a_cancelled_answer_holds_after_a_crash_whatever_the_databases_default(
    lazy_database: embedded.Cluster,
) -> None:
    """`cancelled` tells the caller the timeout will never fire: the store's sessions commit durably whatever the
    database's or role's default (db.SESSION_OPTIONS), so a crash after the answer cannot undo the cancellation."""
    url, topic = lazy_database.url(), "resilience.crash.cancelled"
    with Store(url) as store:
        sent = store.send(topic, {"order": 1}, key="order-paid", delay=timedelta(seconds=1))
        with frozen_wal(lazy_database) as crash_now:
            assert [(r.message_id, r.outcome) for r in store.cancel(key="order-paid")] == [(sent, "cancelled")]
            crash_now()
    time.sleep(1.2)
    with Store(url) as store:
        store.deliver_due()
        assert _in_topic(store.conn, topic) == []
        assert [(r.message_id, r.outcome) for r in store.cancel(key="order-paid")] == [(sent, "already_cancelled")]
