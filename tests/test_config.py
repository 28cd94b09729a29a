"""Delay-level configuration: RocketMQ's `messageDelayLevel` format, env and airflow.cfg precedence,
and due times fixed at enqueue so a changed table never moves a pending message."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.config import (
    DEFAULT_LEVELS,
    ConfigError,
    format_duration,
    load_settings,
    parse_duration,
    parse_levels,
)
from tests.helpers import at, deliveries

S = timedelta(seconds=1)
M = timedelta(minutes=1)
H = timedelta(hours=1)


def test_default_table_is_rocketmqs() -> None:
    levels = parse_levels(DEFAULT_LEVELS)
    assert len(levels) == 18
    assert levels[:4] == (1 * S, 5 * S, 10 * S, 30 * S)
    assert levels[4:14] == tuple(n * M for n in range(1, 11))
    assert levels[14:] == (20 * M, 30 * M, 1 * H, 2 * H)
    assert Settings().levels == levels
    assert Settings().max_level == 18
    assert Settings().level_delay(18) == 2 * H


def test_every_unit() -> None:
    assert parse_levels("250ms 2s 3m 4h 5d") == (
        timedelta(milliseconds=250),
        2 * S,
        3 * M,
        4 * H,
        timedelta(days=5),
    )
    assert parse_levels("  1s\t\n10s  ") == (1 * S, 10 * S)


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("1s 5x 10s", "5x"),
        ("1s s", "s"),
        ("1s -5s", "-5s"),
        ("1.5s", "1.5s"),
        ("1s 0s", "0s"),
        ("1S", "1S"),
        ("5 s", "5"),
    ],
)
def test_bad_token_is_named(text: str, bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_levels(text)
    assert repr(bad) in str(info.value)


def test_empty_table_is_refused() -> None:
    with pytest.raises(ConfigError, match="empty"):
        parse_levels("   ")


def test_bad_duration_names_the_setting() -> None:
    assert parse_duration("500ms", "x") == timedelta(milliseconds=500)
    with pytest.raises(ConfigError, match=r"wheel_precision.*'fast'"):
        parse_duration("fast", "wheel_precision")


def test_precision_outside_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="wheel_precision"):
        Settings(wheel_precision=timedelta(milliseconds=50))
    with pytest.raises(ConfigError, match="wheel_precision"):
        Settings(wheel_precision=timedelta(minutes=2))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No delaywheel settings in the environment; AIRFLOW_CONFIG points at an empty temp file."""
    for name in (
        "LEVELS",
        "MAX_BODY_BYTES",
        "WHEEL_PRECISION",
        "DATABASE_URL",
        "MAX_RECONSUME_TIMES",
        "BATCH_SIZE",
        "WHEEL_NEAR_WINDOW",
        "WHEEL_MAX_DELAY",
        "PAST_TOLERANCE",
        "TOPIC_RETENTION",
    ):
        monkeypatch.delenv(f"DELAYWHEEL_{name}", raising=False)
        monkeypatch.delenv(f"AIRFLOW__DELAYWHEEL__{name}", raising=False)
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text("[core]\nload_examples = False\n")
    monkeypatch.setenv("AIRFLOW_CONFIG", str(cfg))
    return cfg


def test_defaults_without_configuration(clean_env: Path) -> None:
    assert load_settings().levels == parse_levels(DEFAULT_LEVELS)


def test_precedence_env_over_airflow_env_over_cfg(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env.write_text("[delaywheel]\nlevels = 1m 2m\nmax_body_bytes = 1000\nwheel_precision = 100ms\n")
    settings = load_settings()
    assert settings.levels == (1 * M, 2 * M)
    assert settings.max_body_bytes == 1000
    assert settings.wheel_precision == timedelta(milliseconds=100)

    monkeypatch.setenv("AIRFLOW__DELAYWHEEL__LEVELS", "1h")
    assert load_settings().levels == (1 * H,)

    monkeypatch.setenv("DELAYWHEEL_LEVELS", "3s 4s 5s")
    assert load_settings().levels == (3 * S, 4 * S, 5 * S)
    assert load_settings().max_body_bytes == 1000  # other settings still come from airflow.cfg


def test_bad_level_string_from_each_source_names_the_token(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env.write_text("[delaywheel]\nlevels = 1s 2q\n")
    with pytest.raises(ConfigError, match="'2q'"):
        load_settings()
    monkeypatch.setenv("AIRFLOW__DELAYWHEEL__LEVELS", "1s 7y")
    with pytest.raises(ConfigError, match="'7y'"):
        load_settings()
    monkeypatch.setenv("DELAYWHEEL_LEVELS", "1s 9z")
    with pytest.raises(ConfigError, match="'9z'"):
        load_settings()


def test_bad_integer_setting_is_named(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELAYWHEEL_MAX_BODY_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"max_body_bytes.*'lots'"):
        load_settings()


def test_changing_the_table_does_not_move_pending_messages(db_url: str, t0: datetime) -> None:
    """Due times are fixed at enqueue: a message sent at level 2 = 5s stays due at t0+5s after the
    table changes to '1m 1h', and is neither delivered early nor held back to the new delay."""
    with Store(db_url, Settings(levels=parse_levels("1s 5s"))) as old:
        first = old.send("orders", {"n": 1}, delay_level=2, now=t0)
        second = old.send("orders", {"n": 2}, delay_level=1, now=t0)
    with Store(db_url, Settings(levels=parse_levels("1m 1h"))) as new:
        assert new.deliver_level(2, now=at(t0, 4.999)).delivered == 0
        result = new.deliver_level(2, now=at(t0, 5))
        assert result.delivered == 1
        assert new.deliver_level(1, now=at(t0, 1)).delivered == 1
        rows = {mid: (due, done) for mid, due, done, _ in deliveries(new)}
    assert rows[first][0] == at(t0, 5)
    assert rows[second][0] == at(t0, 1)


def test_shortening_the_table_leaves_no_message_behind(db_url: str, t0: datetime) -> None:
    """Levels removed from the table while they hold messages are served by the last level's deliverer,
    on their own fixed due times and in their own FIFO order, and shown by stats until they are empty."""
    with Store(db_url, Settings(levels=parse_levels("1s 5s 10s 30s"))) as old:
        sent = {
            level: [old.send("orders", {"level": level, "n": n}, delay_level=level, now=t0) for n in range(3)]
            for level in (3, 4)
        }
    with Store(db_url, Settings(levels=parse_levels("1s 2s"))) as new:
        shown = {row["level"]: row for row in new.stats(now=at(t0, 1))["levels"]}
        assert shown[3]["delay"] is None and shown[3]["backlog"] == 3 and shown[4]["backlog"] == 3
        assert new.deliver_level(2, now=at(t0, 9.999)).delivered == 0  # never early
        early = new.deliver_level(2, now=at(t0, 10))
        assert early.delivered == 3 and early.next_due == at(t0, 30)
        assert new.deliver_due(now=at(t0, 30)) == 3
        rows = deliveries(new)
        assert [mid for mid, *_ in rows] == sent[3] + sent[4]
        assert [due for _, due, *_ in rows] == [at(t0, 10)] * 3 + [at(t0, 30)] * 3
        assert sorted(row["level"] for row in new.stats(now=at(t0, 31))["levels"]) == [1, 2]


def _no_configured_url(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DELAYWHEEL_DATABASE_URL", "AIRFLOW__DELAYWHEEL__DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONFIG", "/nonexistent/airflow.cfg")


def test_a_store_without_a_url_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URL given or configured: an error naming the ways to give one, the embedded cluster among them, and no
    server started on the side (the constructor raises before it connects to anything)."""
    _no_configured_url(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"Store\(url\).*DELAYWHEEL_DATABASE_URL.*delaywheel\.dev\.embedded\.store\(\)"
    ):
        Store()
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", "postgresql://app@db.example/store")
    assert Store().url == "postgresql://app@db.example/store"  # (a Store connects on first use)


def test_the_project_folder_is_delaywheel_home_or_the_checkout(tmp_path: Path) -> None:
    """PROJECT_ROOT (the embedded cluster, reports, input folders) is DELAYWHEEL_HOME when set, else this checkout;
    an installed package uses the working directory (tests/test_wheel_install.py)."""
    probe = "from delaywheel.config import PROJECT_ROOT; print(PROJECT_ROOT)"
    env = {k: v for k, v in os.environ.items() if k != "DELAYWHEEL_HOME"}
    checkout = Path(__file__).resolve().parents[1]
    assert subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.strip() == str(checkout)
    assert subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "DELAYWHEEL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip() == str(tmp_path)


@given(st.integers(1, 10**12))
def test_a_formatted_duration_reads_back_as_itself(ms: int) -> None:
    """`format_duration` writes what `parse_duration` reads (the retry policies' texts), in the largest whole unit."""
    text = format_duration(timedelta(milliseconds=ms))
    assert parse_duration(text, "x") == timedelta(milliseconds=ms)
    assert format_duration(timedelta(minutes=90)) == "90m" and format_duration(timedelta(hours=24)) == "1d"
