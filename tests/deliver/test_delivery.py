"""Delivery on the level queues and the wheel with an injected clock: never early, FIFO, checkpoints
in the delivering transaction, busy lanes, catch-up, far future, and out-of-order commits."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import psycopg

from delaywheel import Settings, Store
from delaywheel.produce.validation import Message
from tests.helpers import at, deliveries, syncs, table_counts, traced


def test_level_never_early_fifo_and_countdown(store: Store, t0: datetime) -> None:
    ids = [store.send("orders", {"n": i}, delay_level=2, now=at(t0, i)) for i in range(5)]  # due t0+5 .. t0+9
    result = store.deliver_level(2, now=at(t0, 4.999))
    assert (result.delivered, result.next_due, result.busy, result.more) == (0, at(t0, 5), False, False)
    result = store.deliver_level(2, now=at(t0, 6.5))
    assert (result.delivered, result.next_due) == (2, at(t0, 7))
    assert store.deliver_level(2, now=at(t0, 6.9)).delivered == 0
    result = store.deliver_level(2, now=at(t0, 100))
    assert (result.delivered, result.next_due) == (3, None)
    rows = deliveries(store, "orders")
    assert [r[0] for r in rows] == ids
    assert [r[1] for r in rows] == [at(t0, 5 + i) for i in range(5)]
    assert [r[2] for r in rows] == [at(t0, 6.5)] * 2 + [at(t0, 100)] * 3  # delivered_at recorded
    assert all(done >= due for _, due, done, _ in rows)


def test_level_stops_at_first_message_not_due(store: Store, t0: datetime) -> None:
    """RocketMQ's rule: the head decides. A later message that happens to be due (its producer's clock
    was behind) waits behind a head that is not."""
    head = store.send("orders", b"head", delay_level=1, now=at(t0, 10))  # due t0+11
    behind = store.send("orders", b"behind", delay_level=1, now=t0)  # due t0+1
    result = store.deliver_level(1, now=at(t0, 5))
    assert (result.delivered, result.next_due) == (0, at(t0, 11))
    assert store.deliver_level(1, now=at(t0, 11)).delivered == 2
    assert [r[0] for r in deliveries(store)] == [head, behind]


def test_levels_are_independent_queues(store: Store, t0: datetime) -> None:
    slow = store.send("orders", b"slow", delay_level=3, now=t0)  # 10s
    fast = store.send("orders", b"fast", delay_level=1, now=t0)  # 1s
    assert store.deliver_level(1, now=at(t0, 1)).delivered == 1
    assert store.deliver_level(3, now=at(t0, 9)).delivered == 0
    assert store.deliver_level(3, now=at(t0, 10)).delivered == 1
    assert [r[0] for r in deliveries(store)] == [fast, slow]


def test_checkpoint_matches_last_delivered_row(store: Store, t0: datetime) -> None:
    store.send_many([Message("orders", {"n": i}, delay_level=1) for i in range(10)], now=t0)
    store.send_many([Message("orders", {"n": i}, delay_level=1) for i in range(10)], now=at(t0, 5))
    result = store.deliver_level(1, now=at(t0, 3), limit=4)
    assert (result.delivered, result.more) == (4, True)
    assert store.deliver_level(1, now=at(t0, 3)).delivered == 6

    def cursor() -> tuple[str, int, int]:
        row = store.conn.execute(
            "SELECT cursor_xid::text, cursor_id, delivered FROM delaywheel.level_checkpoint WHERE level = 1"
        ).fetchone()
        assert row is not None
        return row[0], row[1], row[2]

    last_delivered = deliveries(store)[-1][0]
    xid = store.conn.execute("SELECT xid::text FROM delaywheel.level_queue WHERE id = %s", (last_delivered,)).fetchone()
    assert xid is not None
    assert cursor() == (xid[0], last_delivered, 10)
    store.deliver_level(1, now=at(t0, 6))
    assert cursor()[1:] == (deliveries(store)[-1][0], 20)


def test_second_deliverer_on_a_held_level_is_busy(db_url: str, store: Store, t0: datetime) -> None:
    store.prepare(now=t0)  # the wheel has rolled: the timer sits in the near wheel
    store.send("orders", b"x", delay_level=1, now=t0)
    store.send("orders", b"y", delay=1000, now=t0)
    with Store(db_url) as first, first.conn.transaction():
        assert first.deliver_level(1, now=at(t0, 1)).delivered == 1  # holds level 1's lock until COMMIT
        assert first.advance_wheel(now=at(t0, 1)).delivered == 1  # and the wheel's
        assert store.deliver_level(1, now=at(t0, 1)).busy
        assert store.advance_wheel(now=at(t0, 1)).busy
        assert not store.deliver_level(2, now=at(t0, 1)).busy  # other levels are free
    again = store.deliver_level(1, now=at(t0, 1))
    assert (again.busy, again.delivered) == (False, 0)
    assert len(deliveries(store)) == 2


def test_a_level_pass_inside_the_callers_transaction_commits_with_it(store: Store, t0: datetime) -> None:
    """On a connection already in a transaction the level pass runs in a savepoint, with the same pipelines and no
    BEGIN or COMMIT of its own: what it delivered, and the checkpoint it moved, are the caller's to keep or roll
    back."""
    ids = store.send_many([Message("t", {"n": i}, delay_level=1) for i in range(2)], now=t0)
    with store.conn.transaction(force_rollback=True):
        assert store.deliver_level(1, now=at(t0, 1)).delivered == 2
        assert len(deliveries(store, "t")) == 2
    assert deliveries(store, "t") == []  # rolled back with the caller's transaction, checkpoint included
    with store.conn.transaction():
        assert store.deliver_level(1, now=at(t0, 1)).delivered == 2
    assert [m[0] for m in deliveries(store, "t")] == ids
    assert store.deliver_level(1, now=at(t0, 2)).delivered == 0  # the checkpoint moved with them


def test_a_level_pass_is_one_round_trip(store: Store, t0: datetime) -> None:
    """As the wheel's pass (test_wheel_cursor): one CALL (migrations/029: the lock, the checkpoint, the move, which
    writes the checkpoint itself, COMMIT and the head), one Sync, whether it delivers or finds nothing. It was eight
    round trips, then two, and a deliverer passes every level at start."""
    store.send("orders", b"first", delay_level=1, now=t0)
    assert store.deliver_level(1, now=at(t0, 1)).delivered == 1  # creates the topic's partition: the common case next
    ids = store.send_many([Message("orders", {"n": i}, delay_level=1) for i in range(3)], now=at(t0, 1))
    store.send("orders", b"later", delay_level=1, now=at(t0, 5))
    result, lines = traced(store.conn, lambda: store.deliver_level(1, now=at(t0, 2)))
    assert (result.delivered, result.next_due) == (3, at(t0, 6))
    assert [m[0] for m in deliveries(store, "orders")][-3:] == ids
    assert syncs(lines) == 1
    idle, lines = traced(store.conn, lambda: store.deliver_level(2, now=at(t0, 2)))
    assert (idle.delivered, idle.next_due, syncs(lines)) == (0, None, 1)


def test_a_level_pass_on_a_day_without_its_topic_partition_creates_it_outside_the_pass_or_in_the_callers_transaction(
    store: Store, t0: datetime
) -> None:
    """As the wheel's (test_wheel_cursor): the procedure returns before its move when the clock's day has no topic
    partition; a Store's pass creates it in a transaction of its own and passes again, inside the caller's transaction
    it is made there and goes with the caller's rollback."""
    day = t0 + timedelta(days=40)  # no topic partition yet
    mid = store.send("t", {"n": 1}, delay_level=1, now=day)

    def topic_partition() -> bool:
        row = store.conn.execute("SELECT delaywheel.partition_named('topic_messages', %s) IS NOT NULL", (day,))
        return bool(row.fetchone()[0])  # type: ignore[index]

    with store.conn.transaction(force_rollback=True):
        assert store.deliver_level(1, now=at(day, 2)).delivered == 1
        assert topic_partition()
    assert not topic_partition()  # rolled back with the caller's transaction, the delivery with it
    assert store.deliver_level(1, now=at(day, 2)).delivered == 1
    assert topic_partition() and [m[0] for m in deliveries(store, "t")] == [mid]


def test_wheel_never_early_inside_a_slot(store: Store, t0: datetime) -> None:
    early, late = (store.send("timers", b"a", deliver_at=at(t0, s), now=t0) for s in (0.2, 0.7))
    result = store.advance_wheel(now=at(t0, 0.5))
    assert (result.delivered, result.next_due) == (1, at(t0, 0.7))
    assert store.advance_wheel(now=at(t0, 0.699)).delivered == 0
    assert store.advance_wheel(now=at(t0, 0.7)).delivered == 1
    assert [(r[0], r[1], r[2]) for r in deliveries(store)] == [
        (early, at(t0, 0.2), at(t0, 0.5)),
        (late, at(t0, 0.7), at(t0, 0.7)),
    ]


def test_wheel_with_coarse_precision_is_still_exact(db_url: str, t0: datetime) -> None:
    with Store(db_url, Settings(wheel_precision=timedelta(minutes=1))) as store:
        mid = store.send("timers", b"a", deliver_at=at(t0, 42.5), now=t0)
        assert store.advance_wheel(now=at(t0, 42.4)).delivered == 0
        assert store.advance_wheel(now=at(t0, 42.5)).delivered == 1
        assert deliveries(store)[0][:3] == (mid, at(t0, 42.5), at(t0, 42.5))


def test_wheel_catches_up_after_hours_of_downtime_in_due_order(store: Store, t0: datetime) -> None:
    rng = random.Random(7)
    offsets = [rng.uniform(1, 3 * 3600) for _ in range(3000)]
    ids = store.send_many(
        [Message("timers", {"i": i}, delay=timedelta(seconds=s)) for i, s in enumerate(offsets)], now=t0
    )
    late = at(t0, 5 * 3600)
    passes = 0
    while True:
        result = store.advance_wheel(now=late, limit=400)
        passes += 1
        if not result.more:
            break
    assert passes >= 8
    rows = deliveries(store, "timers")
    assert len(rows) == 3000 and {r[0] for r in rows} == set(ids)
    assert [(r[1], r[0]) for r in rows] == sorted((r[1], r[0]) for r in rows)  # due order
    assert all(r[2] == late for r in rows)


def test_far_future_messages_survive_many_rolls(store: Store, t0: datetime) -> None:
    days = [0.5, 3.5, 10, 45.25, 200, 364.9]
    ids = {store.send("timers", {"d": d}, delay=timedelta(days=d), now=t0): d for d in days}
    # the wheel has not rolled yet: far blocks take what lies beyond the near window (3 days), nothing sooner
    assert table_counts(store)["wheel_far"] == len([d for d in days if d >= 3])
    for d in days:
        due = t0 + timedelta(days=d)
        assert store.advance_wheel(now=due - timedelta(milliseconds=1)).delivered == 0
        assert store.advance_wheel(now=due).delivered == 1
        assert {r[0] for r in deliveries(store)} == {mid for mid, x in ids.items() if x <= d}
    rows = deliveries(store)
    assert all(due == done == t0 + timedelta(days=ids[mid]) for mid, due, done, _ in rows)


def test_out_of_order_commit_levels(db_url: str, store: Store, t0: datetime) -> None:
    """A sender's transaction takes its position first and commits last: the level's cursor must
    wait for it, then deliver it exactly once."""
    store.prepare(now=t0)
    with Store(db_url) as held:
        held.prepare(now=t0)
        with held.conn.transaction():  # the caller's transaction: send runs as a savepoint inside it
            held_id = held.send("orders", b"held", delay_level=1, now=t0)
            later_id = store.send("orders", b"later", delay_level=1, now=t0)  # commits
            store.deliver_level(1, now=at(t0, 30))
            assert held_id not in {r[0] for r in deliveries(store)}
        store.deliver_level(1, now=at(t0, 30))
        store.deliver_level(1, now=at(t0, 31))
    ids = [r[0] for r in deliveries(store)]
    assert sorted(ids) == sorted([held_id, later_id])
    assert ids == [held_id, later_id]  # FIFO in commit-safe (xid, id) order


def test_out_of_order_commit_wheel(db_url: str, store: Store, t0: datetime) -> None:
    store.prepare(now=t0)
    with Store(db_url) as held:
        held.prepare(now=t0)
        with held.conn.transaction():
            held_id = held.send("timers", b"held", deliver_at=at(t0, 1), now=t0)
            later_id = store.send("timers", b"later", deliver_at=at(t0, 2), now=t0)
            store.advance_wheel(now=at(t0, 10))
            assert held_id not in {r[0] for r in deliveries(store)}
        store.advance_wheel(now=at(t0, 10))
        store.advance_wheel(now=at(t0, 11))
    ids = [r[0] for r in deliveries(store)]
    assert sorted(ids) == sorted([held_id, later_id])


def test_out_of_order_commit_wheel_later_delivered_first(db_url: str, store: Store, t0: datetime) -> None:
    """The later message commits with the lower transaction id and is delivered while the held one is
    still open; the cursor passes the held message's due time; it is still delivered, once."""
    store.prepare(now=t0)
    with Store(db_url) as held:
        held.prepare(now=t0)
        later_id = store.send("timers", b"later", deliver_at=at(t0, 2), now=t0)
        with held.conn.transaction():
            held_id = held.send("timers", b"held", deliver_at=at(t0, 1), now=t0)
            assert store.advance_wheel(now=at(t0, 10)).delivered == 1
            assert [r[0] for r in deliveries(store)] == [later_id]
        result = store.advance_wheel(now=at(t0, 10))
        assert result.delivered == 1
        assert store.advance_wheel(now=at(t0, 12)).delivered == 0
    assert [r[0] for r in deliveries(store)] == [later_id, held_id]


def test_deliver_due_drains_every_lane(store: Store, t0: datetime) -> None:
    messages = [Message("mixed", {"i": i}, delay_level=1 + i % 18) for i in range(36)]
    messages += [Message("mixed", {"i": i}, delay=timedelta(minutes=i)) for i in range(1, 20)]
    ids = store.send_many(messages, now=t0)
    assert store.deliver_due(now=at(t0, 3 * 3600)) == len(ids)
    assert sorted(r[0] for r in deliveries(store)) == sorted(ids)
    assert store.deliver_due(now=at(t0, 4 * 3600)) == 0


def test_open_transaction_in_another_database_does_not_hold_delivery(
    store: Store, server_url: str, t0: datetime
) -> None:
    """Airflow's metadata database lives on the same cluster: its transactions cannot write our tables,
    so they must not hold back the commit horizon of levels, wheel or consumers."""
    level_id = store.send("orders", b"level", delay_level=1, now=t0)
    wheel_id = store.send("orders", b"wheel", deliver_at=at(t0, 1), now=t0)
    with psycopg.connect(server_url) as elsewhere:
        elsewhere.execute("SELECT pg_current_xact_id()")  # an open transaction with an id, other database
        assert store.deliver_level(1, now=at(t0, 1)).delivered == 1
        assert store.advance_wheel(now=at(t0, 1)).delivered == 1
        assert sorted(m.message_id for m in store.pull("orders", "g").messages) == sorted([level_id, wheel_id])
        elsewhere.rollback()


def test_open_producer_transaction_does_not_stop_the_wheel(db_url: str, store: Store, t0: datetime) -> None:
    """An application sends a timer inside its own transaction and keeps it open while the wheel needs to
    roll: the advancer must not wait for it (the roll is retried next pass) and keeps delivering."""
    store.prepare(now=t0)
    ready = store.send("timers", b"ready", deliver_at=at(t0, 1), now=t0)
    with Store(db_url) as app:
        app.prepare(now=t0)
        with app.conn.transaction():
            held = app.send("timers", b"held", deliver_at=t0 + timedelta(days=2), now=t0)
            result = store.advance_wheel(now=t0 + timedelta(days=2))  # the near window must roll forward
            assert (result.delivered, result.busy) == (1, False)
        assert store.advance_wheel(now=t0 + timedelta(days=2)).delivered == 1
    assert [r[0] for r in deliveries(store)] == [ready, held]
