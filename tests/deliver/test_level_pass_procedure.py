"""The level pass procedure (migrations/029, as 033 replaced it) runs the library's own statements: a change to any
of them in deliver/levels.py (or to the commit horizon, the planner settings or the level's head) fails here until a
migration installs it in the procedure too."""

from __future__ import annotations

from delaywheel import Store
from delaywheel.db import COMMIT_HORIZON
from delaywheel.deliver import levels
from delaywheel.pending import LEVEL_HEAD
from tests.deliver.test_wheel_pass_procedure import DURABLE, PLACEHOLDER, as_variables, words


def test_the_procedure_runs_the_librarys_statements(store: Store) -> None:
    source, inputs = store.conn.execute(
        "SELECT p.prosrc, p.proargnames[1:8] FROM pg_proc p WHERE p.oid = to_regproc('delaywheel.level_pass')"
    ).fetchone()  # type: ignore[misc]
    flat = words(source)
    for statement in (levels.CURSOR, levels._DELIVER, LEVEL_HEAD):  # as written there, indented as the body
        assert words(as_variables(statement)) in flat, statement
    assert words(COMMIT_HORIZON) in flat and f"PERFORM {levels.PLAN};" in source
    # the lock, then the checkpoint, the move, the commit (not waiting for its flush) and the head, in that order
    order = ["delaywheel.take_lane(", words(as_variables(levels.CURSOR)), words(as_variables(levels._DELIVER))]
    order += [DURABLE, "COMMIT;", words(as_variables(LEVEL_HEAD))]
    positions = [flat.index(part) for part in order]
    assert positions == sorted(positions)
    # the CALL passes the procedure's inputs in their order
    assert [f"p_{name}" for name in PLACEHOLDER.findall(levels._CALL)] == inputs
