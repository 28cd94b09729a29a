"""The vectorised batch path (`columns._simple`) against the per-message rules (`validation.prepare`).

`send_many` takes the column checks for the usual batch and the per-message rules for anything else. The two must
agree on everything: the same columns (due times to the microsecond, lanes, clamped levels) for a batch both
accept, and the same error for a batch with a bad message. Hypothesis mixes good batches with every kind of bad
or irregular field; a batch the fast path does not cover is fine as long as the result is the same.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaywheel import Settings
from delaywheel.produce.columns import Columns, _one_by_one, _simple, prepare_columns
from delaywheel.produce.validation import InvalidMessage, Message

NOW = datetime(2030, 1, 1, 12, 0, 0, 250_000, tzinfo=UTC)
SETTINGS = Settings(max_body_bytes=64)
YEAR = timedelta(days=365)

topics = st.sampled_from(
    ["orders", "orders.timeout", "%RETRY%g", "%DLQ%g", "", "bad topic", "x" * 128, "orders\n", "orders\x00"]
)
UNSTORABLE = st.sampled_from(["\x00", "a\x00", "\udcff", "\ud800\udc00"])  # NUL, lone surrogates (issue 18)
bodies = st.one_of(
    st.sampled_from([b"x" * 64, b"x" * 65, "é" * 32, "é" * 33]),
    st.binary(max_size=80),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.lists(st.integers(), max_size=4),
    st.text(max_size=10),
    st.just(object()),
    UNSTORABLE,
    st.dictionaries(UNSTORABLE, st.integers(), max_size=1),
    st.sampled_from(["\\u0000", [[[[]]]]]),
)
keys = st.one_of(st.sampled_from(["", "k" * 1024, "k" * 1025, None]), st.text(max_size=4), st.integers(), UNSTORABLE)
tags = st.one_of(st.none(), st.sampled_from(["created", "paid", "t" * 1024, "t" * 1025]), st.integers(), UNSTORABLE)
properties = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from(["1", "2"])),
    st.just({"a": 1}),
    st.just({1: "a"}),
    st.dictionaries(UNSTORABLE, st.just("1"), max_size=1),
    st.dictionaries(st.just("a"), UNSTORABLE, max_size=1),
    st.sampled_from(
        [
            {"ORIGIN_MESSAGE_ID": "1"},
            {"ORIGIN_TOPIC": "t", "a": "1"},
            {"REPLAY_ID": "r"},
            {"a": "v" * 32_758},
            {"a": "v" * 32_759},
            {"a": "é" * 5459},
        ]
    ),
)
levels = st.one_of(st.sampled_from([-1, 0, 18, 19, 2**31 - 1, 2**31, 2**63, 1.0, True, None]), st.integers(-1, 20))
# the edges of each rule, which random draws over a year would rarely hit
EDGES_DELAY = [
    timedelta(microseconds=-1),
    timedelta(0),
    -1,
    0,
    YEAR,
    YEAR + timedelta(microseconds=1),
    YEAR // timedelta(milliseconds=1),
    YEAR // timedelta(milliseconds=1) + 1,
    0.5,
    -0.0,
]
EDGES_AT = [
    NOW - SETTINGS.past_tolerance,
    NOW - SETTINGS.past_tolerance - timedelta(microseconds=1),
    NOW,
    NOW + YEAR,
    NOW + YEAR + timedelta(microseconds=1),
]
delays = st.one_of(
    st.sampled_from(EDGES_DELAY),
    st.timedeltas(-timedelta(seconds=2), YEAR + timedelta(days=1)),
    st.integers(-1, (YEAR // timedelta(milliseconds=1)) + 2000),
    st.floats(-1, 1e5),
    st.just(float("nan")),
)
times = st.one_of(
    st.sampled_from(EDGES_AT),
    st.datetimes(
        NOW.replace(tzinfo=None) - timedelta(days=1),
        NOW.replace(tzinfo=None) + YEAR + timedelta(days=1),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=-5))]),
    ),
    st.datetimes(NOW.replace(tzinfo=None), NOW.replace(tzinfo=None) + timedelta(days=1)),  # naive
)


FIELDS = ["topic", "body", "key", "tags", "properties", "when"]


@st.composite
def batches(draw: st.DrawFn) -> list[Message]:
    """Mostly one kind of delay per batch (the fast path's case), sometimes a mix; good fields except for at most one
    chosen field, which draws from everything (bad, irregular and good values): a second bad field would mask the
    first for any rule checked after it."""
    kind = draw(st.sampled_from(["level", "delay", "at", "none", "mixed"]))
    wild = draw(st.sampled_from([None, *FIELDS]))

    def pick(field: str, good: st.SearchStrategy[object], anything: st.SearchStrategy[object]) -> object:
        return draw(anything if field == wild else good)

    out = []
    for _ in range(draw(st.integers(1, 12))):
        k = draw(st.sampled_from(["level", "delay", "at", "none"])) if kind == "mixed" else kind
        when = {
            "level": lambda: {"delay_level": pick("when", st.integers(0, 20), levels)},
            "delay": lambda: {"delay": pick("when", st.timedeltas(timedelta(0), YEAR), delays)},
            "at": lambda: {
                "deliver_at": pick(
                    "when",
                    st.datetimes(
                        NOW.replace(tzinfo=None) - timedelta(seconds=1),
                        NOW.replace(tzinfo=None) + YEAR,
                        timezones=st.just(UTC),
                    ),
                    times,
                )
            },
            "none": lambda: {},
        }[k]()
        out.append(
            Message(
                pick("topic", st.sampled_from(["orders", "orders.timeout"]), topics),  # type: ignore[arg-type]
                pick("body", st.binary(max_size=64), bodies),
                key=pick("key", st.one_of(st.none(), st.text(min_size=1, max_size=4)), keys),  # type: ignore[arg-type]
                tags=pick("tags", st.sampled_from([None, "created"]), tags),  # type: ignore[arg-type]
                properties=pick("properties", st.sampled_from([None, {"a": "1"}]), properties),  # type: ignore[arg-type]
                **when,
            )
        )
    return out


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
