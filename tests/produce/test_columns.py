"""The vectorised batch path (`columns._simple`) against the per-message rules (`validation.prepare`).

`send_many` takes the column checks for the usual batch and the per-message rules for anything else. The two must
agree on everything: the same columns (due times to the microsecond, lanes, clamped levels) for a batch both
accept, and the same error for a batch with a bad message. Hypothesis mixes good batches with every kind of bad
or irregular field (`tests.helpers.batches`); a batch the fast path does not cover is fine as long as the result is
the same.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaywheel.produce.columns import Columns, _one_by_one, _simple, prepare_columns
from delaywheel.produce.validation import InvalidMessage, Message
from tests.helpers import EDGES_AT, EDGES_DELAY, NOW, SETTINGS, batches


def _outcome(prepare: object, batch: list[Message]) -> Columns | tuple[str, str]:
    try:
        return prepare(batch, NOW, SETTINGS, np.zeros(len(batch), np.int32))  # type: ignore[operator]
    except InvalidMessage as e:
        return (e.reason, str(e))


def _as_lists(c: Columns) -> list[list[object]]:
    return [col.to_pylist() if isinstance(col, pa.Array) else col.tolist() for col in c]


def _assert_both_paths_agree(batch: list[Message]) -> None:
    expected = _outcome(_one_by_one, batch)
    got = _outcome(prepare_columns, batch)
    if isinstance(expected, Columns):
        assert isinstance(got, Columns), got
        assert _as_lists(got) == _as_lists(expected)
    else:
        assert got == expected


@settings(max_examples=600, deadline=None)
@given(batches())
def test_the_column_checks_agree_with_the_per_message_rules(batch: list[Message]) -> None:
    _assert_both_paths_agree(batch)


def test_a_good_batch_takes_the_column_checks() -> None:
    """The equivalence above would hold trivially if every batch fell back; the usual batch must not."""
    batch = [Message("orders", b"x", delay_level=3, key=f"k{i}") for i in range(100)]
    assert _simple(batch, NOW, SETTINGS, np.zeros(100, np.int32)) is not None
    batch = [Message("orders", {"n": i}, delay=timedelta(seconds=i)) for i in range(100)]
    assert _simple(batch, NOW, SETTINGS, np.zeros(100, np.int32)) is not None


EDGES = [
    *(Message("orders", body, delay_level=1) for body in (b"x" * 64, b"x" * 65, "é" * 31, "é" * 32)),
    *(Message("orders", b"x", delay_level=1, key=key) for key in ("k" * 1024, "k" * 1025, "")),
    *(Message("orders", b"x", delay_level=level) for level in (-1, 0, 18, 19, 2**31 - 1, 2**31)),
    *(Message("orders", b"x", delay=delay) for delay in EDGES_DELAY),
    *(Message("orders", b"x", deliver_at=when) for when in EDGES_AT),
]


@pytest.mark.parametrize("edge", EDGES, ids=repr)
def test_the_edges_of_each_rule_agree(edge: Message) -> None:
    """Each rule's boundary, after a good message of the same kind (so the batch stays one the column checks take)."""
    batch = [edge._replace(body=b"ok", key=None), edge]
    _assert_both_paths_agree(batch)


@given(
    st.lists(
        st.one_of(st.text(max_size=40), st.sampled_from(["", "order-42", "é" * 300, "🙂k"])), min_size=1, max_size=20
    )
)
@settings(max_examples=100, deadline=None)
def test_a_looked_up_key_hashes_as_a_segment_filter_does(keys: list[str]) -> None:
    """keyblooms.probe (plain Python, for cancel by key) and key_hashes (numpy, for a batch's filters) agree."""
    from delaywheel.produce.keyblooms import key_hashes, probe

    h1, h2 = key_hashes(pa.array(keys, pa.string()))
    assert [probe(k) for k in keys] == list(zip(h1.tolist(), h2.tolist(), strict=True))
