"""A consumer that holds its group on a topic for a lease and hands the group over to a successor at the end.

What `airflow.operators.ConsumeOperator` runs, as the Kafka provider's `ConsumeFromTopicOperator` runs its hook's
consumer: the operator brings the Airflow things (the handler, templating, the reschedule after SIGTERM), this the
protocol. Two advisory locks on (group, topic, member slot) (`locks.GROUP_TOPIC_SLOT_KEY`), beside the queue leases
that keep a batch from two consumers (`consume.topics`):

- presence (`CONSUMER_PRESENCE_LOCK`, shared), held for the consumer's whole life on a connection of its own: a
  consumer whose lease ended looks for another holder of its slot before it lets go (`grace_s`), so a successor that
  failed at start-up leaves no gap while it is retried;
- the turn (`CONSUMER_TURN_LOCK`, exclusive), held while it consumes: a successor in the slot waits for it, and the
  server grants it the moment the old consumer lets go, so the new one pulls within milliseconds rather than at a
  standby's next look for a free queue. The turn is only a wake-up; the queue leases decide who handles what.

A group read by N long-running consumers gives each a slot, 0..N-1 (at most MAX_MEMBERS, the topic's queues: a
member more would hold none): the N consume side by side as members sharing the queues, each handing over to its
own successor. One consumer is slot 0.

A watchdog thread sets `stop` at the lease end (or past it, once a successor is present, at most `grace_s` later);
the consumer then finishes its batch, acks it and returns, so nothing is lost or handled twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import sql

from delaywheel.consume.consumer import ConsumeTotals, Handler
from delaywheel.consume.topics import QUEUES
from delaywheel.db import connect
from delaywheel.locks import CONSUMER_PRESENCE_LOCK, CONSUMER_TURN_LOCK, GROUP_TOPIC_SLOT_KEY

if TYPE_CHECKING:
    from delaywheel.store import Store

TURN_WAIT_S = 0.2  # a consumer waiting for its turn looks at its stop event this often
HANDOVER_POLL_S = 0.5  # past the lease, waiting for a successor: look for one this often (as the deliver lanes do)
MAX_MEMBERS = QUEUES  # long-running consumers of one group side by side: one more than the queues would hold none

# Parameters: group, topic, then the member slot.
_PRESENCE_KEYS = sql.SQL("{}, {}").format(sql.Literal(CONSUMER_PRESENCE_LOCK), sql.SQL(GROUP_TOPIC_SLOT_KEY))
_TURN_KEYS = sql.SQL("{}, {}").format(sql.Literal(CONSUMER_TURN_LOCK), sql.SQL(GROUP_TOPIC_SLOT_KEY))
BE_PRESENT = sql.SQL("SELECT pg_advisory_lock_shared({})").format(_PRESENCE_KEYS)
TAKE_TURN = sql.SQL("SELECT pg_advisory_lock({})").format(_TURN_KEYS)
GIVE_TURN = sql.SQL("SELECT pg_advisory_unlock({})").format(_TURN_KEYS)
# How many other live lease consumers of (group, topic) in this slot hold their presence lock in this database.
SUCCESSORS = sql.SQL(
    """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
         AND pid <> pg_backend_pid() AND classid::bigint = {presence}
         AND objid = ({key})::oid
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
).format(presence=sql.Literal(CONSUMER_PRESENCE_LOCK), key=sql.SQL(GROUP_TOPIC_SLOT_KEY))


def _whole(value: object, name: str, low: int, high: int) -> int:
    """`value` as an integer from `low` to `high`: an int, or its decimal digits as text (a rendered template);
    else ValueError naming `name`."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value.strip()) <= 3:
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, not {value!r}")
    return value


def checked_members(members: object) -> int:
    """How many long-running consumers read a group side by side: 1..MAX_MEMBERS, else ValueError."""
    return _whole(members, "members", 1, MAX_MEMBERS)


def checked_slot(slot: object) -> int:
    """A long-running consumer's member slot: 0..MAX_MEMBERS - 1, else ValueError."""
    return _whole(slot, "slot", 0, MAX_MEMBERS - 1)


def member_slots(members: object) -> list[int]:
    """The slots of `members` long-running consumers of a group (checked): 0..members - 1."""
    return list(range(checked_members(members)))


class Log(Protocol):
    """Where the consumer says when it took its turn and why it could not wait or look: a `logging.Logger`, or an
    Airflow task's `self.log`."""

    def info(self, msg: str, /, *args: Any) -> Any: ...

    def warning(self, msg: str, /, *args: Any) -> Any: ...


class LeasedConsumer:
    """Consume `topic` as `group` on `store` for `lease_s` seconds, then hand over to the next consumer of its member
    `slot` (see the module; ValueError for a slot outside 0..MAX_MEMBERS - 1, before anything is taken).

    `stop` (set by the caller, e.g. on SIGTERM) ends it early, the same way. After `run`, `lease_ended` says the
    lease's end stopped it and `handed_over` that a successor was seen running at that end.
    """

    def __init__(
        self,
        store: Store,
        topic: str,
        group: str,
        *,
        lease_s: float,
        grace_s: float = 0.0,
        slot: int = 0,
        stop: threading.Event | None = None,
        log: Log | None = None,
    ) -> None:
        self.slot = checked_slot(slot)
        self.store, self.topic, self.group = store, topic, group
        self.lease_s, self.grace_s = lease_s, grace_s
        self.stop = stop if stop is not None else threading.Event()
        self.log: Log = log if log is not None else logging.getLogger(__name__)
        self.lease_ended = False
        self.handed_over = False

    def run(
        self,
        handler: Handler,
        *,
        max_messages: int = 100,
        idle_s: float | None = None,
        tags: str | None = None,
        start: str | datetime = "earliest",
    ) -> ConsumeTotals:
        """Consume until the lease ends (and a successor is present, within the grace), `stop` is set, or, with
        `idle_s` (a drain-and-stop run, which does not wait for its turn behind a lease), nothing came for that
        long. `tags` and `start` as `Store.consume` takes them. Returns the consumer's totals."""
        key = (self.group, self.topic, self.slot)
        with connect(self.store.url, autocommit=True) as presence:
            presence.execute(BE_PRESENT, key)
            watchdog = threading.Thread(target=self._watch, args=(presence,), name="delaywheel-consumer-lease")
            watchdog.daemon = True
            watchdog.start()
            try:
                self.store.conn  # noqa: B018  # connected before the turn: a hand-over costs no connection set-up
                if idle_s is None:
                    self._wait_turn(presence)
                return self.store.consume(
                    self.topic,
                    self.group,
                    handler,
                    max_messages=max_messages,
                    stop=self.stop,
                    idle_s=idle_s,
                    tags=tags,
                    start=start,
                )
            finally:
                with contextlib.suppress(psycopg.Error):  # the successor waiting for its turn gets it now
                    presence.execute(GIVE_TURN, key)
                self.stop.set()
                watchdog.join()

    def _wait_turn(self, presence: psycopg.Connection) -> None:
        """Block until this consumer holds the turn of (group, topic, slot) or `stop` is set. The lock is waited for in
        slices of TURN_WAIT_S (lock_timeout), so a stop is seen that soon; a lost connection goes on to consume
        (the queue leases still decide who handles what)."""
        presence.execute("SELECT set_config('lock_timeout', %s, false)", (f"{int(TURN_WAIT_S * 1000)}ms",))
        waited = time.monotonic()
        while not self.stop.is_set():
            try:
                presence.execute(TAKE_TURN, (self.group, self.topic, self.slot))
            except psycopg.errors.LockNotAvailable:
                continue
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self.log.warning("cannot wait for the turn (%s); consuming beside the other members", exc)
                return
            self.log.info(
                "took the turn of %s / %s slot %d after %.2fs",
                self.group,
                self.topic,
                self.slot,
                time.monotonic() - waited,
            )
            return

    def _watch(self, presence: psycopg.Connection) -> None:
        """Set `stop` at the lease end, or past it once a successor is present (at most `grace_s` later)."""
        end = time.monotonic() + self.lease_s
        if self.stop.wait(self.lease_s):
            return
        while time.monotonic() < end + self.grace_s:  # the lease is over: hand over to a live successor
            try:
                row = presence.execute(SUCCESSORS, (self.group, self.topic, self.slot)).fetchone()
            except psycopg.Error as exc:  # cannot tell: hand over as without a grace
                self.log.warning("cannot look for a successor (%s); stopping at the lease end", exc)
                break
            if row and row[0] > 0:
                self.handed_over = True
                break
            if self.stop.wait(HANDOVER_POLL_S):
                return
        self.lease_ended = True
        self.stop.set()
