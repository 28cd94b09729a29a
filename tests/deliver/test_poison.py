"""Poison messages (issue 18, findings 3, 5 and 6), in two layers.

Validation: every value PostgreSQL cannot store or cast (NUL, lone surrogates), every value beyond a limit, and every
reserved name is refused with InvalidMessage, by the per-message rules and the column checks alike, and nothing is
written. Set-aside: a row that reached a queue anyway (written here with SQL) is set aside with its reason by the
pass that meets it (level pass, wheel pass, the roll), and the lane goes on delivering every other message once.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.consume.topics import Delivered
from delaywheel.partitions import PartitionCache
from delaywheel.produce.columns import _one_by_one, prepare_columns
from delaywheel.produce.validation import (
    MAX_PROPERTIES_BYTES,
    MAX_TAGS_CHARS,
    InvalidMessage,
    Message,
    storable,
)
from tests.helpers import at, deliveries

NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)
SETTINGS = Settings()
LONE = "\udcff"  # what the CLI's argv gives for the byte 0xff (surrogateescape)
UNSTORABLE = ["\x00", "a\x00b", LONE, "\ud800", "x\udc00y", "\ud800\udc00"]  # the last: two lone halves in Python


def _deep(depth: int) -> list:
    body: list = []
    for _ in range(depth):
        body = [body]
    return body


BAD = [  # (message, reason)
    *((Message(t, b"x"), "bad_topic") for t in ("orders\n", "orders\x00", "ord" + LONE, "\norders")),
    *((Message(t, b"x"), "reserved_topic") for t in ("%RETRY%g", "%DLQ%g", "%RETRY%")),
    *((Message("orders", b"x", key=k), "bad_key") for k in UNSTORABLE),
    *((Message("orders", b"x", tags=t), "bad_tags") for t in [*UNSTORABLE, "t" * (MAX_TAGS_CHARS + 1)]),
    *((Message("orders", b"x", properties={"p": v}), "bad_properties") for v in UNSTORABLE),
    *((Message("orders", b"x", properties={k: "v"}), "bad_properties") for k in UNSTORABLE),
    *(
        (Message("orders", b"x", properties={name: "1"}), "reserved_property")
        for name in ("ORIGIN_MESSAGE_ID", "ORIGIN_TOPIC", "REPLAY_ID", "REPLAY_OF_TOPIC")
    ),
    (Message("orders", b"x", properties={"p": "v" * MAX_PROPERTIES_BYTES}), "properties_too_large"),
    (Message("orders", b"x", properties={"p": "é" * 6000}), "properties_too_large"),  # \u00e9 as stored: 6 bytes
    *(
        (Message("orders", body), "bad_body")
        for body in (
            "\x00",
            {"k": "\x00"},
            {"\x00": 1},
            [1, {"a": ["b\x00"]}],
            LONE,
            {"k": "\ud800"},
            {LONE: 1},
            "\ud800\udc00",
            "\\\x00",
            _deep(200_000),
        )
    ),
]
GOOD = [
    Message("orders", b"\x00\xff"),  # bytes bodies are bytes: anything goes
    Message("orders", "\\u0000"),  # the text backslash-u0000, not NUL
    Message("orders", ["a\\", "\\u0000", "\\\\u0000"]),
    Message("orders", {"emoji": "😀", "é": "ü"}),  # a pair escapes as \ud83d\ude00: fine for jsonb
    Message("orders", b"x", key="😀" * 1024, tags="t" * MAX_TAGS_CHARS, properties={"p": "ü😀"}),
    Message("orders", b"x", properties={"p": "v" * (MAX_PROPERTIES_BYTES - 20)}),
    Message("%RETRYg", b"x"),
    Message("a%DLQ%", b"x"),
]


def _outcome(prepare: object, batch: list[Message]) -> object:
    try:
        c = prepare(batch, NOW, SETTINGS, np.zeros(len(batch), np.int32))  # type: ignore[operator]
        return [col.to_pylist() if hasattr(col, "to_pylist") else col.tolist() for col in c]
    except InvalidMessage as e:
        return (e.reason, str(e))


@pytest.mark.parametrize(("message", "reason"), BAD, ids=[f"{reason}-{i}" for i, (_, reason) in enumerate(BAD)])
def test_unstorable_values_limits_and_reserved_names_are_refused(message: Message, reason: str) -> None:
    """Alone and behind a good message of the same kind, by both paths, with the same error."""
    for batch in ([message], [Message("orders", b"ok"), message]):
        one_by_one = _outcome(_one_by_one, batch)
        assert isinstance(one_by_one, tuple) and one_by_one[0] == reason, one_by_one
        assert _outcome(prepare_columns, batch) == one_by_one


@pytest.mark.parametrize("message", GOOD, ids=[str(i) for i in range(len(GOOD))])
def test_storable_values_pass(message: Message) -> None:
    batch = [Message("orders", b"ok"), message]
    got = _outcome(prepare_columns, batch)
    assert not isinstance(got, tuple), got
    assert got == _outcome(_one_by_one, batch)


def test_the_store_may_use_its_reserved_names() -> None:
    """The retry ladder (retry.reconsume_later) writes %RETRY%/%DLQ% topics and ORIGIN_* properties."""
    batch = [
        Message(
            "%RETRY%g",
            b"x",
            delay_level=3,
            properties={"ORIGIN_MESSAGE_ID": "7", "ORIGIN_TOPIC": "o", "REPLAY_ID": "r"},
        ),
        Message("%DLQ%g", b"x", properties={"ORIGIN_MESSAGE_ID": "7"}),
    ]
    for internal in (False, True):
        try:
            prepare_columns(batch, NOW, SETTINGS, internal=internal)
            outcome = "accepted"
        except InvalidMessage as e:
            outcome = e.reason
        assert outcome == ("accepted" if internal else "reserved_topic")
    with pytest.raises(InvalidMessage) as e:
        prepare_columns([Message("orders", b"x", properties={"ORIGIN_TOPIC": "x"})], NOW, SETTINGS)
    assert e.value.reason == "reserved_property"


def test_the_store_may_retry_what_it_stored_before_the_limits() -> None:
    """Limits are for producers: a retry re-sends what the store already held (tags or properties stored before
    the limits existed). Storability still holds for everyone."""
    big = Message("%RETRY%g", b"x", delay_level=3, tags="t" * 5000, properties={"p": "v" * 40_000})
    prepare_columns([big], NOW, SETTINGS, internal=True)
    for bad in (big._replace(tags="\x00"), big._replace(properties={"p": LONE})):
        with pytest.raises(InvalidMessage):
            prepare_columns([bad], NOW, SETTINGS, internal=True)


def test_a_retry_of_an_odd_stored_message_does_not_fail_the_ack(store: Store, t0: datetime) -> None:
    """A delivered row written some other way (long tags, a property that is a number) still goes to the retry
    topic when its consumer fails it, with its properties as strings."""
    store.send("orders", b"x", now=t0)
    store.conn.execute(
        "UPDATE delaywheel.topic_messages SET tags = repeat('t', 5000),"
        ' properties = \'{"n": 1, "ORIGIN_MESSAGE_ID": "abc"}\''
    )
    batch = store.pull("orders", "g")
    (m,) = batch.messages
    assert m.idempotency_id == m.message_id
    store.ack(batch, failed={m.message_id})
    row = store.conn.execute("SELECT tags, properties FROM delaywheel.level_segments").fetchone()
    assert row is not None and row[0] == ["t" * 5000]
    assert json.loads(row[1][0]) == {"n": "1", "ORIGIN_MESSAGE_ID": "abc", "ORIGIN_TOPIC": "orders"}


def test_send_many_of_something_else_is_an_invalid_message() -> None:
    for thing in ({"topic": "orders", "body": b"x"}, ("orders", b"x"), None, "orders"):
        with pytest.raises(InvalidMessage) as e:
            prepare_columns([Message("orders", b"ok"), thing], NOW, SETTINGS)  # type: ignore[list-item]
        assert e.value.reason == "bad_message"


texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=6) | st.sampled_from(UNSTORABLE)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(texts, texts, texts, texts, st.one_of(texts, st.dictionaries(texts, texts, max_size=2))),
        min_size=1,
        max_size=4,
    )
)
def test_both_paths_agree_on_any_text(rows: list[tuple[str, str, str, str, object]]) -> None:
    """Keys, tags, property names and values and JSON bodies drawn from all of Unicode, NUL and surrogates
    included: the column checks and the per-message rules reach the same verdict, which is `storable`'s."""
    batch = [
        Message("orders", body, key=key or None, tags=tags, properties={name: value})
        for key, tags, name, value, body in rows
    ]
    expected = _outcome(_one_by_one, batch)
    assert _outcome(prepare_columns, batch) == expected
    strings = [
        t
        for key, tags, name, value, body in rows
        for t in (key, tags, name, value, *(body.items() if isinstance(body, dict) else [(body, "")]))
    ]
    flat = [x for t in strings for x in (t if isinstance(t, tuple) else (t,))]
    assert isinstance(expected, tuple) == (not all(map(storable, flat))), expected


def test_idempotency_id_never_raises() -> None:
    def delivered(properties: dict) -> Delivered:
        return Delivered("t", 1, 42, None, None, properties, b"", 0, NOW, NOW, "t")

    assert delivered({"ORIGIN_MESSAGE_ID": "7"}).idempotency_id == 7
    for bad in ("abc", "", "-1", "1e3", "٣", "99999999999999999999", " 7", 7):
        assert delivered({"ORIGIN_MESSAGE_ID": bad}).idempotency_id == 42
    assert delivered({}).idempotency_id == 42


def _hot_rows(store: Store) -> int:
    row = store.conn.execute(
        "SELECT (SELECT count(*) FROM delaywheel.level_segments) + (SELECT count(*) FROM delaywheel.wheel)"
        " + (SELECT count(*) FROM delaywheel.wheel_far_segments) + (SELECT count(*) FROM delaywheel.topic_messages)"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_rejected_send_writes_nothing_and_says_why(store: Store, t0: datetime) -> None:
    """What reached PostgreSQL before (CharacterNotInRepertoire, UntranslatableCharacter, UnicodeEncodeError,
    RecursionError, AttributeError) is an InvalidMessage now, in every lane, and nothing is written."""
    cases = [
        {"key": "k\x00"},
        {"tags": "t\x00"},
        {"properties": {"p": "\x00"}},
        {"properties": {"p": LONE}},
        {"key": LONE},
        {"body": _deep(200_000)},
        {"body": {"k": "\x00"}},
        {"topic": "orders\n"},
        {"topic": "%DLQ%g"},
        {"properties": {"ORIGIN_MESSAGE_ID": "1"}},
        {"tags": "t" * 8_000_000},
        {"properties": {"p": "v" * 8_000_000}},
    ]
    for case in cases:
        for when in ({}, {"delay_level": 1}, {"delay": timedelta(seconds=10)}, {"delay": timedelta(days=6)}):
            args = {"topic": "orders", "body": b"x", **when, **case}
            with pytest.raises(InvalidMessage):
                store.send(args.pop("topic"), args.pop("body"), now=t0, **args)
    with pytest.raises(InvalidMessage):
        store.send_many([{"topic": "orders", "body": b"x"}], now=t0)  # type: ignore[list-item]
    assert _hot_rows(store) == 0
    store.send("orders", b"x", now=t0)  # the connection is fine
    assert _hot_rows(store) == 1


# --- set aside: bad rows written with SQL ------------------------------------------------------------------------

BAD_PROPERTIES = '{"p": "\\udcff"}'  # what `send --property $'p=\xff'` stored before validation refused it


def _set_aside(store: Store) -> list[tuple]:
    return store.conn.execute(
        "SELECT message_id, lane, level, topic, reason, properties FROM delaywheel.set_aside ORDER BY message_id"
    ).fetchall()


def _delivered_once(store: Store) -> list[int]:
    ids = [r[0] for r in deliveries(store)]
    assert len(ids) == len(set(ids)), "a message was delivered twice"
    return sorted(ids)


def _cancellation_reasons(store: Store) -> list[tuple[int, str]]:
    return store.conn.execute("SELECT message_id, reason FROM delaywheel.cancellations ORDER BY 1").fetchall()


def test_a_level_row_that_cannot_be_delivered_is_set_aside_and_the_level_goes_on(store: Store, t0: datetime) -> None:
    ids = [store.send("orders", {"n": i}, delay_level=1, now=at(t0, i)) for i in range(6)]  # due t0+1 .. t0+6
    for bad in (ids[1], ids[4]):
        store.conn.execute(
            "UPDATE delaywheel.level_segments SET properties = ARRAY[%s] WHERE id_first = %s", (BAD_PROPERTIES, bad)
        )
    result = store.deliver_level(1, now=at(t0, 3.5))  # the first bad one is due, the second is not yet
    assert (result.delivered, result.skipped_cancelled, result.next_due) == (2, 1, at(t0, 4))
    assert _delivered_once(store) == [ids[0], ids[2]]
    # the batch read the second one too (a pass reads its batch before it knows what is due): set aside early
    assert [r[:5] for r in _set_aside(store)] == [(i, "level", 1, "orders", "bad_properties") for i in (ids[1], ids[4])]
    assert _set_aside(store)[0][5] == BAD_PROPERTIES  # kept as it was stored
    assert store.deliver_level(1, now=at(t0, 4.5)).delivered == 1  # its batch still reads the set-aside row
    result = store.deliver_level(1, now=at(t0, 100), limit=1)
    assert (result.delivered, result.skipped_cancelled, result.more) == (0, 1, True)
    assert store.deliver_level(1, now=at(t0, 100)).delivered == 1
    assert store.deliver_level(1, now=at(t0, 100)).delivered == 0
    assert _delivered_once(store) == sorted(set(ids) - {ids[1], ids[4]})
    assert _cancellation_reasons(store) == [
        (ids[1], "set aside: bad_properties"),
        (ids[4], "set aside: bad_properties"),
    ]
    later = store.send("orders", b"later", delay_level=1, now=at(t0, 200))
    assert store.deliver_level(1, now=at(t0, 300)).delivered == 1
    assert _delivered_once(store)[-1] == later
    assert len(_set_aside(store)) == 2  # once each


def test_a_segment_sharing_bad_properties_is_set_aside_whole(store: Store, t0: datetime) -> None:
    """A send_many segment stores one properties value for all its messages: each of them is set aside."""
    batch = store.send_many(
        [Message("orders", {"n": i}, delay_level=1, properties={"p": "v"}) for i in range(5)], now=t0
    )
    good = store.send("orders", b"after", delay_level=1, now=t0)
    store.conn.execute(
        "UPDATE delaywheel.level_segments SET properties = ARRAY['[1]'] WHERE id_first = %s", (batch[0],)
    )
    assert store.deliver_level(1, now=at(t0, 5)).delivered == 1  # only `good`: '[1]' casts, but is no object
    assert [r[0] for r in _set_aside(store)] == batch
    assert _delivered_once(store) == [good]


def test_a_near_wheel_row_that_cannot_be_delivered_is_set_aside(store: Store, t0: datetime) -> None:
    ids = [store.send("orders", {"n": i}, delay=timedelta(seconds=10 + i), now=t0) for i in range(4)]
    store.conn.execute('UPDATE delaywheel.wheel SET properties = \'["not", "an object"]\' WHERE id = %s', (ids[2],))
    result = store.advance_wheel(now=at(t0, 12.5))
    assert (result.delivered, result.skipped_cancelled) == (2, 1)
    rows = _set_aside(store)
    assert [r[:5] for r in rows] == [(ids[2], "wheel", None, "orders", "bad_properties")]
    assert store.advance_wheel(now=at(t0, 20)).delivered == 1
    assert _delivered_once(store) == [ids[0], ids[1], ids[3]]
    assert store.advance_wheel(now=at(t0, 30)).delivered == 0
    # a straggler: a bad row committed for a time the cursor already passed
    late = store.send("orders", b"late", delay=timedelta(seconds=40), now=t0)
    store.conn.execute(
        "UPDATE delaywheel.wheel SET properties = '7', deliver_at = %s, xid = pg_current_xact_id() WHERE id = %s",
        (at(t0, 25), late),
    )
    good = store.send("orders", b"good", delay=timedelta(seconds=1), now=at(t0, 31))
    assert store.advance_wheel(now=at(t0, 40)).delivered == 1
    assert [r[0] for r in _set_aside(store)] == [ids[2], late]
    assert _delivered_once(store) == [ids[0], ids[1], ids[3], good]


def test_a_far_row_that_cannot_be_delivered_does_not_stop_the_wheel(db_url: str, t0: datetime) -> None:
    """Before: the roll failed on it, so every wheel pass failed, timers due in days included, and later passes
    failed with 'no partition of relation "wheel" found for row' (the partition cache trusted partitions the
    failed roll had created)."""
    with Store(db_url, Settings()) as store:
        near = store.send("orders", b"near", delay=timedelta(minutes=1), now=t0)
        far = [store.send("orders", {"n": i}, delay=timedelta(days=5, seconds=i), now=t0) for i in range(3)]
        farther = store.send("orders", b"farther", delay=timedelta(days=6), now=t0)
        store.conn.execute(
            "UPDATE delaywheel.wheel_far_segments SET properties = ARRAY[%s] WHERE id_first = %s",
            (BAD_PROPERTIES, far[1]),
        )
        assert store.advance_wheel(now=at(t0, 120)).delivered == 1  # the roll is not due yet
        day2 = t0 + timedelta(days=2, seconds=1)  # the roll moves the bad block into the near window
        assert store.advance_wheel(now=day2).delivered == 0
        assert [r[:5] for r in _set_aside(store)] == [(far[1], "wheel", None, "orders", "bad_properties")]
        moved = store.conn.execute("SELECT id FROM delaywheel.wheel WHERE id = ANY(%s) ORDER BY id", (far,)).fetchall()
        assert [r[0] for r in moved] == [far[0], far[2]]
        for day in range(3, 8):
            store.advance_wheel(now=t0 + timedelta(days=day, seconds=10))
        assert _delivered_once(store) == sorted([near, far[0], far[2], farther])
        assert len(_set_aside(store)) == 1
        assert _cancellation_reasons(store) == [(far[1], "set aside: bad_properties")]
        store.send("orders", b"after", delay=timedelta(hours=1), now=t0 + timedelta(days=7))
        assert store.advance_wheel(now=t0 + timedelta(days=7, hours=2)).delivered == 1


def test_a_failed_roll_leaves_the_partition_cache_honest(db_url: str, t0: datetime) -> None:
    """An entry for a partition created in a transaction that rolled back is not trusted afterwards."""
    cache = PartitionCache()
    hour = t0 + timedelta(days=3)
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            cache.ensure(conn, "wheel", [hour])
            cache.ensure(conn, "wheel", [hour])  # trusted within its own transaction: no second creation
            raise RuntimeError
        with conn.transaction():
            cache.ensure(conn, "wheel", [hour])
            conn.execute(
                "INSERT INTO delaywheel.wheel (id, topic, body, is_json, deliver_at, enqueued_at)"
                " VALUES (1, 'orders', 'x', false, %s, %s)",
                (hour, t0),
            )
        with conn.transaction():
            cache.ensure(conn, "wheel", [hour])  # committed: known from now on
        assert ("wheel", hour) in cache._known


@pytest.mark.parametrize("lane", ["level", "wheel"])
def test_an_unexplained_failure_still_stops_the_pass(store: Store, t0: datetime, lane: str) -> None:
    """Set-aside only skips rows it can name: any other data error is raised, and nothing moves. The error comes
    from a trigger on the topics, inside the pass's move (the pass is one CALL: nothing to patch in Python)."""
    if lane == "level":
        store.send("orders", b"x", delay_level=1, now=t0)
    else:
        store.send("orders", b"x", delay=timedelta(seconds=1), now=t0)
    store.conn.execute(
        "CREATE FUNCTION public.boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM 1/0; RETURN NEW; END $$;"
        " CREATE TRIGGER boom BEFORE INSERT ON delaywheel.topic_messages FOR EACH ROW EXECUTE FUNCTION public.boom()"
    )
    with pytest.raises(psycopg.errors.DivisionByZero):
        if lane == "level":
            store.deliver_level(1, now=at(t0, 5))
        else:
            store.advance_wheel(now=at(t0, 5))
    assert _set_aside(store) == [] and deliveries(store) == []


def test_the_cli_refuses_what_it_refused_to_deliver_before(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delaywheel send ... --property $'p=\\xff'` returned 0 and stopped level 1 for good; now it is bad input."""
    from delaywheel.cli import main

    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    argv_property = b"p=\xff".decode(errors="surrogateescape")  # how Python hands the shell's $'p=\xff' over
    assert main(["send", "--topic", "t", "--body", '{"n":1}', "--level", "1", "--property", argv_property]) == 2
    err = capsys.readouterr().err
    assert "cannot be stored" in err and "Traceback" not in err
    assert main(["send", "--topic", "%DLQ%g", "--body", "1"]) == 2
    assert "reserved" in capsys.readouterr().err
    assert _hot_rows(store) == 0


def test_the_runtime_role_sets_rows_aside(role_db: tuple[str, str]) -> None:
    """Set-aside needs nothing the runtime role lacks (docs/operations.md, "Roles"): a level row and a far row, poisoned by the
    owner, are set aside by a runtime store's passes and the roll."""
    owner, runtime = role_db
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    with Store(runtime, Settings()) as store, psycopg.connect(owner, autocommit=True) as admin:
        level_ids = [store.send("orders", b"x", delay_level=1, now=t0) for _ in range(2)]
        far_ids = [store.send("orders", b"x", delay=timedelta(days=5), now=t0) for _ in range(2)]
        admin.execute(
            "UPDATE delaywheel.level_segments SET properties = ARRAY[%s] WHERE id_first = %s",
            (BAD_PROPERTIES, level_ids[0]),
        )
        admin.execute(
            "UPDATE delaywheel.wheel_far_segments SET properties = ARRAY[%s] WHERE id_first = %s",
            (BAD_PROPERTIES, far_ids[0]),
        )
        assert store.deliver_level(1, now=at(t0, 5)).delivered == 1
        for day in range(2, 7):
            store.advance_wheel(now=t0 + timedelta(days=day, seconds=1))
        assert _delivered_once(store) == [level_ids[1], far_ids[1]]
        assert [r[:2] for r in _set_aside(store)] == [(level_ids[0], "level"), (far_ids[0], "wheel")]
