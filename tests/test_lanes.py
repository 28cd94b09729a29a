"""Lanes listed and named one way (delaywheel/lanes.py)."""

from __future__ import annotations

from datetime import timedelta

from delaywheel.channels import NOTIFY_CHANNEL, lane_channel
from delaywheel.config import DEFAULT_LEVELS, Settings, parse_levels
from delaywheel.lanes import all_lanes, delay_label, lane_key, lane_name


def test_every_level_then_the_wheel() -> None:
    settings = Settings(levels=parse_levels("1s 5s 10s"))
    assert all_lanes(settings) == [1, 2, 3, None]
    assert all_lanes(settings, wheel=False) == [1, 2, 3]


def test_names_and_keys() -> None:
    assert [lane_name(lane) for lane in (1, 18, None)] == ["level 1", "level 18", "wheel"]
    assert [lane_key(lane) for lane in (1, 18, None)] == ["1", "18", "wheel"]
    assert lane_channel(3) == f"{NOTIFY_CHANNEL}_3" and lane_channel(None) == f"{NOTIFY_CHANNEL}_wheel"


def test_a_delay_label_is_what_the_level_table_reads_back() -> None:
    text = DEFAULT_LEVELS + " 500ms 1500ms 90s 36h 3d"
    assert " ".join(delay_label(d) for d in parse_levels(text)) == text
    assert [delay_label(d) for d in (timedelta(seconds=60), timedelta(hours=24), timedelta(milliseconds=1))] == [
        "1m",
        "1d",
        "1ms",
    ]
