"""A group's tag filter (RocketMQ's subscribe expression, `consume/tags.py`): the parser against a simple model, and
the filter at the pull: a group is handed exactly its tags' messages, in order, each once, and its offset passes the
others with the batch's ack."""

from __future__ import annotations

import json
import string
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from delaywheel import Message, Store
from delaywheel.cli import main
from delaywheel.consume import tags
from delaywheel.consume.topics import retry_topic
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import MAX_TAGS_CHARS

# A tag as a subscription can name one: no `||`, no space or `|` at either end, not `*`, not empty.
TAG = st.text(string.ascii_letters + string.digits + " |-_.*é", min_size=1, max_size=12).filter(
    lambda t: t == t.strip() and "||" not in t and not t.startswith("|") and not t.endswith("|") and t != "*"
)


def model(expression: str) -> frozenset[str] | None:
    """What an expression means, written plainly: `*` all, else the `||`-separated tags, stripped."""
    if expression.strip() == "*":
        return None
    return frozenset(part.strip() for part in expression.split("||"))


@given(st.frozensets(TAG, min_size=1, max_size=8))
def test_render_then_parse_gives_the_same_tags(accepted: frozenset[str]) -> None:
    assert tags.parse(tags.render(accepted)) == accepted
    assert tags.parse(tags.render(None)) is None


@hsettings(max_examples=500)
@given(st.one_of(st.text(max_size=60), st.text(" |*ab", max_size=30)))
def test_any_text_parses_as_the_model_says_or_is_refused_with_a_value_error(expression: str) -> None:
    try:
        parsed = tags.parse(expression)
    except ValueError as refused:
        assert str(refused).startswith("tags")
        parts = [p.strip() for p in expression.split("||")]
        assert (
            not expression.strip()
            or "\x00" in expression
            or any(not p or p == "*" or p.startswith("|") or p.endswith("|") for p in parts)
            or not all(_storable(p) for p in parts)
        )
        return
    assert parsed == model(expression)


@given(st.frozensets(TAG, max_size=5), st.one_of(st.none(), TAG))
def test_a_tag_matches_exactly_when_it_is_one_of_the_expressions(accepted: frozenset[str], tag: str | None) -> None:
    expression = tags.render(accepted) if accepted else "*"
    parsed = tags.parse(expression)
    assert tags.matches(parsed, tag) == (not accepted or tag in accepted)


def _storable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("A ||", "tag 2 .* is empty"),
        ("|| A", "tag 1 .* is empty"),
        ("A || || B", "tag 2 .* is empty"),
        ("A || *", "stands alone"),
        ("A|||B", "starts or ends with '|'"),
        ("A\x00", "NUL"),
        ("x" * (MAX_TAGS_CHARS + 1), f"at most {MAX_TAGS_CHARS}"),
        (" || ".join(f"t{i}" for i in range(tags.MAX_TAGS + 1)), "above the limit"),
        ("x" * (tags.MAX_EXPRESSION_CHARS + 1), "characters, above"),
        (7, "must be a string"),
        (b"A", "must be a string"),
    ],
)
def test_bad_expressions_are_refused_with_the_reason(expression: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        tags.parse(expression)


def test_spaces_and_single_bars_inside_a_tag_are_the_tags() -> None:
    assert tags.parse(" a b ||c|d|| e ") == {"a b", "c|d", "e"}
    assert tags.parse(" * ") is None and tags.parse(None) is None


def _send(store: Store, topic: str, tagged: list[str | None], keys: list[str | None] | None = None) -> list[int]:
    keys = keys or [None] * len(tagged)
    return store.send_many(
        [Message(topic, {"n": i}, tags=tag, key=key) for i, (tag, key) in enumerate(zip(tagged, keys, strict=True))]
    )


def test_a_group_is_handed_its_tags_and_its_offset_passes_the_rest(store: Store) -> None:
    ids = _send(store, "orders", ["A", "B", None, "C", "A", "a"])
    batch = store.pull("orders", "g", tags="A || C")
    assert [m.message_id for m in batch.messages] == [ids[0], ids[3], ids[4]]
    assert batch.skipped == 3 and batch
    assert store.ack(batch).acked == 3
    assert not store.pull("orders", "g", tags="A || C")  # nothing read: the offset passed the skipped ones too
    assert len(store.pull("orders", "g")) == 0  # whatever the filter: the skipped rows are behind the offset
    assert [m.message_id for m in store.pull("orders", "all").messages] == ids  # another group: its own offset
    assert [m.message_id for m in store.pull("orders", "star", tags="*").messages] == ids


def test_a_batch_of_skipped_rows_only_is_acked_past_them(store: Store) -> None:
    ids = _send(store, "orders", ["B", "B", "A", "B"])
    batch = store.pull("orders", "g", 2, tags="A")
    assert batch.messages == [] and batch.skipped == 2 and batch and batch.behind  # read two, more behind them
    assert store.ack(batch).acked == 0
    batch = store.pull("orders", "g", 2, tags="A")
    assert [m.message_id for m in batch.messages] == [ids[2]] and batch.skipped == 1
    store.ack(batch)
    assert not store.pull("orders", "g", 2, tags="A")


def test_a_queue_whose_rows_were_all_skipped_is_acked_past_them(store: Store) -> None:
    """A batch over two queues, one of them with skipped rows only: a cursor there and no message; its ack (the common
    move, one statement) passes both queues' rows."""
    ids = _send(store, "orders", ["A", "B", "A", "B"], ["k1", "k2", "k1", "k2"])
    batch = store.pull("orders", "g", tags="A")
    assert [m.message_id for m in batch.messages] == [ids[0], ids[2]] and batch.skipped == 2
    assert len(batch.cursors) == 2 and len(set(batch.qids)) == 1  # k1's and k2's queues differ
    assert store.ack(batch).acked == 2
    assert not store.pull("orders", "g")  # k2's queue too: passed


def test_the_group_retry_topic_is_not_filtered(store: Store) -> None:
    """A retry is a message the group took already (it failed): a filter that dropped it would lose a failure."""
    _send(store, "orders", ["A"])
    send_for_store(store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"r": 1}, tags="A")], [1])
    send_for_store(store.conn, store.settings, store._cache, [Message(retry_topic("g"), {"r": 2}, tags="Z")], [1])
    batch = store.pull("orders", "g", tags="B")
    assert [m.body for m in batch.messages] == [{"r": 1}, {"r": 2}] and batch.skipped == 1


def test_consume_hands_only_the_groups_tags_and_passes_the_rest(db_url: str, store: Store) -> None:
    tagged = ["A", "B", "B", "B", "A", None, "C", "B", "B", "A"]
    ids = _send(store, "orders", tagged)
    handed: list[int] = []
    with Store(db_url) as own:
        totals = own.consume(
            "orders",
            "g",
            lambda messages: handed.extend(m.message_id for m in messages),
            max_messages=2,
            tags="A||C",
            idle_s=1.5,
        )
    assert handed == [i for i, tag in zip(ids, tagged, strict=True) if tag in ("A", "C")]
    assert totals.messages == 4 and totals.skipped == 6
    assert not store.pull("orders", "g")  # everything passed
    with Store(db_url) as own:
        got = list(own.messages("orders", "h", tags="B", idle_s=1.5))
    assert [m.message_id for m in got] == [i for i, tag in zip(ids, tagged, strict=True) if tag == "B"]
    assert not store.pull("orders", "h")


def test_a_bad_expression_is_refused_before_anything_is_read(store: Store) -> None:
    _send(store, "orders", ["A"])
    with pytest.raises(ValueError, match="stands alone"):
        store.pull("orders", "g", tags="A || *")
    with pytest.raises(ValueError, match="empty"):
        store.consume("orders", "g", lambda _: None, tags="", idle_s=0.1)
    assert store.conn.execute("SELECT count(*) FROM delaywheel.consumer_offsets").fetchone() == (0,)


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sent=st.lists(
        st.tuples(st.sampled_from(["A", "B", "C", None]), st.sampled_from([None, "k1", "k2", "k3"])), max_size=30
    ),
    accepted=st.frozensets(st.sampled_from(["A", "B", "C"])),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8),
)
def test_pulls_and_acks_with_a_filter_match_the_model(
    store: Store, sent: list[tuple[str | None, str | None]], accepted: frozenset[str], sizes: list[int]
) -> None:
    """Random tags, keys (queues), filter and batch sizes: pulled and acked in turn, the group is handed exactly the
    messages with its tags, in the topic's order, each once (acked ones never again), and ends with nothing left to
    read: a queue whose rows a batch skipped, all or some, is acked past them too."""
    tagged = [tag for tag, _ in sent]
    topic, group = f"t{uuid.uuid4().hex[:8]}", "g"
    ids = _send(store, topic, tagged, [key for _, key in sent])
    expression = tags.render(accepted) if accepted else "*"
    want = [i for i, tag in zip(ids, tagged, strict=True) if not accepted or tag in accepted]
    handed: list[int] = []
    for n in range(len(ids) + 2):
        batch = store.pull(topic, group, sizes[n % len(sizes)], tags=expression)
        if not batch:
            break
        assert all(tags.matches(tags.parse(expression), m.tags) for m in batch.messages)
        handed += [m.message_id for m in batch.messages]
        store.ack(batch)
    assert handed == want
    assert not store.pull(topic, group, 100, tags=expression) and not store.pull(topic, group, 100)


def test_the_cli_takes_tags_and_refuses_a_bad_expression(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    ids = _send(store, "orders", ["A", "B", "A"])
    assert main(["pull", "--topic", "orders", "--group", "g", "--tags", "A", "--ack"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [int(line.split("\t")[0]) for line in lines[:2]] == [ids[0], ids[2]]
    assert lines[2] == "2 message(s), 1 skipped by --tags, 2 acked"
    with pytest.raises(SystemExit) as refused:  # while the arguments are parsed
        main(["pull", "--topic", "orders", "--group", "g", "--tags", "A||"])
    assert refused.value.code == 2
    assert "tag 2 of 'A||' is empty" in capsys.readouterr().err
    assert main(["consume", "--topic", "orders", "--group", "h", "--tags", "B", "--idle", "1s", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["message_id"] for r in map(json.loads, captured.out.splitlines())] == [ids[1]]
    assert "skipped 2 (--tags)" in captured.err
