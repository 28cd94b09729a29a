"""The waiting consumer (`Store.consume`, `Store.messages`, `delaywheel consume`): behaviour, not timing.

Bounds on waits are wide (CI is loaded); what is checked is which messages a consumer handles, in what order,
how often, and that none is handled before it is due."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from delaywheel import Message, Store
from delaywheel.channels import TOPIC_CHANNEL
from delaywheel.cli import main
from delaywheel.consume import consumer as consume
from delaywheel.consume import topics
from delaywheel.consume.retry import retry_topic
from delaywheel.produce.producer import send_for_store
from tests.helpers import ROOT, deliveries, delivering, syncs, traced


def test_the_consumer_gets_exactly_the_delivered_messages_in_order_and_none_early(db_url: str, store: Store) -> None:
    stop = threading.Event()
    deliverer = delivering(db_url, stop)
    seen: list[tuple[int, float, float]] = []  # (message_id, handled at, due at) in handling order
    try:
        ids = store.send_many([Message("t", {"n": i}, delay=timedelta(milliseconds=300 + 37 * i)) for i in range(40)])
        ids += store.send_many([Message("t", {"n": i}, delay_level=1) for i in range(20)])  # a level too
        ids += store.send_many([Message("other", {"n": i}) for i in range(5)])  # another topic: not ours

        def handler(messages: list) -> None:
            now = time.time()
            seen.extend((m.message_id, now, m.deliver_at.timestamp()) for m in messages)

        with Store(db_url) as own:
            totals = own.consume("t", "g", handler, max_messages=7, limit=60, duration_s=60)
    finally:
        stop.set()
        deliverer.join(30)
    delivered = [d[0] for d in deliveries(store, "t")]  # in the topic's (xid, queue_offset) order
    assert [s[0] for s in seen] == delivered and sorted(delivered) == sorted(ids[:60])
    assert all(handled >= due for _, handled, due in seen), "a message was handled before it was due"
    assert totals.messages == 60 and totals.stopped_by == "limit" and totals.retried == 0
    with Store(db_url) as own:
        assert len(own.pull("t", "g")) == 0  # all acked


def test_failures_and_handler_errors_go_to_the_retry_ladder(db_url: str, store: Store) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(6)])
    calls: list[list[int]] = []

    def handler(messages: list) -> list[int]:
        calls.append([m.message_id for m in messages])
        if len(calls) == 1:
            return [messages[0].message_id]  # one failure
        raise RuntimeError("the handler broke")  # the whole batch

    totals = store.consume("t", "g", handler, max_messages=3, limit=6, duration_s=30)
    assert calls == [ids[:3], ids[3:]]
    assert (totals.messages, totals.retried, totals.handler_errors) == (6, 4, 1)
    retries = store.conn.execute(
        "SELECT properties->>'ORIGIN_MESSAGE_ID' FROM delaywheel.level_queue WHERE topic = %s ORDER BY id",
        (retry_topic("g"),),
    ).fetchall()
    assert sorted(int(r[0]) for r in retries) == sorted([ids[0], *ids[3:]])


def test_the_iterator_acks_what_the_loop_has_moved_past(db_url: str, store: Store) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(10)])
    got: list[int] = []
    for m in store.messages("t", "g", max_messages=4, duration_s=30):
        if len(got) == 6:
            break  # the 7th message is in hand, not handled
        got.append(m.message_id)
    assert got == ids[:6]
    look = store.pull("t", "g", 10)
    assert [m.message_id for m in look.messages] == ids[6:]  # the rest comes again
    store.release(look)
    assert [m.message_id for m in store.messages("t", "g", limit=4, duration_s=30)] == ids[6:]
    assert len(store.pull("t", "g")) == 0


_KILLED_CONSUMER = """
import os, signal, sys
from delaywheel import Store
out = open(sys.argv[2], "a")
def handler(messages):
    out.write(" ".join(str(m.message_id) for m in messages) + "\\n")
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # handled, not acked
with Store(sys.argv[1]) as store:
    store.consume("t", "g", handler, max_messages=5, duration_s=30)
"""


def test_a_consumer_killed_between_handler_and_ack_leaves_the_batch_to_the_next(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(8)])
    log = tmp_path / "handled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", _KILLED_CONSUMER, db_url, str(log)], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert log.read_text().split() == [str(i) for i in ids[:5]]
    again: list[int] = []
    store.consume("t", "g", lambda ms: again.extend(m.message_id for m in ms), limit=8, duration_s=30)
    assert again == ids  # the killed consumer's batch first, at least once


def test_a_lost_notification_or_a_bad_payload_still_delivers_by_the_safety_wake(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer never hears its topic's notification (it listens on another channel, where it gets junk
    payloads only): it still finds the message within its safety wake."""
    monkeypatch.setattr(consume, "TOPIC_CHANNEL", "delaywheel_nobody")
    got: list[int] = []
    out: dict[str, consume.ConsumeTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = own.consume(
                "t", "g", lambda ms: got.extend(m.message_id for m in ms), limit=1, duration_s=30, safety_wake_s=0.5
            )

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.8)
    with psycopg.connect(db_url, autocommit=True) as other:
        for payload in ("", "not a topic", "t" * 5000, "\x01"):
            other.execute("SELECT pg_notify(%s, %s)", ("delaywheel_nobody", payload))
    mid = store.send("t", {"n": 1})
    thread.join(30)
    assert got == [mid]
    assert out["totals"].notified_wakes == 0 and out["totals"].safety_wakes >= 1


def test_a_notification_wakes_the_consumer_long_before_its_safety_wake(db_url: str, store: Store) -> None:
    out: dict[str, consume.ConsumeTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = own.consume("t", "g", lambda ms: None, limit=1, duration_s=60, safety_wake_s=30)

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.8)
    with psycopg.connect(db_url, autocommit=True) as other:  # junk on the real channel is ignored
        other.execute("SELECT pg_notify(%s, %s)", (TOPIC_CHANNEL, "not-our-topic"))
    store.send("t", {"n": 1})
    thread.join(20)
    assert not thread.is_alive(), "the consumer slept through the notification"
    assert out["totals"].notified_wakes >= 1 and out["totals"].safety_wakes == 0


def test_two_consumers_of_one_group_share_it_one_key_at_a_time_in_order(db_url: str, store: Store) -> None:
    """Each consumer holds its share of the group's queues; one key's messages are in one queue. Between them they
    handle every message once, both handle some, never one key in both at the same time, each key in order."""
    ids = store.send_many([Message("t", {"n": i}, key=f"k{i % 12}") for i in range(120)])
    handled: dict[str, list[int]] = {"a": [], "b": []}
    inside: dict[str, set[str]] = {"a": set(), "b": set()}
    overlaps: list[str] = []
    lock = threading.Lock()

    def consumer(name: str) -> None:
        other = "b" if name == "a" else "a"

        def handler(messages: list) -> None:
            keys = {m.key for m in messages}
            with lock:
                overlaps.extend(keys & inside[other])
                inside[name] = keys
            time.sleep(0.05)  # long enough for the other consumer to pull meanwhile
            handled[name].extend(m.message_id for m in messages)
            with lock:
                inside[name] = set()

        with Store(db_url) as own:
            own.consume("t", "g", handler, max_messages=5, idle_s=2.0, duration_s=60)

    threads = [threading.Thread(target=consumer, args=(n,)) for n in handled]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert overlaps == []
    both = handled["a"] + handled["b"]
    assert sorted(both) == ids and len(set(both)) == len(both)  # every message once
    assert handled["a"] and handled["b"]  # shared
    for name in handled:
        assert handled[name] == sorted(handled[name])  # each in offset order (so each key in order)


def test_cli_consume_json_prints_messages_and_acks(
    db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    ids = store.send_many([Message("t", {"n": i}, key=f"k{i}") for i in range(3)])
    assert main(["consume", "--topic", "t", "--group", "g", "--json", "--count", "3", "--duration", "30s"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["message_id"] for r in rows] == ids and [r["body"] for r in rows] == [{"n": i} for i in range(3)]
    assert rows[0]["key"] == "k0" and rows[0]["idempotency_id"] == ids[0]
    assert len(store.pull("t", "g")) == 0  # acked
    assert main(["consume", "--topic", "t", "--group", "g", "--idle", "500ms"]) == 0  # nothing more: idle stop
    with pytest.raises(SystemExit) as exited:
        main(["consume", "--topic", "t", "--group", "g", "--count", "0"])  # not a count (argparse)
    assert exited.value.code == 2


def test_cli_consume_errors_are_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert main(["consume", "--topic", "t", "--group", "g", "--duration", "1s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("delaywheel: database error:") and len(err.strip().splitlines()) == 1


def test_the_consumer_rides_out_a_lost_connection(db_url: str, store: Store) -> None:
    """Its connections are terminated (as by a server restart) while it waits: it reconnects, LISTENs again and
    still gets the next message, once."""
    got: list[int] = []
    out: dict[str, consume.ConsumeTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = own.consume(
                "t", "g", lambda ms: got.extend(m.message_id for m in ms), limit=2, duration_s=60, safety_wake_s=0.5
            )

    first = store.send("t", {"n": 1})
    thread = threading.Thread(target=loop)
    thread.start()
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    store.conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    time.sleep(0.5)
    second = store.send("t", {"n": 2})
    thread.join(60)
    assert not thread.is_alive()
    assert got == [first, second] and out["totals"].reconnects >= 1


def test_cli_consume_stops_cleanly_on_sigterm(db_url: str, store: Store) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(2)])
    env = {
        **os.environ,
        "DELAYWHEEL_DATABASE_URL": db_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "delaywheel.cli", "consume", "--topic", "t", "--group", "g", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]  # written and flushed before the ack
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [json.loads(line)["message_id"] for line in lines] == ids and out == ""
    assert "stopped by a signal" in err and "Traceback" not in err
    assert len(store.pull("t", "g")) == 0  # acked before it stopped


def test_a_notified_delivery_still_above_the_horizon_is_pulled_again_soon(db_url: str, store: Store) -> None:
    """A transaction that began writing before a delivery committed holds the delivery back (commit horizon): the
    consumer's notified pull finds nothing, and it looks again within milliseconds, not at its safety wake."""
    got: list[int] = []
    out: dict[str, consume.ConsumeTotals] = {}

    def loop() -> None:
        with Store(db_url) as own:
            out["totals"] = own.consume(
                "t", "g", lambda ms: got.extend(m.message_id for m in ms), limit=1, duration_s=60, safety_wake_s=30
            )

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.8)  # waiting on LISTEN by now
    with psycopg.connect(db_url) as holder:  # an open transaction with an xid, older than the delivery
        holder.execute("SELECT pg_current_xact_id()")
        mid = store.send("t", {"n": 1})  # in the topic at commit, NOTIFY sent; not readable yet
        time.sleep(0.15)
        assert got == []
    thread.join(20)  # the holder ended (rolled back): the next look finds it
    assert got == [mid]
    assert out["totals"].safety_wakes == 0 and out["totals"].empty_pulls >= 2


def test_after_a_batch_with_nothing_behind_it_the_consumer_waits_for_the_next_notification(
    db_url: str, store: Store
) -> None:
    """The pull that acks a batch finds nothing past the offset (`Batch.behind` false): the consumer sleeps until a
    notification or its safety wake, instead of looking again every few milliseconds."""
    store.send("t", {"n": 1})
    with Store(db_url) as own:
        totals = own.consume("t", "g", lambda ms: None, duration_s=1.5, safety_wake_s=30)
    assert totals.messages == 1 and totals.repulls == 0 and totals.empty_pulls == 1
    assert totals.held_acks == 1  # its ack waited for a notification that did not come, then went with a pull
    batch = store.pull("t", "g")
    assert len(batch) == 0 and not batch.behind
    with psycopg.connect(db_url) as holder:  # rows past the offset that no read can take yet: behind
        holder.execute("SELECT pg_current_xact_id()")
        store.send("t", {"n": 2})
        held_back = store.pull("t", "g")
        assert len(held_back) == 0 and held_back.behind


def test_a_batch_that_left_rows_unread_says_so(store: Store) -> None:
    """`Batch.behind` with messages: rows past the offset that the batch does not hold (beyond its room), so the
    consumer pulls again at once instead of holding the ack for a notification that came already."""
    store.send_many([Message("t", {"n": i}) for i in range(5)])

    def peek(n: int) -> topics.Batch:
        batch = store.pull("t", "g", max_messages=n)
        store.release(batch)
        return batch

    assert peek(2).behind
    whole = peek(5)
    assert len(whole) == 5 and not whole.behind
    assert not peek(6).behind
    # the group's retry topic is read after the topic, into the room left: its rows that found none are behind
    send_for_store(
        store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"n": i}) for i in range(2)], [1, 1]
    )
    assert peek(5).behind
    assert peek(6).behind
    both = peek(7)
    assert len(both) == 7 and not both.behind


def test_a_batch_is_in_each_sources_order_whatever_order_its_rows_arrive_in(store: Store) -> None:
    """The read has no ORDER BY of its own (it sorted whole rows, bodies and all): `_batch` puts each source's rows in
    (xid, queue_offset) order, so a plan that returned them otherwise would still hand them out in order."""
    store.send_many([Message("t", {"n": i}) for i in range(4)])
    store.send_many([Message("t", {"n": i}) for i in range(4, 7)])
    send_for_store(store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"n": 9})], [1])
    sources = ("t", retry_topic("g"))
    holder = topics.new_holder()
    with store.conn.transaction():
        queues = topics._take(store.conn, "g", "t", holder, 30.0, durable=True)
        rows = topics._read(store.conn, "g", sources, holder, 10).fetchall()
    in_order = topics._batch("g", sources, rows, 10, holder, queues)
    topics.give_queues(store.conn, "g", "t", holder)
    assert [m.message_id for m in in_order.messages] == [m.message_id for m in store.pull("t", "g", 10).messages]
    assert [m.body["n"] for m in in_order.messages] == [0, 1, 2, 3, 4, 5, 6, 9]
    for shuffled in (rows[::-1], rows[3:] + rows[:3]):
        batch = topics._batch("g", sources, shuffled, 10, holder, queues)
        assert batch.messages == in_order.messages and batch.positions == in_order.positions
        assert batch.cursors == in_order.cursors


def test_a_caught_up_consumer_acks_a_batch_with_the_pull_of_the_next_delivery(db_url: str, store: Store) -> None:
    """A batch that read every readable row is acked with the pull the next notification asks for (one round trip
    for both), not with an empty pull of its own; meanwhile its offset has not moved, and a crash then would hand
    it out again (at least once)."""
    first = store.send("t", {"n": 1})
    offsets: list[object] = []

    def second_delivery() -> None:
        time.sleep(0.5)  # the consumer is holding the first batch's ack by now
        offsets.append(store.conn.execute("SELECT count(*) FROM delaywheel.consumer_offsets").fetchone())
        store.send("t", {"n": 2})

    got: list[int] = []

    def handler(messages: list) -> None:
        got.extend(m.message_id for m in messages)
        if len(got) == 1:
            threading.Thread(target=second_delivery).start()

    with Store(db_url) as own:
        totals = own.consume("t", "g", handler, limit=2, duration_s=20, ack_hold_s=30, safety_wake_s=30)
    assert got[0] == first and len(got) == 2
    assert offsets == [(0,)]  # the group's first ack had not been written half a second after the handler
    assert totals.empty_pulls == 0 and totals.held_acks == 0 and totals.notified_wakes == 1
    assert len(store.pull("t", "g")) == 0  # both acked


HOLDER = topics.new_holder()


def _ack_and_pull(store: Store, done: topics.Batch | None, n: int = 2) -> tuple:
    return topics.ack_and_pull(store.conn, store.settings, store._cache, done, None, "t", "g", n, HOLDER)


def test_in_the_steady_state_the_ack_and_the_next_pull_are_one_round_trip(store: Store) -> None:
    """Every round trip costs the consumer and its server process a wake-up, and each waits for a CPU on a busy
    machine. With nothing failed, the ack, the take of the member's queues and the read are sent before the server's first
    answer and end in one Sync, so they are one implicit transaction (libpq's trace: no line from the server
    between the client's)."""
    ids = store.send_many([Message("t", {"n": i}) for i in range(6)])
    _, first = _ack_and_pull(store, None)  # takes the group's queues
    assert first.queues == tuple(range(topics.QUEUES))  # the only member: all of them
    result, second = _ack_and_pull(store, first)  # the group's first ack: its offset rows are written
    assert result.acked == 2
    (result, third), lines = traced(store.conn, lambda: _ack_and_pull(store, second))
    sides = [line[0] for line in lines]
    assert "B" in sides and "F" not in sides[sides.index("B") :], "the client waited for an answer in between"
    assert syncs(lines) == 1
    assert (result.acked, result.already_acked) == (2, 0)
    assert [m.message_id for b in (first, second, third) for m in b.messages] == ids


def _wal_syncs(conn: psycopg.Connection) -> int:
    """The cluster's WAL syncs so far, with this session's own counts flushed first (they are sent to the
    statistics at most once a second otherwise)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0])


def test_an_ack_that_rides_a_pull_does_not_wait_for_its_wal_flush(store: Store) -> None:
    """Beside busy loops a durable commit waits a scheduler tick, and the pull's rows come back only after its
    ack commits: an ack that travels with a pull commits asynchronously (a crash can undo it, and the batch is
    handed out again, as after a crash before the ack). `ack` on its own stays durable: one WAL sync per ack."""
    store.send_many([Message("t", {"n": i}) for i in range(61)])
    batch = store.pull("t", "g", 1)
    before = _wal_syncs(store.conn)
    for _ in range(30):
        store.ack(batch)
        batch = store.pull("t", "g", 1)
    durable = _wal_syncs(store.conn) - before
    store.release(batch)
    batch = _ack_and_pull(store, None, n=1)[1]
    before = _wal_syncs(store.conn)
    for _ in range(29):
        result, batch = _ack_and_pull(store, batch, n=1)
        assert result.acked == 1
    riding = _wal_syncs(store.conn) - before
    assert durable >= 30 and riding < 10, (durable, riding)
    topics.give_queues(store.conn, "g", "t", HOLDER)
    assert len(store.pull("t", "g")) == 2  # every ack took: only the last batch (and the one after it) left


def test_a_batch_acked_meanwhile_is_counted_and_not_handed_out_again(store: Store) -> None:
    """The one-trip pull reads before it learns whether its ack moved the offset. When it did not (another consumer
    of the group acked past the batch), that read is dropped and the ack takes the general path: the batch counts as
    already acked and the next pull starts after it."""
    ids = store.send_many([Message("t", {"n": i}) for i in range(6)])
    _, first = _ack_and_pull(store, None)
    _, second = _ack_and_pull(store, first)
    store.ack(second)  # by hand, as another consumer of the group would (gives the member's queues back)
    result, third = _ack_and_pull(store, second)
    assert (result.acked, result.already_acked) == (0, 2)
    assert [m.message_id for m in third.messages] == ids[4:]


@pytest.mark.parametrize("size", [0, -1, 2**31 - 1, 2**63 - 1, 2**63, True, 1.5])
def test_a_batch_size_out_of_range_is_refused_before_anything_is_read(store: Store, size: object) -> None:
    """The read adds one to the limit: 2**31-1 said "integer out of range" and 2**63-1 "bigint out of range"."""
    with pytest.raises(ValueError, match="max_messages must be a whole number from 1 to 1,000,000"):
        store.pull("t", "g", size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_messages must be a whole number"):
        store.consume("t", "g", lambda ms: None, max_messages=size)  # type: ignore[arg-type]
