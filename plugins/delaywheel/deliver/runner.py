"""The delivery loop: RocketMQ's countdown, shared by the CLI, the Airflow operators and the demo.

Each lane (a level, or the wheel; `None` stands for the wheel) is passed until drained, then the loop
sleeps exactly until the earliest next due time, waking early when a producer NOTIFYs a new message.
A pass is one transaction, so stopping between passes (deadline, SIGTERM) loses and duplicates nothing.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from delaywheel import partitions
from delaywheel.channels import NOTIFY_CHANNEL, lane_channel
from delaywheel.db import connect
from delaywheel.deliver.presence import UnservedWatch
from delaywheel.lanes import Lane, lane_name
from delaywheel.locks import LANE_PRESENCE_LOCK, lane_lock_key
from delaywheel.pending import level_head
from delaywheel.reconnect import backoff_delays, connection_lost, short_of_resources, transient, transient_reason
from delaywheel.types import TopicSpan, add_spans

if TYPE_CHECKING:  # the loop drives the Store it is handed; the facade sits above it (pyproject: layers)
    from delaywheel.store import Store

BUSY_RETRY_S = 0.02  # another deliverer or a canceller holds the lane: look again soon
CLOCK_EVERY_S = 60.0  # measure the database clock's offset from ours this often
PREPARE_EVERY_S = 600.0  # partitions are created hours ahead; refresh them this often
SUMMARIZE_EVERY_S = 60.0  # BRIN summaries autovacuum dropped (partitions.summarize): a cancel stays fast
SUMMARIZE_TOPICS_EVERY_S = 1.0  # ... and the current topic partitions' newest rows, which every cancel by key reads
SAFETY_WAKE_S = 5.0  # without a known next due time, look anyway this often (a missed NOTIFY costs this much)
HANDOVER_POLL_S = 0.5  # past the duration, waiting for a successor: look for one this often
ANNOUNCED_MAX = 4096  # announced due times held at most (the earliest are kept): a flood of NOTIFYs costs no memory

log = logging.getLogger(__name__)


@dataclass
class RunTotals:
    delivered: int = 0
    skipped_cancelled: int = 0
    passes: int = 0
    busy_passes: int = 0
    waited_passes: int = 0  # passes that found their lane (or both its turns) held and waited (PassResult.waited)
    reconnects: int = 0  # connections lost (a server restart) and made again
    short_of_resources: int = 0  # rounds the server refused for want of a resource (disk, memory, slots): retried
    per_lane: dict[str, int] = field(default_factory=dict)
    per_topic: dict[str, TopicSpan] = field(default_factory=dict)  # what this run wrote, per topic


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
    ready: Callable[[], None] | None = None,
) -> RunTotals:
    """Deliver on `lanes` for `duration_s` seconds (or until `stop` is set, or, with `until_idle`,
    until nothing is pending on them).

    With `handover_grace_s`, the run hands its lanes over only to a live successor: past `duration_s`
    it keeps delivering, for up to `handover_grace_s` more, until every lane has another runner. A
    successor that failed to start (a task killed at start-up on a busy machine) then leaves no lane
    unserved while Airflow retries it. `ready` is called once the loop listens for producers' notifications and
    holds its lanes' presence locks, before the first pass."""
    stop = stop or threading.Event()
    totals = RunTotals()
    deadline = time.monotonic() + duration_s
    next_report = time.monotonic() + progress_every_s
    next_prepare = time.monotonic()
    hints = DueHints()
    retry_in = backoff_delays()  # waits before reconnecting; starts over once a round succeeds
    # When each lane is next due (database epoch seconds; None: empty as last seen; -inf: look now). A round passes
    # only the lanes due by now: an idle level costs nothing while the wheel is busy, rather than a transaction per
    # level per round. Every lane is passed once at start and after a reconnect; every SAFETY_WAKE_S the levels'
    # heads are read again (one query) and the wheel is passed.
    due: dict[Lane, float | None] = dict.fromkeys(lanes, -math.inf)
    announced = Announced()  # due times producers announced and not yet looked at, up to the next safety wake
    look_all_at = time.monotonic() + SAFETY_WAKE_S
    clock = _Clock(store)
    unserved = UnservedWatch(store.settings)  # logs the store's lanes that have due messages and no deliverer
    with _summarizing(store.url, lambda: totals.delivered), _Listener(store.url, lanes) as listener:
        if ready:
            ready()
        while not stop.is_set():
            try:
                listener.ensure(stop, deadline + handover_grace_s)
                if stop.is_set() or not _keep_going(listener.conn, lanes, deadline, handover_grace_s):
                    break
                unserved.check(listener.conn)
                if time.monotonic() >= next_prepare:
                    store.prepare()
                    next_prepare = time.monotonic() + PREPARE_EVERY_S
                now = clock.now()
                safety = time.monotonic() >= look_all_at
                if safety or announced.due_by(now):
                    # The safety wake (every lane, whatever we believe: a message sent without a notification), or
                    # a producer announced a message due by now on a lane we cannot tell: read every level's head in
                    # one query and pass the wheel, rather than pass every level before the wheel.
                    due.update(_heads(store.conn, lanes))
                    if safety:
                        look_all_at = time.monotonic() + SAFETY_WAKE_S
                announced.drop_due(now)
                busy = False
                for lane in lanes:
                    if stop.is_set():  # SIGTERM between lanes: the round ends here, every pass so far committed
                        break
                    lane_due = due[lane]
                    if lane_due is None or lane_due > now:
                        continue
                    while True:
                        result = store.advance_wheel() if lane is None else store.deliver_level(lane)
                        totals.passes += 1
                        totals.delivered += result.delivered
                        totals.skipped_cancelled += result.skipped_cancelled
                        if result.delivered:
                            totals.per_lane[lane_name(lane)] = (
                                totals.per_lane.get(lane_name(lane), 0) + result.delivered
                            )
                            add_spans(totals.per_topic, result.topics)
                        totals.busy_passes += result.busy
                        totals.waited_passes += result.waited
                        if not result.more or stop.is_set():
                            break
                    if result.busy:  # another deliverer or a canceller holds the lane: look again soon
                        busy = True
                        due[lane] = clock.now() + BUSY_RETRY_S
                    else:
                        due[lane] = None if result.next_due is None else result.next_due.timestamp()
                if progress and time.monotonic() >= next_report:
                    progress(totals)
                    next_report = time.monotonic() + progress_every_s
                known = [d for d in due.values() if d is not None] + announced.first()
                if until_idle and not known and not busy:
                    break
                now = clock.now()
                wait = min([look_all_at - time.monotonic(), *(max(0.0, d - now) for d in known)])
                past = time.monotonic() >= deadline
                wait = min(wait, HANDOVER_POLL_S if past else deadline - time.monotonic())
                if wait > 0:
                    # An announcement due before the next safety wake is kept (its lane may be idle now); only one
                    # due before this wait's end cuts it short. A later one is found by that wake's look at every head.
                    announced.horizon = now + (look_all_at - time.monotonic())
                    _sleep_or_notified(listener.conn, wait, stop, now + wait, hints, announced)
                retry_in = backoff_delays()
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if short_of_resources(exc):
                    # The server refused a statement for want of disk, memory or a connection slot: the statement
                    # did nothing (a pass is one transaction). Wait and look at every lane again, on a fresh
                    # connection (the refused transaction's partitions, if any, are gone with it).
                    totals.short_of_resources += 1
                    delay = next(retry_in)
                    log.warning("delaywheel: %s; trying again in %.1fs", transient_reason(exc), delay)
                    store.close()
                    next_prepare = time.monotonic()
                    due = dict.fromkeys(lanes, -math.inf)
                    stop.wait(delay)
                    continue
                if not connection_lost(exc):
                    raise
                # The pass in flight was one transaction: cut by the lost connection, it did not happen (or, if
                # its COMMIT reached the server, it did, checkpoint included). Either way the next pass resumes
                # from the checkpoint. Notifications sent meanwhile are lost: the next round passes every lane.
                totals.reconnects += 1
                log.warning("delaywheel: lost the database connection (%s); reconnecting", str(exc).strip())
                store.close()  # the store's next call opens a fresh connection
                listener.lost()
                next_prepare = time.monotonic()
                due = dict.fromkeys(lanes, -math.inf)
                clock.reset()
                stop.wait(next(retry_in))
    if progress:
        progress(totals)
    return totals


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
            for channel in listen_channels(self.lanes):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            for lane in self.lanes:  # released with the connection, so a crashed runner is never counted
                conn.execute("SELECT pg_advisory_lock_shared(%s, %s)", (LANE_PRESENCE_LOCK, lane_lock_key(lane)))
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
                if not transient(exc) or time.monotonic() + delay >= give_up_at:
                    raise
                log.info("delaywheel: database not reachable yet (%s); next try in %.1fs", str(exc).strip(), delay)
            if stop.wait(delay):
                return


@contextlib.contextmanager
def _summarizing(url: str, delivered: Callable[[], int]) -> Iterator[None]:
    """partitions.summarize while the run lasts: every partition's BRIN indexes every SUMMARIZE_EVERY_S, the current
    topic partitions' every SUMMARIZE_TOPICS_EVERY_S after this run `delivered` more (a cancel by key reads every
    delivered row no summary covers yet: a second's deliveries instead of a minute's). On a thread with a
    connection of its own: after a burst it may summarize thousands of ranges (a second or more), which would
    otherwise hold up the passes."""
    finished = threading.Event()

    def loop() -> None:
        conn: psycopg.Connection | None = None
        every_at = time.monotonic() + SUMMARIZE_EVERY_S
        topics: list[str] | None = None  # the current topic partitions' indexes, looked up again with every full pass
        seen = 0  # `delivered` when the topics were last summarized
        while not finished.wait(SUMMARIZE_TOPICS_EVERY_S):
            if delivered() == seen and time.monotonic() < every_at:
                continue
            try:
                conn = conn or connect(url, autocommit=True)
                if time.monotonic() >= every_at:
                    every_at = time.monotonic() + SUMMARIZE_EVERY_S
                    partitions.summarize(conn)
                    topics = None
                if topics is None:
                    topics = partitions.current_topic_indexes(conn)
                seen = delivered()
                partitions.summarize(conn, topics)
            except psycopg.Error:  # the server went away or restarts: a new connection next time
                _close(conn)
                conn, topics = None, None
        _close(conn)

    thread = threading.Thread(target=loop, name="delaywheel-summarize", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()


def _close(conn: psycopg.Connection | None) -> None:
    if conn is not None:
        with contextlib.suppress(psycopg.Error):
            conn.close()


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
        (LANE_PRESENCE_LOCK, [lane_lock_key(lane) for lane in lanes]),
    ).fetchone()
    return (row[0] if row else 0) < len(set(lanes))


def _sleep_or_notified(
    listener: psycopg.Connection,
    seconds: float,
    stop: threading.Event,
    earliest: float,
    hints: DueHints,
    announced: Announced | None = None,
) -> None:
    """Sleep, but return as soon as a producer announces a message due before `earliest` (epoch seconds). Every
    announced due time is offered to `announced`, which keeps those before its horizon. The notifications that
    arrived together are all read before returning: psycopg drops the rest of a batch its caller leaves."""
    end = time.monotonic() + seconds
    while not stop.is_set():
        remaining = end - time.monotonic()
        if remaining <= 0:
            return
        woken = False
        for notice in listener.notifies(timeout=min(remaining, 0.5), stop_after=1):
            due = hints.parse(notice.payload)
            if due is not None:
                if announced is not None:
                    announced.add(due)
                woken = woken or due < earliest
        if woken:
            return


class Announced:
    """The due times producers announced that the loop has not looked at yet, bounded whatever arrives on its
    channels (anyone who may connect may NOTIFY): only those before `horizon` (the loop's next safety wake, which
    reads every lane's head and so finds any later message anyway), and at most `most` of them, the earliest. Each
    one kept wakes the loop when it falls due."""

    def __init__(self, most: int = ANNOUNCED_MAX) -> None:
        self.horizon = math.inf  # epoch seconds, set by the loop before each sleep
        self.most = most
        self._heap: list[float] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due: float) -> None:
        if due >= self.horizon:
            return
        if len(self._heap) >= self.most:  # a flood: keep the earliest half (sorted, so still a heap)
            self._heap = heapq.nsmallest(max(1, self.most // 2), self._heap)
            if due >= self._heap[-1]:
                return
        heapq.heappush(self._heap, due)

    def first(self) -> list[float]:
        """The earliest due time held, as a list of at most one."""
        return self._heap[:1]

    def due_by(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0] <= now

    def drop_due(self, now: float) -> None:
        """Forget the due times up to `now`: the loop has just looked at every lane's head."""
        while self._heap and self._heap[0] <= now:
            heapq.heappop(self._heap)


# Every level's head in one statement (pending.level_head per level), as epoch seconds. Not the wheel's: its pass
# returns its head (a separate WHEEL_HEAD would read the cursor again, for nothing).
_HEADS = (
    sql.SQL(
        "SELECT ARRAY(SELECT extract(epoch FROM ({}))::float8"
        " FROM unnest(%(levels)s::int[]) WITH ORDINALITY l(level, n) ORDER BY l.n)"
    )
    .format(level_head(sql.Identifier("l", "level")))
    .as_string()
)


def _heads(conn: psycopg.Connection, lanes: Sequence[Lane]) -> dict[Lane, float | None]:
    """Each lane's head, at a safety wake or after an announcement fell due: the levels' read in one query; the wheel
    is passed (the announced message may be the wheel's, and its pass is what reads its head)."""
    levels = [lane for lane in lanes if lane is not None]
    heads: dict[Lane, float | None] = {}
    if levels:
        row = conn.execute(_HEADS, {"levels": levels}).fetchone()
        assert row is not None
        heads.update(zip(levels, row[0], strict=True))
    if None in lanes:
        heads[None] = -math.inf
    return heads


class _Clock:
    """The database's clock read locally: its offset from this machine's clock, measured once a minute, so that a
    round spends no round trip on `clock_timestamp()` just to compute its sleep."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.offset: float | None = None
        self.measured = 0.0

    def reset(self) -> None:
        self.offset = None

    def now(self) -> float:
        if self.offset is None or time.monotonic() - self.measured > CLOCK_EVERY_S:
            before = time.time()
            db = self.store.clock().timestamp()
            after = time.time()
            self.offset = db - (before + after) / 2
            self.measured = time.monotonic()
        return time.time() + self.offset


def listen_channels(lanes: Iterable[Lane]) -> list[str]:
    """What a deliverer of `lanes` listens to: their own announcements (channels.lane_channel) and those of a
    producer that does not say the lane."""
    return [NOTIFY_CHANNEL, *(lane_channel(lane) for lane in lanes)]


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
                self.logger.warning(
                    "ignoring a NOTIFY on %s that is not a due time: %r (further ones are not logged)",
                    NOTIFY_CHANNEL,
                    payload[:100],
                )
        return due
