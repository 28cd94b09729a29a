"""Where the store lives (the URL given or configured; the embedded cluster is the CLI's choice, not this module's),
its connections and the SQL settings they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel.config import ConfigError, Settings

T = TypeVar("T")

# The commit horizon (see DESIGN.md), an SQL expression of type xid8: every transaction below it that could
# have written to *this* database has ended, so a cursor may pass rows below it. Unlike
# pg_snapshot_xmin(pg_current_snapshot()) it leaves out two kinds of transaction that pg_stat_activity shows and
# that cannot write our tables, yet would hold every delivery back for as long as they run: those connected to
# another database of the cluster (Airflow's metadata database, a benchmark's bulk load), and those of processes
# that run as no role (usesysid NULL: autovacuum workers, whose ANALYZE of a hot table such as wheel_cursor holds
# an xid while it writes pg_statistic, for long stretches beside busy loops; every client session, parallel worker
# and replication apply worker runs as a role). Anything not positively shown to be one of those (prepared
# transactions, sessions this role may not see) still holds the horizon.
COMMIT_HORIZON = """(
    SELECT coalesce(min(x), min(pg_snapshot_xmax(s.snap)))
    FROM (SELECT pg_current_snapshot() AS snap) s
    LEFT JOIN LATERAL pg_snapshot_xip(s.snap) x ON mod(x::text::bigint, 4294967296) NOT IN (
        SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL
          AND (a.usesysid IS NULL
               OR a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))))"""

# Planner settings for reading a queue in cursor order, as SQL to SELECT at the start of the reading transaction
# (set_config(..., true) = SET LOCAL). The rows past a cursor arrived after the last ANALYZE, so the planner
# estimates about one of them and picks "read every partition's rows past the cursor, then sort": a pass would
# read the level's whole backlog to deliver one batch, and catching up a backlog would cost its square. With
# sorting priced out it merges the partitions' index order and stops at the LIMIT. JIT goes with it: the price
# put on the sorts that remain pushes the estimate over jit_above_cost, and compiling takes longer than the pass.
QUEUE_PLAN = "set_config('enable_sort', 'off', true), set_config('jit', 'off', true)"

# Set in every transaction that writes rows into a topic, whatever the session's setting: its commit waits for its
# WAL flush, and so becomes visible only once it is on disk. A consumer may read a topic row and ack past it at once;
# a crash that undid the row would hand its transaction id out again, and the row written again would sort before the
# group's offset, never read (DESIGN.md, "Durability"). The store's SQL functions that write topic rows set the same.
DURABLE_COMMIT = "set_config('synchronous_commit', 'on', true)"

# Planner settings added for a delivery pass: its test of each row for a cancellation (pending.not_cancelled) as an
# index probe, never a hash of the cancellations or a scan of them. A pass keeps the plan its connection made after its
# first few passes (prepared, generic) while the day's cancellations keep growing: made when they were few, analyzed,
# the anti-join looks cheapest as a hash of all of them, and every pass then reads them all, so under a stream of
# cancels each pass costs more as the day goes on (tests/test_query_plans.py checks the plan).
# Fencing the test as a subquery (probe=True) is no remedy here: that subquery's own plan scans them per row, and
# its price per row makes the stragglers' move read the due-time index up to now. The pass's statements have no other
# join that wants a hash or a merge.
PASS_PLAN = (
    "set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true),"
    " set_config('enable_mergejoin', 'off', true)"
)


NO_DATABASE = (
    "no database URL: pass one (Store(url)) or configure one (DELAYWHEEL_DATABASE_URL, or database_url in airflow.cfg's"
    " [delaywheel] section); or use the embedded development cluster: delaywheel.dev.embedded.store() in Python, or"
    " the `delaywheel` command, which uses it when no URL is configured"
)


def configured_url(settings: Settings) -> str:
    """The configured database URL. None configured is an error, never a server started on the side: the embedded
    cluster is an explicit choice (`delaywheel.dev.embedded`)."""
    if not settings.database_url:
        raise ConfigError(NO_DATABASE)
    return settings.database_url


# Server settings every store connection starts with (libpq `options`, no privilege needed). JIT off: the store's
# statements each read a few index ranges or write one batch, but a partitioned table (a hundred hourly wheel
# partitions) multiplies the planner's cost estimate past jit_above_cost, and compiling then takes PostgreSQL far
# longer than any of these statements runs (with it on, `stats` on an empty store would spend most of its time
# compiling).
# synchronous_commit on, whatever the role's or database's default: what the store answers (`cancelled`, a send's id)
# and what it makes visible (topic rows) must survive a crash (DURABLE_COMMIT). A consumer's ack may still turn it off
# for its own transaction: a crash that undoes an ack hands the batch out again.
SESSION_OPTIONS = "-c jit=off -c synchronous_commit=on"


def with_session_options(url: str, extra: str = SESSION_OPTIONS) -> str:
    """`url` with `extra` appended to its libpq `options` (any the URL already sets are kept)."""
    params = conninfo_to_dict(url)
    params["options"] = " ".join(str(o) for o in (params.get("options"), extra) if o)
    return make_conninfo("", **params)


def connect(url: str, *, autocommit: bool = False) -> psycopg.Connection:
    """A connection tagged with our application name, so `pg_stat_activity` shows who holds what, with the store's
    session settings (SESSION_OPTIONS)."""
    return psycopg.connect(with_session_options(url), autocommit=autocommit, application_name="delaywheel")


def commits_each_statement(conn: psycopg.Connection) -> bool:
    """Autocommit and outside a transaction (a Store's connection): what a statement writes is committed when it
    ends, and the statements of one pipeline before its Sync form one implicit transaction. Cancel commits its
    cancellations before it waits for the passes in flight; a consumer sends its ack and next pull as one."""
    return conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def in_own_transaction(conn: psycopg.Connection, body: Callable[[bool], T]) -> T:
    """`body(own)` in a transaction of its own. On a Store's connection (`commits_each_statement`) `own` is True and
    `body` is one CALL that commits itself (a pass's p_commit), so no BEGIN or COMMIT costs a round trip, and a CALL
    that fails has rolled back on the server. Inside the caller's transaction `own` is False and `body` runs in a
    savepoint."""
    if commits_each_statement(conn):
        return body(True)
    with conn.transaction():
        return body(False)
