"""The roll in slices (wheel.roll; issue 21, item 4): a far day block moves into the near wheel a few messages a
step, each slice its own transaction, with wheel passes between them; the block is dropped and `near_until` moved
only by the last step. Tiny slice sizes make a small block take many slices."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import datetime, timedelta

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.partitions import DAY, floor_to
from delaywheel.pending import PENDING
from delaywheel.produce.validation import Message
from tests.helpers import Background, deliveries, wait_for_lock

WINDOW = Settings().wheel_near_window


def _near_until(store: Store) -> datetime:
    return store.conn.execute("SELECT near_until FROM delaywheel.wheel_roll").fetchone()[0]  # type: ignore[index]


def _far_messages(store: Store) -> int:
    row = store.conn.execute("SELECT coalesce(sum(n), 0) FROM delaywheel.wheel_far_segments").fetchone()
    assert row is not None
    return int(row[0])


def _pending_ids(store: Store, topic: str) -> list[int]:
    """Every pending message of the topic, once per place it is found (near wheel and far segments)."""
    rows = store.conn.execute(f"SELECT p.id FROM ({PENDING}) p WHERE p.topic = %s", (topic,)).fetchall()
    return sorted(r[0] for r in rows)


def _send_block(store: Store, topic: str, block: datetime, sizes: list[int], now: datetime) -> dict[int, datetime]:
    """Calls of `sizes` messages due in the far day `block` (each call one far segment); {id: due}."""
    due: dict[int, datetime] = {}
    n = itertools.count()
    for size in sizes:
        batch = [block + timedelta(seconds=(next(n) * 7919) % 86400) for _ in range(size)]
        ids = store.send_many([Message(topic, {"i": i}, deliver_at=at) for i, at in enumerate(batch)], now=now)
        due.update(zip(ids, batch, strict=True))
    return due


def _deliver_through(store: Store, start: datetime, end: datetime, step: timedelta) -> None:
    """Wheel passes at every `step` from `start`, and at `end`, each until nothing more is due (injected clock)."""
    now = start
    while True:
        while store.advance_wheel(now=min(now, end)).more:
            pass
        if now >= end:
            return
        now += step


def _check_delivered(store: Store, topic: str, due: dict[int, datetime], cancelled: set[int]) -> None:
    """Exactly once, never early (the injected clock stamps delivered_at), and nothing cancelled."""
    got = deliveries(store, topic)
    ids = [d[0] for d in got]
    assert sorted(ids) == sorted(set(due) - cancelled)
    assert all(delivered_at >= due[mid] == deliver_at for mid, deliver_at, delivered_at, _ in got)


def test_a_block_rolls_in_slices_with_passes_sends_and_cancels_between(db_url: str, t0: datetime) -> None:
    """A block of 40 messages rolled 3 at a time: near-due messages are delivered by the passes between slices, a
    send into the block while it is half rolled is rolled too, cancels of a message still in the block and of one
    already moved both hold, and every message is pending exactly once throughout and delivered once, never early."""
    with Store(db_url, Settings(wheel_roll_slice=3)) as store:
        store.advance_wheel(now=t0)  # the first roll: near_until = t0 + 4 days
        block = _near_until(store)
        roll_at = block - WINDOW  # the near window's end reaches the block: it rolls
        due = _send_block(store, "far", block, [1, 2, 5, 1, 3, 7, 1, 4, 2, 6, 8], now=t0)
        assert _far_messages(store) == len(due) == 40
        near = {store.send("near", {"n": i}, deliver_at=roll_at + timedelta(seconds=i), now=t0): i for i in range(6)}

        cancelled: set[int] = set()
        sent_late: dict[int, datetime] = {}
        steps, delivered_between = 0, 0
        now = roll_at
        while _near_until(store) == block:
            now += timedelta(seconds=1)
            result = store.advance_wheel(now=now)
            steps += 1
            if _near_until(store) == block:  # still rolling: the pass asks to be run again at once
                assert result.next_due == now
                delivered_between += result.delivered
                assert store.conn.execute(
                    "SELECT to_regclass('delaywheel.wheel_far_segments_p' || %s)", (block.strftime("%Y%m%dt0000"),)
                ).fetchone() != (None,)
            ids = _pending_ids(store, "far")
            assert len(ids) == len(set(ids)) == len(due) + len(sent_late)  # never in both places, never lost
            if steps == 3:  # half rolled: cancel a message still in the block, and one already moved
                far_ids = {r[0] for r in store.conn.execute("SELECT id FROM delaywheel.wheel_far").fetchall()}
                moved = sorted(set(due) - far_ids)
                still = sorted(set(due) & far_ids)
                assert moved and still
                for mid in (moved[0], still[-1]):
                    assert [r.outcome for r in store.cancel(message_id=mid)] == ["cancelled"]
                    cancelled.add(mid)
            if steps == 4:  # a send into the block while it is half rolled goes to the block, and is rolled too
                late = block + timedelta(hours=5)
                mid = store.send("far", {"late": 1}, deliver_at=late, now=now)
                sent_late[mid] = late
                assert store.conn.execute(
                    "SELECT count(*) FROM delaywheel.wheel_far WHERE id = %s", (mid,)
                ).fetchone() == (1,)
        assert steps == 8  # slices of 1+2, 5, 1+3, 7, 1+4, 2+6 and 8 segments, then the late send and the last step
        assert delivered_between == len(near)  # delivered while the block was still rolling
        assert _far_messages(store) == 0
        assert store.conn.execute(
            "SELECT count(*) FROM delaywheel.partitions WHERE parent = 'wheel_far_segments'"
        ).fetchone() == (0,)

        due.update(sent_late)
        _deliver_through(store, block - timedelta(hours=1), block + DAY, timedelta(minutes=30))
        _check_delivered(store, "far", due, cancelled)
        assert sorted(d[0] for d in deliveries(store, "near")) == sorted(near)


def test_a_small_block_rolls_in_one_step(store: Store, t0: datetime) -> None:
    """A block within one slice rolls in the pass that finds it, as before: the block dropped, near_until moved."""
    store.advance_wheel(now=t0)
    block = _near_until(store)
    due = _send_block(store, "far", block, [3, 2], now=t0)
    result = store.advance_wheel(now=block - WINDOW)
    assert _near_until(store) == block + DAY and _far_messages(store) == 0
    assert result.next_due != block - WINDOW  # nothing due: no call to pass again at once
    _deliver_through(store, block, block + DAY, timedelta(hours=1))
    _check_delivered(store, "far", due, set())


def test_the_runtime_role_rolls_in_slices(role_db: tuple[str, str]) -> None:
    """A slice deletes the segments it moves (migrations/023 lets the runtime role): the roll as the runtime."""
    _, runtime = role_db
    with Store(runtime, Settings(wheel_roll_slice=2)) as store:
        t0 = store.clock().replace(microsecond=0)
        store.advance_wheel(now=t0)
        block = _near_until(store)
        due = _send_block(store, "far", block, [1, 3, 1, 2], now=t0)
        now = block - WINDOW
        while _near_until(store) == block:
            now += timedelta(seconds=1)
            store.advance_wheel(now=now)
        _deliver_through(store, block, block + DAY, timedelta(hours=2))
        _check_delivered(store, "far", due, set())


def test_prepare_does_one_step_and_a_busy_lane_stops_none(db_url: str, t0: datetime) -> None:
    """`prepare` (the runner calls it every few minutes) does one step, not the whole roll; a step that cannot take
    the lane (another process's pass, or a cancel) moves nothing, and the roll goes on from where it was."""
    with Store(db_url, Settings(wheel_roll_slice=4)) as store:
        store.advance_wheel(now=t0)
        block = _near_until(store)
        due = _send_block(store, "far", block, [4, 4, 4, 4], now=t0)
        store.prepare(now=block - WINDOW)
        assert _far_messages(store) == 12 and _near_until(store) == block  # one slice of 4
        with psycopg.connect(db_url, autocommit=True) as other:  # another process holds the lane: no slice
            with other.transaction():
                other.execute("SELECT pg_advisory_xact_lock(%s, %s)", (0x64770020, 0))
                assert store.advance_wheel(now=block - WINDOW).busy
            assert _far_messages(store) == 12
        steps = 0
        while _near_until(store) == block:
            store.advance_wheel(now=block - WINDOW)
            steps += 1
        assert steps == 4  # three more slices, then the one that finds the block empty and the last step
        _deliver_through(store, block, block + DAY, timedelta(hours=1))
        _check_delivered(store, "far", due, set())


def test_a_roll_that_meets_a_cancels_lookup_gives_way_and_nobody_gets_a_deadlock(store: Store, t0: datetime) -> None:
    """A cancel's lookup locks wheel_far_segments, then wheel; the roll's last step takes wheel, then
    wheel_far_segments, exclusively. Meeting between the lookup's two locks, the roll waits for the second less than
    `deadlock_timeout` and gives up (roll next pass), so the lookup goes on and no one gets a deadlock error (a race
    run met this: three cancels got one, when the roll waited 5 s)."""
    store.advance_wheel(now=t0)
    block = _near_until(store)
    due = _send_block(store, "far", block, [3, 2], now=t0)
    with psycopg.connect(store.url) as lookup, psycopg.connect(store.url, autocommit=True) as watch:
        lookup.execute("LOCK TABLE delaywheel.wheel_far_segments IN ACCESS SHARE MODE")  # the lookup's first lock
        rolling = Background(lambda: store.advance_wheel(now=block - WINDOW))
        waiting, pid = (
            "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND NOT granted)",
            store.conn.info.backend_pid,
        )
        while rolling.thread.is_alive() and watch.execute(waiting, (pid,)).fetchone() != (True,):
            time.sleep(0.001)
        assert rolling.thread.is_alive(), "the roll never waited for the far parent"
        lookup.execute("SELECT count(*) FROM delaywheel.wheel")  # its second: waits for the roll to give way
        rolling.result()  # (a deadlock error would be raised here)
        assert _near_until(store) == block  # the roll gave way
    store.advance_wheel(now=block - WINDOW)  # and rolls at the next pass
    assert _near_until(store) == block + DAY and _far_messages(store) == 0
    _deliver_through(store, block, block + DAY, timedelta(hours=1))
    _check_delivered(store, "far", due, set())


CALLS = st.lists(st.integers(1, 9), min_size=1, max_size=10)
BETWEEN = st.lists(st.sampled_from(["send", "cancel", "near", "nothing"]), max_size=12)


def test_random_blocks_slices_and_interleavings(db_url: str, t0: datetime) -> None:
    """Property: whatever the call sizes, the slice size and what happens between steps (sends into the block,
    cancels of any of its messages, near-due messages), every message is pending exactly once at every step and is
    delivered exactly once, never early, unless cancelled; and the block goes only at the last step."""
    counter = itertools.count()
    clock = [t0]

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        sizes=CALLS, slice_size=st.integers(1, 12), between=BETWEEN, picks=st.lists(st.integers(0, 200), max_size=12)
    )
    def run_example(sizes: list[int], slice_size: int, between: list[str], picks: list[int]) -> None:
        topic = f"roll{next(counter)}"
        with Store(db_url, Settings(wheel_roll_slice=slice_size)) as store:
            store.advance_wheel(now=clock[0])
            block = _near_until(store)
            now = block - WINDOW
            due = _send_block(store, topic, block, sizes, now=clock[0])
            cancelled: set[int] = set()
            near: set[int] = set()
            for i, (what, pick) in enumerate(itertools.zip_longest(between, picks, fillvalue=0)):
                if _near_until(store) != block:
                    break
                now += timedelta(seconds=1)
                if what == "send":
                    at = block + timedelta(seconds=pick * 311)
                    due[store.send(topic, {"late": i}, deliver_at=at, now=now)] = at
                elif what == "cancel" and due:
                    mid = sorted(due)[pick % len(due)]
                    outcome = [r.outcome for r in store.cancel(message_id=mid)]
                    assert outcome == (["already_cancelled"] if mid in cancelled else ["cancelled"])
                    cancelled.add(mid)
                elif what == "near":
                    near.add(store.send(f"{topic}n", {"n": i}, deliver_at=now, now=now))
                store.advance_wheel(now=now)
                ids = _pending_ids(store, topic)
                assert len(ids) == len(set(ids)) == len(due)
            while _near_until(store) == block:
                now += timedelta(seconds=1)
                store.advance_wheel(now=now)
                ids = _pending_ids(store, topic)
                assert len(ids) == len(set(ids)) == len(due)
            _deliver_through(store, now, block + DAY, timedelta(hours=3))
            _check_delivered(store, topic, due, cancelled)
            assert {d[0] for d in deliveries(store, f"{topic}n")} == near
            clock[0] = floor_to(block + DAY, DAY)

    run_example()


def test_a_slice_killed_midway_moves_nothing(db_url: str, t0: datetime) -> None:
    """A deliverer killed inside a slice (after its DELETE, waiting to insert) leaves every message of that slice in
    the block; another store (no position kept) finishes the roll: each message delivered once."""
    with Store(db_url, Settings(wheel_roll_slice=3)) as store:
        store.advance_wheel(now=t0)
        block = _near_until(store)
        due = _send_block(store, "far", block, [2, 2, 2, 2], now=t0)
        store.advance_wheel(now=block - WINDOW)  # one slice: 4 moved, 4 left
        assert _far_messages(store) == 4
        pid = store.conn.info.backend_pid
        failed: list[BaseException] = []

        def step() -> None:
            try:
                store.advance_wheel(now=block - WINDOW)
            except psycopg.OperationalError as exc:
                failed.append(exc)

        with psycopg.connect(db_url, autocommit=True) as other:
            with other.transaction():  # the block's hours in the near wheel: the slice's insert waits there
                for (name,) in other.execute(
                    "SELECT name FROM delaywheel.partitions WHERE parent = 'wheel' AND lo >= %s AND lo < %s",
                    (block, block + DAY),
                ).fetchall():
                    other.execute(f"LOCK TABLE delaywheel.{name} IN SHARE MODE")
                thread = threading.Thread(target=step)
                thread.start()
                wait_for_lock(other, pid, "the slice's insert")
                other.execute("SELECT pg_terminate_backend(%s)", (pid,))
                thread.join()
            assert failed
    with Store(db_url, Settings(wheel_roll_slice=3)) as again:
        assert _far_messages(again) == 4  # the killed slice's delete did not happen
        assert len(_pending_ids(again, "far")) == len(due)
        now = block - WINDOW
        while _near_until(again) == block:
            now += timedelta(seconds=1)
            again.advance_wheel(now=now)
        _deliver_through(again, block, block + DAY, timedelta(hours=1))
        _check_delivered(again, "far", due, set())


def test_on_the_real_clock_a_pass_notices_the_roll_is_due_without_a_new_look(db_url: str) -> None:
    """A pass looks at `near_until` only when the one it last read may no longer cover the roll's target: it reckons
    the server's clock as the clock read with it plus the time since. So the roll must still start as the clock
    crosses into the next target. The near window is set to end 1.5 s before a midnight, so the target moves a day
    while the test waits: the next pass on the real clock rolls the far day the timer is in."""
    with Store(db_url) as probe:
        clock = probe.conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    midnight = floor_to(clock, DAY) + DAY
    if midnight - clock < timedelta(seconds=30):  # too close to midnight to place the window before it
        midnight += DAY
    window = midnight - clock - timedelta(seconds=1.5)
    with Store(db_url, settings=Settings(wheel_near_window=window)) as store:
        store.advance_wheel()  # rolls up to `midnight`, and reads near_until
        assert _near_until(store) == midnight
        [far] = store.send_many([Message("roll.real", {"n": 1}, deliver_at=midnight + timedelta(hours=1))])
        assert _far_messages(store) == 1
        store.advance_wheel()  # within the window: nothing to roll, and no look
        assert _near_until(store) == midnight and _far_messages(store) == 1
        time.sleep(2)
        for _ in range(10):  # the roll may take a few steps
            if not _far_messages(store):
                break
            store.advance_wheel()
        assert _near_until(store) == midnight + DAY and _far_messages(store) == 0
        assert _pending_ids(store, "roll.real") == [far]
