"""The triggers: `DueMessagesTrigger` (for the sensors) and `TopicMessagesTrigger` (each topic Asset's watcher).

`DueMessagesTrigger` waits in the triggerer (no worker slot held) until a lane has a message due.

The wait is RocketMQ's countdown: sleep until the lane's head falls due, but LISTEN on the producers'
channel, where every enqueue announces its earliest due time, and look again when an announced time is
sooner than the end of the current wait (an empty level, or the wheel getting a nearer message). A NOTIFY
can be missed (e.g. across a reconnect), so the wait never exceeds `poll_interval` before looking again.
A payload is only a hint: one that is not a due time (anyone may NOTIFY) is ignored and logged once.
Both triggers survive a lost connection (a PostgreSQL restart) and a server short of a resource (a full disk, too
many connections): they reconnect with backoff, LISTEN again and look at once, since notifications sent meanwhile
are lost. It only reads: running it twice, or in two triggerers, changes nothing. (`TopicMessagesTrigger` writes
its announcement mark; see its docstring for why two of them still announce each message once.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from delaywheel.lanes import lane_name
from delaywheel.types import event_extra

from .connections import DEFAULT_CONN_ID, topic_conn_ids

if TYPE_CHECKING:
    import psycopg

    from delaywheel.deliver.runner import DueHints

# psycopg, the store's code and the hook are imported by `run`, in the triggerer, not with this module: a DAG file
# that makes a topic Asset makes its watcher (`operators.topic_asset`) each time Airflow parses it (every 30 s).


class DueMessagesTrigger(BaseTrigger):
    """Fires once `level`'s head (or, with `level=None`, the wheel's next message) is due.

    Its arguments are `DueMessagesSensor`'s, already rendered (a trigger renders no templates):

    :param level: the delay level (1..N) to wait on; None (the default) waits on the timing wheel.
    :param delaywheel_conn_id: the Airflow connection of the store (default ``delaywheel_default``).
    :param poll_interval: the longest wait, in seconds, before looking again without a notification
        (default 5.0): a NOTIFY can be missed across a reconnect.
    :param now_offset_s: seconds added to the database clock the trigger compares with (default 0.0), so tests
        can make a future message due without waiting; production leaves it at 0 (all workers share the
        database's clock).

    One event, then the trigger ends. ``{"status": "success", "lane", "due_at", "checked_at"}`` when the lane has
    a due message; ``{"status": "error", "lane", "message"}`` when the wait failed on anything but a lost
    connection (which it rides out): an unknown connection id, a database without the store's schema, a denied
    read. `DueMessagesSensor.execute_complete` fails the task with that message, as Airflow's providers do,
    rather than leaving the triggerer's traceback as the task's only account of it.
    """

    def __init__(
        self,
        level: int | None = None,
        delaywheel_conn_id: str = DEFAULT_CONN_ID,
        poll_interval: float = 5.0,
        now_offset_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.level = level
        self.delaywheel_conn_id = delaywheel_conn_id
        self.poll_interval = poll_interval
        self.now_offset_s = now_offset_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "level": self.level,
                "delaywheel_conn_id": self.delaywheel_conn_id,
                "poll_interval": self.poll_interval,
                "now_offset_s": self.now_offset_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        lane = lane_name(self.level)
        try:
            due = await self._wait_due()
        except Exception as exc:  # a lost connection never gets here: _wait_due reconnects
            self.log.exception("%s: waiting for a due message failed", lane)
            yield TriggerEvent({"status": "error", "lane": lane, "message": f"{lane}: {type(exc).__name__}: {exc}"})
            return
        yield TriggerEvent({"status": "success", **due})

    async def _wait_due(self) -> dict[str, str]:
        """Wait until the lane has a due message; its `lane`, `due_at` and the clock it was `checked_at`."""
        import psycopg
        from psycopg import sql

        from delaywheel.deliver.runner import DueHints, listen_channels
        from delaywheel.reconnect import backoff_delays

        from .hooks import DelayWheelHook, next_due_async

        hook = DelayWheelHook(self.delaywheel_conn_id)
        hints = DueHints(self.log)
        retry_in = backoff_delays()
        while True:
            try:
                async with await hook.aconnect() as conn:
                    for channel in listen_channels([self.level]):  # this lane's announcements only
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    while True:
                        head, clock = await next_due_async(conn, self.level, self.now_offset_s)
                        retry_in = backoff_delays()
                        if head is not None and head <= clock:
                            return {
                                "lane": lane_name(self.level),
                                "due_at": head.isoformat(),
                                "checked_at": clock.isoformat(),
                            }
                        wait = (
                            self.poll_interval
                            if head is None
                            else min(self.poll_interval, (head - clock).total_seconds())
                        )
                        self.log.debug("%s: next due %s, waiting up to %.3fs", lane_name(self.level), head, wait)
                        await _sleep_or_sooner(conn, wait, _due_before(clock.timestamp() + wait, hints))
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                await _after_lost_connection(self.log, exc, retry_in)


async def _after_lost_connection(log: Any, exc: psycopg.Error, retry_in: Iterator[float]) -> None:
    """A trigger's connection failed: re-raise unless the error is transient (`reconnect.transient`: the connection
    was lost, or the server is short of disk, memory or connection slots), else wait the next backoff delay before
    the caller reconnects (and looks at once: notifications sent meanwhile are lost)."""
    from delaywheel.reconnect import transient, transient_reason

    if not transient(exc):
        raise exc
    delay = next(retry_in)
    log.warning("%s; reconnecting in %.1fs", transient_reason(exc), delay)
    await asyncio.sleep(delay)


def _due_before(wake_at: float, hints: DueHints) -> Callable[[str], bool]:
    """A producer's announcement wakes the wait if its message is due before the wait ends (`wake_at`, epoch
    seconds); a later one is found by the next look anyway, and a payload that is not a due time is ignored."""

    def wakes(payload: str) -> bool:
        due = hints.parse(payload)
        return due is not None and due < wake_at

    return wakes


async def _sleep_or_sooner(conn: Any, seconds: float, wakes: Callable[[str], bool]) -> None:
    """Wait `seconds` on a LISTENing connection, returning early at a notification whose payload `wakes`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
        async for notice in conn.notifies(timeout=remaining):
            if wakes(notice.payload):
                return


class TopicMessagesTrigger(BaseEventTrigger):
    """An AssetWatcher's trigger on a topic's Asset: fires an Asset event as soon as new messages can be read
    from the topic, so a consumer DAG scheduled on the Asset starts within seconds of a delivery, not at the
    end of the deliverers' lease. Runs for as long as the triggerer keeps it, one event per announcement.

    Each event claims the messages it announces (a mark in `delaywheel.topic_watch`, moved in the same
    transaction that reads them), so two triggerers, or a restarted one, never announce a message twice.
    An announcement lost in a triggerer crash is made up by the next one and by the deliver DAG's
    `publish_topic_events` task; consumers read by group offset, so an event only says "look now".

    It looks when a write into the topic commits (every writer NOTIFYs `TOPIC_CHANNEL` with the topic), and
    every `poll_interval` regardless: a notification can be missed (a reconnect, one arriving during a look),
    or name rows still above the commit horizon.

    :param topic: the topic whose new messages are announced (``topic_asset`` passes the Asset's topic).
    :param delaywheel_conn_id: the Airflow connection of the store (default None: the connection of the topic's
        store, ``delaywheel_<store>`` with several stores configured (docs/stores.md), else ``delaywheel_default``;
        resolved when the trigger is made, so the triggerer runs it on the connection the DAG's parse chose).
    :param poll_interval: seconds between looks when no notification comes (default 1.0).

    Its events carry no ``status``, unlike `DueMessagesTrigger`'s: no task resumes on them (no
    ``execute_complete`` to check one); Airflow records each as an Asset event whose extra holds the payload
    (``event_extra``: topic, count, first/last position) and starts the consumers scheduled on it, so an "error"
    event would start them for nothing. A failure other than a lost connection raises, in the triggerer's log."""

    def __init__(self, topic: str, delaywheel_conn_id: str | None = None, poll_interval: float = 1.0) -> None:
        super().__init__()
        self.topic = topic
        self.delaywheel_conn_id = delaywheel_conn_id or topic_conn_ids(topic)[0]
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"topic": self.topic, "delaywheel_conn_id": self.delaywheel_conn_id, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import psycopg
        from psycopg import sql

        from delaywheel.channels import TOPIC_CHANNEL
        from delaywheel.consume.topics import announce_new
        from delaywheel.reconnect import backoff_delays

        from .hooks import DelayWheelHook

        hook = DelayWheelHook(self.delaywheel_conn_id)
        retry_in = backoff_delays()
        while True:
            try:
                async with await hook.aconnect() as conn:
                    # deliverers and producers name the topics they wrote
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(TOPIC_CHANNEL)))
                    while True:
                        span = await announce_new(conn, self.topic)
                        retry_in = backoff_delays()
                        if span is not None:
                            yield TriggerEvent(event_extra(self.topic, "watcher", span))
                        else:  # a missed NOTIFY, or one for rows still above the commit horizon: look after the poll
                            await _sleep_or_sooner(conn, self.poll_interval, lambda payload: payload == self.topic)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                # an announcement cut by the loss did not move the mark (one transaction): the next one makes it
                await _after_lost_connection(self.log, exc, retry_in)
