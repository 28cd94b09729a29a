"""The wheel pass (sql/wheel_pass.sql) as the library calls it: the CALL passes the procedure's inputs in their order,
and what a pass leaves is what the library reads after it (wheel.CURSOR) and reports (the next due time), stragglers
included."""

from __future__ import annotations

import re
from datetime import datetime

import psycopg

from delaywheel import Store
from delaywheel.deliver import wheel
from delaywheel.types import MAX_ID
from tests.helpers import at

PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def test_the_call_passes_the_procedures_inputs_in_their_order(store: Store) -> None:
    row = store.conn.execute(
        "SELECT p.proargnames[1:9] FROM pg_proc p WHERE p.oid = to_regproc('delaywheel.wheel_pass')"
    ).fetchone()
    assert row is not None
    assert [f"p_{name}" for name in PLACEHOLDER.findall(wheel._CALL)] == row[0]


def test_a_pass_leaves_its_cursor_and_head_and_the_next_takes_the_stragglers(
    store: Store, db_url: str, t0: datetime
) -> None:
    ids = [store.send("orders", {"n": i}, deliver_at=at(t0, 10 + i), now=t0) for i in range(3)]
    result = store.advance_wheel(now=at(t0, 11))
    assert (result.delivered, result.next_due, result.more) == (2, at(t0, 12), False)
    _, cursor_at, cursor_id, _, delivered = store.conn.execute(wheel.CURSOR).fetchone()  # type: ignore[misc]
    assert (cursor_at, cursor_id, delivered) == (at(t0, 11), MAX_ID, 2)  # all due up to the clock: past its last id
    # a row committed behind the cursor after the pass (a straggler) goes with the next pass, never lost
    with psycopg.connect(db_url, autocommit=True) as late:
        late.execute(
            "INSERT INTO delaywheel.wheel (id, topic, body, is_json, deliver_at, enqueued_at)"
            " VALUES (nextval('delaywheel.message_id_seq'), 'orders', 'x', false, %s, %s)",
            (at(t0, 5), t0),
        )
    result = store.advance_wheel(now=at(t0, 12))
    assert result.delivered == 2 and result.next_due is None
    delivered_ids = [r[0] for r in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages")]
    assert len(delivered_ids) == len(set(delivered_ids)) == 4 and set(ids) <= set(delivered_ids)
