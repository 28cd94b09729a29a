"""A group's dead-letter topic as a place to work in (ops/dlq.py, docs/dlq.md): browse what the retry ladder gave up
on, redrive it back to the group (all, by id, by a checked predicate), each dead letter once, recorded."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from delaywheel import InvalidMessage, Settings, Store
from delaywheel.cli import delivered_json, main
from delaywheel.consume.topics import dlq_topic, retry_topic
from delaywheel.ops import dlq
from delaywheel.ops.predicate import UnsafeSQL
from delaywheel.produce.validation import Message
from tests.helpers import Background, at, wait_for_lock

MAX = 1  # the ladder's maximum here: one retry, then the dead-letter topic


@pytest.fixture
def settings() -> Settings:
    return Settings(max_reconsume_times=MAX)


def fail_until_dead(store: Store, t0: datetime, n: int, topic: str = "orders", group: str = "g") -> None:
    """Fail the group's `n` messages each time it gets them, through every retry, until the ladder hands them to its
    DLQ. Each try waits until all `n` came (a transaction of another test's database may hold the commit horizon
    back for a moment, on a shared server)."""
    for attempt in range(MAX + 1):
        failed, deadline = 0, time.monotonic() + 30
        while failed < n:
            store.deliver_due(now=at(t0, 24 * 3600 * attempt))
            batch = store.pull(topic, group, 1000)
            store.ack(batch, failed={m.message_id for m in batch.messages})
            failed += len(batch)
            if not batch.messages:
                assert time.monotonic() < deadline, f"attempt {attempt}: {failed} of {n} came"
                time.sleep(0.05)
    assert len(store.pull(topic, group)) == 0


@pytest.fixture
def dead(store: Store, t0: datetime) -> list[int]:
    """Three orders the group `g` gave up on; their original ids."""
    ids = store.send_many(
        [
            Message("orders", {"order": i}, key=f"o-{i}", tags="paid" if i == 2 else None, properties={"region": "eu"})
            for i in range(3)
        ],
        now=t0,
    )
    fail_until_dead(store, t0, 3)
    return ids


def written(store: Store) -> tuple[int, int, int]:
    """(redriven rows in the group's retry topic, redrive records, dead letters recorded redriven): what redrives
    wrote. (The ladder's own retries in the retry topic have tried once or more.)"""
    row = store.conn.execute(
        "SELECT (SELECT count(*) FROM delaywheel.topic_messages WHERE topic = %s AND reconsume_times = 0),"
        " (SELECT count(*) FROM delaywheel.dlq_redrives), (SELECT count(*) FROM delaywheel.dlq_redriven)",
        (retry_topic("g"),),
    ).fetchone()
    assert row is not None
    return row


def test_browse_shows_what_the_ladder_gave_up_on(store: Store, dead: list[int]) -> None:
    page = store.dlq("g")
    assert page.waiting == 3
    assert [m.idempotency_id for m in page.messages] == dead  # oldest first
    for i, m in enumerate(page.messages):
        assert (m.topic, m.source_topic, m.key, m.body, m.reconsume_times) == (
            "orders",
            dlq_topic("g"),
            f"o-{i}",
            {"order": i},
            MAX + 1,  # the attempts
        )
        assert m.message_id not in dead  # a dead letter is a message of its own
        assert m.properties == {"region": "eu", "ORIGIN_TOPIC": "orders", "ORIGIN_MESSAGE_ID": str(dead[i])}
    assert [m.message_id for m in store.dlq("g", limit=2).messages] == [m.message_id for m in page.messages[:2]]
    assert store.dlq("g", limit=2).waiting == 3


def test_a_redrive_by_id_brings_the_message_back_to_the_group_once(store: Store, dead: list[int]) -> None:
    letters = store.dlq("g").messages
    done = store.redrive("g", ids=[letters[1].message_id], by="alice")
    assert (done.how, done.redriven, done.already_redriven, done.not_found) == ("ids", [letters[1].message_id], [], [])
    assert done.redrive_id is not None
    (back,) = store.pull("orders", "g").messages  # the group's consumer gets it again, as a fresh retry
    assert (back.message_id, back.topic, back.source_topic, back.idempotency_id, back.reconsume_times) == (
        done.retry_ids[0],
        "orders",
        retry_topic("g"),
        dead[1],
        0,
    )
    assert (back.key, back.body, back.properties["region"]) == ("o-1", {"order": 1}, "eu")
    assert [m.message_id for m in store.dlq("g").messages] == [letters[0].message_id, letters[2].message_id]

    before = written(store)
    again = store.redrive("g", ids=[letters[1].message_id, 999_999_999], by="alice")  # a second time: nothing
    assert (again.redrive_id, again.redriven, again.already_redriven, again.not_found) == (
        None,
        [],
        [letters[1].message_id],
        [999_999_999],
    )
    assert written(store) == before

    (record,) = store.redrives("g")
    assert (record.id, record.requested_by, record.how, record.predicate, record.redriven, record.message_ids) == (
        done.redrive_id,
        "alice",
        "ids",
        None,
        1,
        [letters[1].message_id],
    )
    role = store.conn.execute("SELECT session_user").fetchone()
    assert role is not None and record.db_role == role[0]


def test_a_redriven_message_walks_the_ladder_again_and_can_be_redriven_again(
    store: Store, dead: list[int], t0: datetime
) -> None:
    store.redrive("g", all=True)
    fail_until_dead(store, at(t0, 10 * 24 * 3600), 3)  # the ladder starts again: MAX retries, then the DLQ
    page = store.dlq("g")
    assert sorted(m.idempotency_id for m in page.messages) == dead  # new dead letters, the same original ids
    assert all(m.reconsume_times == MAX + 1 for m in page.messages)
    assert len(store.redrive("g", all=True).redriven) == 3
    assert sorted(m.idempotency_id for m in store.pull("orders", "g").messages) == dead


def test_redrive_all_then_again_does_nothing(store: Store, dead: list[int]) -> None:
    done = store.redrive("g", all=True, by="ops")
    assert len(done.redriven) == 3 and len(set(done.retry_ids)) == 3
    assert store.dlq("g").waiting == 0
    assert sorted(m.idempotency_id for m in store.pull("orders", "g").messages) == dead
    before = written(store)
    assert store.redrive("g", all=True) == dlq.Redrive("g", "all", None, [], [], [], [])
    assert written(store) == before
    assert [r.message_ids for r in store.redrives("g")] == [sorted(done.redriven)]


def test_redrive_by_predicate(store: Store, dead: list[int]) -> None:
    letters = store.dlq("g").messages
    where = f"tags = 'paid' OR idempotency_id = {dead[0]} AND properties->>'region' = 'eu'"
    dry = store.redrive("g", where=where, dry_run=True)
    assert (dry.dry_run, dry.redrive_id, dry.redriven) == (True, None, [letters[0].message_id, letters[2].message_id])
    assert written(store) == (0, 0, 0)  # a dry run writes nothing
    done = store.redrive("g", where=where, by="bob")
    assert done.redriven == dry.redriven
    assert sorted(m.idempotency_id for m in store.pull("orders", "g").messages) == [dead[0], dead[2]]
    (record,) = store.redrives("g")
    assert (record.how, record.predicate, record.redriven) == ("where", where, 2)
    assert store.redrive("g", where=where).redriven == []  # matched again, but redriven already


BAD_PREDICATES = [
    "true); DELETE FROM delaywheel.dlq_redriven; --",
    "message_id IN (SELECT message_id FROM delaywheel.topic_messages)",
    "pg_sleep(1) IS NULL",
    "body IS NOT NULL",  # not a column a predicate may name
    "",
]
BAD_REQUESTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("nobody", {"all": True}, dlq.UnknownGroup, "unknown"),
    ("bad group", {"all": True}, InvalidMessage, "malformed"),
    ("g", {}, ValueError, "exactly one"),
    ("g", {"all": True, "ids": [1]}, ValueError, "exactly one"),
    ("g", {"all": 1}, ValueError, "True or False"),
    ("g", {"ids": []}, ValueError, "empty"),
    ("g", {"ids": ["12"]}, ValueError, "whole numbers"),
    ("g", {"ids": [1.0]}, ValueError, "whole numbers"),
    ("g", {"ids": [True]}, ValueError, "whole numbers"),
    ("g", {"ids": [0]}, ValueError, "whole numbers"),
    ("g", {"ids": [2**63]}, ValueError, "whole numbers"),
    ("g", {"ids": "12"}, ValueError, "collection"),
    ("g", {"all": True, "by": "x\x00"}, ValueError, "by must"),
    *(("g", {"where": where}, UnsafeSQL, "--where predicate") for where in BAD_PREDICATES),
]


def test_bad_requests_are_refused_with_a_reason_and_write_nothing(store: Store, dead: list[int]) -> None:
    """An unknown or malformed group, a choice not made or made twice, ids that are not whole numbers, a bad `by`,
    a predicate refused: each raises before anything is written, and the dead letters still wait."""
    for group, options, error, says in BAD_REQUESTS:
        with pytest.raises(error, match=says):
            store.redrive(group, **options)
        assert written(store) == (0, 0, 0), (group, options)
    assert store.dlq("g").waiting == 3


def test_browsing_an_unknown_group_is_refused(store: Store, dead: list[int]) -> None:
    with pytest.raises(dlq.UnknownGroup, match="'nobody' is unknown"):
        store.dlq("nobody")
    store.ack(store.pull("orders", "fresh"))  # a group that has acked is known, with an empty DLQ
    assert store.dlq("fresh") == dlq.DeadLetters("fresh", 0, [])


def test_two_redrives_at_once_redrive_each_dead_letter_once(store: Store, dead: list[int]) -> None:
    """The second waits for the first's commit (the group's REDRIVE_LOCK) and finds everything taken."""
    with Store(store.url, store.settings) as other, psycopg.connect(store.url, autocommit=True) as watching:
        pid = other.conn.info.backend_pid
        with store.conn.transaction():
            first = store.redrive("g", all=True)
            second = Background(lambda: other.redrive("g", all=True))
            wait_for_lock(watching, pid, "the second redrive")
        assert second.result().redriven == []
    assert len(first.redriven) == 3
    assert written(store) == (3, 1, 3)


def test_a_redrive_rolled_back_with_the_callers_transaction_leaves_nothing(store: Store, dead: list[int]) -> None:
    with pytest.raises(RuntimeError), store.conn.transaction():
        assert len(store.redrive("g", all=True).redriven) == 3
        raise RuntimeError("the caller changes its mind")
    assert written(store) == (0, 0, 0)
    assert store.dlq("g").waiting == 3


# ORIGIN_MESSAGE_ID values a row written some other way may hold (absent: the row's own id)
_ORIGINS = st.one_of(
    st.from_regex(r"\A[0-9]{1,20}\Z"),
    st.sampled_from(["9223372036854775807", "9223372036854775808", "0", "007", "", "12a", " 1", "1\n", "٣", "-1"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=22),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.none(),
    st.just(Ellipsis),
)


@pytest.fixture
def dlq_rows(store: Store) -> Iterator[Any]:
    """Writes a row into %DLQ%g by hand with the given ORIGIN_MESSAGE_ID (Ellipsis: none); returns its id."""
    store.prepare()

    def write(origin: Any) -> int:
        properties = {} if origin is Ellipsis else {"ORIGIN_MESSAGE_ID": origin}
        row = store.conn.execute(
            "INSERT INTO delaywheel.topic_messages (topic, message_id, origin, key, tags, properties, body, is_json,"
            " reconsume_times, deliver_at, delivered_at) SELECT %s, nextval('delaywheel.message_id_seq'), 'direct',"
            " NULL, NULL, %s, '1', true, 2, now(), now() RETURNING message_id",
            (dlq_topic("g"), Jsonb(properties)),
        ).fetchone()
        assert row is not None
        return int(row[0])

    yield write


@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(origin=_ORIGINS)
def test_the_predicates_idempotency_id_is_the_consumers(store: Store, dlq_rows: Any, origin: Any) -> None:
    """What `where` calls idempotency_id (SQL) is `Delivered.idempotency_id` (Python) for any ORIGIN_MESSAGE_ID."""
    message_id = dlq_rows(origin)
    (m,) = [m for m in store.dlq("g", limit=1000).messages if m.message_id == message_id]
    matched = store.redrive(
        "g", where=f"message_id = {message_id} AND idempotency_id = {m.idempotency_id}", dry_run=True
    )
    assert matched.redriven == [message_id], (origin, m.idempotency_id)


def test_the_runtime_role_redrives_and_may_not_rewrite_the_record(role_db: tuple[str, str], t0: datetime) -> None:
    _, runtime = role_db
    with Store(runtime, Settings(max_reconsume_times=MAX)) as store:
        store.prepare()
        store.send("orders", {"order": 1}, now=t0)
        fail_until_dead(store, t0, 1)
        done = store.redrive("g", all=True, by="runtime")
        assert len(done.redriven) == 1
        (record,) = store.redrives("g")
        assert record.db_role == "delaywheel_app"
        for statement in (
            "UPDATE delaywheel.dlq_redrives SET redriven = 0",
            "DELETE FROM delaywheel.dlq_redriven",
            "UPDATE delaywheel.dlq_redriven SET message_id = 0",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                store.conn.execute(statement)


def test_the_cli_lists_and_redrives(
    store: Store, dead: list[int], db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    letters = store.dlq("g").messages
    assert main(["dlq", "list", "g", "--json", "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [json.loads(json.dumps(delivered_json(m))) for m in letters[:2]]
    assert main(["dlq", "list", "g"]) == 0
    out = capsys.readouterr().out
    assert "3 dead letter(s) waiting in %DLQ%g; 3 shown" in out and f"\t{dead[0]}\t2\t" in out

    assert main(["dlq", "redrive", "g", "--id", str(letters[0].message_id), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("would redrive 1 dead letter(s) of group g to %RETRY%g\n")
    assert written(store) == (0, 0, 0)
    assert main(["dlq", "redrive", "g", "--id", str(letters[0].message_id), "--id", "12345678"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("redrove 1 dead letter(s) of group g to %RETRY%g (redrive ")
        and "not in the group's DLQ: 12345678" in out
    )
    (record,) = store.redrives("g")
    assert record.requested_by is not None and record.requested_by.startswith("cli:")
    assert main(["dlq", "redrive", "g", "--id", str(letters[0].message_id)]) == 1  # nothing left to do
    assert "1 already redriven" in capsys.readouterr().out
    assert main(["dlq", "redrive", "g", "--where", "key = 'o-2'", "--by", "carol", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["redriven"] == [letters[2].message_id]
    assert store.redrives("g")[0].requested_by == "carol"

    for argv, says in (
        (["dlq", "redrive", "g", "--where", "pg_read_file('/etc/passwd') IS NULL"], "pg_read_file"),
        (["dlq", "redrive", "nobody", "--all"], "unknown"),
        (["dlq", "list", "bad group"], "malformed"),
    ):
        assert main(argv) == 2
        assert says in capsys.readouterr().err
    for argv in (
        ["dlq", "redrive", "g"],
        ["dlq", "redrive", "g", "--all", "--id", "1"],
        ["dlq", "redrive", "g", "--id", "x"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    assert written(store) == (2, 2, 2)


def test_dead_letters_pulled_by_another_group_keep_their_origin(store: Store, dead: list[int]) -> None:
    """A dead letter as any consumer of the DLQ topic gets it: the same Delivered as browsing shows."""
    (m, *_) = store.pull(dlq_topic("g"), "ops").messages
    (browsed, *_) = store.dlq("g").messages
    assert m == browsed
    assert delivered_json(m)["properties"]["ORIGIN_MESSAGE_ID"] == str(dead[0])
    assert delivered_json(m)["idempotency_id"] == dead[0]


def test_a_large_redrive_is_one_transaction(store: Store, t0: datetime) -> None:
    """Dead letters go back in one transaction with their record, however many (the retries by one COPY)."""
    store.send_many([Message("orders", {"n": i}) for i in range(2000)], now=t0)
    fail_until_dead(store, t0, 2000)
    assert len(store.redrive("g", all=True).redriven) == 2000
    xids = store.conn.execute(
        "SELECT count(DISTINCT xid), count(*) FROM delaywheel.topic_messages WHERE topic = %s AND reconsume_times = 0",
        (retry_topic("g"),),
    ).fetchone()
    assert xids == (1, 2000)
