"""The delivery loop: RocketMQ's countdown, shared by the CLI, the Airflow operators and the demo.

Each lane (a level, or the wheel; `None` stands for the wheel) is passed until drained, then the loop
sleeps exactly until the earliest next due time, waking early when a producer NOTIFYs a new message.
A pass is one transaction, so stopping between passes (deadline, SIGTERM) loses and duplicates nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
RECONNECT_FIRST_S = 0.2  # after a lost connection, the first retry comes this soon; later ones back off ...
RECONNECT_MAX_S = 5.0  # ... doubling up to this

log = logging.getLogger(__name__)


@dataclass
class RunTotals:
    delivered: int = 0
    skipped_cancelled: int = 0
    passes: int = 0
    busy_passes: int = 0
    reconnects: int = 0  # connections lost (a server restart) and made again
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
    hints = DueHints()
    retry_in = backoff_delays()  # waits before reconnecting; starts over once a round succeeds
    with _summarizing(store.url), _Listener(store.url, lanes) as listener:
        while not stop.is_set():
            try:
                listener.ensure(stop, deadline + handover_grace_s)
                if stop.is_set() or not _keep_going(listener.conn, lanes, deadline, handover_grace_s):
                    break
                if time.monotonic() >= next_prepare:
                    store.prepare()
                    next_prepare = time.monotonic() + PREPARE_EVERY_S
                earliest = None
                busy = False
                for lane in lanes:
                    if stop.is_set():  # SIGTERM between lanes: the round ends here, every pass so far committed
                        break
                    while True:
                        result = store.advance_wheel() if lane is None else store.deliver_level(lane)
                        totals.passes += 1
                        totals.delivered += result.delivered
                        totals.skipped_cancelled += result.skipped_cancelled
                        if result.delivered:
                            totals.per_lane[lane_name(lane)] = totals.per_lane.get(lane_name(lane), 0) + result.delivered
                            add_spans(totals.per_topic, result.topics)
                        busy |= result.busy
                        totals.busy_passes += result.busy
                        if not result.more or stop.is_set():
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
                    _sleep_or_notified(listener.conn, wait, stop, now.timestamp() + wait, hints)
                retry_in = backoff_delays()
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if not connection_lost(exc):
                    raise
                # The pass in flight was one transaction: cut by the lost connection, it did not happen (or, if
                # its COMMIT reached the server, it did, checkpoint included). Either way the next pass resumes
                # from the checkpoint. Notifications sent meanwhile are lost: the next round passes at once.
                totals.reconnects += 1
                log.warning("delaywheel: lost the database connection (%s); reconnecting", str(exc).strip())
                store.close()  # the store's next call opens a fresh connection
                listener.lost()
                next_prepare = time.monotonic()
                stop.wait(next(retry_in))
    if progress:
        progress(totals)
    return totals


# SQLSTATEs after which the session is gone: the server shut down, crashed or is starting up / shutting down.
_GONE = {"57P01", "57P02", "57P03", "57P05"}


def connection_lost(exc: BaseException) -> bool:
    """Is `exc` the loss of the connection (the server restarted, crashed or is unreachable), as opposed to
    an error of the statement (a lock not available, a query cancelled), which must not be hidden?"""
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith("08") or state in _GONE


def backoff_delays(first_s: float = RECONNECT_FIRST_S, most_s: float = RECONNECT_MAX_S) -> Iterator[float]:
    """Waits between reconnect attempts: doubling from `first_s` up to `most_s`, with up to 25 % jitter
    so that many loops cut by one restart do not all knock at the same instant."""
    delay = first_s
    while True:
        yield delay * (1 + random.random() / 4)
        delay = min(delay * 2, most_s)


class _Listener:
    """The loop's LISTENing connection, which also holds the lanes' presence locks. After a lost connection
    (`lost`), `ensure` reconnects with backoff and re-issues the LISTEN and the locks."""

    def __init__(self, url: str, lanes: Sequence[Lane]) -> None:
        self.url = url
        self.lanes = lanes
        self._conn: psycopg.Connection | None = None

    def __enter__(self) -> _Listener:
        self._open()  # the first connection fails loudly: a wrong URL is not an outage
        return self

    def __exit__(self, *exc: object) -> None:
        self.lost()

    @property
    def conn(self) -> psycopg.Connection:
        assert self._conn is not None
        return self._conn

    def _open(self) -> None:
        conn = connect(self.url, autocommit=True)
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")  # type: ignore[arg-type]
            for lane in self.lanes:  # released with the connection, so a crashed runner is never counted
                conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (PRESENCE_LOCK, _lane_key(lane)))
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def lost(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def ensure(self, stop: threading.Event, give_up_at: float) -> None:
        """Reconnect if the connection was lost, trying with backoff until the server answers. Past
        `give_up_at` (the run's end) the last error is raised: the run could not do its work."""
        if self._conn is not None:
            return
        for delay in backoff_delays():
            try:
                self._open()
                log.warning("delaywheel: reconnected")
                return
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if not connection_lost(exc) or time.monotonic() + delay >= give_up_at:
                    raise
                log.info("delaywheel: database not reachable yet (%s); next try in %.1fs", str(exc).strip(), delay)
            if stop.wait(delay):
                return


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


def _sleep_or_notified(
    listener: psycopg.Connection, seconds: float, stop: threading.Event, earliest: float, hints: DueHints
) -> None:
    """Sleep, but return as soon as a producer announces a message due before `earliest` (epoch seconds)."""
    end = time.monotonic() + seconds
    while not stop.is_set():
        remaining = end - time.monotonic()
        if remaining <= 0:
            return
        for notice in listener.notifies(timeout=min(remaining, 0.5)):
            due = hints.parse(notice.payload)
            if due is not None and due < earliest:
                return


def due_hint(payload: str) -> float | None:
    """The due time (epoch seconds) a producer's NOTIFY on `NOTIFY_CHANNEL` announces, or None if the payload
    is not one. Anyone who may connect can NOTIFY any text, so a payload is only a hint to look sooner."""
    try:
        value = float(payload)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class DueHints:
    """Parses the announcements one waiter (a delivery loop, a trigger) receives. A payload that is not a due
    time is ignored (the waiter looks at its next poll anyway) and logged once per waiter, then only counted:
    a flood of bad NOTIFYs neither stops a loop nor fills its log."""

    def __init__(self, logger: Any = None) -> None:  # a logging.Logger, or Airflow's structlog logger
        self.logger = logger or log
        self.ignored = 0

    def parse(self, payload: str) -> float | None:
        due = due_hint(payload)
        if due is None:
            self.ignored += 1
            if self.ignored == 1:
                self.logger.warning("ignoring a NOTIFY on %s that is not a due time: %r (further ones are not logged)",
                                    NOTIFY_CHANNEL, payload[:100])
        return due
