"""Bar charts as inline SVG geometry, computed on the server so the page needs no JavaScript or CDN."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any


@dataclass(frozen=True)
class Bar:
    label: str
    value: int
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Chart:
    """What the template draws: bars in a `width` x `height` plot area plus the axis maximum."""

    bars: list[Bar]
    width: int
    height: int
    maximum: int


def bar_chart(points: Sequence[tuple[str, int]], *, width: int = 720, height: int = 160, gap: float = 4.0) -> Chart:
    """Scale `(label, value)` points to bars of equal width; an empty or all-zero series draws flat bars."""
    maximum = max((value for _, value in points), default=0)
    slot = width / max(len(points), 1)
    bars = []
    for i, (label, value) in enumerate(points):
        h = height * value / maximum if maximum else 0.0
        bars.append(Bar(label, value, x=i * slot + gap / 2, y=height - h, width=max(slot - gap, 1.0), height=h))
    return Chart(bars, width, height, maximum)


def hourly(histogram: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """`wheel_stats`' 24 one-hour buckets from now as chart points, each labelled by its start (UTC, to the minute):
    24 distinct clock times, the first one now."""
    return [(f"{row['start'].astimezone(UTC):%H:%M}", int(row["due"])) for row in histogram]
