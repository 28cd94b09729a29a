"""Retention never drops unread rows silently: a topic partition past the database's retention floor goes even with
rows a consumer group has not read, and the drop counts them per group and topic (delaywheel.retired_unread), retire
returns and logs them, and `stats` (library, CLI text and --json) shows them. Days in 2020 are past the floor (7 days by
the database's clock) whatever clock the retire is given."""

from __future__ import annotations

import itertools
import json
import logging
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import errors

from delaywheel import Settings, Store
from delaywheel.cli import main
from delaywheel.partitions import Retired, Unread
from delaywheel.produce.validation import Message

OLD = datetime(2020, 1, 1, tzinfo=UTC)
RETENTION = timedelta(days=8)  # a retire this long after a day drops that day's topic partition


def _send(store: Store, topic: str, n: int, day: datetime) -> None:
    """n messages due at once: straight into the topic's partition of `day`."""
    store.send_many([Message(topic, {"i": i}) for i in range(n)], now=day)


def _read(store: Store, topic: str, group: str, n: int) -> None:
    """Group `group` reads and acks the first n messages of `topic` (no offsets row when n is 0)."""
    if n:
        assert store.ack(store.pull(topic, group, n)).acked == n


def _topic_drops(retired: list[Retired]) -> list[Retired]:
    return [r for r in retired if r.parent == "topic_messages"]


def _recorded(store: Store) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(group, topic) -> (dropped, partitions, last_dropped) as delaywheel.retired_unread holds them."""
    rows = store.conn.execute(
        "SELECT grp, topic, dropped, partitions, last_dropped FROM delaywheel.retired_unread"
    ).fetchall()
    return {(g, t): (d, p, last) for g, t, d, p, last in rows}


def test_retire_counts_logs_and_shows_what_a_group_had_not_read(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    _send(store, "orders", 30, OLD)
    _send(store, "payments", 5, OLD)
    _send(store, "audit", 4, OLD)  # a topic no group reads: no group to count it for
    _read(store, "orders", "a", 30)  # a read all of it
    _read(store, "orders", "b", 12)  # b read 12 of 30
    _read(store, "payments", "b", 5)
    _read(store, "payments", "c", 2)  # c read 2 of 5
    with caplog.at_level(logging.WARNING, logger="delaywheel.partitions"):
        retired = _topic_drops(store.retire(now=OLD + RETENTION))
    assert [(r.rows, r.unread) for r in retired] == [(39, (Unread("b", "orders", 18), Unread("c", "payments", 3)))]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2
    assert "dropped 18 rows of topic 'orders' that consumer group 'b' had not read" in warned[0]
    assert "dropped 3 rows of topic 'payments' that consumer group 'c' had not read" in warned[1]
    assert _recorded(store) == {("b", "orders"): (18, 1, 18), ("c", "payments"): (3, 1, 3)}

    # the next day's rows: a read none of them (its offsets row is from the day before), b all
    day2 = OLD + timedelta(days=1)
    _send(store, "orders", 7, day2)
    _read(store, "orders", "b", 7)  # the 18 b had not read went: it reads on from the next day's first row
    retired = _topic_drops(store.retire(now=day2 + RETENTION))
    assert [r.unread for r in retired] == [(Unread("a", "orders", 7),)]
    assert _recorded(store) == {
        ("a", "orders"): (7, 1, 7),
        ("b", "orders"): (18, 1, 18),
        ("c", "payments"): (3, 1, 3),
    }

    # a third day b misses part of: its counts add up
    day3 = OLD + timedelta(days=2)
    _send(store, "orders", 10, day3)
    _read(store, "orders", "a", 10)
    _read(store, "orders", "b", 4)
    assert [r.unread for r in _topic_drops(store.retire(now=day3 + RETENTION))] == [(Unread("b", "orders", 6),)]
    assert _recorded(store)[("b", "orders")] == (24, 2, 6)

    figures = store.stats()["retired_unread"]
    assert [(r["consumer_group"], r["topic"], r["dropped"], r["partitions"], r["last_dropped"]) for r in figures] == [
        ("b", "orders", 24, 2, 6),  # the latest drop first
        ("a", "orders", 7, 1, 7),
        ("c", "payments", 3, 1, 3),
    ]
    assert figures[0]["last_partition"] == "topic_messages_p20200103t0000"


def test_nothing_is_counted_when_every_group_read_everything(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    _send(store, "orders", 20, OLD)
    _read(store, "orders", "a", 20)
    _read(store, "orders", "b", 20)
    with caplog.at_level(logging.WARNING, logger="delaywheel.partitions"):
        retired = _topic_drops(store.retire(now=OLD + RETENTION))
    assert [(r.rows, r.unread) for r in retired] == [(20, ())]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _recorded(store) == {}
    assert store.stats()["retired_unread"] == []


def test_the_cli_says_what_retire_dropped_unread(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delaywheel retire` runs on the database's clock: days in 2020 are past any retention."""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    _send(store, "orders", 9, OLD)
    _read(store, "orders", "a", 9)
    _read(store, "orders", "b", 4)
    assert main(["retire", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dropped_unread"] == [
        {"partition": "topic_messages_p20200101t0000", "topic": "orders", "consumer_group": "b", "rows": 5}
    ]
    _send(store, "orders", 3, OLD + timedelta(days=1))  # neither group reads these
    assert main(["retire"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for group in ("a", "b"):
        assert (
            f"DROPPED UNREAD: 3 rows of topic 'orders' that group '{group}' had not read (topic_messages_p20200102t0000)"
            in lines
        )
    assert main(["stats", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["retired_unread"]
    assert {(r["consumer_group"], r["topic"], r["dropped"]) for r in figures} == {
        ("a", "orders", 3),
        ("b", "orders", 8),
    }
    assert all(isinstance(r["last_dropped_at"], str) for r in figures)  # ISO 8601, as every time in --json
    assert main(["stats"]) == 0
    text = capsys.readouterr().out
    assert "DROPPED UNREAD by retention" in text
    assert "  orders / b: 8 rows in 2 partition(s); last 3 rows of topic_messages_p20200102t0000 at" in text


def test_the_count_takes_a_topic_partition_only(store: Store) -> None:
    """The counting function names a partition by text, quoted: anything but a partition of topic_messages is
    refused with the reason."""
    store.prepare(now=OLD)
    for name in ("level_segments_p20200101t0000", "consumer_offsets", "x; DROP TABLE delaywheel.wheel", ""):
        with pytest.raises(errors.InvalidParameterValue, match=r"not a partition of delaywheel\.topic_messages"):
            store.conn.execute("SELECT * FROM delaywheel.partition_unread(%s)", (name,))
        store.conn.rollback()


def test_counts_match_a_model(db_url: str) -> None:
    """Random topics, groups and reads on a day of their own each: what retire reports, logs and records per group
    and topic is what each group that acked something there left unread."""
    days = itertools.count()
    with Store(db_url, Settings()) as store:

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            topics=st.lists(
                st.tuples(st.integers(1, 12), st.lists(st.integers(0, 12), min_size=3, max_size=3)),
                min_size=1,
                max_size=3,
            )
        )
        def run_example(topics: list[tuple[int, list[int]]]) -> None:
            i = next(days)
            day = OLD + timedelta(days=i)
            expected: dict[tuple[str, str], int] = {}
            for k, (rows, reads) in enumerate(topics):
                topic = f"d{i}t{k}"
                _send(store, topic, rows, day)
                for g, read in enumerate(reads):
                    _read(store, topic, f"g{g}", min(read, rows))
                    if 0 < read < rows:  # a group with no offsets row (read 0) is not counted
                        expected[(f"g{g}", topic)] = rows - read
            retired = _topic_drops(store.retire(now=day + RETENTION))
            assert len(retired) == 1 and retired[0].rows == sum(rows for rows, _ in topics)
            assert {(u.group, u.topic): u.rows for u in retired[0].unread} == expected
            recorded = {key: v for key, v in _recorded(store).items() if key[1].startswith(f"d{i}t")}
            assert recorded == {key: (n, 1, n) for key, n in expected.items()}

        run_example()
