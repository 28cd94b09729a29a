"""The wheel pass procedure (migrations/028, as 033 replaced it) runs the library's own statements: a change to any
of them in deliver/wheel.py (or to the commit horizon or the planner settings in db.py) fails here until a migration
installs it in the procedure too."""

from __future__ import annotations

import re

from delaywheel import Store
from delaywheel.db import COMMIT_HORIZON, DURABLE_COMMIT, PASS_PLAN, QUEUE_PLAN
from delaywheel.deliver import wheel
from delaywheel.types import MAX_ID

PLACEHOLDER = re.compile(r"%\((\w+)\)s")
# The pass's commit waits for its WAL flush whatever the session's setting, set right before it.
DURABLE = f"PERFORM {DURABLE_COMMIT};"


def as_variables(statement: str) -> str:
    """A statement of deliver/wheel.py as the procedure embeds it: each placeholder %(x)s as the variable p_x."""
    return PLACEHOLDER.sub(r"p_\1", statement)


def words(text: str) -> str:
    """`text` with every run of white space as one space: the procedure indents what it embeds."""
    return " ".join(text.split())


def test_the_procedure_runs_the_librarys_statements(store: Store) -> None:
    source, inputs = store.conn.execute(
        "SELECT p.prosrc, p.proargnames[1:9] FROM pg_proc p WHERE p.oid = to_regproc('delaywheel.wheel_pass')"
    ).fetchone()  # type: ignore[misc]
    statements = [wheel.CURSOR, wheel._MOVE_STRAGGLERS, wheel._MOVE_DUE, wheel._APPEND, wheel._TRIM]
    statements += [wheel._HEAD_SOON, wheel._HEAD_AFTER]
    flat = words(source)
    for statement in statements:  # as written there, indented as the procedure's body
        assert words(as_variables(statement)) in flat, statement
    assert words(COMMIT_HORIZON) in flat and PASS_PLAN in source and QUEUE_PLAN in source and str(MAX_ID) in source
    # the queue plan is set after the stragglers' move and before the due batch's, as the module says
    stragglers, due = (flat.index(words(as_variables(s))) for s in (wheel._MOVE_STRAGGLERS, wheel._MOVE_DUE))
    assert stragglers < flat.index(f"PERFORM {QUEUE_PLAN}") < due
    # the lane's lock before all of it; the append, then the commit, waiting for its flush, then the head
    parts = ["delaywheel.take_lane(", words(as_variables(wheel._APPEND)), DURABLE, "COMMIT;"]
    parts.append(words(as_variables(wheel._HEAD_SOON)))
    positions = [flat.index(part) for part in parts]
    assert positions == sorted(positions)
    # the CALL passes the procedure's inputs in their order
    assert [f"p_{name}" for name in PLACEHOLDER.findall(wheel._CALL)] == inputs
