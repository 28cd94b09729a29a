"""Shared fixtures: the project's own PostgreSQL (embedded cluster, or DELAYWHEEL_DATABASE_URL),
a migrated template database, and a fresh database cloned from it for every test that asks."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel import Settings, Store
from delaywheel.db import database_url
from delaywheel.migrate import migrate

TEMPLATE = "delaywheel_test_template"


def _with_db(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


@pytest.fixture(scope="session")
def server_url() -> str:
    """Admin URL of the server the tests use (the `postgres` database)."""
    return _with_db(database_url(Settings(database_url=os.environ.get("DELAYWHEEL_DATABASE_URL"))), "postgres")


@pytest.fixture(scope="session")
def template_db(server_url: str) -> str:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    url = _with_db(server_url, TEMPLATE)
    migrate(url)
    return TEMPLATE


@pytest.fixture
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test; dropped afterwards."""
    name = f"dwtest_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield _with_db(server_url, name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def settings() -> Settings:
    return Settings()


@pytest.fixture
def store(db_url: str, settings: Settings) -> Iterator[Store]:
    with Store(db_url, settings) as s:
        yield s


@pytest.fixture
def t0() -> datetime:
    """A fixed start for tests that inject the clock (whole second, UTC)."""
    return datetime(2030, 1, 1, tzinfo=timezone.utc)


def at(t: datetime, seconds: float) -> datetime:
    return t + timedelta(seconds=seconds)


def dbname(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])
