"""Shared fixtures: the project's own PostgreSQL (embedded cluster, or DELAYWHEEL_DATABASE_URL),
a migrated template database, and a fresh database cloned from it for every test that asks; and each test's tier,
marked by where it lives and what it uses (`pytest_collection_modifyitems`). Plain helpers are in tests/helpers.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from delaywheel import Settings, Store
from delaywheel.config import TEST_CLOCK_ENV
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url, configure
from delaywheel.migrate import migrate
from tests.helpers import ROOT, free_ports, fresh_database

# Tests inject fixed clocks far from the database's (`t0`, 2030-01-01): said once, here, for this process and every
# one it starts (the CLI, Airflow, Spark), so that `now=` is not held to the database's clock. A test of that rule
# builds Settings(test_clock=False).
os.environ[TEST_CLOCK_ENV] = "1"

TEMPLATE = "delaywheel_test_template"
# Per checkout: sessions of several checkouts (git worktrees) share one cluster, each with its own metadata database.
AIRFLOW_TEST_DB = "airflow_test_" + hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]


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


# Tiers (Makefile: `make check` deselects airflow, spark, browser and slow). Marked here by where a test lives and
# what it uses, so that no test escapes its tier for want of a decorator.
TIER_DIRS = {"airflow": "airflow", "spark": "spark"}  # tests/<dir>/ -> marker
TIER_FIXTURES = {  # a fixture -> the marker of every test that uses it
    "airflow_db": "airflow",
    "store_connection": "airflow",
    "metadata_db": "airflow",
    "spark": "spark",
    "spark_cluster": "spark",
}
BROWSER_MODULES = {"test_browser.py"}  # headless Chromium
# `slow`: the store's tests that start throwaway clusters or servers, crash or restart them, or take seconds of
# threads, subprocesses or random cases each (4 s or more in a `--durations=0` run of the quick tier here): `make
# check` leaves them to `make test`.
SLOW_MODULES = {"test_crash.py", "test_poolers.py", "test_resilience.py", "test_scarce_resources.py"}
SLOW_FIXTURES = {"own_cluster", "second_cluster", "pgbouncer"}
SLOW_TESTS = {  # node ids without parameters
    "tests/test_properties.py::test_random_sends_cancels_and_clocks",
    "tests/test_wheel_install.py::test_the_installed_wheel_migrates_sends_delivers_and_pulls",
    "tests/test_concurrency.py::test_producers_and_two_deliverers_per_lane",
    "tests/test_upgrade.py::test_an_upgraded_store_behaves_as_a_fresh_one",
    "tests/test_cli.py::test_cli_never_shows_a_traceback_for_bad_input",
    "tests/test_cli.py::test_long_running_commands_freeze_their_start_up_heap_in_their_own_process_only",
    "tests/test_query_plans.py::test_a_far_block_is_searched_by_its_segments",
    "tests/test_query_plans.py::test_a_wheel_pass_and_the_wheel_head_read_a_batch",
    "tests/produce/test_send.py::test_a_single_send_gives_the_verdict_of_the_rules",
    "tests/deliver/test_presence.py::test_a_delivery_loop_logs_the_lanes_nobody_delivers",
    "tests/deliver/test_wheel_roll_slices.py::test_random_blocks_slices_and_interleavings",
    "tests/deliver/test_horizon.py::test_wheel_delivers_once_while_other_databases_churn",
    "tests/deliver/test_delivery.py::test_far_future_messages_survive_many_rolls",
    "tests/deliver/test_delivery.py::test_open_producer_transaction_does_not_stop_the_wheel",
    "tests/deliver/test_runner.py::test_the_lane_is_handed_over_as_soon_as_a_successor_runs",
    "tests/deliver/test_runner.py::test_a_message_whose_announcement_is_lost_is_found_by_the_safety_wake_without_passing_idle_levels",
    "tests/deliver/test_runner.py::test_without_a_successor_the_lane_stays_served_through_the_grace",
    "tests/deliver/test_runner.py::test_the_loop_summarizes_the_topic_it_delivers_into_within_seconds",
    "tests/deliver/test_wheel_cursor.py::test_the_cursor_read_stays_bounded_under_an_old_transaction",
    "tests/consume/test_lease.py::test_the_successor_takes_over_at_the_lease_end_with_nothing_handled_twice",
    "tests/ops/test_cancel.py::test_cancel_by_key_finds_exactly_the_pending_messages",
    "tests/ops/test_cancel_race.py::test_cancel_stream_beside_delivery_loops",
    "tests/ops/test_cancel_race.py::test_a_bulk_cancel_in_the_callers_transaction_holds_every_lane",
    "tests/ops/test_cancel_race.py::test_a_cancel_in_the_callers_transaction_holds_the_lanes",
    "tests/batch/test_bulk_columns.py::test_what_the_column_path_accepts_is_what_the_rows_give",
    "tests/shop/test_orders.py::test_story_outcome_matches_the_rules_exactly",
    "tests/shop/test_orders.py::test_quality_suite_catches_a_broken_outcome",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(tests):
            continue
        where = item.path.relative_to(tests)
        fixtures = set(getattr(item, "fixturenames", ()))
        marks = {TIER_FIXTURES[f] for f in fixtures & TIER_FIXTURES.keys()}
        if len(where.parts) > 1 and where.parts[0] in TIER_DIRS:
            marks.add(TIER_DIRS[where.parts[0]])
        if where.name in BROWSER_MODULES:
            marks.add("browser")
        if where.name in SLOW_MODULES or fixtures & SLOW_FIXTURES or item.nodeid.split("[")[0] in SLOW_TESTS:
            marks.add("slow")
        for mark in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[embedded.Cluster]:
    """A throwaway cluster of the module's own (a temporary folder, a free port), migrated and prepared: for tests
    that restart, crash or starve a server, never the shared one."""
    root = Path(tempfile.mkdtemp(prefix="delaywheel-own-", dir="/var/tmp"))
    root.chmod(0o755)  # the postgres user (we may be root) must reach it
    cluster = embedded.Cluster(root=root, port=free_ports(1)[0])
    embedded.start(cluster)
    try:
        migrate(cluster.url())
        with Store(cluster.url()) as store:
            store.prepare()
        yield cluster
    finally:
        embedded.stop(cluster)
        shutil.rmtree(root, ignore_errors=True)
