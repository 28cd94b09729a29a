"""Lanes: what a deliverer serves, listed and named one way everywhere.

A lane is one delay level (its number, 1..N of the level table) or the timing wheel (None): each has its own
queue, advisory lock (locks.py), checkpoint and deliverer. At send, a message takes one of three kinds of lane
(`LaneKind`, the `lane` column of the pending rows): `direct` (due already: written straight into its topic),
`level` or `wheel`; with its level, a pending row's kind names its `Lane`. Nothing here imports more than the
standard library and the settings.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from delaywheel.config import Settings

Lane = int | None  # a level's number, or None for the timing wheel
LaneKind = Literal["direct", "level", "wheel"]
# The level table's own notation (RocketMQ's messageDelayLevel, config.parse_levels), largest unit first.
_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))


def all_lanes(settings: Settings, *, wheel: bool = True) -> list[Lane]:
    """Every level in order, then the wheel (unless `wheel` is False): the lanes a full deliverer serves, in the
    order it passes them."""
    return [*range(1, settings.max_level + 1), *([None] if wheel else [])]


EVERY_LANE = "every lane"  # how results and Asset events name one deliverer of all lanes (DeliverAllLanesOperator)


def lane_name(lane: Lane) -> str:
    """How logs, reports and Asset events name a lane: 'level 3', 'wheel'."""
    return "wheel" if lane is None else f"level {lane}"


def lane_key(lane: Lane) -> str:
    """A lane as one token: '3', 'wheel' (the catch-up report's keys, lateness thresholds' keys, the suffix of the
    lane's announcement channel)."""
    return "wheel" if lane is None else str(lane)


def delay_label(delay: timedelta) -> str:
    """A level's delay in the level table's notation: '1s', '2m', '2h', '500ms' (what parse_levels reads back)."""
    ms = round(delay / timedelta(milliseconds=1))
    for unit, size in _UNITS:
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
