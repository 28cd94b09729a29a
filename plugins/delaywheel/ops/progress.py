"""Progress lines for long work inside Spark tasks (bulk enqueue, catch-up).

Spark's console bar counts finished partitions, and a partition of millions of rows stays at 0 for minutes. A
task's stderr reaches the Airflow task log in local mode (spark-submit's output is logged line by line) and the
executor's log on a cluster (Spark UI, Executors).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """A running count as a line on stderr every `every` seconds and once at the end."""

    def __init__(
        self,
        label: str,
        unit: str,
        every: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ) -> None:
        self.label, self.unit, self.every, self.clock, self.out = label, unit, every, clock, out
        self.started = self.reported = clock()

    def update(self, count: int, detail: str = "", *, done: bool = False) -> None:
        now = self.clock()
        if not done and now - self.reported < self.every:
            return
        self.reported = now
        rate = count / (now - self.started) if now > self.started else 0.0
        print(
            f"{self.label}: {count:,} {self.unit}{', ' + detail if detail else ''}; {rate:,.0f} {self.unit}/s"
            + (", done" if done else ""),
            file=self.out or sys.stderr,
            flush=True,
        )
