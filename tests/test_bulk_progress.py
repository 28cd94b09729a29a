"""A bulk writer's progress lines: every `every` seconds of its clock, and once at its end."""

from __future__ import annotations

import io

from delaywheel.bulk import Counts, Progress


def test_progress_reports_every_interval_and_at_the_end() -> None:
    now = [100.0]
    out = io.StringIO()
    progress = Progress("bulk enqueue, partition 3", 10.0, clock=lambda: now[0], out=out)
    total = Counts()

    for at, rows in ((104.0, 50_000), (110.0, 50_000), (115.0, 50_000), (121.0, 50_000)):
        now[0] = at
        progress.update(total.add(Counts(rows=rows, enqueued=rows - 2, rejected=2)))
    total.add(Counts(rows=10_000, skipped=10_000))
    now[0] = 125.0
    progress.update(total, done=True)

    assert out.getvalue().splitlines() == [
        "bulk enqueue, partition 3: 100,000 rows, 99,996 enqueued, 0 already enqueued, 4 quarantined; 10,000 rows/s",
        "bulk enqueue, partition 3: 200,000 rows, 199,992 enqueued, 0 already enqueued, 8 quarantined; 9,524 rows/s",
        "bulk enqueue, partition 3: 210,000 rows, 199,992 enqueued, 10,000 already enqueued, 8 quarantined; "
        "8,400 rows/s, done",
    ]


def test_an_empty_partition_still_says_it_is_done() -> None:
    out = io.StringIO()
    Progress("bulk enqueue, partition 0", out=out, clock=lambda: 5.0).update(Counts(), done=True)
    assert out.getvalue() == "bulk enqueue, partition 0: 0 rows, 0 enqueued, 0 already enqueued, 0 quarantined; 0 rows/s, done\n"
