"""A consumer that waits: sleep on the topic's delivery notification, pull a batch, handle it, ack it.

Deliveries `pg_notify` the topic's name on `TOPIC_CHANNEL` at commit (levels.TOPIC_SUMMARY, and the producer for
messages sent without delay). A consumer LISTENs on a connection of its own and pulls when its topic (or its
group's retry topic) is named, or after `safety_wake_s` without a word: a notification can be lost (a reconnect)
or forged, so it only ever says "look now". Rows become readable once below the commit horizon (DESIGN.md), which
may lag the notification by a producer transaction still open: a pull that finds nothing readable while rows past
the group's offset exist (`Batch.behind`) looks again after 2, 5, 10, 20 ... ms (then every 200 ms while they stay
unreadable); one that finds nothing past the offset waits for the next notification or the safety wake.

Per batch, the ack of the batch just handled and the pull of the next are one transaction (`topics.ack_and_pull`:
the offsets' move, the member's share of the group's queues, then one read of them in the topic and the retry topic,
in binary): one round trip while nothing failed, else more (BEGIN and COMMIT around them).
A batch that took every readable row waits up to `ack_hold_s` for the next notification before that round trip, so
its ack goes with the pull of the next delivery rather than with a pull that finds nothing. An ack that goes with a
pull commits asynchronously (`topics._ASYNC_ACK`); the loop's last ack is durable. At most `max_messages`
are in hand at a time (the prefetch bound). Any number of consumers of one group share its load: each is a
member holding leases on its share of the topic's queues (`topics`, sql/consume.sql), renewed by its pulls and given
back when it stops; one key's messages are in one queue, so they are handled in order, one at a time. A member whose
handler outlives `lease_s` loses its queues to the others and its ack is refused (counted in `ConsumeTotals.lost`).
Delivery to the handler is at least once: a batch whose ack did not commit (a crash, a kill, a lost connection) is
handled again, by this consumer or another; deduplicate on `Delivered.idempotency_id`.
With a tag filter (`tags`) the topic's rows with another tag are skipped at the pull (`topics._batch`); a batch of
skipped rows only goes to no handler and is acked with the next pull, at once. A group with no offsets on the topic
gets them at `start` when the consumer starts (`position.start`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from delaywheel.channels import TOPIC_CHANNEL
from delaywheel.consume import position, topics
from delaywheel.consume.tags import parse as parse_tags
from delaywheel.consume.topics import Batch, Delivered
from delaywheel.db import connect
from delaywheel.reconnect import backoff_delays, transient, transient_reason

if TYPE_CHECKING:  # the loop drives the Store it is handed; the facade sits above it (pyproject: layers)
    from delaywheel.store import Store

SAFETY_WAKE_S = 1.0  # with no notification, look anyway this often (what a lost notification costs at most)
BUSY_RETRY_S = 0.25  # another consumer of the group holds the topic: try again this soon (or when notified)
ACK_HOLD_S = 0.1  # a caught-up consumer holds a handled batch's ack this long for the next pull to carry it
REPULL_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)  # notified, yet nothing readable (horizon): look again after
MAX_HANDLER_TIMEOUT_S = 86_400.0  # the longest `handler_timeout_s` (a day)

log = logging.getLogger(__name__)

# What a handler returns: None (every message handled) or the ids of the messages that failed (to the retry ladder).
Handler = Callable[[list[Delivered]], Collection[int] | None]


class Abandon(Exception):
    """Raise from a handler to stop consuming without acking the batch in hand: it is handled again by the next
    consumer of the group (the CLI raises it when its output pipe is closed). Any other exception from a handler
    sends the whole batch to the retry ladder and consuming goes on."""


@dataclass
class ConsumeTotals:
    messages: int = 0  # handed to the handler (or yielded) and acked
    batches: int = 0
    retried: int = 0  # sent to the retry ladder (or the dead-letter topic) by their acks
    already_acked: int = 0  # in batches another consumer of the group had acked past
    skipped: int = 0  # read and passed without being handed over: their tag is not the group's (`tags`)
    handler_errors: int = 0  # batches whose handler raised (all their messages retried)
    handler_timeouts: int = 0  # batches whose handler outlived `handler_timeout_s`: not acked, handled again
    notified_wakes: int = 0  # pulls a notification asked for
    safety_wakes: int = 0  # pulls after a wait that no notification ended
    empty_pulls: int = 0
    held_acks: int = 0  # acks held `ack_hold_s` in vain (no notification came): sent with an empty pull
    repulls: int = 0  # waits of REPULL_S: a pull found rows past the offset, none readable yet (commit horizon)
    busy: int = 0  # pulls that found every queue of the group held by other members
    lost: int = 0  # messages of batches whose lease expired and passed to another member: not acked
    sought: int = 0  # messages of batches read before a seek of the topic: not acked (the seek's position stands)
    reconnects: int = 0
    stopped_by: str = ""  # "stop", "limit", "duration", "idle" or "abandon"


class Consumer:
    """One consumer of `group` on `topic`: the waiting, pulling and acking behind `consume` and `messages`."""

    def __init__(
        self,
        store: Store,
        topic: str,
        group: str,
        *,
        max_messages: int = 100,
        stop: threading.Event | None = None,
        limit: int | None = None,
        duration_s: float | None = None,
        idle_s: float | None = None,
        safety_wake_s: float = SAFETY_WAKE_S,
        ack_hold_s: float = ACK_HOLD_S,
        lease_s: float = topics.DEFAULT_LEASE_S,
        tags: str | None = None,
        start: str | datetime = position.EARLIEST,
    ) -> None:
        topics.checked_batch_size(max_messages)
        self.lease_s = topics.checked_lease(lease_s)
        self.accept = parse_tags(tags)  # the group's tag filter (None: every message)
        self.start = position.start_target(start)  # where the group starts if it has no offset on the topic yet
        self.store = store
        self.topic = topic
        self.group = group
        self.max_messages = max_messages
        self.stop = stop or threading.Event()
        self.limit = limit
        self.deadline = None if duration_s is None else time.monotonic() + duration_s
        self.idle_s = idle_s
        self.safety_wake_s = safety_wake_s
        self.ack_hold_s = ack_hold_s
        self.totals = ConsumeTotals()
        self._names = set(topics.sources_of(topic, group))
        self._listener: psycopg.Connection | None = None
        self.holder = topics.new_holder()  # this member's name in the group's leases
        self._last_message = time.monotonic()
        self.unacked = False  # set after a batch: leave it unacked, so that the next pull hands it out again

    # -- the loop ---------------------------------------------------------------------------------------------
    def batches(self) -> Generator[Batch, None, None]:
        """Yield batches; after each, the caller sets `self.failed` (ids to retry) or raises. A batch is acked
        when the caller asks for the next one (with the pull of that one) or when the loop ends."""
        done: Batch | None = None
        self.failed: set[int] = set()
        looks = 0  # empty pulls in a row that found rows behind (above the commit horizon)
        retry_in = backoff_delays()
        # the first connections fail loudly (a wrong URL is not an outage), and so does a start ahead of the clock
        position.start(self.store.conn, self.topic, self.group, self.start)  # a new group's offset, once
        self._ensure_listener()
        try:
            while True:
                handed = self.totals.messages + (len(done) if done is not None else 0)
                if self._should_stop(handed):
                    break
                room = self.max_messages if self.limit is None else min(self.max_messages, self.limit - handed)
                try:
                    self._ensure_listener()
                    self._drain()  # notifications up to here are answered by this pull
                    result, batch = topics.ack_and_pull(
                        self.store.conn,
                        self.store.settings,
                        self.store._cache,
                        done,
                        self.failed,
                        self.topic,
                        self.group,
                        room,
                        self.holder,
                        self.lease_s,
                        self.accept,
                    )
                    retry_in = backoff_delays()
                except psycopg.errors.TransactionRollback as exc:  # a deadlock: nothing was done; again (idempotent)
                    log.warning("delaywheel consumer: %s; trying again", str(exc).strip().splitlines()[0])
                    self.stop.wait(next(retry_in))
                    continue
                except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                    if not transient(exc):
                        raise
                    self._lost(exc)
                    self.stop.wait(next(retry_in))
                    continue  # `done` is acked after reconnecting (acks are idempotent)
                if done is not None:
                    self._count(done, result)
                    done = None
                self.failed = set()
                if batch.skipped:
                    self.totals.skipped += batch.skipped
                    if not batch.messages:  # read, none the group's: acked with the next pull, at once
                        done = batch
                        continue
                if batch.messages:
                    looks = 0
                    self._last_message = time.monotonic()
                    yield batch
                    if self.unacked:  # (the group's offset did not move: the next pull reads the batch again)
                        self.unacked, self.failed = False, set()
                        continue
                    done = batch
                    caught_up = not batch.behind and not self.failed
                    if caught_up and not self._should_stop(self.totals.messages + len(batch)):
                        self._hold_ack()  # caught up: its ack goes with the pull the next notification asks for
                    continue
                self.totals.empty_pulls += 1
                if not batch.queues:  # other members hold every queue: look now and then (a share may come free)
                    self.totals.busy += 1
                    self.stop.wait(BUSY_RETRY_S)
                    continue
                if batch.behind:  # committed past the offset, not readable yet (commit horizon): look again soon
                    wait = REPULL_S[min(looks, len(REPULL_S) - 1)]
                    looks += 1
                    self.totals.repulls += 1
                else:  # nothing past the offset: the next delivery's notification (or the safety wake) ends the wait
                    looks, wait = 0, self.safety_wake_s
                woke = self._wait_or_lose(wait)
                if woke is None:
                    continue
                if woke:
                    self.totals.notified_wakes += 1
                elif not batch.behind:
                    self.totals.safety_wakes += 1
        except Abandon:
            done = None  # handled again by the next consumer
            self.totals.stopped_by = "abandon"
        finally:
            try:
                if done is not None:
                    try:
                        result = topics.ack(
                            self.store.conn, self.store.settings, self.store._cache, done, self.failed, give_back=False
                        )
                    except topics.LeaseLost as exc:
                        log.warning("delaywheel consumer: %s", exc)
                        result = topics.AckResult(lost=len(done))
                    self._count(done, result)
                self._release()
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if not transient(exc):
                    raise
                log.warning(
                    "delaywheel consumer: the last batch's ack was cut (%s); it will be handled again", str(exc).strip()
                )
            finally:
                self._close_listener()

    def _should_stop(self, handed: int) -> bool:
        now = time.monotonic()
        if self.stop.is_set():
            self.totals.stopped_by = "stop"
        elif self.limit is not None and handed >= self.limit:
            self.totals.stopped_by = "limit"
        elif self.deadline is not None and now >= self.deadline:
            self.totals.stopped_by = "duration"
        elif self.idle_s is not None and now - self._last_message >= self.idle_s:
            self.totals.stopped_by = "idle"
        else:
            return False
        return True

    def _count(self, batch: Batch, result: topics.AckResult) -> None:
        self.totals.batches += bool(batch.messages)  # (a batch of skipped rows only was handed to no one)
        self.totals.messages += len(batch.messages)
        self.totals.retried += result.retried
        self.totals.already_acked += result.already_acked
        self.totals.lost += result.lost
        self.totals.sought += result.sought

    # -- waiting ----------------------------------------------------------------------------------------------
    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.closed:
            conn = connect(self.store.url, autocommit=True)
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(TOPIC_CHANNEL)))
            except BaseException:
                conn.close()
                raise
            self._listener = conn

    def _hold_ack(self) -> None:
        """Wait up to `ack_hold_s` (ACK_HOLD_S) for a notification before acking the batch just handled, which read
        every row readable past the offset: its ack then travels with the pull of the next delivery, one round trip
        and one wake-up of the consumer and its server process instead of two. The handled batch stays unacked that
        much longer (at least once either way: a crash meanwhile hands it out again)."""
        if self._wait_or_lose(self.ack_hold_s):
            self.totals.notified_wakes += 1
        elif not self.stop.is_set():
            self.totals.held_acks += 1

    def _wait_or_lose(self, seconds: float) -> bool | None:
        """`_wait`, or None when the connection was lost (or the server ran short of a resource) meanwhile: counted,
        the next round reconnects."""
        try:
            return self._wait(seconds)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if not transient(exc):
                raise
            self._lost(exc)
            return None

    def _drain(self) -> None:
        """Drop the notifications received so far: the pull that follows answers them (a delivery they announce that
        it cannot read yet shows as `Batch.behind`)."""
        assert self._listener is not None
        for _ in self._listener.notifies(timeout=0):
            pass

    def _wait(self, seconds: float) -> bool:
        """Sleep up to `seconds` (less near a deadline or idle limit); True if a notification named our topic or
        retry topic. Any other payload (another topic, a forged one) is ignored."""
        end = time.monotonic() + seconds
        if self.deadline is not None:
            end = min(end, self.deadline)
        if self.idle_s is not None:
            end = min(end, self._last_message + self.idle_s)
        self._ensure_listener()
        assert self._listener is not None
        while not self.stop.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            # short slices, so that a stop (SIGTERM) is seen within 0.1 s
            for notice in self._listener.notifies(timeout=min(remaining, 0.1), stop_after=1):
                if notice.payload in self._names:
                    return True
        return False

    # -- connections and locks --------------------------------------------------------------------------------
    def _release(self) -> None:
        """Give the member's queues back and leave the group: the other members take them at their next pull."""
        with contextlib.suppress(psycopg.OperationalError, psycopg.InterfaceError):
            topics.give_queues(self.store.conn, self.group, self.topic, self.holder)

    def _lost(self, exc: BaseException) -> None:
        """A transient error (`reconnect.transient`): a lost connection, or the server short of disk, memory or
        connection slots. Either way start again on fresh connections after the caller's backoff."""
        self.totals.reconnects += 1
        log.warning("delaywheel consumer: %s; reconnecting", transient_reason(exc))
        self.store.close()  # its next call opens a fresh connection; the member keeps its queues (its leases)
        self._close_listener()  # notifications sent meanwhile are lost: the next round pulls at once

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(psycopg.Error):
                self._listener.close()
            self._listener = None


def consume(
    store: Store, topic: str, group: str, handler: Handler, *, handler_timeout_s: float | None = None, **options: object
) -> ConsumeTotals:
    """Handle `topic`'s messages for `group` until stopped (`stop`, `limit` messages, `duration_s`, `idle_s`):
    see the module docstring. `handler(messages)` returns None, or the ids of the messages that failed, which go to
    a retry (then the dead-letter topic) with the batch's ack; an exception sends the whole batch there
    (Abandon: acks nothing and stops). With `handler_timeout_s` the handler runs on a thread of its own; a batch it
    has not returned from within that time is left unacked and handed out again at the next pull (`_in_time`).
    Returns what was done."""
    timeout = checked_handler_timeout(handler_timeout_s)
    consumer = Consumer(store, topic, group, **options)  # type: ignore[arg-type]
    batches = consumer.batches()
    late: list[threading.Thread] = []  # handlers that outlived the timeout, maybe still running
    for batch in batches:
        try:
            failed = handler(batch.messages) if timeout is None else _in_time(handler, batch.messages, timeout)
        except HandlerTimeout as exc:
            late = [thread for thread in (*late, exc.thread) if thread.is_alive()]
            log.warning(
                "delaywheel consumer: the handler did not return within %s s on a batch of %d (group %s, topic %s);"
                " not acked, it is handled again (%d timed-out handler(s) still running)",
                timeout,
                len(batch),
                group,
                topic,
                len(late),
            )
            consumer.totals.handler_timeouts += 1
            consumer.unacked = True
            continue
        except Abandon:
            _abandon(batches)
            break
        except Exception:
            log.exception("delaywheel consumer: the handler failed on a batch of %d; retrying it", len(batch))
            consumer.totals.handler_errors += 1
            failed = [m.message_id for m in batch.messages]
        consumer.failed = set(failed or ())
    return consumer.totals


class HandlerTimeout(Exception):
    """A handler did not return within `handler_timeout_s`; `thread` runs it still."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__("the handler did not return in time")
        self.thread = thread


def checked_handler_timeout(value: object) -> float | None:
    """`handler_timeout_s`: None (wait as long as the handler takes) or a number of seconds above 0 and at most
    MAX_HANDLER_TIMEOUT_S; ValueError else, before anything is read."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_HANDLER_TIMEOUT_S:
        raise ValueError(
            f"handler_timeout_s must be a number of seconds above 0 and at most {MAX_HANDLER_TIMEOUT_S:,.0f},"
            f" not {value!r}"
        )
    return float(value)


def _in_time(handler: Handler, messages: list[Delivered], timeout: float) -> Collection[int] | None:
    """`handler(messages)` on a daemon thread of its own, waited for up to `timeout` seconds: what it returns or
    raises, or HandlerTimeout. A thread cannot be stopped from outside, so one that timed out runs on, unwaited,
    beside the handling of later batches (and of this one again)."""
    outcome: list[tuple[bool, Any]] = []
    finished = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, handler(messages)))
        except BaseException as exc:  # handed to the consumer's thread, which decides (Abandon, a retry)
            outcome.append((False, exc))
        finally:
            finished.set()

    thread = threading.Thread(target=run, name="delaywheel-handler", daemon=True)
    thread.start()
    if not finished.wait(timeout):
        raise HandlerTimeout(thread)
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def messages(store: Store, topic: str, group: str, **options: object) -> Iterator[Delivered]:
    """The iterator form: yields messages one by one. A message counts as handled when the loop asks for the
    next one; a batch is acked once all of it has been handled (with the pull of the next). Leaving the loop
    early (break, an exception) acks the messages handled so far and not the one in hand, which comes again."""
    consumer = Consumer(store, topic, group, **options)  # type: ignore[arg-type]
    batches = consumer.batches()
    batch: Batch | None = None
    handed = 0
    try:
        for batch in batches:
            for message in batch.messages:
                handed += 1
                yield message
            handed = 0
    except GeneratorExit:
        pass
    finally:
        if batch is not None and handed > 0:
            # left inside a batch: ack the messages before the one in hand, then end without acking the batch
            with contextlib.suppress(psycopg.Error, topics.LeaseLost):
                part = _prefix(batch, handed - 1)
                if part.messages:
                    store.ack(part)
                    consumer.totals.messages += len(part.messages)
            _abandon(batches)
        else:
            batches.close()


def _abandon(batches: Generator[Batch, None, None]) -> None:
    """End `Consumer.batches` without acking the batch in hand."""
    with contextlib.suppress(StopIteration):
        batches.throw(Abandon())


def _prefix(batch: Batch, n: int) -> Batch:
    """The first `n` messages of `batch` as a batch of their own (cursors at the last of each source's queue)."""
    part = Batch(
        batch.group,
        batch.messages[:n],
        positions=batch.positions[:n],
        qids=batch.qids[:n],
        topic=batch.topic,
        holder=batch.holder,
        queues=batch.queues,
        seeks=dict(batch.seeks),
    )
    for m, (xid, offset), qid in zip(part.messages, part.positions, part.qids, strict=True):
        part.cursors[(m.source_topic, qid)] = (str(xid), offset)
        part.ends[m.source_topic] = (str(xid), offset)  # every row of the queues held up to here is in the part
    return part
