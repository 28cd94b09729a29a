"""An injected clock (`now=`): refused outside a tolerance of the database's clock unless the caller is a test
(`Settings.test_clock`, which tests/conftest.py turns on for the suite), and refused naive or not a datetime always,
with nothing written. A `now` far from the real clock changes shared state: a level message placed an hour ahead sits
at the head of its FIFO lane and holds back every producer's; a year-2100 `now` creates year-2100 partitions; a
1971 one slips a due time past `past_tolerance`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.batch import bulk, input_rows
from delaywheel.config import TEST_CLOCK_ENV, ConfigError
from delaywheel.partitions import PartitionCache
from delaywheel.produce.validation import NOW_AHEAD, NOW_BEHIND, InvalidMessage, Message, check_now_near
from tests.helpers import table_counts

EMPTY = {"level_queue": 0, "wheel": 0, "wheel_far": 0, "topic_messages": 0, "cancellations": 0}
NOT_A_TEST = Settings(test_clock=False)


@pytest.fixture
def real(db_url: str) -> Iterator[Store]:
    """A store whose caller is not a test: `now=` is held to the database's clock."""
    with Store(db_url, NOT_A_TEST) as s:
        yield s


def partitions(store: Store) -> int:
    row = store.conn.execute(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'delaywheel'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def refused(store: Store, call: Callable[[], Any], match: str) -> None:
    before = partitions(store)
    with pytest.raises(InvalidMessage, match=match) as error:
        call()
    assert error.value.reason == "bad_now"
    assert table_counts(store) == EMPTY
    assert partitions(store) == before  # not even a partition for the injected hour


def test_the_suite_runs_as_a_test_and_a_caller_otherwise_is_not_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().test_clock  # tests/conftest.py: DELAYWHEEL_TEST_CLOCK=1
    monkeypatch.delenv(TEST_CLOCK_ENV)
    assert not Settings().test_clock
    for value, expected in (("0", False), ("false", False), ("1", True), (" TRUE ", True)):
        monkeypatch.setenv(TEST_CLOCK_ENV, value)
        assert Settings().test_clock is expected
    monkeypatch.setenv(TEST_CLOCK_ENV, "maybe")
    with pytest.raises(ConfigError, match=TEST_CLOCK_ENV):
        Settings()


def test_a_now_an_hour_ahead_is_refused_and_blocks_no_lane(real: Store) -> None:
    ahead = real.clock() + timedelta(hours=1)
    refused(real, lambda: real.send("orders", {"n": 1}, delay_level=1, now=ahead), "ahead of the database's clock")
    refused(real, lambda: real.send_many([Message("orders", {"n": 1}, delay_level=1)], now=ahead), "ahead of")
    # what the finding was: a level-1 message of another producer is not held back behind an hour-ahead one
    real.send("orders", {"n": 2}, delay_level=1)
    assert real.conn.execute(
        "SELECT deliver_at - clock_timestamp() < interval '2 s' FROM delaywheel.level_queue"
    ).fetchall() == [(True,)]


def test_a_year_2100_now_creates_no_partitions(real: Store) -> None:
    year_2100 = datetime(2100, 1, 1, tzinfo=UTC)
    refused(real, lambda: real.send("orders", b"x", delay=timedelta(days=2), now=year_2100), "ahead of")
    refused(real, lambda: real.send_many([Message("orders", b"x")], now=year_2100), "ahead of")
    refused(real, lambda: real.prepare(now=year_2100), "ahead of")


def test_a_1971_now_does_not_slip_past_the_past_tolerance(real: Store) -> None:
    then = datetime(1971, 1, 1, tzinfo=UTC)
    refused(real, lambda: real.send("orders", b"x", deliver_at=then, now=then), "behind the database's clock")
    refused(real, lambda: real.send_many([Message("orders", b"x", deliver_at=then)], now=then), "behind")


@pytest.mark.parametrize(
    "now",
    [datetime(2030, 1, 1), datetime.now(), "2030-01-01T00:00:00Z", 1893456000, 1.5, b"now", object()],
)
def test_a_naive_or_non_datetime_now_is_refused_even_in_a_test(store: Store, now: Any) -> None:
    assert store.settings.test_clock
    refused(store, lambda: store.send("orders", b"x", now=now), "now must be")
    refused(store, lambda: store.send_many([Message("orders", b"x")], now=now), "now must be")
    for call in (store.deliver_level, store.stats, store.prepare, store.retire):
        with pytest.raises(InvalidMessage, match="now must be"):
            call(**({"level": 1} if call == store.deliver_level else {}), now=now)
    assert table_counts(store) == EMPTY


def test_a_now_read_from_the_database_clock_is_accepted(real: Store) -> None:
    now = real.clock()  # behind by the time since it was read: within NOW_BEHIND
    sent = [real.send("orders", b"x", delay_level=1, now=now), *real.send_many([Message("orders", b"y")], now=now)]
    assert len(sent) == 2
    due = real.conn.execute("SELECT deliver_at FROM delaywheel.level_queue").fetchone()
    assert due == (now + real.settings.level_delay(1),)
    assert real.deliver_level(1, now=now).delivered == 0  # not due yet at that instant
    assert real.stats(now=now)["now"] == now


def test_deliver_wheel_stats_and_retire_refuse_a_far_now(real: Store) -> None:
    real.send("orders", b"x", delay_level=1)
    ahead = real.clock() + timedelta(hours=1)
    cursor = real.conn.execute("SELECT * FROM delaywheel.wheel_cursor").fetchall()
    for call in (
        lambda: real.deliver_level(1, now=ahead),
        lambda: real.advance_wheel(now=ahead),
        lambda: real.deliver_due(now=ahead),
        lambda: real.stats(now=ahead),
        lambda: real.retire(now=datetime(2100, 1, 1, tzinfo=UTC)),
    ):
        with pytest.raises(InvalidMessage, match="ahead of the database's clock"):
            call()
    assert real.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone() == (1,)  # not delivered early
    assert real.conn.execute("SELECT * FROM delaywheel.wheel_cursor").fetchall() == cursor  # not moved an hour on


def test_bulk_enqueue_refuses_a_far_now(real: Store, db_url: str) -> None:
    mapping = input_rows.ColumnMap.parse("", "orders", "text").with_defaults(["key", "body", "delay_level"])
    chunk = pa.RecordBatch.from_pylist(
        [{"key": "k", "body": "b", "delay_level": 1, input_rows.FILE_COLUMN: "a.csv", input_rows.ROW_COLUMN: 1}]
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        write = lambda: bulk.write_chunk(  # noqa: E731
            conn, NOT_A_TEST, PartitionCache(), chunk, mapping, "a.csv", now=real.clock() + timedelta(hours=1)
        )
        refused(real, write, "ahead of")
    assert real.conn.execute("SELECT count(*) FROM delaywheel.bulk_claims").fetchone() == (0,)


@given(st.timedeltas(min_value=timedelta(days=-3), max_value=timedelta(days=3)))
def test_a_now_is_accepted_exactly_within_the_tolerance(offset: timedelta) -> None:
    clock = datetime(2026, 12, 7, 12, tzinfo=UTC)
    try:
        check_now_near(clock + offset, clock, NOT_A_TEST)
        accepted = True
    except InvalidMessage as exc:
        assert exc.reason == "bad_now"
        accepted = False
    assert accepted == (-NOW_BEHIND <= offset <= NOW_AHEAD)
    check_now_near(clock + offset, clock, replace(NOT_A_TEST, test_clock=True))  # a test: any aware instant
