"""Sending: ids, level 0, clamping, every rejection (with nothing written), body round trips."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import hypothesis
import pytest

from delaywheel import Settings, Store
from delaywheel.deliver.runner import listen_channels
from delaywheel.produce.validation import InvalidMessage, Message
from tests.helpers import at, batches, deliveries, fresh_database, table_counts, wait_for_lock

EMPTY = {"level_queue": 0, "wheel": 0, "wheel_far": 0, "topic_messages": 0, "cancellations": 0}


def test_send_and_send_many_return_ids_in_order(store: Store, t0: datetime) -> None:
    one = store.send("orders", {"n": 0}, delay_level=1, now=t0)
    many = store.send_many(
        [Message("orders", {"n": i}, delay_level=1 + i % 3) for i in range(5)]
        + [Message("orders", b"w", delay=timedelta(seconds=3)), Message("orders", b"d")],
        now=t0,
    )
    assert len(many) == 7 and len(set(many)) == 7 and one not in many
    assert many == sorted(many) and one < many[0]
    queued = dict(store.conn.execute("SELECT id, level FROM delaywheel.level_queue").fetchall())
    assert queued == {one: 1, **{mid: 1 + i % 3 for i, mid in enumerate(many[:5])}}
    assert table_counts(store)["topic_messages"] == 1  # the level-0 one
    assert store.send_many([], now=t0) == []


def test_a_first_batch_imports_nothing_inside_its_transaction(db_url: str) -> None:
    """A new producer's first send_many, inside the caller's transaction, runs no import: pyarrow's one-time pandas
    import (about half a second) happens when the columns module loads, before send_many opens its transaction."""
    script = f"""
import sys
from delaywheel import Store
from delaywheel.produce import arrow_copy, columns
from delaywheel.produce.validation import Message
with Store({db_url!r}) as store, store.conn.transaction():
    loaded = set(sys.modules)
    store.send_many([Message("orders", {{"n": i}}, delay=10 + i) for i in range(3)])
    print(sorted(set(sys.modules) - loaded))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_level_zero_delivers_immediately(store: Store, t0: datetime) -> None:
    mid = store.send("orders", {"paid": True}, now=t0)
    mid0 = store.send("orders", {"paid": False}, delay_level=0, now=t0)
    assert deliveries(store, "orders") == [(mid, t0, t0, "orders"), (mid0, t0, t0, "orders")]
    assert [m.message_id for m in store.pull("orders", "g").messages] == [mid, mid0]
    assert table_counts(store)["level_queue"] == 0


def test_level_above_maximum_is_clamped_and_recorded(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"x", delay_level=25, now=t0)
    row = store.conn.execute(
        "SELECT level, requested_level, deliver_at FROM delaywheel.level_queue WHERE id = %s", (mid,)
    ).fetchone()
    assert row == (18, 25, t0 + timedelta(hours=2))
    assert store.deliver_level(18, now=at(t0, 7199.999)).delivered == 0
    assert store.deliver_level(18, now=at(t0, 7200)).delivered == 1
    assert [d[0] for d in deliveries(store)] == [mid]


def test_time_in_the_past_within_tolerance_delivers_at_once(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"late", deliver_at=t0 - timedelta(hours=3), now=t0)
    assert [d[0] for d in deliveries(store)] == [mid]


def test_delay_in_milliseconds_and_timedelta(store: Store, t0: datetime) -> None:
    a = store.send("orders", b"a", delay=1500, now=t0)
    b = store.send("orders", b"b", delay=timedelta(minutes=2), now=t0)
    assert store.advance_wheel(now=at(t0, 1.499)).delivered == 0
    assert store.advance_wheel(now=at(t0, 1.5)).delivered == 1
    assert store.advance_wheel(now=at(t0, 120)).delivered == 1
    assert [(d[0], d[1]) for d in deliveries(store)] == [(a, at(t0, 1.5)), (b, at(t0, 120))]


def test_limits_are_inclusive(store: Store, t0: datetime) -> None:
    limit = Settings().wheel_max_delay
    store.send("orders", b"x", delay=limit, now=t0)
    store.send("orders", b"x", deliver_at=t0 - Settings().past_tolerance, now=t0)
    assert table_counts(store)["wheel_far"] + table_counts(store)["wheel"] == 1
    assert table_counts(store)["topic_messages"] == 1


def _rejections(t0: datetime) -> list[tuple[str, dict[str, Any]]]:
    naive = datetime(2030, 1, 1, 0, 0, 5)
    return [
        ("bad_level", {"delay_level": -1}),
        ("bad_level", {"delay_level": 1.5}),
        ("bad_level", {"delay_level": "2"}),
        ("bad_level", {"delay_level": True}),
        ("bad_level", {"delay_level": False}),
        ("bad_topic", {"topic": ""}),
        ("bad_topic", {"topic": "has space"}),
        ("bad_topic", {"topic": "a" * 128}),
        ("bad_topic", {"topic": "tópico"}),
        ("bad_topic", {"topic": "semi;colon"}),
        ("bad_topic", {"topic": None}),
        ("body_too_large", {"body": b"x" * 65}),
        ("body_too_large", {"body": "y" * 63}),  # 63 chars + 2 quotes as JSON
        ("bad_body", {"body": {1, 2}}),
        ("bad_body", {"body": object()}),
        ("bad_body", {"body": {"x": float("nan")}}),
        ("naive_deliver_at", {"deliver_at": naive}),
        ("bad_deliver_at", {"deliver_at": "2030-01-01T00:00:05+00:00"}),
        ("bad_delay", {"delay": float("nan")}),
        ("bad_delay", {"delay": float("inf")}),
        ("bad_delay", {"delay": -1}),
        ("bad_delay", {"delay": timedelta(seconds=-1)}),
        ("bad_delay", {"delay": "5s"}),
        ("bad_delay", {"delay": True}),
        ("too_far", {"delay": timedelta(days=365, milliseconds=1)}),
        ("too_far", {"deliver_at": t0 + timedelta(days=366)}),
        ("too_far", {"delay": 1e18}),  # beyond what a timedelta can hold
        ("too_far", {"delay": timedelta(days=4_000_000)}),  # beyond what a datetime can hold
        ("bad_level", {"delay_level": 2**40}),  # too large to store, not merely above the table
        ("too_old", {"deliver_at": t0 - timedelta(days=1, seconds=1)}),
        ("conflicting_delay", {"delay_level": 3, "deliver_at": t0 + timedelta(minutes=1)}),
        ("conflicting_delay", {"delay_level": 3, "delay": 1000}),
        ("conflicting_delay", {"delay": 1000, "deliver_at": t0 + timedelta(minutes=1)}),
        ("bad_key", {"key": ""}),
        ("bad_key", {"key": 42}),
        ("bad_properties", {"properties": {"a": 1}}),
        ("bad_tags", {"tags": ["a"]}),
    ]


def test_every_rejection_names_its_reason_and_writes_nothing(db_url: str, t0: datetime) -> None:
    with Store(db_url, Settings(max_body_bytes=64)) as store:
        store.send("warmup", b"x" * 64, delay_level=1, now=t0)  # exactly the limit is fine
        store.conn.execute("TRUNCATE delaywheel.level_segments")
        for reason, override in _rejections(t0):
            args: dict[str, Any] = {"topic": "orders", "body": {"ok": 1}, **override}
            topic, body = args.pop("topic"), args.pop("body")
            with pytest.raises(InvalidMessage) as info:
                store.send(topic, body, now=t0, **args)
            assert info.value.reason == reason, (override, info.value.reason, str(info.value))
            assert str(info.value)  # a sentence a person can act on
            assert table_counts(store) == EMPTY, override


def test_send_many_with_one_bad_message_writes_nothing(store: Store, t0: datetime) -> None:
    good = [
        Message("orders", {"n": 1}),
        Message("orders", {"n": 2}, delay_level=2),
        Message("orders", {"n": 3}, delay=timedelta(seconds=30)),
        Message("orders", {"n": 4}, delay=timedelta(days=200)),
    ]
    for bad in (
        Message("orders", {"n": 5}, delay_level=-3),
        Message("bad topic", {}),
        Message("orders", {}, deliver_at=datetime(2030, 1, 1)),
    ):
        with pytest.raises(InvalidMessage):
            store.send_many([*good[:2], bad, *good[2:]], now=t0)
        assert table_counts(store) == EMPTY
    assert len(store.send_many(good, now=t0)) == 4
    assert sum(table_counts(store).values()) == 4


BODIES: list[Any] = [
    b"",
    b"\x00\xffbinary\x80",
    {"order": 42, "items": [1, 2, {"x": None}]},
    "text é ✓",
    12.5,
    [],
    None,
]


def test_bodies_round_trip_through_pull(store: Store, t0: datetime) -> None:
    ids = [store.send("bodies", body, delay_level=1 if i % 2 else 0, now=t0) for i, body in enumerate(BODIES)]
    store.deliver_level(1, now=at(t0, 1))
    batch = store.pull("bodies", "g", 100)
    got = {m.message_id: m.body for m in batch.messages}
    assert got == dict(zip(ids, BODIES, strict=True))
    assert isinstance(got[ids[1]], bytes)


def test_properties_tags_and_key_are_kept(store: Store, t0: datetime) -> None:
    mid = store.send(
        "orders",
        b"x",
        delay=timedelta(seconds=2),
        key="order-42",
        tags="timeout",
        properties={"tenant": "acme"},
        now=t0,
    )
    store.advance_wheel(now=at(t0, 2))
    (m,) = store.pull("orders", "g").messages
    assert (m.message_id, m.key, m.tags, m.properties, m.topic) == (
        mid,
        "order-42",
        "timeout",
        {"tenant": "acme"},
        "orders",
    )
    assert m.deliver_at == at(t0, 2) and m.delivered_at == at(t0, 2)


def test_aware_datetime_in_any_zone(store: Store, t0: datetime) -> None:
    plus2 = timezone(timedelta(hours=2))
    mid = store.send("orders", b"x", deliver_at=(t0 + timedelta(seconds=10)).astimezone(plus2), now=t0)
    assert store.advance_wheel(now=at(t0, 9.9)).delivered == 0
    assert store.advance_wheel(now=at(t0, 10)).delivered == 1
    assert deliveries(store)[0][:2] == (mid, at(t0, 10))


# A single send is one statement (delaywheel.send_one, migrations/019) instead of send_many's batch path: the same rules,
# the same rows, the same notifications, the same deliveries.

ONE_BY_ONE: list[Message] = [
    Message("orders", {"n": 1}),  # level 0: straight into the topic
    Message("orders", b"\x00bin", delay_level=0, key="k0", tags="t", properties={"a": "1"}),
    Message("orders", "late", deliver_at=datetime(2029, 12, 31, 23, 0, tzinfo=UTC)),  # past: direct
    Message("orders", {"lvl": 3}, delay_level=3, key="order-1", tags="timeout", properties={"tenant": "acme"}),
    Message("orders", b"clamped", delay_level=40),
    Message("timers", b"near", delay=1500, key="t-1"),
    Message(
        "timers", {"at": 1}, deliver_at=datetime(2030, 1, 1, 0, 0, 7, 250_000, tzinfo=timezone(timedelta(hours=3)))
    ),
    Message("timers", b"far", delay=timedelta(days=10, microseconds=7), key="far-1", properties={"x": "é"}),
    Message("timers", None, delay=timedelta(0)),  # a zero delay: direct
]

_ROWS = {  # every stored column but xid (transaction ids are the cluster's)
    "level_segments": "id_first, level, requested_level, reconsume_times, deliver_at, enqueued_at, id_last, n, ids,"
    " topics, keys, tags, properties, bodies, is_json, key_bloom",
    "wheel": "id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at",
    "wheel_far_segments": "id_first, id_last, block, enqueued_at, n, ids, deliver_ats, keys, bodies, topics, tags,"
    " properties, is_json, key_bloom",
    "topic_messages": "message_id, queue_offset, topic, origin, level, key, tags, properties, body, is_json,"
    " reconsume_times, deliver_at, delivered_at",
}


def _stored(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    return {
        table: store.conn.execute(f"SELECT {cols} FROM delaywheel.{table} ORDER BY 1").fetchall()
        for table, cols in _ROWS.items()
    }


def _drain(listener: Any) -> list[Any]:
    """The notifications the listening connection has received (none arrives later than this short wait)."""
    return list(listener.notifies(timeout=0.3))


@pytest.fixture
def twin_url(server_url: str, template_db: str) -> Iterator[str]:
    """A second fresh database from the same template: its ids and offsets start where db_url's do."""
    with fresh_database(server_url, template_db) as url:
        yield url


def test_a_single_send_stores_and_delivers_what_send_many_does(db_url: str, twin_url: str, t0: datetime) -> None:
    import psycopg

    stores = Store(db_url), Store(twin_url)
    listeners = [psycopg.connect(u, autocommit=True) for u in (db_url, twin_url)]
    try:
        for listener in listeners:  # every lane's announcements, and the channel of producers that do not say one
            for channel in [*listen_channels([*range(1, 19), None]), "delaywheel_topic"]:
                listener.execute(f'LISTEN "{channel}"')
        single, batch = stores
        for m in ONE_BY_ONE:
            assert (
                single.send(
                    m.topic,
                    m.body,
                    delay_level=m.delay_level,
                    delay=m.delay,
                    deliver_at=m.deliver_at,
                    key=m.key,
                    tags=m.tags,
                    properties=m.properties,
                    now=t0,
                )
                == batch.send_many([m], now=t0)[0]
            )
        assert _stored(single) == _stored(batch)
        assert all(_stored(single).values())  # every lane was written
        announced = [(n.channel, n.payload) for n in _drain(listeners[0])]
        assert announced == [(n.channel, n.payload) for n in _drain(listeners[1])]
        # each on its lane's channel (migrations/022 and channels.lane_channel agree), none on the any-lane one
        assert {channel for channel, _ in announced} >= {"delaywheel_enqueue_wheel", "delaywheel_topic"}
        assert any(channel.removeprefix("delaywheel_enqueue_").isdigit() for channel, _ in announced)
        assert "delaywheel_enqueue" not in {channel for channel, _ in announced}
        for store in stores:  # the same passes over the same rows
            store.prepare(now=at(t0, 10 * 86400))  # rolls the far block into the near wheel
            store.deliver_due(now=at(t0, 11 * 86400))
        assert len(_stored(single)["topic_messages"]) == len(ONE_BY_ONE)
        assert _stored(single)["topic_messages"] == _stored(batch)["topic_messages"]
        assert deliveries(single) == deliveries(batch)
        assert [(m.message_id, m.body, m.key, m.tags, m.properties) for m in single.pull("timers", "g").messages] == [
            (m.message_id, m.body, m.key, m.tags, m.properties) for m in batch.pull("timers", "g").messages
        ]
    finally:
        for listener in listeners:
            listener.close()
        for store in stores:
            store.close()


def test_a_single_send_on_the_database_clock(store: Store) -> None:
    """Without now=, the database's clock places the message: a delay after it, an absolute time against it."""
    before = store.clock()
    near = store.send("timers", b"x", delay=timedelta(seconds=30))
    level = store.send("orders", b"y", delay_level=2)
    soon = store.send("timers", b"z", deliver_at=before + timedelta(minutes=5))
    past = store.send("timers", b"p", deliver_at=before - timedelta(minutes=5))
    far = store.send("timers", b"f", deliver_at=before + timedelta(days=30))
    after = store.clock()
    ((due, enqueued),) = store.conn.execute(
        "SELECT deliver_at, enqueued_at FROM delaywheel.wheel WHERE id = %s", (near,)
    ).fetchall()
    assert before <= enqueued <= after and due == enqueued + timedelta(seconds=30)
    ((due, enqueued),) = store.conn.execute(
        "SELECT deliver_at, enqueued_at FROM delaywheel.level_queue WHERE id = %s", (level,)
    ).fetchall()
    assert due == enqueued + Settings().level_delay(2)
    assert store.conn.execute("SELECT deliver_at FROM delaywheel.wheel WHERE id = %s", (soon,)).fetchone() == (
        before + timedelta(minutes=5),
    )
    assert [d[:2] for d in deliveries(store)] == [(past, before - timedelta(minutes=5))]
    assert store.conn.execute("SELECT count(*) FROM delaywheel.wheel_far WHERE id = %s", (far,)).fetchone() == (1,)


def test_every_rejection_on_the_database_clock(db_url: str) -> None:
    """The same reasons without an injected clock (absolute due times are placed by the database)."""
    with Store(db_url, Settings(max_body_bytes=64)) as store:
        for reason, override in _rejections(store.clock()):
            args: dict[str, Any] = {"topic": "orders", "body": {"ok": 1}, **override}
            topic, body = args.pop("topic"), args.pop("body")
            with pytest.raises(InvalidMessage) as info:
                store.send(topic, body, **args)
            assert info.value.reason == reason, (override, info.value.reason, str(info.value))
            assert table_counts(store) == EMPTY, override


def test_a_single_send_in_the_callers_transaction_is_a_savepoint(db_url: str, t0: datetime) -> None:
    import psycopg

    with Store(db_url) as store, psycopg.connect(db_url, autocommit=True) as other:
        with store.conn.transaction():
            kept = store.send("orders", b"kept", delay_level=1, now=t0)
            with other.transaction():  # a roll in progress holds the wheel's state: a far timer's send times out
                other.execute("SELECT 1 FROM delaywheel.wheel_state FOR UPDATE")
                store.conn.execute("SET LOCAL lock_timeout = '50ms'")
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    store.send("timers", b"lost", delay=timedelta(days=9), now=t0)
            also = store.send("timers", b"also", delay=1000, now=t0)  # the caller's transaction goes on
        assert sorted(
            r[0]
            for r in store.conn.execute(
                "SELECT id FROM delaywheel.level_queue UNION ALL SELECT id FROM delaywheel.wheel"
            ).fetchall()
        ) == [kept, also]
        with pytest.raises(RuntimeError), store.conn.transaction():  # the caller's rollback takes the send with it
            store.send("orders", b"gone", delay_level=1, now=t0)
            raise RuntimeError
        assert table_counts(store)["level_queue"] == 1


def _send_many(store: Store, message: Message, now: datetime) -> int:
    return store.send_many([message], now=now)[0]


def _send_one(store: Store, message: Message, now: datetime) -> int:
    return store.send(message.topic, message.body, delay=message.delay, deliver_at=message.deliver_at, now=now)


@pytest.mark.parametrize("send", [_send_many, _send_one], ids=["send_many", "send"])
def test_a_near_timer_takes_no_lock_and_a_far_one_waits_for_a_roll(
    db_url: str, t0: datetime, send: Callable[[Store, Message, datetime], int]
) -> None:
    """A send reads the roll's bound (near_until) unlocked: a near timer goes through while a roll holds the wheel's
    state, so its transaction takes an xid only at its write (send_many) and writes no row lock (send, migrations/026).
    A far timer locks the bound FOR KEY SHARE before its write, waits for the roll, and is placed by the bound the
    roll left: a timer whose day the roll moved into the near window goes to the near wheel, not into a far block
    the roll has already moved."""
    import threading

    import psycopg

    with Store(db_url) as store, psycopg.connect(db_url) as roll, psycopg.connect(db_url, autocommit=True) as watch:
        store.advance_wheel(now=t0)  # the first roll sets near_until
        (near_until,) = store.conn.execute("SELECT near_until FROM delaywheel.wheel_roll").fetchone()  # type: ignore[misc]
        store.conn.execute("SET lock_timeout = '10s'")
        store.conn.commit()
        roll.execute("SELECT FROM delaywheel.wheel_roll FOR UPDATE")  # a roll in progress, as wheel._roll holds it
        roll.execute("UPDATE delaywheel.wheel_roll SET near_until = near_until + interval '1 day'")
        near = send(store, Message("timers", b"near", delay=timedelta(seconds=5)), t0)
        assert store.conn.execute("SELECT count(*) FROM delaywheel.wheel WHERE id = %s", (near,)).fetchone() == (1,)
        due = near_until + timedelta(hours=2)
        sent: list[int] = []
        producer = threading.Thread(
            target=lambda: sent.append(send(store, Message("timers", b"rolled", deliver_at=due), t0))
        )
        producer.start()
        wait_for_lock(watch, store.conn.info.backend_pid, "the far timer's send")
        roll.commit()
        producer.join(timeout=20)
        assert len(sent) == 1
        placed = store.conn.execute(
            "SELECT (SELECT deliver_at FROM delaywheel.wheel WHERE id = %(id)s),"
            " (SELECT count(*) FROM delaywheel.wheel_far WHERE id = %(id)s)",
            {"id": sent[0]},
        ).fetchone()
        assert placed == (due, 0)


def test_a_single_send_calls_no_sql_function_out_of_line(db_url: str) -> None:
    """The SQL helpers a single send uses (partition_width, partition_start, partition_name, due_hint) are inlined
    into send_one's plans (migrations/026). One that is not is planned again in every transaction that calls it:
    partition_width (kept out of line by a SET clause) and due_hint (a FROM clause, and IMMUTABLE over STABLE
    extract()) cost a single send 78 us of its 166 on the server. The server counts each function it calls out of
    line (track_functions): none of them may be SQL."""
    import psycopg

    with Store(db_url) as store, psycopg.connect(db_url, autocommit=True) as watch:
        store.conn.execute("SET track_functions = 'all'")
        for delay in (timedelta(seconds=5), timedelta(days=9)):
            with store.conn.transaction():  # in a caller's transaction (send_one_savepoint) and on its own
                store.send("timers", b"x", delay=delay)
            store.send("timers", b"x", delay=delay)
        store.send("timers", b"x", delay_level=2)
        store.conn.execute("SELECT pg_stat_force_next_flush()")  # reported once the session is idle
        deadline = time.monotonic() + 10
        while True:
            watch.execute("SELECT pg_stat_clear_snapshot()")
            called = dict(
                watch.execute(
                    "SELECT f.funcname, l.lanname FROM pg_stat_user_functions f JOIN pg_proc p ON p.oid = f.funcid"
                    " JOIN pg_language l ON l.oid = p.prolang WHERE f.schemaname = 'delaywheel'"
                ).fetchall()
            )
            if called or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert {"send_one", "send_one_savepoint", "partition_ready"} <= called.keys()
    assert set(called.values()) == {"plpgsql"}, called


def test_a_single_send_creates_its_partitions_as_the_runtime_role(db_url: str) -> None:
    """The runtime role may create partitions only through ensure_partition (migrations/017); send_one does, for every lane,
    on a store none of whose partitions exist yet for those times."""
    from psycopg.conninfo import make_conninfo

    from delaywheel.dev import embedded

    runtime = make_conninfo(db_url, user=embedded.RUNTIME_LOGIN)
    t = datetime(2031, 6, 1, 12, tzinfo=UTC)
    with Store(runtime) as store:
        for kwargs in ({}, {"delay_level": 1}, {"delay": 2000}, {"delay": timedelta(days=9)}):
            store.send("orders", b"x", now=t, **kwargs)  # type: ignore[arg-type]
        assert table_counts(store) == {**EMPTY, "level_queue": 1, "wheel": 1, "wheel_far": 1, "topic_messages": 1}


def _verdict(send: Any) -> tuple[str, str] | None:
    try:
        send()
    except InvalidMessage as e:
        return (e.reason, str(e))
    return None


@hypothesis.settings(
    max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(batches())
def test_a_single_send_gives_the_verdict_of_the_rules(db_url: str, batch: list[Message]) -> None:
    """Property: a single send accepts exactly what `validation.prepare` accepts and refuses the rest with its reason
    and sentence, with the clock injected and (every message but an absolute due time, which the database's clock
    places) without it: a delay or a level is checked against a fixed instant and placed by the database."""
    from delaywheel.partitions import PartitionCache
    from delaywheel.produce import producer
    from delaywheel.produce.validation import prepare
    from tests.helpers import NOW, SETTINGS

    message = batch[0]
    expected = _verdict(lambda: prepare(message, NOW, SETTINGS))
    with Store(db_url, SETTINGS) as store:
        cache = PartitionCache()
        assert _verdict(lambda: producer.send_one(store.conn, SETTINGS, cache, message, now=NOW)) == expected
        if message.deliver_at is None:
            assert _verdict(lambda: producer.send_one(store.conn, SETTINGS, cache, message)) == expected
        written = sum(table_counts(store).values())
        store.conn.execute(
            "TRUNCATE delaywheel.level_segments, delaywheel.wheel, delaywheel.wheel_far_segments,"
            " delaywheel.topic_messages"
        )
    assert written == (0 if expected else 1 + (message.deliver_at is None))


def test_the_delivered_message_has_its_own_name(store: Store, t0: datetime) -> None:
    """A producer hands over a `delaywheel.Message`; a consumer gets `delaywheel.Delivered`, another class with
    its own name."""
    import delaywheel

    store.send("orders", {"n": 1}, now=t0)
    (got,) = store.pull("orders", "g").messages
    assert type(got) is delaywheel.Delivered
    assert delaywheel.Message is Message and delaywheel.Delivered is not delaywheel.Message
    assert isinstance(store.ack(store.pull("orders", "g")), delaywheel.AckResult)
    assert isinstance(store.deliver_level(1, now=t0), delaywheel.PassResult)
    assert all(isinstance(r, delaywheel.CancelResult) for r in store.cancel(message_id=got.message_id))


def test_an_injected_now_moves_the_wheels_single_cursor(store: Store) -> None:
    """docs/library.md, `now=`: advance_wheel(now=…) ahead of the real clock delivers what is due by then and leaves the wheel's
    one cursor there; passes on the real clock then deliver nothing before that instant."""
    clock = store.clock()
    early = store.send("timers", b"early", delay=1000)
    ahead = clock + timedelta(hours=1)
    assert store.advance_wheel(now=ahead).delivered == 1  # due in a second, delivered now: early
    (got,) = deliveries(store)
    assert got[0] == early and got[2] == ahead
    assert store.conn.execute("SELECT cursor_at FROM delaywheel.wheel_state").fetchone() == (ahead,)
    store.send("timers", b"held", delay=1)  # due in a millisecond
    time.sleep(0.01)
    result = store.advance_wheel()  # the real clock is behind the cursor: held until it gets there
    assert result.delivered == 0 and result.next_due == ahead
