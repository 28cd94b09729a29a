"""Where a group reads from (`consume/position.py`): a new group's start (earliest, latest, a time) and `seek` of an
existing group's offsets (backwards hands messages again, forwards skips them), in every queue of the topic, recorded
in `group_seeks`, taking turns with acks on the offsets' row locks, never undone by the ack of a batch read before
it, and never past the commit horizon."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from delaywheel import Message, Store
from delaywheel.cli import main
from delaywheel.consume import topics
from delaywheel.consume.position import UnknownOffset
from delaywheel.consume.topics import QUEUES, retry_topic
from delaywheel.produce.producer import send_for_store


def _send(store: Store, topic: str, n: int, first: int = 0) -> list[int]:
    """`n` messages sent one by one (each its own transaction: read order is send order)."""
    return [store.send(topic, {"n": i}) for i in range(first, first + n)]


def _ids(batch: Any) -> list[int]:
    return [m.message_id for m in batch.messages]


def _drain(store: Store, topic: str, group: str, **options: Any) -> list[int]:
    batch = store.pull(topic, group, 1000, **options)
    store.ack(batch)
    return _ids(batch)


def _offset(store: Store, group: str, topic: str) -> list[tuple[str, int]] | None:
    """The group's offset in each queue of the topic, in queue order; None: it has none."""
    rows = store.conn.execute(
        "SELECT cursor_xid::text, cursor_offset FROM delaywheel.consumer_offsets WHERE grp = %s AND topic = %s"
        " ORDER BY qid",
        (group, topic),
    ).fetchall()
    assert len(rows) in (0, QUEUES)  # every queue's, or none
    return [tuple(r) for r in rows] or None  # type: ignore[misc]


def _seeks(store: Store) -> list[tuple[Any, ...]]:
    """Each seek recorded: group, topic, target, by, every queue's from (in queue order) and the one to."""
    rows = store.conn.execute(
        "SELECT grp, topic, target, sought_by, array_agg(ARRAY[from_xid::text, from_offset::text] ORDER BY qid),"
        " array_agg(DISTINCT ARRAY[to_xid::text, to_offset::text]), array_agg(qid ORDER BY qid)"
        " FROM delaywheel.group_seeks GROUP BY grp, topic, target, sought_by, sought_at ORDER BY min(id)"
    ).fetchall()
    seeks = []
    for grp, topic, target, by, froms, (to,), qids in rows:
        assert qids == list(range(QUEUES))  # a row per queue
        seeks.append((grp, topic, target, by, [(x, int(o)) for x, o in froms], (to[0], int(to[1]))))
    return seeks


# -- a new group's start ------------------------------------------------------------------------------------------


def test_a_new_group_started_at_latest_reads_only_what_comes_after(store: Store) -> None:
    before = _send(store, "orders", 3)
    assert _drain(store, "orders", "new", start="latest") == []
    after = _send(store, "orders", 2, 3)
    assert _drain(store, "orders", "new", start="latest") == after
    assert _drain(store, "orders", "old") == before + after  # the default: earliest kept


def test_a_new_group_started_at_a_time_reads_from_the_first_message_delivered_then(store: Store) -> None:
    _send(store, "orders", 3)
    at = store.clock()
    later = _send(store, "orders", 2, 3)
    assert _drain(store, "orders", "g", start=at) == later
    quiet = store.clock()  # nothing delivered since: the group starts at the end
    assert _drain(store, "orders", "h", start=quiet) == []
    assert _drain(store, "orders", "h", start=quiet) == []
    assert _drain(store, "orders", "h") == []


def test_start_changes_nothing_for_a_group_with_an_offset(store: Store) -> None:
    first = _send(store, "orders", 2)
    batch = store.pull("orders", "g", 1)
    store.ack(batch)
    assert _ids(batch) == first[:1]
    rest = _send(store, "orders", 2, 2)
    assert _drain(store, "orders", "g", start="latest") == first[1:] + rest


def test_the_consumer_starts_a_new_group_at_its_start(db_url: str, store: Store) -> None:
    _send(store, "orders", 3)
    handed: list[int] = []
    later: list[int] = []

    def send_later() -> None:
        time.sleep(0.5)
        with Store(db_url) as producer:
            later.extend(_send(producer, "orders", 2, 3))

    sender = threading.Thread(target=send_later)
    sender.start()
    with Store(db_url) as own:
        own.consume("orders", "g", lambda ms: handed.extend(m.message_id for m in ms), start="latest", idle_s=2.0)
    sender.join()
    assert handed == later


def test_a_start_and_a_seek_set_every_queue_of_the_topic(store: Store) -> None:
    """A position of the topic is every queue's: a group started at latest or at a time, or sought back, reads each
    queue from there, whatever queue a message's key puts it in."""

    def send(first: int) -> list[int]:
        return store.send_many([Message("orders", {"n": i}, key=f"key-{i}") for i in range(first, first + 128)])

    early = send(0)
    queues = store.conn.execute("SELECT count(DISTINCT qid) FROM delaywheel.topic_messages").fetchone()
    assert queues == (QUEUES,)  # the keys spread over every queue
    assert _drain(store, "orders", "late", start="latest") == []
    started = _offset(store, "late", "orders")
    assert started is not None and len(set(started)) == 1 and started[0] != ("0", 0)
    at = store.clock()
    later = send(128)
    assert _drain(store, "orders", "late") == later
    assert _drain(store, "orders", "timed", start=at) == later
    assert _drain(store, "orders", "g") == early + later
    store.seek("orders", "g", to="earliest")
    assert _offset(store, "g", "orders") == [("0", 0)] * QUEUES
    assert _drain(store, "orders", "g") == early + later
    store.seek("orders", "g", to_time=at)
    sought = _offset(store, "g", "orders")
    assert sought is not None and len(set(sought)) == 1
    assert _drain(store, "orders", "g") == later


@pytest.mark.parametrize(
    ("start", "error"),
    [
        ("newest", "start must be"),
        (None, "start must be"),
        (datetime(2030, 1, 1), "start must be"),  # no time zone
        ("2030-01-01T00:00:00+00:00", "start must be"),  # text: the CLI and the operator read it
    ],
)
def test_a_bad_start_is_refused_before_anything_is_written(store: Store, start: Any, error: str) -> None:
    _send(store, "orders", 1)
    with pytest.raises(ValueError, match=error):
        store.pull("orders", "g", start=start)
    with pytest.raises(ValueError, match=error):
        store.consume("orders", "g", lambda _: None, start=start, idle_s=0.1)
    assert _offset(store, "g", "orders") is None


def test_a_start_ahead_of_the_clock_is_refused(store: Store) -> None:
    _send(store, "orders", 1)
    with pytest.raises(ValueError, match="ahead of the database's clock"):
        store.pull("orders", "g", start=store.clock() + timedelta(hours=1))
    with pytest.raises(ValueError, match="ahead of the database's clock"):
        store.consume("orders", "g", lambda _: None, start=store.clock() + timedelta(hours=1), idle_s=0.1)
    assert _offset(store, "g", "orders") is None


# -- seek -----------------------------------------------------------------------------------------------------------


def test_seek_back_hands_messages_again_and_is_recorded(store: Store) -> None:
    first = _send(store, "orders", 3)
    at = store.clock()
    later = _send(store, "orders", 3, 3)
    assert _drain(store, "orders", "g") == first + later
    end = _offset(store, "g", "orders")

    seeked = store.seek("orders", "g", to_time=at, by="ops: replay after the bug fix")
    assert _drain(store, "orders", "g") == later
    assert store.seek("orders", "g", to="earliest").moves[0][1].xid == 0
    assert _drain(store, "orders", "g") == first + later

    user = store.conn.execute("SELECT current_user::text").fetchone()
    assert end is not None and user is not None
    rows = _seeks(store)
    assert [r[:4] for r in rows] == [
        ("g", "orders", f"time {at.isoformat()}", "ops: replay after the bug fix"),
        ("g", "orders", "earliest", user[0]),  # by default: the database role
    ]
    assert rows[0][4] == end and rows[1][5] == ("0", 0)
    assert [(str(b.xid), b.offset) for b, _ in seeked.moves] == end and seeked.by == "ops: replay after the bug fix"
    assert len({a for _, a in seeked.moves}) == 1  # every queue to the one position
    assert seeked.as_dict()["moves"] == [
        {
            "queue": qid,
            "from": {"xid": before.xid, "queue_offset": before.offset},
            "to": {"xid": after.xid, "queue_offset": after.offset},
        }
        for qid, (before, after) in enumerate(seeked.moves)
    ]


def test_seek_forward_skips_messages(store: Store) -> None:
    ids = _send(store, "orders", 6)
    batch = store.pull("orders", "g", 1)
    store.ack(batch)
    offsets = {m.message_id: m.queue_offset for m in store.pull("orders", "other", 10).messages}
    store.seek("orders", "g", to_offset=offsets[ids[4]])
    assert _drain(store, "orders", "g") == ids[4:]
    store.seek("orders", "g", to_offset=offsets[ids[2]])  # back again, by offset
    assert _drain(store, "orders", "g") == ids[2:]
    store.seek("orders", "g", to_offset=offsets[ids[5]] + 1000)  # past every row: the end
    assert _drain(store, "orders", "g") == []
    store.seek("orders", "g", to="earliest")
    store.seek("orders", "g", to="latest")
    assert _drain(store, "orders", "g") == []
    more = _send(store, "orders", 2, 6)
    assert _drain(store, "orders", "g") == more
    assert len(_seeks(store)) == 5


def test_seek_moves_the_topic_not_the_groups_retry_topic(store: Store) -> None:
    """The retry topic holds the group's own failures: a seek of the topic neither hands them again nor drops them;
    the retry topic is sought by its own name."""
    ids = _send(store, "orders", 2)
    send_for_store(store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"retry": 1})], [1])
    batch = store.pull("orders", "g")
    assert len(batch) == 3
    store.ack(batch)
    retry_offset = _offset(store, "g", retry_topic("g"))
    store.seek("orders", "g", to="earliest")
    assert _offset(store, "g", retry_topic("g")) == retry_offset
    assert _drain(store, "orders", "g") == ids
    store.seek(retry_topic("g"), "g", to="earliest")
    assert [m.body for m in store.pull("orders", "g").messages] == [{"retry": 1}]


def test_seek_never_passes_a_transaction_that_may_still_commit(db_url: str, store: Store) -> None:
    """A seek or start to `latest` (or a time) stops at the commit horizon: a delivery still being written when it
    ran is read once it commits, though rows committed after it were readable at the seek."""
    first = _send(store, "orders", 1)
    assert _drain(store, "orders", "g") == first
    with Store(db_url) as producer:
        with producer.conn.transaction():
            held = producer.send("orders", {"n": "held"})  # a topic row, not committed yet
            after = _send(store, "orders", 1, 1)  # committed, above the horizon the open one holds
            store.seek("orders", "g", to="latest")
            assert store.pull("orders", "new", start="latest").messages == []
            store.seek("orders", "g", to_time=store.clock())
        assert _drain(store, "orders", "g") == [held, *after]
        assert _drain(store, "orders", "new") == [held, *after]


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ({}, "exactly one of"),
        ({"to": "earliest", "to_offset": 3}, "exactly one of"),
        ({"to": "oldest"}, "to must be"),
        ({"to_offset": -1}, "to_offset must be"),
        ({"to_offset": True}, "to_offset must be"),
        ({"to_offset": "3"}, "to_offset must be"),
        ({"to_time": datetime(2030, 1, 1)}, "time zone"),
        ({"to_time": "2030-01-01T00:00:00+00:00"}, "time zone"),
        ({"to": "earliest", "by": ""}, "by must be"),
        ({"to": "earliest", "by": "x" * 201}, "by must be"),
        ({"to": "earliest", "by": "a\x00b"}, "by must be"),
    ],
)
def test_a_bad_seek_is_refused_and_writes_nothing(store: Store, target: dict[str, Any], error: str) -> None:
    _send(store, "orders", 1)
    store.ack(store.pull("orders", "g", 1))
    before = _offset(store, "g", "orders")
    with pytest.raises(ValueError, match=error):
        store.seek("orders", "g", **target)
    assert _offset(store, "g", "orders") == before and _seeks(store) == []


def test_a_seek_ahead_of_the_clock_is_refused(store: Store) -> None:
    _send(store, "orders", 1)
    store.ack(store.pull("orders", "g"))
    with pytest.raises(ValueError, match="ahead of the database's clock"):
        store.seek("orders", "g", to_time=store.clock() + timedelta(minutes=5))
    assert _seeks(store) == []


def test_an_unknown_group_or_topic_is_refused_with_the_reason(store: Store) -> None:
    _send(store, "orders", 1)
    _send(store, "payments", 1)
    with pytest.raises(UnknownOffset, match="the group is unknown"):
        store.seek("orders", "nobody", to="earliest")
    store.ack(store.pull("orders", "g"))
    with pytest.raises(UnknownOffset, match=r"acked none of it yet \(its topics: orders\)"):
        store.seek("payments", "g", to="earliest")
    with pytest.raises(UnknownOffset, match="the topic is unknown"):
        store.seek("nothing", "g", to="latest")
    with pytest.raises(ValueError, match="group"):
        store.seek("orders", "bad group", to="latest")
    with pytest.raises(ValueError, match="topic"):
        store.seek("bad topic", "g", to="latest")
    assert _seeks(store) == []


# -- seeks and acks take turns ---------------------------------------------------------------------------------------


def _waiting_for_a_lock(store: Store, pid: int) -> bool:
    row = store.conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # seen by the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_blocked(store: Store, other: Store, thread: threading.Thread, out: list[Any]) -> None:
    pid = other.conn.info.backend_pid
    deadline = time.monotonic() + 20
    while not _waiting_for_a_lock(store, pid):
        assert thread.is_alive() and time.monotonic() < deadline, f"the second one did not wait for the lock: {out}"
        time.sleep(0.02)


def test_a_seek_waits_for_an_ack_in_progress_and_moves_from_where_it_left(db_url: str, store: Store) -> None:
    ids = _send(store, "orders", 6)
    with Store(db_url) as consumer, Store(db_url) as operator:
        consumer.ack(consumer.pull("orders", "g", 3))
        batch = consumer.pull("orders", "g", 3)
        operator.conn  # noqa: B018  # connected first: its pid is what the wait is looked up by
        with consumer.conn.transaction():
            assert consumer.ack(batch).acked == 3  # the offset's row stays locked until this commits
            thread, out = _in_thread(lambda: operator.seek("orders", "g", to="earliest", by="rewind"))
            _wait_blocked(store, operator, thread, out)
        thread.join(20)
        acked_to = _offset(store, "g", "orders")
        seeked = out[0]
        assert not isinstance(seeked, BaseException), seeked
        assert acked_to == [("0", 0)] * QUEUES
        before, _ = seeked.moves[batch.qids[-1]]
        assert before.offset == batch.messages[-1].queue_offset  # from where the ack left it, not where it began
    assert _drain(store, "orders", "g") == ids


def test_a_seek_in_a_lock_cycle_with_an_ack_gives_way_and_the_ack_goes_on(db_url: str, store: Store) -> None:
    """Acks lock a group's offset rows in no fixed order; a seek locks all of them. When an ack holding one row asks
    for one the seek holds (a cycle), the seek's bounded wait runs out first: it lets go and tries again, and the ack
    is never the one the deadlock detector cancels."""
    ids = _send(store, "orders", 3)
    assert _drain(store, "orders", "g") == ids
    lock = "SELECT FROM delaywheel.consumer_offsets WHERE grp = 'g' AND topic = 'orders' AND qid = %s FOR UPDATE"
    deadlock = store.conn.execute("SELECT current_setting('deadlock_timeout')").fetchone()
    assert deadlock == ("1s",)  # the server's default, which the seek's wait stays below
    with Store(db_url) as acker, Store(db_url) as operator:
        operator.conn  # noqa: B018
        with acker.conn.transaction():
            acker.conn.execute(lock, (5,))
            thread, out = _in_thread(lambda: operator.seek("orders", "g", to="earliest", by="cycle"))
            _wait_blocked(store, operator, thread, out)  # holding queues 0-4, waiting for 5
            started = time.monotonic()
            acker.conn.execute(lock, (2,))  # a cycle: the seek gives way
            assert time.monotonic() - started < 0.9  # before the deadlock detector would look
            time.sleep(0.6)  # the seek tries again meanwhile, and waits
            assert thread.is_alive()
        thread.join(20)
    assert not isinstance(out[0], BaseException), out[0]
    assert _offset(store, "g", "orders") == [("0", 0)] * QUEUES
    assert _drain(store, "orders", "g") == ids


def test_an_ack_waits_for_a_seek_in_progress_and_does_not_undo_a_skip(db_url: str, store: Store) -> None:
    ids = _send(store, "orders", 6)
    with Store(db_url) as consumer, Store(db_url) as operator:
        consumer.ack(consumer.pull("orders", "g", 2))
        batch = consumer.pull("orders", "g", 2)
        consumer.conn  # noqa: B018
        with operator.conn.transaction():
            operator.seek("orders", "g", to_offset=batch.messages[-1].queue_offset + 1, by="skip")
            thread, out = _in_thread(lambda: consumer.ack(batch))
            _wait_blocked(store, consumer, thread, out)
        thread.join(20)
        assert (out[0].acked, out[0].sought) == (0, 2)  # the seek passed the batch: its ack moves nothing
    assert _drain(store, "orders", "g") == ids[4:]


def test_an_ack_after_a_rewind_moves_nothing_and_the_batch_comes_again(db_url: str, store: Store) -> None:
    """A batch pulled before a rewind and acked after it moves no offset (`AckResult.sought`), nor retries its
    failures: the group reads on from the rewind, the batch's own messages among them."""
    ids = _send(store, "orders", 6)
    with Store(db_url) as consumer, Store(db_url) as operator:
        consumer.ack(consumer.pull("orders", "g", 2))
        batch = consumer.pull("orders", "g", 2)
        consumer.conn  # noqa: B018
        with operator.conn.transaction():
            operator.seek("orders", "g", to="earliest")
            thread, out = _in_thread(lambda: consumer.ack(batch, failed={batch.messages[0].message_id}))
            _wait_blocked(store, consumer, thread, out)
        thread.join(20)
        assert (out[0].acked, out[0].retried, out[0].sought) == (0, 0, 2)
    assert _drain(store, "orders", "g") == ids
    assert _drain(store, retry_topic("g"), "g") == []  # nothing was retried


def test_a_consumer_loop_whose_batch_a_rewind_overtook_reads_from_the_rewind(store: Store) -> None:
    """The loop's ack travels with its next pull (`ack_and_pull`, one round trip): after a rewind it moves nothing,
    and the pull that goes with it reads from where the seek put the group, in every queue."""
    ids = store.send_many([Message("orders", {"n": i}, key=f"k{i}") for i in range(40)])
    holder = topics.new_holder()

    def ack_and_pull(done: topics.Batch | None, n: int) -> tuple[topics.AckResult, topics.Batch]:
        return topics.ack_and_pull(store.conn, store.settings, store._cache, done, None, "orders", "g", n, holder)

    _, batch = ack_and_pull(None, 30)
    result, batch = ack_and_pull(batch, 5)  # the first 30 acked
    assert result.acked == 30
    store.seek("orders", "g", to="earliest")
    result, again = ack_and_pull(batch, 100)
    assert (result.acked, result.sought) == (0, 5)
    assert sorted(m.message_id for m in again.messages) == sorted(ids)
    result, rest = ack_and_pull(again, 100)
    assert (result.acked, result.sought, rest.messages) == (40, 0, [])
    topics.give_queues(store.conn, "g", "orders", holder)


# -- a model -------------------------------------------------------------------------------------------------------

Step = tuple[str, int]


@hsettings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["send", "pull", "pull_no_ack", "earliest", "latest", "offset", "time"]), st.integers(0, 6)
        ),
        max_size=25,
    )
)
def test_pulls_acks_and_seeks_match_a_model(store: Store, steps: list[Step]) -> None:
    """One producer, one consumer, seeks in between: the group reads from a cursor into the topic's messages, as a
    list and an index would. A seek by offset or time to message k puts the cursor at k (past the end: at the end)."""
    topic, group = f"t{uuid.uuid4().hex[:8]}", "g"
    sent: list[Any] = []  # (message_id, queue_offset, delivered_at), in read order
    cursor = 0
    acked = False  # the group has an offset row (a seek needs one)
    for op, n in steps:
        if op == "send":
            for i in range(n):
                store.send(topic, {"n": i})
            rows = store.conn.execute(
                "SELECT message_id, queue_offset, delivered_at FROM delaywheel.topic_messages WHERE topic = %s"
                " ORDER BY xid, queue_offset",
                (topic,),
            ).fetchall()
            sent = [tuple(r) for r in rows]
        elif op in ("pull", "pull_no_ack"):
            batch = store.pull(topic, group, max(n, 1))
            want = sent[cursor : cursor + max(n, 1)]
            assert _ids(batch) == [m[0] for m in want]
            if op == "pull" and batch:
                store.ack(batch)
                cursor += len(want)
                acked = True
            else:
                store.release(batch)
        elif not acked:
            with pytest.raises(UnknownOffset):
                store.seek(topic, group, to="latest")
        elif op in ("earliest", "latest"):
            store.seek(topic, group, to=op)
            cursor = 0 if op == "earliest" else len(sent)
        elif n < len(sent):
            if op == "offset":
                store.seek(topic, group, to_offset=sent[n][1])
            else:
                store.seek(topic, group, to_time=sent[n][2])
            cursor = n
        else:
            store.seek(topic, group, to_offset=(sent[-1][1] + 1) if sent else 0)
            cursor = len(sent)
    assert _ids(store.pull(topic, group, 1000)) == [m[0] for m in sent[cursor:]]


# -- the command line ------------------------------------------------------------------------------------------------


def test_the_cli_seeks_and_says_what_moved(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    ids = _send(store, "orders", 3)
    assert _drain(store, "orders", "g") == ids
    assert main(["seek", "orders", "g", "--to-earliest", "--by", "ops: rewind", "--json"]) == 0
    seeked = json.loads(capsys.readouterr().out)
    assert len(seeked["moves"]) == QUEUES
    assert (seeked["target"], seeked["by"], seeked["moves"][0]["to"]) == (
        "earliest",
        "ops: rewind",
        {"xid": 0, "queue_offset": 0},
    )
    assert main(["pull", "--topic", "orders", "--group", "g", "--json"]) == 0
    assert [m["message_id"] for m in json.loads(capsys.readouterr().out)] == ids
    assert main(["seek", "orders", "g", "--to-time", store.clock().isoformat()]) == 0
    assert "moved to time" in capsys.readouterr().out
    assert main(["pull", "--topic", "orders", "--group", "g"]) == 0
    assert "0 message(s)" in capsys.readouterr().out
    assert main(["seek", "orders", "nobody", "--to-latest"]) == 2
    assert "the group is unknown" in capsys.readouterr().err
    for argv in (["seek", "orders", "g"], ["seek", "orders", "g", "--to-time", "2030-01-01T00:00:00"]):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2
    assert main(["pull", "--topic", "orders", "--group", "h", "--start", "latest", "--ack"]) == 0
    assert "0 message(s)" in capsys.readouterr().out
    assert len(_seeks(store)) == 2
