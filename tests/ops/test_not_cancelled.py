"""One definition of "cancelled" (pending.cancelled): a cancellation is of the message with that id *due at that
time*, for every reader. Bulk cancel and reconcile used to read `message_id` alone, the deliverers and quality
(message_id, due_at): on a cancellation naming a message's id with another due time, bulk cancel counted the message
as cancelled while the deliverers delivered it."""

from __future__ import annotations

from datetime import datetime, timedelta

from psycopg import sql

from delaywheel import Store
from delaywheel.batch.quality import due_sql
from delaywheel.batch.reconcile import Reconcile
from delaywheel.partitions import PartitionCache
from delaywheel.pending import PENDING
from tests.helpers import deliveries

KEYS = ["k-level", "k-near", "k-far"]


def _due_cancelled(store: Store, t0: datetime) -> dict[int, bool]:
    query = due_sql(t0, t0 + timedelta(days=30), timedelta(days=1))
    return {mid: cancelled for mid, _, _, _, _, _, cancelled in store.conn.execute(query)}  # type: ignore[arg-type]


def test_every_reader_agrees_on_what_is_cancelled(store: Store, t0: datetime) -> None:
    level = store.send("orders", b"l", delay_level=1, key="k-level", now=t0)
    near = store.send("orders", b"n", delay=timedelta(minutes=5), key="k-near", now=t0)
    far = store.send("orders", b"f", delay=timedelta(days=20), key="k-far", now=t0)
    due = dict(store.conn.execute(sql.SQL("SELECT id, deliver_at FROM ({}) p").format(sql.SQL(PENDING))).fetchall())
    assert set(due) == {level, near, far}
    # A cancellation row for each message's id at another due time (written by hand: the store never writes one).
    cache = PartitionCache()
    for mid, at in due.items():
        cache.ensure(store.conn, "cancellations", [at + timedelta(hours=1)])
        store.conn.execute(
            "INSERT INTO delaywheel.cancellations (message_id, due_at, reason) VALUES (%s, %s, 'other')",
            (mid, at + timedelta(hours=1)),
        )

    # It cancels none of them, for any reader.
    assert store.count_matching(keys=KEYS) == 3
    stale = Reconcile("public.anything", "id", None, "orders", delay=timedelta(minutes=1)).pending_sql(store.conn)
    assert sorted(k for (k,) in store.conn.execute(stale)) == sorted(KEYS)  # type: ignore[arg-type]
    assert _due_cancelled(store, t0) == {level: False, near: False, far: False}

    # The message's own cancellation cancels it, for every reader.
    assert [r.outcome for r in store.cancel(key="k-near")] == ["cancelled"]
    assert store.count_matching(keys=KEYS) == 2
    assert _due_cancelled(store, t0) == {level: False, near: True, far: False}
    store.deliver_due(now=t0 + timedelta(days=21))
    assert sorted(r[0] for r in deliveries(store)) == sorted([level, far])
