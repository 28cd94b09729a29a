"""Cancels hold no lane lock while deliverers run (DESIGN.md, "Cancellation"): each interleaving of a cancel and a
delivery pass, held open on their own connections, gives the true answer and never both; a stream of cancels beside
a delivery loop starves no pass and keeps delivery exactly once."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta

import psycopg
import pytest

from delaywheel import Store
from delaywheel.deliver import levels
from delaywheel.locks import WHEEL_LOCK, turns
from delaywheel.ops.cancel import CancelResult, find, key_params, mark, settle
from delaywheel.produce.validation import Message
from tests.helpers import Background, deliveries, wait_for_lock

NOW = timedelta(seconds=30)  # the passes' injected clock, after t0: every timer below is due


def outcomes(results: list[CancelResult]) -> list[tuple[int | None, str]]:
    return [(r.message_id, r.outcome) for r in results]


def timer(store: Store, t0: datetime, key: str, lane: str) -> int:
    # The cancellations' partition exists beforehand: a transaction that creates one holds its parent's lock until
    # it ends, and the held-open transactions below are about rows, not DDL.
    store._cache.ensure(store.conn, "cancellations", [t0])
    if lane == "wheel":
        return store.send("race", b"x", delay=timedelta(seconds=5), key=key, now=t0)
    return store.send("race", b"x", delay_level=1, key=key, now=t0)


def deliver(store: Store, lane: str, now: datetime):  # type: ignore[no-untyped-def]
    return store.advance_wheel(now=now) if lane == "wheel" else store.deliver_level(1, now=now)


def delivered_ids(store: Store) -> list[int]:
    return [r[0] for r in deliveries(store, "race")]


@pytest.fixture
def other(db_url: str) -> Store:
    with Store(db_url) as s:
        yield s  # type: ignore[misc]


@pytest.fixture
def watch(db_url: str) -> Iterator[psycopg.Connection]:
    """A session outside any transaction, where pg_stat_activity is read afresh: a test waits with it until its thread's
    backend waits for a lock (wait_for_lock), the point the test means, however loaded the machine."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("lane", ["wheel", "level"])
def test_cancel_committed_before_the_pass_reads(store: Store, other: Store, t0: datetime, lane: str) -> None:
    mid = timer(store, t0, "k", lane)
    assert outcomes(store.cancel(key="k")) == [(mid, "cancelled")]
    assert deliver(other, lane, t0 + NOW).delivered == 0
    assert delivered_ids(store) == []


@pytest.mark.parametrize("lane", ["wheel", "level"])
@pytest.mark.parametrize("pass_ends", ["commit", "rollback"])
@pytest.mark.parametrize("how", ["id", "key"])
def test_pass_in_flight_when_the_cancel_runs(
    store: Store, other: Store, watch: psycopg.Connection, t0: datetime, lane: str, pass_ends: str, how: str
) -> None:
    """The pass has read and written the message, uncommitted: the cancel's row commits, then the cancel waits for the
    pass; committed, the message was delivered; rolled back, it stays cancelled and no later pass delivers it. By id
    or by key: the wait's statement works the lanes out from each (the procedures of migrations/027)."""
    mid = timer(store, t0, "k", lane)
    with other.conn.transaction() as tx:
        assert deliver(other, lane, t0 + NOW).delivered == 1  # a savepoint: the lane's lock stays held
        cancelling = Background(lambda: store.cancel(message_id=mid) if how == "id" else store.cancel(key="k"))
        # waiting for the pass: here already in find, for the partitions this first pass created (a relation lock
        # held to its end); with the partitions in place, in the lane wait with its cancellation committed (below)
        wait_for_lock(watch, store.conn.info.backend_pid, "the cancel")
        if pass_ends == "rollback":
            raise psycopg.Rollback(tx)
    if pass_ends == "commit":
        assert outcomes(cancelling.result()) == [(mid, "already_delivered")]
        assert delivered_ids(store) == [mid]
        assert outcomes(store.cancel(key="k")) == [(mid, "already_delivered")]
    else:
        assert outcomes(cancelling.result()) == [(mid, "cancelled")]
        assert deliver(other, lane, t0 + NOW).delivered == 0
        assert delivered_ids(store) == []


@pytest.mark.parametrize("turn", [0, 1])
def test_the_cancellation_is_committed_before_the_cancel_waits(
    store: Store, db_url: str, watch: psycopg.Connection, t0: datetime, turn: int
) -> None:
    """The cancellation is committed, then the cancel waits for the pass in flight, whichever of the lane's two
    turns it holds (held here as a pass holds it, with the lane's lock): while it waits, its cancellation is already
    committed, so a pass starting now skips the message; and the other turn is free for that pass (the cancel let go
    of the first turn before it waited for the second)."""
    mid = timer(store, t0, "k", "wheel")
    held = [WHEEL_LOCK, turns(*WHEEL_LOCK)[turn]]
    free = turns(*WHEEL_LOCK)[1 - turn]
    with psycopg.connect(db_url, autocommit=True) as lane, psycopg.connect(db_url, autocommit=True) as third:
        for lock in held:
            lane.execute("SELECT pg_advisory_lock(%s, %s)", lock)
        cancelling = Background(lambda: store.cancel(key="k"))
        wait_for_lock(watch, store.conn.info.backend_pid, "the cancel")
        assert third.execute(
            "SELECT count(*) FROM delaywheel.cancellations WHERE message_id = %s", (mid,)
        ).fetchone() == (1,)
        assert third.execute("SELECT pg_try_advisory_lock(%s, %s)", free).fetchone() == (True,)
        third.execute("SELECT pg_advisory_unlock(%s, %s)", free)
        for lock in held:
            lane.execute("SELECT pg_advisory_unlock(%s, %s)", lock)
        assert outcomes(cancelling.result()) == [(mid, "cancelled")]


@pytest.mark.parametrize("lane", ["wheel", "level"])
@pytest.mark.parametrize("pass_commits", ["before_cancel_commits", "after_cancel_commits"])
def test_cancel_row_uncommitted_when_the_pass_reads(
    store: Store, other: Store, watch: psycopg.Connection, t0: datetime, lane: str, pass_commits: str
) -> None:
    """The cancel has inserted its row, uncommitted, when the pass reads: the pass cannot see it and delivers. The
    cancel then must say already_delivered, whichever of the two commits first."""
    mid = timer(store, t0, "k", lane)
    params = {"v": mid}
    found = find(store.conn, "id", params)
    with store.conn.transaction():
        marked = mark(store.conn, store._cache, found, "race")
        assert marked == {mid}
        if pass_commits == "before_cancel_commits":
            assert deliver(other, lane, t0 + NOW).delivered == 1
        else:
            pass_tx = other.conn.transaction()
            pass_tx.__enter__()
            assert deliver(other, lane, t0 + NOW).delivered == 1
    # the cancellation is committed now
    if pass_commits == "before_cancel_commits":
        assert outcomes(settle(store.conn, "id", params, found, marked)) == [(mid, "already_delivered")]
    else:
        settling = Background(lambda: settle(store.conn, "id", params, found, marked))
        wait_for_lock(watch, store.conn.info.backend_pid, "the settle")
        pass_tx.__exit__(None, None, None)
        assert outcomes(settling.result()) == [(mid, "already_delivered")]
    assert delivered_ids(store) == [mid]


def test_cancel_after_the_pass_committed(store: Store, other: Store, t0: datetime) -> None:
    """Found pending, but the pass commits before the cancellation is inserted: the cursors no longer show it
    pending, nothing is inserted, and the answer is already_delivered."""
    mid = timer(store, t0, "k", "wheel")
    found = find(store.conn, "key", key_params("k"))
    assert deliver(other, "wheel", t0 + NOW).delivered == 1
    marked = mark(store.conn, store._cache, found, "race")
    assert marked == set()
    assert outcomes(settle(store.conn, "key", {"v": "k"}, found, marked)) == [(mid, "already_delivered")]
    assert store.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (0,)


def test_two_cancels_of_one_message(store: Store, other: Store, watch: psycopg.Connection, t0: datetime) -> None:
    """The second waits at the unique index for the first to commit: one cancelled, one already_cancelled."""
    mid = timer(store, t0, "k", "wheel")
    found = find(store.conn, "id", {"v": mid})
    with store.conn.transaction():
        marked = mark(store.conn, store._cache, found, "first")
        second_pid = (
            other.conn.info.backend_pid
        )  # connected here, not raced by the thread (Store connects on first use)
        second = Background(lambda: other.cancel(message_id=mid))
        wait_for_lock(watch, second_pid, "the second cancel")
    assert outcomes(settle(store.conn, "id", {"v": mid}, found, marked)) == [(mid, "cancelled")]
    assert outcomes(second.result()) == [(mid, "already_cancelled")]
    assert store.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (1,)
    assert deliver(store, "wheel", t0 + NOW).delivered == 0


def _hold_shared(conn: psycopg.Connection, locks: list[tuple[int, int]]) -> None:
    """Hold `locks` shared until `conn`'s transaction ends, as cancels waiting for a pass do."""
    for lock in locks:
        conn.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", lock)


def test_a_pass_takes_the_turn_the_cancels_left_free(db_url: str, store: Store, t0: datetime) -> None:
    """Cancels granted a turn as the pass holding it committed keep it until their processes run: the next pass
    takes the other turn, and does not wait for them."""
    mid = timer(store, t0, "k", "wheel")
    assert store.advance_wheel(now=t0).delivered == 0  # the first pass rolls the far blocks' window (see below)
    for turn in turns(*WHEEL_LOCK):
        with psycopg.connect(db_url) as cancels:
            _hold_shared(cancels, [turn])
            result = store.advance_wheel(now=t0 + NOW)
            assert (result.busy, result.waited) == (False, False)
    assert delivered_ids(store) == [mid]


def test_a_pass_waits_out_a_cancels_shared_hold(
    db_url: str, store: Store, watch: psycopg.Connection, t0: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both turns held shared (cancels on both, stalled) make a pass wait, not report busy, and the pass says it
    waited; held longer than levels.LANE_WAIT (a cancel inside a transaction), the pass reports busy as before. A pass
    that finds its lane free did not wait."""
    mid = timer(store, t0, "k", "wheel")
    # The first pass rolls the far blocks' window (near_until), and the roll waits for the lane on its own before the
    # pass tries it: roll now, so the pass below is what meets the held turns.
    assert store.advance_wheel(now=t0).delivered == 0
    monkeypatch.setattr(levels, "LANE_WAIT", "5s")  # the hold is released once the pass waits, however slow the machine
    both = turns(*WHEEL_LOCK)
    with psycopg.connect(db_url) as holder:
        _hold_shared(holder, both)
        passing = Background(lambda: store.advance_wheel(now=t0 + NOW))
        wait_for_lock(watch, store.conn.info.backend_pid, "the pass")  # released once the pass waits, not before
        holder.rollback()
        result = passing.result()
        assert (result.busy, result.waited, result.delivered) == (False, True, 1)
        monkeypatch.setattr(levels, "LANE_WAIT", "100ms")
        _hold_shared(holder, both)
        late = store.advance_wheel(now=t0 + NOW)
        assert (late.busy, late.waited) == (True, False)
        holder.rollback()
    assert not store.advance_wheel(now=t0 + NOW).waited
    assert delivered_ids(store) == [mid]


def test_a_busy_pass_holds_nothing(db_url: str, store: Store, t0: datetime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that took its lane's lock and then found both turns held reports busy holding neither: inside a caller's
    transaction too, where the lane's lock would otherwise stay held (and other deliverers' rolls wait) until that
    transaction ends."""
    monkeypatch.setattr(levels, "LANE_WAIT", "50ms")
    timer(store, t0, "k", "wheel")
    assert store.advance_wheel(now=t0).delivered == 0
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url, autocommit=True) as other:
        _hold_shared(holder, turns(*WHEEL_LOCK))
        with store.conn.transaction():
            assert store.advance_wheel(now=t0 + NOW).busy
            assert other.execute("SELECT pg_try_advisory_lock(%s, %s)", WHEEL_LOCK).fetchone() == (True,)
        other.execute("SELECT pg_advisory_unlock(%s, %s)", WHEEL_LOCK)


def test_a_waiting_pass_goes_before_later_cancels(
    db_url: str, store: Store, watch: psycopg.Connection, t0: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL grants no shared request past a waiting exclusive one: cancels arriving while a pass waits for a
    turn queue behind it, so a stream of them cannot starve the pass."""
    monkeypatch.setattr(levels, "LANE_WAIT", "5s")
    timer(store, t0, "k", "wheel")
    assert store.advance_wheel(now=t0).delivered == 0  # the roll, which waits on its own (see above), done first
    first_turn = turns(*WHEEL_LOCK)[0]
    with psycopg.connect(db_url) as first, psycopg.connect(db_url, autocommit=True) as later:
        _hold_shared(first, turns(*WHEEL_LOCK))
        passing = Background(lambda: store.advance_wheel(now=t0 + NOW))
        # waiting for the first turn, not merely not yet returned (a loaded CI run once took longer than a fixed pause)
        wait_for_lock(watch, store.conn.info.backend_pid, "the pass")
        cancel_wait = Background(lambda: later.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", first_turn))
        # behind the waiting pass, although only a shared lock is held
        wait_for_lock(watch, later.info.backend_pid, "the later cancel's shared request")
        first.rollback()
        assert passing.result().delivered == 1
        cancel_wait.result()


def test_cancel_stream_beside_delivery_loops(db_url: str, store: Store) -> None:
    """Real clock: producers send timers due within ~1 s (wheel and level 1), two threads cancel keys at random
    (many at their due time, racing the passes), one deliverer per lane. No pass is busy; every message is delivered
    exactly once unless a cancel said cancelled or already_cancelled, and then never; every already_delivered is
    true."""
    store.prepare()
    keys: dict[str, int] = {}
    lock = threading.Lock()
    stop = threading.Event()
    stop_delivering = threading.Event()
    errors: list[BaseException] = []
    answers: list[CancelResult] = []
    busy = {"passes": 0, "busy": 0}

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with Store(db_url) as own:
                n = 0
                while not stop.is_set():
                    batch = [f"p{seed}-{n + i}" for i in range(rng.randint(1, 10))]
                    n += len(batch)
                    ids = own.send_many(
                        [
                            Message("race", b"x", key=k, delay_level=1)
                            if rng.random() < 0.3
                            else Message("race", b"x", key=k, delay=timedelta(seconds=rng.uniform(0.05, 1)))
                            for k in batch
                        ]
                    )
                    with lock:
                        keys.update(zip(batch, ids, strict=True))
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    def cancel_loop(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with Store(db_url) as own:
                while not stop.is_set():
                    with lock:
                        pool = list(keys)
                    if not pool:
                        time.sleep(0.005)
                        continue
                    key = rng.choice(pool[-300:])  # recent: pending, due now, or just delivered
                    answers.extend(own.cancel(key=key) if rng.random() < 0.7 else own.cancel(message_id=keys[key]))
        except BaseException as exc:
            errors.append(exc)

    def deliver_loop(lane: int | None) -> None:
        try:
            with Store(db_url) as own:
                while not stop_delivering.is_set():
                    result = own.advance_wheel(limit=50) if lane is None else own.deliver_level(lane, limit=50)
                    with lock:
                        busy["passes"] += 1
                        busy["busy"] += result.busy
                    if not result.more and not result.delivered:
                        time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=cancel_loop, args=(10 + s,)) for s in range(2)]
    threads += [threading.Thread(target=deliver_loop, args=(lane,)) for lane in (1, None)]
    for t in threads:
        t.start()
    time.sleep(4)
    stop.set()
    time.sleep(2.5)  # past the longest delay (level 1 = 1 s)
    stop_delivering.set()
    for t in threads:
        t.join()
    assert not errors, errors
    store.deliver_due()
    counts = dict(
        store.conn.execute(
            "SELECT message_id, count(*) FROM delaywheel.topic_messages WHERE topic = 'race' GROUP BY 1"
        ).fetchall()
    )
    assert set(counts.values()) <= {1}
    said_cancelled = {a.message_id for a in answers if a.outcome in ("cancelled", "already_cancelled")}
    said_delivered = {a.message_id for a in answers if a.outcome == "already_delivered"}
    assert not said_cancelled & set(counts), "delivered and reported cancelled"
    assert said_delivered <= set(counts)
    assert set(counts) | said_cancelled == set(keys.values())
    assert busy["busy"] == 0, busy
    assert len({a.message_id for a in answers if a.outcome == "cancelled"}) > 20
    assert len(said_delivered) > 20
    print(
        f"passes {busy['passes']}, busy {busy['busy']}, answers {len(answers)},"
        f" cancelled {len(said_cancelled)}, already_delivered {len(said_delivered)}"
    )


def test_a_cancel_in_the_callers_transaction_holds_the_lanes(store: Store, other: Store, t0: datetime) -> None:
    """Nothing can be committed before the caller's commit, so the cancel takes the lanes' locks as before: a pass of
    that lane reports busy until then, and skips the message after."""
    mid = timer(store, t0, "k", "wheel")
    with store.conn.transaction():
        assert outcomes(store.cancel(key="k")) == [(mid, "cancelled")]
        assert other.advance_wheel(now=t0 + NOW).busy
    assert other.advance_wheel(now=t0 + NOW).delivered == 0
    assert delivered_ids(store) == []


def test_a_bulk_cancel_in_the_callers_transaction_holds_every_lane(store: Store, other: Store, t0: datetime) -> None:
    """`cancel_matching` inside the caller's transaction takes every lane's lock (wheel, then levels ascending) until
    the caller ends: passes of the wheel and of a level report busy meanwhile, and skip the messages after."""
    timers = [timer(store, t0, "k", "wheel"), timer(store, t0, "k", "level")]
    with store.conn.transaction():
        assert store.cancel_matching(keys=["k"]) == len(timers)
        assert deliver(other, "wheel", t0 + NOW).busy
        assert deliver(other, "level", t0 + NOW).busy
    assert deliver(other, "wheel", t0 + NOW).delivered == deliver(other, "level", t0 + NOW).delivered == 0
    assert delivered_ids(store) == []
