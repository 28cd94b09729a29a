"""The level pass (sql/level_pass.sql) as the library calls it: the CALL passes the procedure's inputs in their order,
and what a pass leaves is what the library reads after it: the checkpoint (levels.CURSOR) past the due prefix, and
the level's head (pending.LEVEL_HEAD) at the first message it left."""

from __future__ import annotations

import re
from datetime import datetime

from delaywheel import Store
from delaywheel.deliver import levels
from delaywheel.pending import LEVEL_HEAD
from tests.helpers import at

PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def test_the_call_passes_the_procedures_inputs_in_their_order(store: Store) -> None:
    row = store.conn.execute(
        "SELECT p.proargnames[1:8] FROM pg_proc p WHERE p.oid = to_regproc('delaywheel.level_pass')"
    ).fetchone()
    assert row is not None
    assert [f"p_{name}" for name in PLACEHOLDER.findall(levels._CALL)] == row[0]


def test_a_pass_moves_the_due_prefix_and_leaves_checkpoint_and_head(store: Store, t0: datetime) -> None:
    first = [store.send("orders", {"n": i}, delay_level=1, now=t0) for i in range(3)]
    later = store.send("orders", {"n": 3}, delay_level=1, now=at(t0, 5))
    store.cancel(message_id=first[1])
    result = store.deliver_level(1, now=at(t0, 2))
    assert (result.delivered, result.skipped_cancelled, result.next_due) == (2, 1, at(t0, 6))
    _, cursor_id = store.conn.execute(levels.CURSOR, {"level": 1}).fetchone()  # type: ignore[misc]
    assert cursor_id == first[2]  # past the whole due prefix, the cancelled one too
    head = store.conn.execute(LEVEL_HEAD, {"level": 1}).fetchone()
    assert head is not None and at(t0, 6) in head
    assert store.deliver_level(1, now=at(t0, 6)).delivered == 1
    delivered = [r[0] for r in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages ORDER BY 1")]
    assert delivered == [first[0], first[2], later]
