"""`Store`: the one entry point the CLI, the DAGs, the Spark jobs and the tests use."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors

from delaywheel import partitions
from delaywheel.config import Settings, load_settings
from delaywheel.consume import position, retry, topics
from delaywheel.consume.tags import parse as parse_tags
from delaywheel.db import commits_each_statement, configured_url, connect
from delaywheel.deliver import levels, wheel
from delaywheel.lanes import all_lanes
from delaywheel.migrate import migrate
from delaywheel.ops import cancel as cancelling
from delaywheel.ops import dlq as dead_letters
from delaywheel.ops import stats
from delaywheel.produce import producer
from delaywheel.produce.validation import Message, check_now, check_now_near
from delaywheel.types import PassResult

if TYPE_CHECKING:
    from delaywheel.consume.consumer import ConsumeTotals


class Store:
    """A connection to the store plus the settings it runs with. Not thread-safe: one per thread.

    Calls run in their own transaction, or as a savepoint inside one the caller opened on `conn`
    (e.g. to enqueue an order's timeout in the transaction that inserts the order).
    Every call that decides by time takes `now=` so tests can inject the clock; by default the
    database's clock decides. An injected `now` must be aware, and within a second ahead or five minutes behind
    the database's clock unless `settings.test_clock` (validation.check_now_near): it changes shared state.

    `url` is the store's PostgreSQL; without one, the configured one (DELAYWHEEL_DATABASE_URL, airflow.cfg), and
    with none configured a ConfigError naming the ways to give one. The embedded development cluster is an explicit
    choice: `delaywheel.dev.embedded.store()` (the `delaywheel` command's default). It is not a `Store.embedded()`
    here, because the store core imports nothing of `delaywheel.dev` (an import contract checks it).
    """

    def __init__(self, url: str | None = None, settings: Settings | None = None, *, apply_migrations: bool = False):
        self.settings = settings or load_settings()
        self.url = url or configured_url(self.settings)
        if apply_migrations:
            migrate(self.url)
        self._conn: psycopg.Connection | None = None
        self._cache = partitions.PartitionCache()
        self._started: set[tuple[str, str]] = set()  # (group, topic) given its start by a pull of this Store

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            if self._conn is not None:  # lost (a server restart) or closed: partitions its cut transaction
                self._cache = partitions.PartitionCache()  # created are gone, so forget what it knew
                self._conn = None
            self._conn = connect(self.url)
            self._conn.autocommit = True  # explicit transactions only: conn.transaction()
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clock(self) -> datetime:
        return producer.database_clock(self.conn)

    def _now(self, now: datetime | None) -> datetime | None:
        """An injected clock, checked (`validation.check_now`, `check_now_near`); None: the database's decides."""
        if check_now(now) is not None and not self.settings.test_clock:
            assert now is not None
            check_now_near(now, self.clock(), self.settings)
        return now

    # producing
    def send(
        self,
        topic: str,
        body: Any,
        *,
        delay_level: int | None = None,
        delay: timedelta | int | float | None = None,
        deliver_at: datetime | None = None,
        key: str | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        now: datetime | None = None,
    ) -> int:
        """Send one message; returns its id. Raises InvalidMessage (nothing written) on bad input. One statement
        (`producer.send_one`); inside a transaction the caller opened on `conn`, a savepoint the server takes and
        releases within that statement."""
        message = Message(topic, body, delay_level, delay, deliver_at, key, tags, properties or {})
        return producer.send_one(self.conn, self.settings, self._cache, message, now=now)

    def send_many(self, messages: Iterable[Message], *, now: datetime | None = None) -> list[int]:
        """Send a batch by COPY, all or nothing; returns ids in input order."""
        return producer.send_many(self.conn, self.settings, self._cache, messages, now=now)

    # delivering
    def deliver_level(self, level: int, *, now: datetime | None = None, limit: int | None = None) -> PassResult:
        """One pass over a level. The last configured level's pass also covers any level above it that still
        holds messages (the table was shortened while they were pending): their due times were fixed at
        enqueue, so they go out on time, each level in its own FIFO order under its own lock and checkpoint."""
        if not 1 <= level <= self.settings.max_level:
            raise ValueError(f"level {level} is not configured (1..{self.settings.max_level})")
        limit = limit or self.settings.batch_size
        now = self._now(now)
        result = levels.deliver_level(self.conn, self._cache, level, now=now, limit=limit)
        if level == self.settings.max_level:
            for removed in levels.levels_above(self.conn, level):
                result = result.combine(levels.deliver_level(self.conn, self._cache, removed, now=now, limit=limit))
        return result

    def advance_wheel(self, *, now: datetime | None = None, limit: int | None = None) -> PassResult:
        return wheel.advance_wheel(
            self.conn, self.settings, self._cache, now=self._now(now), limit=limit or self.settings.batch_size
        )

    def deliver_due(self, *, now: datetime | None = None) -> int:
        """Deliver everything due now on every level and the wheel (repeating passes until drained)."""
        now = self._now(now)
        total = 0
        for lane in all_lanes(self.settings):
            while True:
                result = self.advance_wheel(now=now) if lane is None else self.deliver_level(lane, now=now)
                total += result.delivered
                if not result.more:
                    break
        return total

    # consuming
    def pull(
        self,
        topic: str,
        group: str,
        max_messages: int = 100,
        *,
        lease_s: float = topics.DEFAULT_LEASE_S,
        tags: str | None = None,
        start: str | datetime = position.EARLIEST,
    ) -> topics.Batch:
        """The group's next messages in this pull's share of the topic's queues, leased for `lease_s`: `ack` the
        batch (or `release` it) within the lease, or another member takes its queues and the ack is refused. `tags`:
        the group's filter, RocketMQ's `TAG1 || TAG2` or `*` (`consume.tags`): the topic's messages with another tag
        are skipped, not handed over, and the batch's ack passes them. `start`: where a group with no offset on the
        topic yet starts, "earliest" (every message kept), "latest" (what is delivered after this pull) or a time
        (`consume.position`). Bad values raise ValueError before anything is read or written."""
        accept = parse_tags(tags)
        target = position.start_target(start)
        topics.checked_batch_size(max_messages)
        topics.checked_lease(lease_s)
        if target.kind != position.EARLIEST and (group, topic) not in self._started:
            position.start(self.conn, topic, group, target)
            if commits_each_statement(self.conn):  # committed (a caller's transaction may yet roll it back)
                if len(self._started) >= 4096:
                    self._started.clear()
                self._started.add((group, topic))  # it has an offset now: later starts would change nothing
        return topics.pull(self.conn, topic, group, max_messages, lease_s=lease_s, accept=accept)

    def ack(self, batch: topics.Batch, failed: set[int] | None = None) -> topics.AckResult:
        """Commit the batch's offsets (failed ids to the retry ladder) and give its queues back; LeaseLost if its
        lease passed to another member."""
        return topics.ack(self.conn, self.settings, self._cache, batch, failed)

    def release(self, batch: topics.Batch) -> None:
        """Give the batch's queues back without acking it: its messages come to the group's next pull."""
        topics.release(self.conn, batch)

    def consume(
        self,
        topic: str,
        group: str,
        handler: Callable[[list[topics.Delivered]], Collection[int] | None],
        *,
        max_messages: int = 100,
        stop: threading.Event | None = None,
        limit: int | None = None,
        duration_s: float | None = None,
        idle_s: float | None = None,
        safety_wake_s: float | None = None,
        ack_hold_s: float | None = None,
        handler_timeout_s: float | None = None,
        lease_s: float | None = None,
        tags: str | None = None,
        start: str | datetime = position.EARLIEST,
    ) -> ConsumeTotals:
        """Wait for `topic`'s deliveries and hand them to `handler(messages)` in batches of up to `max_messages`,
        acking each after it (consume.py): returns `consume.ConsumeTotals`. `handler` returns None or the ids that
        failed (to a retry); it raises to retry the whole batch. With `handler_timeout_s`, the handler runs on a
        thread of its own, and a batch it has not handled within that time is not acked but handled again. Runs
        until `stop` is set, `limit` messages were handled, `duration_s` passed, or nothing came for `idle_s`. Any
        number of consumers of one group share its load; `lease_s` bounds a batch's handling (past it, its queues
        pass to another member). `tags` and `start` as `pull`'s."""
        from delaywheel.consume import consumer as consume

        return consume.consume(
            self,
            topic,
            group,
            handler,
            handler_timeout_s=handler_timeout_s,
            **_consumer_options(max_messages, stop, limit, duration_s, idle_s, safety_wake_s, ack_hold_s, lease_s),
            tags=tags,
            start=start,
        )

    def messages(
        self,
        topic: str,
        group: str,
        *,
        max_messages: int = 100,
        stop: threading.Event | None = None,
        limit: int | None = None,
        duration_s: float | None = None,
        idle_s: float | None = None,
        safety_wake_s: float | None = None,
        ack_hold_s: float | None = None,
        lease_s: float | None = None,
        tags: str | None = None,
        start: str | datetime = position.EARLIEST,
    ) -> Iterator[topics.Delivered]:
        """`consume` as an iterator of messages: a message is acked once the loop asks for the next one (or ends)."""
        from delaywheel.consume import consumer as consume

        options = _consumer_options(max_messages, stop, limit, duration_s, idle_s, safety_wake_s, ack_hold_s, lease_s)
        return consume.messages(self, topic, group, tags=tags, start=start, **options)

    def seek(
        self,
        topic: str,
        group: str,
        *,
        to_time: datetime | None = None,
        to_offset: int | None = None,
        to: str | None = None,
        by: str | None = None,
    ) -> position.Seeked:
        """Move `group`'s offset on `topic` so that its next pull starts at the first message delivered at or after
        `to_time`, or at the first at or past queue_offset `to_offset`, or (`to`) at the earliest message kept or
        after the latest delivered: backwards its messages are handed again, forwards skipped. Exactly one target.
        Recorded in `delaywheel.group_seeks` with `by` (default: the database role). The group's retry topic is not
        moved (seek `%RETRY%<group>` itself for that). Returns what moved; ValueError (nothing written) for a bad
        target, or a group without an offset on the topic (`position.UnknownOffset`, saying why)."""
        target = position.seek_target(to_time, to_offset, to)
        return position.seek(self.conn, topic, group, target, by)

    def set_retry_policy(
        self,
        group: str,
        *,
        max_attempts: int | None = None,
        delays: Iterable[timedelta | str] | str | None = None,
    ) -> retry.RetryPolicy:
        """Give `group` its own retries, replacing any policy it had: `max_attempts` retries before its dead-letter
        topic (0..1000; default the store's `max_reconsume_times`) and `delays`, the delay before each (timedeltas or
        texts such as '4m', or one text '4m,10m,1h'; the last repeats; default RocketMQ's ladder). Each delay is a
        positive whole number of milliseconds up to `wheel_max_delay`. Raises `retry.InvalidRetryPolicy` (a
        ValueError) with the reason and writes nothing on bad input. The group's next ack with failures follows it."""
        return retry.set_policy(self.conn, self.settings, group, max_attempts=max_attempts, delays=delays)

    def retry_policy(self, group: str) -> retry.RetryPolicy | None:
        """The group's retry policy; None: it has none and follows RocketMQ's ladder (`retry.schedule` gives the
        delays a failed message of the group gets, either way)."""
        return retry.read_policy(self.conn, group)

    def clear_retry_policy(self, group: str) -> bool:
        """Remove the group's retry policy (RocketMQ's ladder again); False: it had none."""
        return retry.clear_policy(self.conn, group)

    # cancelling
    def cancel(
        self, *, message_id: int | None = None, key: str | None = None, reason: str = "cancelled"
    ) -> list[cancelling.CancelResult]:
        return cancelling.cancel(self.conn, self._cache, message_id=message_id, key=key, reason=reason)

    def cancel_matching(
        self,
        *,
        keys: list[str] | None = None,
        where: str | None = None,
        keys_from: cancelling.KeysFrom | None = None,
        match: cancelling.Match | None = None,
        reason: str = "bulk cancel",
    ) -> int:
        """Cancel every pending message meeting every condition given (see `cancel.cancel_matching`): `where` is
        one checked expression, never SQL text run as is (`predicate.UnsafeSQL` otherwise)."""
        return cancelling.cancel_matching(
            self.conn,
            self._cache,
            keys=keys,
            where=where,
            keys_from=keys_from,
            match=match,
            reason=reason,
            timeout=self.settings.match_timeout,
        )

    def count_matching(
        self,
        *,
        keys: list[str] | None = None,
        where: str | None = None,
        keys_from: cancelling.KeysFrom | None = None,
        match: cancelling.Match | None = None,
    ) -> int:
        return cancelling.count_matching(
            self.conn, keys=keys, where=where, keys_from=keys_from, match=match, timeout=self.settings.match_timeout
        )

    # dead letters
    def dlq(self, group: str, *, limit: int = 100) -> dead_letters.DeadLetters:
        """The group's dead letters waiting (not redriven), oldest first, as consumers get messages: `topic` the
        original topic, `idempotency_id` the original id, `reconsume_times` the attempts (`dlq.browse`)."""
        return dead_letters.browse(self.conn, group, limit=limit)

    def redrive(
        self,
        group: str,
        *,
        ids: Collection[int] | None = None,
        where: str | None = None,
        all: bool = False,
        by: str | None = None,
        dry_run: bool = False,
    ) -> dead_letters.Redrive:
        """Send the group's dead letters (`all=True`, by `ids`, or meeting the checked predicate `where`) back to
        the group as fresh retries, each once, recorded with `by` and the database role (`dlq.redrive`)."""
        return dead_letters.redrive(
            self.conn,
            self.settings,
            self._cache,
            group,
            ids=ids,
            where=where,
            all=all,
            by=by,
            dry_run=dry_run,
            timeout=self.settings.match_timeout,
        )

    def redrives(self, group: str, *, limit: int = 20) -> list[dead_letters.RedriveRecord]:
        """The group's last redrives as recorded, newest first."""
        return dead_letters.history(self.conn, group, limit=limit)

    # operating
    def stats(self, *, now: datetime | None = None, window: timedelta = timedelta(minutes=5)) -> dict[str, Any]:
        """Figures for operators, from one snapshot (README, "stats"); `stats.as_json` is their JSON form."""
        return stats.collect(self.conn, self.settings, self._now(now), window)

    def prepare(self, *, now: datetime | None = None) -> None:
        """Create the partitions the next hours need, so producers and deliverers never wait on DDL.
        The delivery loop calls this periodically; the maintenance DAG and `migrate` do too. Each partition is
        created and committed on its own: one transaction holding a new hour of level_segments (its parent locked
        ACCESS EXCLUSIVE) while it waited to create the day's topic partition deadlocked with a pass
        (PartitionCache.without_ddl)."""
        now = self._now(now)
        with contextlib.suppress(errors.LockNotAvailable):  # a producer holds a far block: roll next time
            wheel.roll(self.conn, self.settings, self._cache, now)
        clock = now or self.clock()
        self._cache.ensure(self.conn, "level_segments", [clock + partitions.HOUR * i for i in range(3)])
        self._cache.ensure(self.conn, "topic_messages", [clock, clock + partitions.DAY])

    def summarize(self) -> int:
        """Bring the BRIN summaries that cancel searches by up to date (partitions.summarize)."""
        return partitions.summarize(self.conn)

    def retire(self, *, now: datetime | None = None) -> list[partitions.Retired]:
        return partitions.retire(self.conn, self._now(now) or self.clock(), self.settings.topic_retention, self._cache)


def _consumer_options(
    max_messages: int,
    stop: threading.Event | None,
    limit: int | None,
    duration_s: float | None,
    idle_s: float | None,
    safety_wake_s: float | None,
    ack_hold_s: float | None,
    lease_s: float | None,
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "max_messages": max_messages,
        "stop": stop,
        "limit": limit,
        "duration_s": duration_s,
        "idle_s": idle_s,
    }
    if safety_wake_s is not None:
        options["safety_wake_s"] = safety_wake_s
    if ack_hold_s is not None:
        options["ack_hold_s"] = ack_hold_s
    if lease_s is not None:
        options["lease_s"] = lease_s
    return options
