"""Time-range partitions of the hot tables: created ahead of need, retired by DROP once drained."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import psycopg
from psycopg import errors, sql

from delaywheel.db import commits_each_statement
from delaywheel.locks import SUMMARIZE_LOCK
from delaywheel.pending import SEGMENT_PENDING, WHEEL_PENDING

log = logging.getLogger(__name__)

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
# parent table -> partition width. The near wheel's is 4 hours (partition_width): a lookup by key or id opens every
# partition of it, which with hourly ones would be most of a cancel; a wider one keeps delivered rows on disk longer.
WIDTH = {
    "level_segments": HOUR,
    "wheel": 4 * HOUR,
    "wheel_far_segments": DAY,
    "topic_messages": DAY,
    "cancellations": DAY,
}


T = TypeVar("T")


def floor_to(ts: datetime, width: timedelta) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((ts - epoch) // width) * width


class PartitionMissing(Exception):
    """A transaction run by `PartitionCache.without_ddl` needs a partition this process does not know exists."""

    def __init__(self, parent: str, lows: list[datetime]) -> None:
        super().__init__(f"{parent}: {', '.join(lo.isoformat() for lo in lows)}")
        self.parent = parent
        self.lows = lows


class PartitionCache:
    """Partitions this process knows exist, so the hot path asks PostgreSQL only for new ranges.

    A partition this session creates exists only once its transaction commits: a pass or a roll that fails after
    creating one rolls the creation back. Such an entry is *tentative*, kept with the id of the transaction that
    created it; the next time it is needed it is trusted within that same transaction, confirmed if that
    transaction committed, and otherwise created again (a cache that trusted it sent rows to a partition that was
    never there: "no partition of relation ... found for row", on every later pass)."""

    def __init__(self) -> None:
        self._known: set[tuple[str, datetime]] = set()
        self._tentative: dict[tuple[str, datetime], str] = {}  # entry -> xid of the transaction that created it
        self._deferring = False  # inside `without_ddl`: raise PartitionMissing rather than create

    def ensure(self, conn: psycopg.Connection, parent: str, instants: set[datetime] | list[datetime]) -> None:
        width = WIDTH[parent]
        lows = sorted({floor_to(ts, width) for ts in instants})
        lows = [lo for lo in lows if not self._usable(conn, (parent, lo))]
        if lows and self._deferring:
            lows = self._absent(conn, parent, lows)
            if lows:
                raise PartitionMissing(parent, lows)
        committed = commits_each_statement(conn)  # each creation below is a transaction of its own
        for lo in lows:
            entry = (parent, lo)
            # ensure_partition's re-check after its lock can read a stale catalog snapshot (an advisory
            # lock does not refresh it), so a session racing another creator may still get DuplicateTable:
            # the partition exists, which is all we wanted. The savepoint keeps the caller's transaction.
            xid = None
            with contextlib.suppress(errors.DuplicateTable), conn.transaction():
                row = conn.execute(
                    "SELECT delaywheel.ensure_partition(%s, %s, %s), pg_current_xact_id_if_assigned()::text",
                    (parent, lo, lo + width),
                ).fetchone()
                xid = row[1] if row else None
            if xid is None or committed:  # it existed, committed, or was created and committed just now
                self._known.add(entry)
            else:  # it may have been created just now, by a transaction that can still roll back
                self._tentative[entry] = xid

    def known(self, parent: str, lows: list[datetime]) -> list[datetime]:
        """Those of `lows` (partitions' lower bounds) that this process knows exist (committed): what a statement
        that checks for its own partition on the server (wheel.wheel_pass) need not check."""
        return [lo for lo in lows if (parent, lo) in self._known]

    def without_ddl(self, conn: psycopg.Connection, run: Callable[[], T]) -> T:
        """`run()`, a transaction of the store's own (a delivery pass, a send), with no partition created inside it.

        Creating a partition locks its parent ACCESS EXCLUSIVE until the creator's transaction ends. A level pass
        that created the day's topic partition, then read level_segments, could wait behind `prepare`, which had
        created an hour of level_segments and waits for the topic partitions' creation lock the pass holds: a
        deadlock. So when `run` needs a partition this process does not know,
        `ensure` raises PartitionMissing, `run` rolls back (nothing of it is kept), the partition is created in a
        transaction of its own, committed, and `run` goes again; it happens once per partition and process. Inside
        a transaction the caller holds, a partition can only be created there: `prepare` ahead of need
        (the delivery loop does) keeps that rare."""
        if not commits_each_statement(conn):
            return run()
        for _ in range(len(WIDTH) + 1):  # a try finds one parent's missing partitions (and a day may turn)
            self._deferring = True
            try:
                return run()
            except PartitionMissing as missing:
                needed = missing
            finally:
                self._deferring = False
            self.ensure(conn, needed.parent, needed.lows)  # `run` rolled back: each its own transaction
        return run()

    def _absent(self, conn: psycopg.Connection, parent: str, lows: list[datetime]) -> list[datetime]:
        """The partitions of `lows` that do not exist (read only: a partition the catalog shows has committed, as
        this transaction creates none); those that do are known from now on."""
        rows = conn.execute(
            "SELECT lo, delaywheel.partition_named(%s, lo) IS NOT NULL FROM unnest(%s::timestamptz[]) lo",
            (parent, lows),
        ).fetchall()
        self._known.update((parent, lo) for lo, there in rows if there)
        return [lo for lo, there in rows if not there]

    def _usable(self, conn: psycopg.Connection, entry: tuple[str, datetime]) -> bool:
        return entry in self._known or (entry in self._tentative and self._settled(conn, entry))

    def _settled(self, conn: psycopg.Connection, entry: tuple[str, datetime]) -> bool:
        """Can a tentative entry be used? Yes within the transaction that created it, or once that committed."""
        xid = self._tentative[entry]
        row = conn.execute(
            "SELECT pg_current_xact_id_if_assigned()::text = %s, pg_xact_status(%s::xid8)", (xid, xid)
        ).fetchone()
        if row is not None and row[0]:
            return True
        del self._tentative[entry]
        if row is not None and row[1] == "committed":
            self._known.add(entry)
            return True
        return False  # rolled back (or too old to tell): ensure it again

    def forget(self, parent: str, instant: datetime) -> None:
        entry = (parent, floor_to(instant, WIDTH[parent]))
        self._known.discard(entry)
        self._tentative.pop(entry, None)


@dataclass(frozen=True)
class Unread:
    """Rows of a retired topic partition that a consumer group had not read (past its offset on the topic)."""

    group: str
    topic: str
    rows: int


@dataclass(frozen=True)
class Retired:
    """A dropped partition, its rows, and for a topic partition the rows each group had not read (recorded in
    delaywheel.retired_unread by the drop itself)."""

    parent: str
    name: str
    rows: int
    unread: tuple[Unread, ...] = ()


def _try_lock(conn: psycopg.Connection, parent: str, lo: datetime) -> bool:
    """ACCESS EXCLUSIVE on a partition, NOWAIT; through sql/partitions.sql's function, as the runtime role owns no table."""
    try:
        with conn.transaction():
            row = conn.execute("SELECT delaywheel.lock_partition(%s, %s, true)", (parent, lo)).fetchone()
        return bool(row and row[0])
    except errors.LockNotAvailable:
        return False


# A partition may go when nothing in it is pending. These queries run after the partition is locked
# ACCESS EXCLUSIVE, so no transaction can still be writing into it.
# ({partition}: the partition's name, quoted.)
_PENDING = {
    "level_segments": (
        sql.SQL("""
        SELECT count(*) FROM {partition} s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE {pending}"""),
        SEGMENT_PENDING,
    ),
    "wheel": (
        sql.SQL("""
        SELECT count(*) FROM {partition} q, delaywheel.wheel_state s
        WHERE {pending}"""),
        WHEEL_PENDING,
    ),
}


def retire(
    conn: psycopg.Connection, now: datetime, retention: timedelta, cache: PartitionCache | None = None
) -> list[Retired]:
    """Drop drained partitions; returns what was dropped. Busy partitions are left for the next run. A topic partition
    past the database's retention floor goes even with rows a consumer group has not read: the drop counts them per
    group and topic (delaywheel.retired_unread, what `stats` shows), and each is in `Retired.unread` and logged as a
    warning."""
    dropped: list[Retired] = []
    candidates = conn.execute(
        "SELECT parent, name, lo, hi FROM delaywheel.partitions WHERE parent = ANY(%s) ORDER BY lo",
        (["level_segments", "wheel", "topic_messages", "cancellations"],),
    ).fetchall()
    oldest_pending_due = _oldest_pending_due(conn)
    for parent, name, lo, hi in candidates:
        if parent == "level_segments" and hi > now - HOUR:
            continue  # may still receive rows from producers' clocks
        if parent == "wheel" and hi > now:
            continue
        if parent == "topic_messages" and hi > now - retention:
            continue
        if parent == "cancellations" and (
            hi > now - HOUR or (oldest_pending_due is not None and hi > oldest_pending_due)
        ):
            continue  # a cancellation must outlive every message due in its range
        try:
            with conn.transaction():
                if not _try_lock(conn, parent, lo):
                    continue
                partition = sql.Identifier("delaywheel", name)
                if parent in _PENDING:
                    query, pending = _PENDING[parent]
                    row = conn.execute(query.format(partition=partition, pending=pending)).fetchone()
                    if row and row[0]:
                        continue
                count = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(partition)).fetchone()
                conn.execute("SELECT delaywheel.drop_partition(%s, %s)", (parent, lo))  # the owner drops it
                unread = _dropped_unread(conn, name) if parent == "topic_messages" else ()
        except errors.ObjectInUse:
            # The database's own check found it not drained (a topic day no group has read within the database's
            # retention floor, a cancellation a message queued since still needs): left for a later run.
            continue
        if cache:
            cache.forget(parent, lo)
        for u in unread:
            log.warning(
                "retire: dropped %s rows of topic %r that consumer group %r had not read (partition %s, past the"
                " retention floor); counted in delaywheel.retired_unread",
                u.rows,
                u.topic,
                u.group,
                name,
            )
        dropped.append(Retired(parent, name, int(count[0]) if count else 0, unread))
    return dropped


# What drop_partition (sql/partitions.sql) just recorded for the topic partition named %s, read back in its transaction.
_DROPPED_UNREAD = """
    SELECT grp, topic, last_dropped FROM delaywheel.retired_unread
    WHERE last_drop_xid = pg_current_xact_id() AND last_partition = %s
    ORDER BY grp, topic"""


def _dropped_unread(conn: psycopg.Connection, name: str) -> tuple[Unread, ...]:
    return tuple(Unread(g, t, int(n)) for g, t, n in conn.execute(_DROPPED_UNREAD, (name,)).fetchall())


def _oldest_pending_due(conn: psycopg.Connection) -> datetime | None:
    """The earliest due time of any message not yet delivered (a segment's messages share theirs)."""
    row = conn.execute(
        sql.SQL("""
        SELECT least(
            (SELECT min(s.deliver_at) FROM delaywheel.level_segments s
             LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level WHERE {segment_pending}),
            (SELECT min(q.deliver_at) FROM delaywheel.wheel q, delaywheel.wheel_state s
             WHERE {wheel_pending}),
            (SELECT min(block) FROM delaywheel.wheel_far_segments))  -- a lower bound: the blocks' days""").format(
            segment_pending=SEGMENT_PENDING, wheel_pending=WHEEL_PENDING
        )
    ).fetchone()
    return row[0] if row else None


# Every partition's BRIN index (far blocks, level queues, topics); not the parents' (relkind 'I').
_BRIN_INDEXES = """
    SELECT c.oid::regclass::text FROM pg_class c
    JOIN pg_am a ON a.oid = c.relam AND a.amname = 'brin'
    JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'delaywheel'
    WHERE c.relkind = 'i'
"""
# The BRIN indexes of the topic partitions that take deliveries now: those whose day holds a moment within a minute
# of the database's clock (today's, and around midnight the day's before or after).
_CURRENT_TOPIC_BRIN_INDEXES = """
    SELECT c.oid::regclass::text FROM delaywheel.partitions p
    JOIN pg_index i ON i.indrelid = to_regclass(format('delaywheel.%I', p.name))
    JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_am a ON a.oid = c.relam AND a.amname = 'brin'
    WHERE p.parent = 'topic_messages' AND p.lo < now() + interval '1 minute' AND p.hi > now() - interval '1 minute'
"""


def current_topic_indexes(conn: psycopg.Connection) -> list[str]:
    """The BRIN indexes of the topic partitions deliveries go to now (for `summarize(conn, indexes)`)."""
    return [index for (index,) in conn.execute(_CURRENT_TOPIC_BRIN_INDEXES).fetchall()]


def summarize(conn: psycopg.Connection, indexes: list[str] | None = None) -> int:
    """Summarize the page ranges the BRIN indexes do not cover yet (every partition's, or those of `indexes`);
    returns how many were added.

    `autosummarize` asks autovacuum to summarize each range once it fills, but its queue holds 256 requests per
    database and drops the rest: after a burst of deliveries much of a topic partition can stay unsummarized, and a
    cancel by key then reads every unsummarized page, many times what it reads with summaries. And a range it does
    summarize waits for autovacuum's next visit (a minute): every cancel by key reads the rows of each range no
    summary covers, up to a minute's deliveries. So the delivery loop calls this every minute
    for every partition and every second for the current topic partitions (`current_topic_indexes`). The last,
    partly filled range is summarized too (PostgreSQL's `brin_summarize_new_values`): a row delivered into it later
    updates its summary. An index that autovacuum is working on, or one dropped meanwhile, is left for the next
    call; so is everything while another session summarizes (every lane's loop calls this)."""
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (SUMMARIZE_LOCK,)).fetchone()
    if not (row and row[0]):
        return 0
    added = 0
    try:
        if indexes is None:
            indexes = [index for (index,) in conn.execute(_BRIN_INDEXES).fetchall()]
        for index in indexes:
            try:
                with conn.transaction():  # one short transaction per index: none holds the commit horizon back
                    conn.execute("SET LOCAL lock_timeout = '50ms'")
                    row = conn.execute("SELECT delaywheel.summarize_brin(%s::regclass)", (index,)).fetchone()
                added += int(row[0]) if row else 0
            except (errors.LockNotAvailable, errors.UndefinedTable, errors.InsufficientPrivilege):
                continue
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (SUMMARIZE_LOCK,))
    return added
