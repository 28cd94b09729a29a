"""Property-based: random mixes of levels, wheel times (near, far, across many rolls), cancels and bulk
cancels, rows made undeliverable with SQL (set aside, migrations/016), and random clock advances. One database per test;
each example uses its own topic and a clock that only moves forward, so examples do not disturb each other."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.produce.validation import Message
from tests.helpers import deliveries

SEND = st.one_of(
    st.tuples(st.just("level"), st.integers(1, 18)),
    st.tuples(st.just("wheel"), st.floats(0, 120, allow_nan=False)),  # seconds, inside a slot or a few
    st.tuples(st.just("wheel"), st.floats(120, 3 * 86400, allow_nan=False)),
    st.tuples(st.just("wheel"), st.floats(4 * 86400, 200 * 86400, allow_nan=False)),  # beyond the near window
)


def test_random_sends_cancels_and_clocks(db_url: str, t0: datetime) -> None:
    counter = itertools.count()
    clock = [t0]
    set_aside = [0]
    with Store(db_url, Settings(wheel_near_window=timedelta(hours=2))) as store:

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            sends=st.lists(SEND, min_size=1, max_size=25),
            cancel_picks=st.lists(st.integers(0, 24), max_size=6),
            bulk_picks=st.lists(st.integers(0, 24), max_size=6),
            poison_picks=st.lists(st.integers(0, 24), max_size=3),
            steps=st.lists(st.floats(0.001, 300 * 86400, allow_nan=False), min_size=1, max_size=3),
        )
        # one example that surely poisons (a near-wheel timer and a level message), so the set-aside path is
        # always exercised whatever the random draws
        @example(
            sends=[("wheel", 200.0), ("level", 3)], cancel_picks=[], bulk_picks=[], poison_picks=[0, 1], steps=[1.0]
        )
        def run_example(
            sends: list[tuple[str, float]],
            cancel_picks: list[int],
            bulk_picks: list[int],
            poison_picks: list[int],
            steps: list[float],
        ) -> None:
            topic = f"prop{next(counter)}"
            base = clock[0]
            messages = [
                Message(topic, {"i": i}, key=f"{topic}-{i}", delay_level=int(v), properties={"i": str(i)})
                if lane == "level"
                else Message(
                    topic,
                    {"i": i},
                    key=f"{topic}-{i}",
                    deliver_at=base + timedelta(seconds=v),
                    properties={"i": str(i)},
                )
                for i, (lane, v) in enumerate(sends)
            ]
            ids = store.send_many(messages, now=base)
            due = dict(
                zip(
                    ids,
                    [
                        base + (store.settings.level_delay(int(v)) if lane == "level" else timedelta(seconds=v))
                        for lane, v in sends
                    ],
                    strict=True,
                )
            )
            level_of = {mid: int(v) for mid, (lane, v) in zip(ids, sends, strict=True) if lane == "level"}
            cancelled = set()
            for pick in cancel_picks:
                if pick < len(ids):
                    for result in store.cancel(message_id=ids[pick]):
                        if result.outcome == "cancelled":
                            cancelled.add(result.message_id)
            # Poison a few pending messages that no cancel picks (a cancel reads properties as jsonb too): each
            # is set aside by the pass that meets it, and nothing else changes.
            poisoned = {
                ids[p]
                for p in poison_picks
                if p < len(ids)
                and p not in cancel_picks + bulk_picks
                and ids[p] not in cancelled
                and _poison(store, ids[p])
            }
            now = base
            for n, step in enumerate([*sorted(steps), (max(due.values()) - base).total_seconds() + 1]):
                now = max(now, base + timedelta(seconds=step))
                store.deliver_due(now=now)
                if n == 0 and bulk_picks:  # a bulk cancel between clock advances
                    keys = [f"{topic}-{p}" for p in bulk_picks if p < len(ids)]
                    before = store.count_matching(keys=keys)
                    assert store.cancel_matching(keys=keys) == before
                    pending = {mid for mid in ids if mid not in {r[0] for r in deliveries(store, topic)}}
                    cancelled |= {mid for mid in pending if messages[ids.index(mid)].key in keys}
                rows = deliveries(store, topic)
                got = [r[0] for r in rows]
                assert len(got) == len(set(got)), "exactly once"
                assert not set(got) & cancelled, "cancelled never delivered"
                assert all(r[1] == due[r[0]] and r[2] >= r[1] for r in rows), "never early, due time kept"
                assert set(got) == {m for m in ids if due[m] <= now and m not in cancelled | poisoned}, (
                    "all due delivered"
                )
                aside = {
                    r[0]
                    for r in store.conn.execute(
                        "SELECT message_id FROM delaywheel.set_aside WHERE message_id = ANY(%s)", (ids,)
                    ).fetchall()
                }
                assert aside <= poisoned, "only what cannot be delivered is set aside"
                assert {m for m in poisoned if due[m] <= now and m not in cancelled} <= aside, "set aside when met"
                for level in set(level_of.values()):
                    same = [m for m in got if level_of.get(m) == level]
                    assert same == sorted(same), "FIFO per level"
            set_aside[0] += len(poisoned)
            clock[0] = now + timedelta(seconds=1)
            store.retire(now=clock[0])

        run_example()
    assert set_aside[0], "some example set a row aside"


def _poison(store: Store, message_id: int) -> bool:
    """Make a pending message undeliverable with SQL, wherever it waits: properties that do not cast to jsonb (a
    segment keeps them as text) or that are not an object (the near wheel's jsonb). False if it was delivered
    at once (a due time already past)."""
    changed = 0
    for table in ("level_segments", "wheel_far_segments"):
        changed += store.conn.execute(
            f"UPDATE delaywheel.{table} SET properties[array_position(ids, %(id)s)] = %(bad)s"
            " WHERE ids @> ARRAY[%(id)s::bigint]",
            {"id": message_id, "bad": '{"p": "\\udcff"}'},
        ).rowcount
    changed += store.conn.execute(
        "UPDATE delaywheel.wheel SET properties = '[1]' WHERE id = %s", (message_id,)
    ).rowcount
    return changed > 0
