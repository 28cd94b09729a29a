"""Shared fixtures: the project's own PostgreSQL (embedded cluster, or DELAYWHEEL_DATABASE_URL),
a migrated template database, and a fresh database cloned from it for every test that asks. Plain helpers are in
tests/helpers.py."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from delaywheel import Settings, Store
from delaywheel.config import TEST_CLOCK_ENV
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url, configure
from delaywheel.migrate import migrate
from tests.helpers import ROOT, fresh_database

# Re-exported until the pass-procedure tests being rewritten import it from tests.helpers, as the rest do.
from tests.helpers import at as at

# Tests inject fixed clocks far from the database's (`t0`, 2030-01-01): said once, here, for this process and every
# one it starts (the CLI, Airflow, Spark), so that `now=` is not held to the database's clock. A test of that rule
# builds Settings(test_clock=False).
os.environ[TEST_CLOCK_ENV] = "1"

TEMPLATE = "delaywheel_test_template"
AIRFLOW_TEST_DB = "airflow_test"


def _with_db(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


@pytest.fixture(scope="session")
def server_url() -> str:
    """Admin URL of the server the tests use (the `postgres` database): DELAYWHEEL_DATABASE_URL's role, or the
    embedded cluster's superuser (its default URL is the runtime role's, which may create nothing)."""
    if os.environ.get("DELAYWHEEL_DATABASE_URL"):
        return _with_db(os.environ["DELAYWHEEL_DATABASE_URL"], "postgres")
    return embedded.start().admin_url("postgres")  # (started if need be, idempotently)


@pytest.fixture(scope="session")
def airflow_db(server_url: str) -> dict[str, str]:
    """A migrated Airflow metadata database for `dag.test()` runs; returns the environment it needs
    (already applied to os.environ, so import Airflow only inside tests that use this fixture)."""
    return configure(
        server_url,
        metadata_db=AIRFLOW_TEST_DB,
        home=ROOT / ".delaywheel" / "airflow-test",
        replace=True,
        store_connection=False,
    )


@pytest.fixture
def store_connection(airflow_db: dict[str, str], db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Airflow's `delaywheel_default` connection → this test's database (by environment); returns its URL."""
    url = as_url(db_url)
    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", url)
    return url


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """One migrated template per test session: several sessions share the cluster (helpers, CI), and a
    shared name would let one session drop the template another is cloning from."""
    name = f"{TEMPLATE}_{os.getpid()}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    migrate(_with_db(server_url, name))  # the store's line only: the shop example's tests add theirs (shop_schema)
    yield name
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test; dropped afterwards."""
    with fresh_database(server_url, template_db) as url:
        yield url


def migrate_shop(url: str) -> str:
    """The shop example's own line (examples/shop, its schema `shop`) migrated into the database at `url`; returns
    `url`."""
    from delaywheel_shop import schema  # the example: only the tests of it need it

    schema.migrate(url)
    return url


@pytest.fixture
def shop_schema(db_url: str) -> str:
    """This test's database with the shop example's schema too (the template carries only the store's); returns its
    URL. Every test under tests/shop has it (tests/shop/conftest.py)."""
    return migrate_shop(db_url)


@pytest.fixture
def metadata_db(server_url: str) -> Iterator[str]:
    """The name of an Airflow metadata database for one `scripts/airflow.sh` run, dropped afterwards."""
    name = f"airflow_sh_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


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
    return datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def roles(server_url: str) -> None:
    """The embedded cluster's roles, created as `db start` creates them (idempotent; a superuser's work)."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        embedded.create_roles(conn)


@pytest.fixture
def role_db(server_url: str, roles: None) -> Iterator[tuple[str, str]]:
    """A fresh database migrated by the owner's login; yields (owner URL, runtime URL)."""
    from delaywheel.migrate import OWNER_ROLE, migrate

    name = f"dwroles_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
        conn.execute(f"GRANT CREATE ON DATABASE {name} TO {OWNER_ROLE}")
    owner = make_conninfo(server_url, dbname=name, user=embedded.OWNER_LOGIN)
    runtime = make_conninfo(server_url, dbname=name, user=embedded.RUNTIME_LOGIN)
    migrate(owner)
    yield owner, runtime
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
