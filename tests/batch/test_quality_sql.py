"""The quality job's statements are text (Spark runs them: JDBC reads one statement, Spark SQL has no psycopg), so
what goes into them is checked or quoted here: thresholds are lane keys and finite numbers, times are psycopg
literals."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from delaywheel.batch.quality import Thresholds, deliveries_sql, due_sql


def test_thresholds_are_lane_keys_and_numbers() -> None:
    sql = Thresholds.parse("default=5000,1=1500,wheel=2000").levels_sql()
    assert "map('1', 1500.0D, 'wheel', 2000.0D)" in sql and "5000.0D" in sql
    for hostile in (
        {"per_lane": {"1', 0D), lane_key) --": 1.0}},
        {"per_lane": {"1": "1D) --"}},
        {"default_ms": float("nan")},
        {"per_lane": {"wheel": float("inf")}},
    ):
        with pytest.raises(ValueError):
            Thresholds(**hostile)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Thresholds.parse("1=1e999")


def test_window_bounds_are_quoted_literals_in_utc() -> None:
    start = datetime(2026, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))  # 00:00 UTC
    for text in (
        deliveries_sql(start, start + timedelta(hours=1)),
        due_sql(start, start + timedelta(hours=1), timedelta(days=1)),
    ):
        assert "'2026-01-01 00:00:00+00:00'::timestamptz" in text and "'2026-01-01 01:00:00+00:00'::timestamptz" in text
    assert "'2025-12-31 00:00:00+00:00'::timestamptz" in due_sql(
        start.astimezone(UTC), start + timedelta(hours=1), timedelta(days=1)
    )
