"""Where the store lives: the configured PostgreSQL, or the embedded cluster when none is configured."""

from __future__ import annotations

import psycopg

from . import embedded
from .config import Settings, load_settings


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
