"""Where the store lives: the configured PostgreSQL, or the embedded cluster when none is configured."""

from __future__ import annotations

import psycopg

from . import embedded
from .config import Settings, load_settings

# The commit horizon (DESIGN.md §5), an SQL expression of type xid8: every transaction below it that could
# have written to *this* database has ended, so a cursor may pass rows below it. Unlike
# pg_snapshot_xmin(pg_current_snapshot()) it leaves out transactions that pg_stat_activity shows connected to
# another database of the cluster (Airflow's metadata database, a benchmark's bulk load): they cannot write our
# tables, yet would hold every delivery back for as long as they run. Anything not positively shown to be
# elsewhere (prepared transactions, sessions this role may not see) still holds the horizon.
COMMIT_HORIZON = """(
    SELECT coalesce(min(x), min(pg_snapshot_xmax(s.snap)))
    FROM (SELECT pg_current_snapshot() AS snap) s
    LEFT JOIN LATERAL pg_snapshot_xip(s.snap) x ON mod(x::text::bigint, 4294967296) NOT IN (
        SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL
          AND a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database())))"""


def database_url(settings: Settings | None = None, *, start_embedded: bool = True) -> str:
    """The configured URL; without one, the embedded cluster's (started on demand, idempotently)."""
    settings = settings or load_settings()
    if settings.database_url:
        return settings.database_url
    cluster = embedded.default_cluster()
    if start_embedded:
        embedded.start(cluster)
    return cluster.url("delaywheel")


def connect(url: str, *, autocommit: bool = False) -> psycopg.Connection:
    """A connection tagged with our application name, so `pg_stat_activity` shows who holds what."""
    return psycopg.connect(url, autocommit=autocommit, application_name="delaywheel")
