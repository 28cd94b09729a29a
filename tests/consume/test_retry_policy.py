"""Retry policies per consumer group (consume/retry.py): the schedule and attempts against a simple model, retries on
a group's schedule (their due time the failure's plus the scheduled delay) and then its dead-letter topic, the ladder
for a group without one, bad policies refused with nothing written."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.cli import main
from delaywheel.consume import retry
from delaywheel.consume.retry import InvalidRetryPolicy, RetryPolicy, dlq_topic, retry_topic
from delaywheel.produce.validation import InvalidMessage

SETTINGS = Settings()
LEVEL_DELAYS = list(SETTINGS.levels)
MS = timedelta(milliseconds=1)


# -- the mapping, against a model -------------------------------------------------------------------------------------


def model(policy: RetryPolicy | None, settings: Settings) -> list[timedelta]:
    """The delay before each retry, written out the plain way: the ladder is level 3, 4, ... (the last level after it
    ends), `max_reconsume_times` long; a schedule is its delays, the last one again until max_attempts."""
    limit = settings.max_reconsume_times if policy is None or policy.max_attempts is None else policy.max_attempts
    if policy is None or policy.delays is None:
        ladder = list(settings.levels[2:]) + [settings.levels[-1]] * limit
        return ladder[:limit]
    delays = list(policy.delays)
    return (delays + [delays[-1]] * limit)[:limit]


delays = st.one_of(
    st.sampled_from(LEVEL_DELAYS),  # a configured level's delay: that level's queue
    st.integers(1, 10 * 86_400_000).map(lambda ms: timedelta(milliseconds=ms)),  # any other: the wheel
)
policies = st.one_of(
    st.none(),
    st.builds(
        RetryPolicy,
        st.just("g"),
        st.one_of(st.none(), st.integers(0, 40)),
        st.one_of(st.none(), st.lists(delays, min_size=1, max_size=12).map(tuple)),
    ),
)


@hsettings(max_examples=400, deadline=None)
@given(policies, st.integers(0, 30))
def test_each_retry_gets_the_models_delay_then_the_dead_letter_topic(policy: RetryPolicy | None, default: int) -> None:
    """Retry n + 1 of a message that failed n times: the model's n-th delay, sent on the level whose delay it is (the
    ladder's own levels included) or else on the wheel; after the model's last, the dead-letter topic (None)."""
    settings = Settings(max_reconsume_times=default)
    expected = model(policy, settings)
    for tries in range(len(expected) + 3):
        step = retry.next_retry(policy, settings, tries)
        if tries >= len(expected):
            assert step is None
        elif isinstance(step, int):
            assert settings.level_delay(min(step, settings.max_level)) == expected[tries]
            assert policy is None or policy.delays is None or step == LEVEL_DELAYS.index(expected[tries]) + 1
        else:
            assert step == expected[tries] and step not in LEVEL_DELAYS
    assert retry.schedule(policy, settings) == expected


def test_a_delay_past_a_lowered_wheel_max_delay_is_cut_to_it() -> None:
    """A policy set under a longer `wheel_max_delay` must not fail the ack that sends its retry (the group would stop):
    its delay is cut to the store's longest."""
    policy = RetryPolicy("g", 2, (timedelta(days=30),))
    assert retry.next_retry(policy, Settings(wheel_max_delay=timedelta(days=7)), 1) == timedelta(days=7)


def test_describe_folds_runs_of_one_delay() -> None:
    minutes = [timedelta(minutes=m) for m in (4, 10, 10, 60, 60, 60)]
    assert retry.describe(minutes) == ["1 after 4m", "2-3 after 10m", "4-6 after 1h"]
    assert retry.describe([]) == []


# -- retries in the store ---------------------------------------------------------------------------------------------


def queued(store: Store) -> list[dict[str, Any]]:
    """Every message not delivered yet: its lane, level, count, and due and enqueue times, in enqueue order."""
    rows = store.conn.execute(
        """SELECT * FROM (
               SELECT id, 'level', level, topic, reconsume_times, properties, deliver_at, enqueued_at
               FROM delaywheel.level_queue
               UNION ALL
               SELECT id, 'wheel', NULL, topic, NULL, properties, deliver_at, enqueued_at FROM delaywheel.wheel
           ) q (id, lane, level, topic, reconsume_times, properties, deliver_at, enqueued_at)
           WHERE NOT EXISTS (SELECT FROM delaywheel.topic_messages t WHERE t.message_id = q.id)
           ORDER BY enqueued_at, id"""
    ).fetchall()
    names = ("lane", "level", "topic", "reconsume_times", "properties", "deliver_at", "enqueued_at")
    return [dict(zip(names, row[1:], strict=True)) for row in rows]


def fail_all(store: Store, group: str) -> tuple[list[int], datetime, datetime]:
    """Pull the group's next batch of `orders` (and its retries) and ack it with every message failed; returns the ids
    and the database's clock just before and after the ack (the failure time lies between)."""
    batch = store.pull("orders", group)
    before = store.clock()
    store.ack(batch, failed={m.message_id for m in batch.messages})
    return [m.message_id for m in batch.messages], before, store.clock()


def test_a_group_retries_on_its_schedule_then_goes_to_its_dead_letter_topic(store: Store) -> None:
    """A schedule of level delays (4m, 2h) and others (90s, 7h), five retries: each retry is due the failure's time
    plus its scheduled delay, on the level whose delay it is or else on the wheel; each comes back with its count and
    its original's idempotency id; the sixth failure goes to %DLQ%g."""
    schedule = [timedelta(minutes=4), timedelta(seconds=90), timedelta(hours=2), timedelta(hours=7)]
    policy = store.set_retry_policy("g", max_attempts=5, delays=schedule)
    assert policy.max_attempts == 5 and policy.delays == tuple(schedule) and policy.updated_at is not None
    original = store.send("orders", {"order": 7}, key="o-7", properties={"region": "eu"})
    cursor = store.clock()  # deliveries' injected clock: never behind the last (the wheel's cursor only moves on)
    for n, delay in enumerate([*schedule, schedule[-1]], start=1):
        _, before, after = fail_all(store, "g")
        [row] = queued(store)
        assert row["topic"] == retry_topic("g")
        assert before <= row["enqueued_at"] <= after and row["deliver_at"] - row["enqueued_at"] == delay
        if delay in LEVEL_DELAYS:
            assert (row["lane"], row["level"], row["reconsume_times"]) == ("level", LEVEL_DELAYS.index(delay) + 1, n)
            assert "RECONSUME_TIME" not in row["properties"]
        else:  # the wheel keeps no count: the property carries it
            assert row["lane"] == "wheel" and row["properties"]["RECONSUME_TIME"] == str(n)
        cursor = max(cursor, row["deliver_at"])
        assert store.deliver_due(now=cursor) == 1
        look = store.pull("orders", "g")
        store.release(look)  # looked at, not handled: the next fail_all pulls it again
        [retried] = look.messages
        assert retried.reconsume_times == n and retried.idempotency_id == original
        assert retried.properties["region"] == "eu" and retried.properties["ORIGIN_TOPIC"] == "orders"
    fail_all(store, "g")
    assert queued(store) == []
    dead = store.pull(dlq_topic("g"), "ops").messages
    assert [(m.reconsume_times, m.idempotency_id, m.key) for m in dead] == [(6, original, "o-7")]
    assert "RECONSUME_TIME" not in dead[0].properties


def test_a_group_without_a_policy_follows_the_ladder_beside_one_with(db_url: str) -> None:
    """Two groups fail the same message: the one without a policy sends it to level 3 + tries and, past the store's
    max_reconsume_times, to its DLQ; the other follows its own. A cleared policy is the ladder again."""
    with Store(db_url, Settings(max_reconsume_times=1)) as store:
        store.set_retry_policy("own", delays=["90s"])
        store.send("orders", {"order": 1})
        fail_all(store, "ladder")
        fail_all(store, "own")
        rows = [(r["lane"], r["level"], r["topic"], r["deliver_at"] - r["enqueued_at"]) for r in queued(store)]
        assert sorted(rows, key=str) == sorted(
            [
                ("level", 3, retry_topic("ladder"), SETTINGS.level_delay(3)),
                ("wheel", None, retry_topic("own"), timedelta(seconds=90)),
            ],
            key=str,
        )
        assert store.deliver_due(now=store.clock() + timedelta(minutes=2)) == 2
        fail_all(store, "ladder")  # max_reconsume_times=1: its second failure is its last
        assert [m.reconsume_times for m in store.pull(dlq_topic("ladder"), "ops").messages] == [2]
        assert store.clear_retry_policy("own") and not store.clear_retry_policy("own")
        assert store.retry_policy("own") is None
        fail_all(store, "own")  # the ladder's max (1) and no more retries: the DLQ
        assert [m.reconsume_times for m in store.pull(dlq_topic("own"), "ops").messages] == [2]


def test_a_changed_policy_applies_from_the_next_ack(store: Store) -> None:
    store.set_retry_policy("g", delays=["90s"])
    store.send("orders", {"order": 1})
    store.send("orders", {"order": 2})
    batch = store.pull("orders", "g", 1)
    store.ack(batch, failed={batch.messages[0].message_id})
    store.set_retry_policy("g", delays=["5m"])  # level 9's delay
    batch = store.pull("orders", "g", 1)
    store.ack(batch, failed={batch.messages[0].message_id})
    assert [(r["lane"], r["deliver_at"] - r["enqueued_at"]) for r in queued(store)] == [
        ("wheel", timedelta(seconds=90)),
        ("level", timedelta(minutes=5)),
    ]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, "give max_attempts, delays or both"),
        ({"max_attempts": -1}, "max_attempts must be a whole number from 0 to 1000"),
        ({"max_attempts": 1001}, "from 0 to 1000"),
        ({"max_attempts": True}, "from 0 to 1000"),
        ({"max_attempts": 2.0}, "from 0 to 1000"),
        ({"max_attempts": "3"}, "from 0 to 1000"),
        ({"delays": []}, "give 1 to 100 delays, not none"),
        ({"delays": ""}, "delays: empty"),
        ({"delays": ["1s"] * 101}, "give 1 to 100 delays, not more"),
        ({"delays": itertools.repeat("1s")}, "give 1 to 100 delays, not more"),
        ({"delays": [timedelta(0)]}, r"item 1 \(0ms\) must be a positive"),
        ({"delays": ["1m", timedelta(seconds=-1)]}, "item 2 .* must be a positive"),
        ({"delays": ["400d"]}, r"item 1 \(400d\) must be .* up to 365d \(wheel_max_delay"),
        ({"delays": [timedelta(microseconds=1500)]}, "whole number of milliseconds"),
        ({"delays": "4m,10x"}, "bad duration '10x'"),
        ({"delays": ["4m", "10 m"]}, "bad duration"),
        ({"delays": [60]}, r"item 1 \(60\) is not a duration"),
        ({"delays": 60}, "delays must be a list of durations, not int"),
        ({"delays": {"4m": 1}}, "not dict"),
    ],
)
def test_a_bad_policy_is_refused_and_nothing_is_written(store: Store, options: dict[str, Any], error: str) -> None:
    store.set_retry_policy("g", max_attempts=3, delays="4m,10m")
    before = store.retry_policy("g")
    with pytest.raises(InvalidRetryPolicy, match=error):
        store.set_retry_policy("g", **options)
    with pytest.raises(InvalidRetryPolicy, match=error):
        store.set_retry_policy("other", **options)
    assert store.retry_policy("g") == before
    assert store.conn.execute("SELECT grp FROM delaywheel.group_retry_policies").fetchall() == [("g",)]


def test_a_bad_group_is_refused(store: Store) -> None:
    for call in (
        lambda: store.set_retry_policy("bad group", max_attempts=1),
        lambda: store.retry_policy("%" * 200),
        lambda: store.clear_retry_policy(""),
    ):
        with pytest.raises(InvalidMessage, match="group"):
            call()
    assert store.conn.execute("SELECT count(*) FROM delaywheel.group_retry_policies").fetchone() == (0,)


def test_producers_may_not_set_the_retry_count(store: Store) -> None:
    with pytest.raises(InvalidMessage, match="RECONSUME_TIME"):
        store.send("orders", {}, properties={"RECONSUME_TIME": "99"})


def test_a_retry_count_that_is_not_one_is_ignored(store: Store) -> None:
    """A topic row written by hand with a RECONSUME_TIME that is no count is handed over with its row's count: a pull
    never fails on it."""
    store.send("orders", {"n": 1})
    for properties in ({"RECONSUME_TIME": "x9"}, {"RECONSUME_TIME": 9}, {"RECONSUME_TIME": "-1"}):
        store.conn.execute(
            "UPDATE delaywheel.topic_messages SET reconsume_times = 2, properties = %s::jsonb", [json.dumps(properties)]
        )
        batch = store.pull("orders", "g")
        store.release(batch)
        [m] = batch.messages
        assert m.reconsume_times == 2
    assert retry.retries_so_far(2, {"RECONSUME_TIME": "7"}) == 7
    assert retry.retries_so_far(2, {"RECONSUME_TIME": "1" * 10}) == 2
    assert retry.retries_so_far(2, {"RECONSUME_TIME": 7}) == 2


def test_the_runtime_role_sets_reads_and_clears_policies(role_db: tuple[str, str]) -> None:
    _, runtime = role_db
    with Store(runtime) as store:
        store.set_retry_policy("g", max_attempts=2, delays=["90s"])
        store.send("orders", {"n": 1})
        fail_all(store, "g")
        assert [r["lane"] for r in queued(store)] == ["wheel"]
        assert store.clear_retry_policy("g")


# -- the command line -------------------------------------------------------------------------------------------------


def test_the_cli_sets_shows_and_clears_a_policy(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)

    def run(*args: str) -> tuple[int, Any, str]:
        try:
            code = main(["group", "retry-policy", *args])
        except SystemExit as exc:  # refused while the arguments are parsed
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, json.loads(out) if "--json" in args and out else out, err

    code, shown, _ = run("g", "--json")
    assert code == 0 and shown["policy"] is None and len(shown["schedule"]) == 16 and shown["schedule"][0] == "10s"
    code, shown, _ = run("g", "--max-attempts", "4", "--delays", "4m,10m,1h,2h,6h,15h", "--json")
    assert code == 0 and shown["policy"]["max_attempts"] == 4
    assert shown["policy"]["delays"] == ["4m", "10m", "1h", "2h", "6h", "15h"]
    assert shown["schedule"] == ["4m", "10m", "1h", "2h"] and shown["dead_letter_topic"] == "%DLQ%g"
    code, text, _ = run("g", "--delays", "90s")  # the whole policy: max attempts back to the default
    assert code == 0 and "max attempts default" in text and "16 retries: 1-16 after 90s; then %DLQ%g" in text
    for bad, says in (
        (["--delays", "0s"], "must be a positive"),
        (["--delays", "4x"], "bad duration '4x'"),
        (["--max-attempts", "1001"], "must be at most 1000"),
        (["--max-attempts", "-1"], "must be at least 0"),
        (["--clear", "--delays", "1m"], "--clear takes neither"),
        (["bad group", "--max-attempts", "1"], "group 'bad group' is malformed"),
    ):
        code, _, err = run(*(bad if bad[0] == "bad group" else ["g", *bad]))
        assert code == 2 and says in err, (bad, err)
    with Store(db_url) as store:
        policy = store.retry_policy("g")
    assert policy is not None and (policy.max_attempts, policy.delays) == (None, (timedelta(seconds=90),))
    assert run("g", "--clear")[0] == 0
    code, text, _ = run("g", "--clear")
    assert code == 1 and "no retry policy: RocketMQ's ladder" in text


def test_the_policy_table_refuses_a_row_no_retry_could_use(store: Store) -> None:
    """The table's own checks, for rows written by hand: no empty schedule, no delay of 0 or less, no NULL in it."""
    for attempts, delays in ((None, None), (-1, None), (None, []), (None, [0]), (None, [1000, None])):
        with pytest.raises(psycopg.errors.CheckViolation):
            store.conn.execute(
                "INSERT INTO delaywheel.group_retry_policies (grp, max_attempts, delays_ms) VALUES ('h', %s, %s)",
                (attempts, delays),
            )
