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
from delaywheel.lanes import Lane, lane_name
from delaywheel.ops.progress import Progress
from delaywheel.store import Store

BUSY_RETRIES = 600  # a live deliverer holds a lane for one pass at a time; catch-up waits its turn


@dataclass(frozen=True)
class LaneResult:
    """What catch-up did on one lane."""

    lane: Lane
    delivered: int
    skipped_cancelled: int
    passes: int


def catch_up_lane(
    url: str, settings: Settings, lane: Lane, *, now: datetime | None = None, limit: int = 50_000
) -> LaneResult:
    """Drain one lane with the deliverers' own passes until nothing due is left (its own connection), its counts
    on stderr as it goes."""
    delivered = cancelled = passes = busy = 0
    progress = Progress(f"catch-up, {lane_name(lane)}", "delivered")
    with Store(url, settings) as store:
        while True:
            result = (
                store.advance_wheel(now=now, limit=limit)
                if lane is None
                else store.deliver_level(lane, now=now, limit=limit)
            )
            if result.busy:
                busy += 1
                if busy > BUSY_RETRIES:
                    raise RuntimeError(f"{lane_name(lane)} stayed busy: another process holds its lock")
                time.sleep(0.05)
                continue
            passes += 1
            delivered += result.delivered
            cancelled += result.skipped_cancelled
            progress.update(delivered, f"{cancelled:,} cancelled, {passes:,} passes", done=not result.more)
            if not result.more:
                return LaneResult(lane, delivered, cancelled, passes)
