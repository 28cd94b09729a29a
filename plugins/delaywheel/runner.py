"""The delivery loop: RocketMQ's countdown, shared by the CLI, the Airflow operators and the demo.

Each lane (a level, or the wheel; `None` stands for the wheel) is passed until drained, then the loop
sleeps exactly until the earliest next due time, waking early when a producer NOTIFYs a new message.
A pass is one transaction, so stopping between passes (deadline, SIGTERM) loses and duplicates nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import psycopg

from . import partitions
from .db import connect
from .levels import TopicSpan, add_spans
from .producer import NOTIFY_CHANNEL
from .store import Store

Lane = int | None  # a level number, or None for the wheel
BUSY_RETRY_S = 0.05  # another deliverer or a canceller holds the lane: look again soon
PREPARE_EVERY_S = 600.0  # partitions are created hours ahead; refresh them this often
SUMMARIZE_EVERY_S = 60.0  # BRIN summaries autovacuum dropped (partitions.summarize): a cancel stays fast
SAFETY_WAKE_S = 5.0  # without a known next due time, look anyway this often (a missed NOTIFY costs this much)
HANDOVER_POLL_S = 0.5  # past the duration, waiting for a successor: look for one this often
PRESENCE_LOCK = 0x64770030  # advisory lock class held (shared) by every live runner of a lane; second key: lane


@dataclass
class RunTotals:
    delivered: int = 0
    skipped_cancelled: int = 0
    passes: int = 0
    busy_passes: int = 0
    per_lane: dict[str, int] = field(default_factory=dict)
    per_topic: dict[str, TopicSpan] = field(default_factory=dict)  # what this run wrote, per topic


def lane_name(lane: Lane) -> str:
    return "wheel" if lane is None else f"level {lane}"


def run(
    store: Store,
    lanes: Sequence[Lane],
    duration_s: float,
    *,
    stop: threading.Event | None = None,
    progress: Callable[[RunTotals], None] | None = None,
    progress_every_s: float = 10.0,
    until_idle: bool = False,
    handover_grace_s: float = 0.0,
) -> RunTotals:
    """Deliver on `lanes` for `duration_s` seconds (or until `stop` is set, or, with `until_idle`,
    until nothing is pending on them).

    With `handover_grace_s`, the run hands its lanes over only to a live successor: past `duration_s`
    it keeps delivering, for up to `handover_grace_s` more, until every lane has another runner. A
    successor that failed to start (a task killed at start-up on a busy machine) then leaves no lane
    unserved while Airflow retries it."""
    stop = stop or threading.Event()
    totals = RunTotals()
    deadline = time.monotonic() + duration_s
    next_report = time.monotonic() + progress_every_s
    next_prepare = time.monotonic()
    with _summarizing(store.url), connect(store.url, autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")  # type: ignore[arg-type]
        for lane in lanes:  # released with the connection, so a crashed runner is never counted
            listener.execute("SELECT pg_advisory_lock_shared(%s, %s)", (PRESENCE_LOCK, _lane_key(lane)))
        while not stop.is_set() and _keep_going(listener, lanes, deadline, handover_grace_s):
            if time.monotonic() >= next_prepare:
                store.prepare()
                next_prepare = time.monotonic() + PREPARE_EVERY_S
            earliest = None
            busy = False
            for lane in lanes:
                while not stop.is_set():
                    result = store.advance_wheel() if lane is None else store.deliver_level(lane)
                    totals.passes += 1
                    totals.delivered += result.delivered
                    totals.skipped_cancelled += result.skipped_cancelled
                    if result.delivered:
                        totals.per_lane[lane_name(lane)] = totals.per_lane.get(lane_name(lane), 0) + result.delivered
                        add_spans(totals.per_topic, result.topics)
                    busy |= result.busy
                    totals.busy_passes += result.busy
                    if not result.more:
                        break
                if result.next_due is not None and (earliest is None or result.next_due < earliest):
                    earliest = result.next_due
            if progress and time.monotonic() >= next_report:
                progress(totals)
                next_report = time.monotonic() + progress_every_s
            if until_idle and earliest is None and not busy:
                break
            now = store.clock()
            wait = SAFETY_WAKE_S if earliest is None else max(0.0, (earliest - now).total_seconds())
            if busy:
                wait = min(wait, BUSY_RETRY_S)
            past = time.monotonic() >= deadline
            wait = min(wait, HANDOVER_POLL_S if past else deadline - time.monotonic())
            if wait > 0:
                # A message due after this sleep ends is found by the next pass anyway; waking for it would
                # wake every idle lane on every enqueue. So only announcements due sooner cut the sleep short.
                _sleep_or_notified(listener, wait, stop, now.timestamp() + wait)
    if progress:
        progress(totals)
    return totals


@contextlib.contextmanager
def _summarizing(url: str) -> Iterator[None]:
    """partitions.summarize every SUMMARIZE_EVERY_S while the run lasts, on a thread with its own connection: after
    a burst it may summarize thousands of ranges (a second or more), which would otherwise hold up the passes."""
    finished = threading.Event()

    def loop() -> None:
        while not finished.wait(SUMMARIZE_EVERY_S):
            with contextlib.suppress(psycopg.Error), connect(url, autocommit=True) as conn:
                partitions.summarize(conn)

    thread = threading.Thread(target=loop, name="delaywheel-summarize", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()


def _lane_key(lane: Lane) -> int:
    return 0 if lane is None else lane


def _keep_going(listener: psycopg.Connection, lanes: Sequence[Lane], deadline: float, grace_s: float) -> bool:
    now = time.monotonic()
    if now < deadline:
        return True
    if now >= deadline + grace_s:
        return False
    row = listener.execute(
        """SELECT count(DISTINCT objid) FROM pg_locks
           WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid() AND classid::bigint = %s AND objsubid = 2
             AND objid::bigint = ANY(%s::bigint[]) AND database = (SELECT oid FROM pg_database WHERE datname = current_database())""",
        (PRESENCE_LOCK, [_lane_key(lane) for lane in lanes]),
    ).fetchone()
    return (row[0] if row else 0) < len(set(lanes))


def _sleep_or_notified(listener: psycopg.Connection, seconds: float, stop: threading.Event, earliest: float) -> None:
    """Sleep, but return as soon as a producer announces a message due before `earliest` (epoch seconds)."""
    end = time.monotonic() + seconds
    while not stop.is_set():
        remaining = end - time.monotonic()
        if remaining <= 0:
            return
        for notice in listener.notifies(timeout=min(remaining, 0.5)):
            if float(notice.payload) < earliest:
                return
