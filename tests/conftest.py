"""Shared fixtures: the project's own PostgreSQL (embedded cluster, or DELAYWHEEL_DATABASE_URL),
a migrated template database, and a fresh database cloned from it for every test that asks."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel import Settings, Store
from delaywheel.config import TEST_CLOCK_ENV
from delaywheel.deliver import runner
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url, configure
from delaywheel.migrate import migrate

# Tests inject fixed clocks far from the database's (`t0`, 2030-01-01): said once, here, for this process and every
# one it starts (the CLI, Airflow, Spark), so that `now=` is not held to the database's clock. A test of that rule
# builds Settings(test_clock=False).
os.environ[TEST_CLOCK_ENV] = "1"

TEMPLATE = "delaywheel_test_template"
ROOT = Path(__file__).resolve().parents[1]
AIRFLOW_TEST_DB = "airflow_test"


T = TypeVar("T")


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing holds, for the servers a test starts (clusters, Airflow, pgbouncer, Redis,
    Spark). Below the kernel's ephemeral range (32768-60999): a port picked by binding to 0 comes from that range,
    where any client's connection may take it before the server given it binds (a CI run lost a port so). The start
    is random so that test runs side by side pick apart."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(embedded._free_port(ports[-1] + 1 if ports else 20000 + random.randrange(9000)))
    return ports


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


@contextlib.contextmanager
def fresh_database(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database cloned from the session's template; dropped afterwards."""
    name = f"dwtest_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield _with_db(server_url, name)
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


def at(t: datetime, seconds: float) -> datetime:
    return t + timedelta(seconds=seconds)


class Background:
    """`fn()` on a thread; `result()` joins it. Where it should wait, a test says so with wait_for_lock on its backend:
    a thread merely not returned yet after a pause may not have got there (a loaded CI run once showed it)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.error:
            raise self.error
        return self.value


def wait_for_lock(conn: psycopg.Connection, pid: int, what: str, seconds: float = 10.0) -> None:
    """Until the backend `pid` waits for a lock (a test's thread blocked where the test means it to be); fails,
    naming `what`, after `seconds`."""
    deadline = time.monotonic() + seconds
    while conn.execute(
        "SELECT wait_event_type IS DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone() != (False,):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} never waited for a lock")
        time.sleep(0.01)


def dbname(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])


HOT_TABLES = ("level_queue", "wheel", "wheel_far", "topic_messages", "cancellations")


def table_counts(store: Store) -> dict[str, int]:
    """Rows in each hot table (through the partitioned parents): what a rejected send must leave at zero."""
    return {
        table: store.conn.execute(f"SELECT count(*) FROM delaywheel.{table}").fetchone()[0]  # type: ignore[index]
        for table in HOT_TABLES
    }


def deliveries(store: Store, topic: str | None = None) -> list[tuple[int, datetime, datetime, str]]:
    """(message_id, deliver_at, delivered_at, topic) of every delivery, in each topic's delivery order."""
    rows = store.conn.execute(
        "SELECT message_id, deliver_at, delivered_at, topic FROM delaywheel.topic_messages"
        " WHERE %(topic)s::text IS NULL OR topic = %(topic)s ORDER BY topic, xid, queue_offset",
        {"topic": topic},
    ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def traced(conn: psycopg.Connection, call: Callable[[], T]) -> tuple[T, list[list[str]]]:
    """`call()`'s result, and the protocol messages it sent and received on `conn` (libpq's trace: per message, the
    side, F from the client or B from the server, its length and its type, e.g. Sync): each Sync the client sends is
    a round trip, a wake-up of the client and of its server process."""
    with tempfile.TemporaryFile("w+") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            result = call()
        finally:
            conn.pgconn.untrace()
        f.seek(0)
        lines = [line.split("\t")[:4] for line in f.read().splitlines() if line[:2] in ("F\t", "B\t")]
    return result, lines


def syncs(lines: list[list[str]]) -> int:
    """The round trips in `traced`'s lines: the Syncs the client sent."""
    return sum(1 for line in lines if line[0] == "F" and line[2] == "Sync")


def delivering(db_url: str, stop: threading.Event) -> threading.Thread:
    """A delivery loop for level 1 and the wheel on its own thread and Store, until `stop` is set."""

    def loop() -> None:
        with Store(db_url) as own:
            runner.run(own, [1, None], 120, stop=stop)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread
