"""Stats report real numbers: level backlog and head, wheel horizons and histogram, topic depth, group lag, the
quarantine and the set-aside rows; lags never negative; one JSON form with numbers as numbers."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta

import pytest

from delaywheel import Store
from delaywheel.airflow.web.charts import hourly
from delaywheel.ops import stats
from delaywheel.produce.validation import Message
from tests.helpers import at, number_paths


def test_level_stats(store: Store, t0: datetime) -> None:
    store.send_many([Message("orders", {"i": i}, delay_level=2) for i in range(4)], now=t0)  # due t0+5
    store.send_many([Message("orders", {"i": i}, delay_level=2) for i in range(3)], now=at(t0, 10))  # t0+15
    store.send("orders", b"x", delay_level=5, now=t0)  # due t0+60
    store.deliver_level(2, now=at(t0, 6))
    levels = {row["level"]: row for row in store.stats(now=at(t0, 20))["levels"]}
    assert len(levels) == 18
    two = levels[2]
    assert (two["backlog"], two["delivered"], two["head_due"], two["delay"]) == (3, 4, at(t0, 15), 5.0)
    assert (two["oldest_overdue_s"], two["lag_s"]) == (5.0, 5.0)
    assert two["checkpoint_id"] > 0 and isinstance(two["checkpoint_xid"], int) and two["checkpoint_xid"] > 0
    five = levels[5]
    assert (five["backlog"], five["head_due"], five["oldest_overdue_s"], five["lag_s"], five["checkpoint_id"]) == (
        1,
        at(t0, 60),
        None,
        0.0,
        0,
    )
    assert levels[1]["backlog"] == 0 and levels[1]["head_due"] is None and levels[1]["lag_s"] == 0.0


def test_wheel_stats(store: Store, t0: datetime) -> None:
    store.prepare(now=t0)
    offsets = [-30, -10, 30, 50, 600, 1800, 5400, 7200, 2 * 86400, 40 * 86400]
    ids = store.send_many([Message("timers", {"s": s}, deliver_at=at(t0, s)) for s in offsets if s > 0], now=t0)
    store.send_many([Message("timers", {"s": s}, deliver_at=at(t0, s)) for s in offsets if s <= 0], now=at(t0, -60))
    store.cancel(message_id=ids[-1])
    store.advance_wheel(now=at(t0, -20))  # delivers the one due at -30; cursor at -20
    wheel = store.stats(now=t0)["wheel"]
    assert (wheel["overdue"], wheel["oldest_overdue_s"], wheel["lag_s"]) == (1, 10.0, 10.0)
    assert (wheel["next_minute"], wheel["next_hour"], wheel["next_day"], wheel["later"]) == (2, 2, 2, 1)
    assert wheel["pending"] == 8
    assert wheel["cursor_at"] == at(t0, -20)
    assert wheel["estimated_after"] is None  # a small wheel is counted row by row
    assert wheel["since_last_pass_s"] is not None and wheel["since_last_pass_s"] >= 0  # the pass's commit, real clock
    # 24 buckets of one hour from now, each (start, end]: 30, 50, 600, 1800 s; 5400 and 7200 s; nothing else
    assert [(b["start"], b["end"]) for b in wheel["histogram_24h"]] == [
        (at(t0, 3600 * i), at(t0, 3600 * (i + 1))) for i in range(24)
    ]
    assert [b["due"] for b in wheel["histogram_24h"]] == [4, 2] + [0] * 22
    assert (
        sum(b["due"] for b in wheel["histogram_24h"]) == wheel["next_minute"] + wheel["next_hour"] + wheel["next_day"]
    )


def test_an_idle_wheel_shows_time_since_its_last_pass_not_a_lag(store: Store, t0: datetime) -> None:
    """The old `cursor_lag_s` grew while nothing was due: it was the time since the last pass. Lag is the age of the
    oldest timer due and not delivered: 0 when none is."""
    assert store.stats(now=t0)["wheel"]["since_last_pass_s"] is None  # never advanced
    store.send("timers", b"x", deliver_at=at(t0, 3600), now=t0)
    store.advance_wheel(now=t0)
    for later in (60, 1800):
        wheel = store.stats(now=at(t0, later))["wheel"]
        assert (wheel["lag_s"], wheel["oldest_overdue_s"], wheel["overdue"]) == (0.0, None, 0)
    wheel = store.stats(now=at(t0, 3700))["wheel"]
    assert (wheel["lag_s"], wheel["overdue"]) == (100.0, 1)


def test_no_negative_lag_while_passes_run(store: Store, db_url: str) -> None:
    """`now` is read after the stats transaction's snapshot: a pass it sees committed before its clock reading.
    (Reading the clock before a slow query gave a cursor lag of -8,870 ms.)"""
    store.advance_wheel()  # the first pass rolls and makes partitions: slow, and not what is raced here
    now = store.clock()
    store.send_many([Message("timers", {"i": i}, deliver_at=now + timedelta(milliseconds=20 * i)) for i in range(100)])
    stop = threading.Event()

    def advance() -> None:
        with Store(db_url) as other:
            while not stop.is_set():
                other.advance_wheel()

    thread = threading.Thread(target=advance)
    thread.start()
    try:
        seen = []
        for _ in range(40):
            figures = store.stats()
            wheel = figures["wheel"]
            seen.append(wheel["since_last_pass_s"])
            assert wheel["lag_s"] >= 0
            assert wheel["last_pass_at"] is None or wheel["last_pass_at"] <= figures["now"]
            assert all(row["lag_s"] >= 0 for row in figures["levels"])
    finally:
        stop.set()
        thread.join()
    assert all(s is not None and s >= 0 for s in seen)


def test_an_injected_clock_behind_the_cursor_gives_no_negative_figure(store: Store, t0: datetime) -> None:
    store.send("timers", b"x", deliver_at=at(t0, 5), now=t0)
    store.advance_wheel(now=at(t0, 10))
    wheel = store.stats(now=t0)["wheel"]
    assert (wheel["lag_s"], wheel["pending"]) == (0.0, 0)
    assert 0 <= wheel["since_last_pass_s"] < 60  # by the database clock: the pass stamped its commit with it


def test_histogram_labels_are_distinct(store: Store, t0: datetime) -> None:
    """The chart labelled its first and last bucket with the same hour (25 buckets from this hour)."""
    now = at(t0, 27 * 60 + 13)
    store.send_many(
        [Message("timers", {"h": h}, deliver_at=now + timedelta(hours=h, minutes=1)) for h in range(24)], now=now
    )
    histogram = store.stats(now=now)["wheel"]["histogram_24h"]
    points = hourly(histogram)
    assert len(points) == 24 and len({label for label, _ in points}) == 24
    assert points[0] == ("00:27", 1) and points[-1] == ("23:27", 1)
    assert [value for _, value in points] == [1] * 24


def test_counts_beyond_the_exact_budget_come_from_the_statistics(
    store: Store, t0: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.send_many(
        # 75 an hour through the 4-hour partition from t0 + 4 h: the statistics' count, spread evenly, is exact
        [Message("timers", {"i": i}, deliver_at=t0 + timedelta(hours=4, seconds=24 + 48 * i)) for i in range(300)],
        now=t0,
    )
    store.send_many(
        [Message("timers", {"i": i}, deliver_at=t0 + timedelta(hours=30, seconds=i)) for i in range(200)], now=t0
    )
    store.send_many([Message("timers", {"i": i}, deliver_at=t0 + timedelta(minutes=30)) for i in range(7)], now=t0)
    store.conn.execute("ANALYZE delaywheel.wheel")
    exact = store.stats(now=t0)["wheel"]
    monkeypatch.setattr(stats, "EXACT_ROWS", 10)
    estimated = store.stats(now=t0)["wheel"]
    assert exact["estimated_after"] is None and estimated["estimated_after"] == t0 + timedelta(hours=4)
    keys = ("pending", "overdue", "next_minute", "next_hour", "next_day", "later")
    assert (
        {k: exact[k] for k in keys}
        == {k: estimated[k] for k in keys}
        == {"pending": 507, "overdue": 0, "next_minute": 0, "next_hour": 7, "next_day": 300, "later": 200}
    )
    assert [b["due"] for b in exact["histogram_24h"]][:9] == [7, 0, 0, 0, 75, 75, 75, 75, 0]
    assert [b["due"] for b in estimated["histogram_24h"]] == [b["due"] for b in exact["histogram_24h"]]


def test_quarantine_and_set_aside_rows_appear(store: Store, t0: datetime) -> None:
    empty = store.stats(now=t0)
    assert empty["quarantine"] == {"total": 0, "by_reason": [], "recent": []}
    assert empty["set_aside"] == {"total": 0, "by_reason": [], "recent": []}
    store.conn.execute(
        """
        INSERT INTO delaywheel.quarantine (source, source_file, row_number, reason, detail, raw, quarantined_at)
        SELECT 'src', 'in.csv', n, CASE WHEN n <= 4 THEN 'bad_body' ELSE 'bad_topic' END, 'row ' || n, '{}',
               %s + make_interval(secs => n)
        FROM generate_series(1, 7) n""",
        (t0,),
    )
    has_set_aside = store.conn.execute("SELECT to_regclass('delaywheel.set_aside') IS NOT NULL").fetchone()[0]  # type: ignore[index]
    if has_set_aside:
        store.conn.execute(
            """
            INSERT INTO delaywheel.set_aside (message_id, lane, level, topic, key, deliver_at, reason, detail, set_aside_at)
            VALUES (41, 'level', 1, 'orders', 'k1', %(t)s, 'bad_properties', 'invalid json', %(t)s),
                   (42, 'wheel', NULL, 'orders', NULL, %(t)s, 'bad_properties', 'invalid json', %(t)s + interval '1 s'),
                   (43, 'wheel', NULL, NULL, NULL, %(t)s, 'bad_topic', 'no topic', %(t)s + interval '2 s')""",
            {"t": t0},
        )
    figures = store.stats(now=t0)
    quarantine = figures["quarantine"]
    assert quarantine["total"] == 7
    assert [(r["reason"], r["count"]) for r in quarantine["by_reason"]] == [("bad_body", 4), ("bad_topic", 3)]
    assert [r["row_number"] for r in quarantine["recent"]] == [7, 6, 5, 4, 3]  # the most recent first
    if has_set_aside:
        aside = figures["set_aside"]
        assert aside["total"] == 3
        assert [(r["reason"], r["count"]) for r in aside["by_reason"]] == [("bad_properties", 2), ("bad_topic", 1)]
        assert [r["message_id"] for r in aside["recent"]] == [43, 42, 41]


def test_json_numbers_are_numbers(
    store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's `stats --json` gave `extract()`'s numerics as strings; the web API gave numbers. One form now."""
    from delaywheel.cli import main

    now = store.clock()
    store.send_many([Message("orders", {"i": i}, delay_level=1) for i in range(3)], now=now - timedelta(seconds=5))
    store.deliver_level(1)
    store.advance_wheel()
    store.send("orders", b"y", delay_level=1, now=now - timedelta(seconds=3))
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert main(["stats", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    level1 = printed["levels"][0]
    for key in ("delay", "lag_s", "oldest_overdue_s", "lateness_p50_s", "lateness_p99_s"):
        assert isinstance(level1[key], float), key
    for key in ("backlog", "checkpoint_id", "checkpoint_xid", "delivered", "delivered_in_window"):
        assert isinstance(level1[key], int), key
    wheel = printed["wheel"]
    for key in ("since_last_pass_s", "lag_s"):
        assert isinstance(wheel[key], float), key
    assert isinstance(wheel["pending"], int) and isinstance(wheel["histogram_24h"][0]["due"], int)
    assert isinstance(printed["now"], str) and datetime.fromisoformat(printed["now"])
    assert not [p for p, t in number_paths(printed).items() if t == "str" and p.endswith(("_s", "count", "due", "n"))]
    assert number_paths(printed) == number_paths(json.loads(json.dumps(stats.as_json(store.stats()))))


def test_stragglers_and_cancellations_count_in_their_interval(store: Store, db_url: str, t0: datetime) -> None:
    """A timer committed after a pass passed its due time (a straggler) is overdue; a cancelled one is not pending."""
    store.advance_wheel(now=t0)
    with Store(db_url) as producer:
        with producer.conn.transaction():
            producer.send("timers", b"late", deliver_at=at(t0, 5), now=t0)
            store.advance_wheel(now=at(t0, 10))  # passes t0+10 below the producer's open transaction
        ids = producer.send_many(
            [Message("timers", {"s": s}, deliver_at=at(t0, s)) for s in (3600, 3600, 7200)], now=at(t0, 10)
        )
    store.cancel(message_id=ids[0])
    wheel = store.stats(now=at(t0, 10))["wheel"]
    assert (wheel["overdue"], wheel["lag_s"], wheel["head_due"]) == (1, 5.0, at(t0, 5))
    assert (wheel["next_hour"], wheel["next_day"], wheel["pending"]) == (
        1,
        1,
        3,
    )  # one of the two at 3600 s is cancelled
    assert [b["due"] for b in wheel["histogram_24h"]][:3] == [1, 1, 0]  # (t0+10, t0+3610] holds 3600 s; then 7200 s


def test_far_blocks_the_roll_has_not_reached_count_by_their_due_times(store: Store, t0: datetime) -> None:
    store.advance_wheel(now=t0)  # near_until: the day after t0 + 3 days
    store.send_many([Message("timers", {"d": d}, deliver_at=t0 + timedelta(days=d)) for d in (5, 5, 6, 40)], now=t0)
    assert store.stats(now=t0)["wheel"]["later"] == 4
    late = t0 + timedelta(days=5, hours=1)  # no pass since: the block of day 5 is overdue, day 6 within 24 h
    wheel = store.stats(now=late)["wheel"]
    assert (wheel["overdue"], wheel["next_day"], wheel["later"], wheel["lag_s"]) == (2, 1, 1, 3600.0)
