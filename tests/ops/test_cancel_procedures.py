"""The cancel procedures (sql/cancel.sql) run the queries ops/cancel.py also runs itself inside a caller's transaction:
a change to the lookup, the lane wait or the search of the topics on one side fails here until the other has it too."""

from __future__ import annotations

import re

import pytest

from delaywheel import Store
from delaywheel.db import LOOKUP_PLAN
from delaywheel.ops import cancel as cancel_module

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def as_parameters(query: str) -> str:
    """A query of ops/cancel.py as a procedure embeds it: each placeholder %(x)s as the parameter p_x."""
    return _PLACEHOLDER.sub(r"p_\1", query)


@pytest.mark.parametrize("how", ["id", "key"])
def test_the_procedures_run_the_librarys_queries(store: Store, how: str) -> None:
    source, inputs = store.conn.execute(
        "SELECT p.prosrc, p.proargnames[1:p.pronargs - 3] FROM pg_proc p"  # the three INOUT results last
        " WHERE p.oid = to_regproc(%s)",
        (f"delaywheel.cancel_by_{how}",),
    ).fetchone()  # type: ignore[misc]
    wait = as_parameters(cancel_module._lane_wait(cancel_module._LANES_MAY_HOLD[how]))
    assert as_parameters(cancel_module._FIND_ONE[how]) in source
    assert "PERFORM" + wait.removeprefix("SELECT") in source
    assert as_parameters(cancel_module._DELIVERED[how]) in source
    assert as_parameters(cancel_module._CANCELLED[how]) in source
    assert cancel_module.FIND_PLAN in source and LOOKUP_PLAN in source
    # the CALL passes the procedure's parameters in their order
    assert [f"p_{name}" for name in _PLACEHOLDER.findall(cancel_module._CALL[how])] == inputs
