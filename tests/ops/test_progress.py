"""Progress lines of long work in Spark tasks: every `every` seconds of their clock, and once at the end."""

from __future__ import annotations

import io

from delaywheel.batch.bulk import Counts
from delaywheel.ops.progress import Progress


def test_progress_reports_every_interval_and_at_the_end() -> None:
    now = [100.0]
    out = io.StringIO()
    progress = Progress("bulk enqueue, partition 3", "rows", 10.0, clock=lambda: now[0], out=out)
    total = Counts()

    for at, rows in ((104.0, 50_000), (110.0, 50_000), (115.0, 50_000), (121.0, 50_000)):
        now[0] = at
        total.add(Counts(rows=rows, enqueued=rows - 2, rejected=2))
        progress.update(total.rows, total.summary())
    total.add(Counts(rows=10_000, skipped=10_000))
    now[0] = 125.0
    progress.update(total.rows, total.summary(), done=True)

    assert out.getvalue().splitlines() == [
        "bulk enqueue, partition 3: 100,000 rows, 99,996 enqueued, 0 already enqueued, 4 quarantined; 10,000 rows/s",
        "bulk enqueue, partition 3: 200,000 rows, 199,992 enqueued, 0 already enqueued, 8 quarantined; 9,524 rows/s",
        "bulk enqueue, partition 3: 210,000 rows, 199,992 enqueued, 10,000 already enqueued, 8 quarantined; "
        "8,400 rows/s, done",
    ]


def test_work_that_ends_at_once_still_says_it_is_done() -> None:
    out = io.StringIO()
    Progress("catch-up, level 4", "delivered", out=out, clock=lambda: 5.0).update(0, done=True)
    assert out.getvalue() == "catch-up, level 4: 0 delivered; 0 delivered/s, done\n"
