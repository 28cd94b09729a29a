"""Catch-up after an outage: drain every lane with the deliverers' own passes, one lane per Spark partition.

Nothing here delivers by a second path: catch-up repeats the deliverers' passes (`Store.deliver_level`,
`Store.advance_wheel`), whose advisory locks and checkpoints make it exactly-once and leave the Airflow deliverers
to resume right after. Spark (spark/redeliver.py) only spreads the lanes over partitions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from delaywheel.config import Settings
from delaywheel.deliver.runner import lane_name
from delaywheel.ops.progress import Progress
from delaywheel.store import Store

BUSY_RETRIES = 600  # a live deliverer holds a lane for one pass at a time; catch-up waits its turn


@dataclass(frozen=True)
class LaneResult:
    """What catch-up did on one lane (a level, or the wheel when level is None)."""

    level: int | None
    delivered: int
    skipped_cancelled: int
    passes: int


def catch_up_lane(url: str, settings: Settings, level: int | None, *, now: datetime | None = None,
                  limit: int = 50_000) -> LaneResult:
    """Drain one lane with the deliverers' own passes until nothing due is left (its own connection), its counts
    on stderr as it goes."""
    delivered = cancelled = passes = busy = 0
    progress = Progress(f"catch-up, {lane_name(level)}", "delivered")
    with Store(url, settings) as store:
        while True:
            result = store.advance_wheel(now=now, limit=limit) if level is None else store.deliver_level(
                level, now=now, limit=limit)
            if result.busy:
                busy += 1
                if busy > BUSY_RETRIES:
                    raise RuntimeError(f"lane {level or 'wheel'} stayed busy: another process holds its lock")
                time.sleep(0.05)
                continue
            passes += 1
            delivered += result.delivered
            cancelled += result.skipped_cancelled
            progress.update(delivered, f"{cancelled:,} cancelled, {passes:,} passes", done=not result.more)
            if not result.more:
                return LaneResult(level, delivered, cancelled, passes)


def lanes(settings: Settings) -> list[int | None]:
    """Every level, then the wheel (None): one catch-up partition each."""
    return [*range(1, settings.max_level + 1), None]
