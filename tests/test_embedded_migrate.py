"""The embedded cluster's start/status/stop and the migration runner, against real PostgreSQL.

Start/stop is exercised on a second cluster in a temp folder: the default cluster is shared by
every test run and every helper on this machine, so it is never stopped here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

import psycopg
import pytest
from delaywheel_shop import schema as shop_schema
from psycopg import sql

from delaywheel import Message, Settings, Store
from delaywheel.dev import embedded
from delaywheel.migrate import SQL_DIR, MigrationError, available, current_version, definitions, migrate
from tests.helpers import dbname, free_ports


@pytest.fixture
def second_cluster() -> Iterator[embedded.Cluster]:
    """A cluster in a /tmp folder the `postgres` user can reach (pytest's tmp_path is 0700 as root)."""
    root = Path(tempfile.mkdtemp(prefix="dw-embedded-", dir="/tmp"))
    os.chmod(root, 0o755)
    cluster = embedded.Cluster(root=root / "pg", port=free_ports(1)[0])
    try:
        yield cluster
    finally:
        if embedded.status(cluster) == "running":
            embedded.stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def test_start_status_stop_are_idempotent(second_cluster: embedded.Cluster) -> None:
    assert embedded.status(second_cluster) == "absent"
    assert embedded.stop(second_cluster) == "already stopped"

    assert embedded.start(second_cluster) == second_cluster
    assert embedded.status(second_cluster) == "running"
    embedded.start(second_cluster)  # again: no error, same cluster
    assert embedded.status(second_cluster) == "running"
    with psycopg.connect(second_cluster.url("postgres")) as conn:
        names = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
        running = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in ("wal_compression", "max_wal_size")}
    assert set(embedded.DATABASES) <= names
    chosen = embedded.server_options(second_cluster, embedded.find_bindir())
    assert running == {"wal_compression": chosen["wal_compression"], "max_wal_size": "8GB"}
    assert chosen["wal_compression"] in ("lz4", "on")  # lz4 wherever the server was built with it, as here

    assert embedded.stop(second_cluster) == "stopped"
    assert embedded.status(second_cluster) == "stopped"
    assert embedded.stop(second_cluster) == "already stopped"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(second_cluster.url("postgres"), connect_timeout=3)

    embedded.start(second_cluster)  # restart keeps the data
    assert embedded.status(second_cluster) == "running"
    with psycopg.connect(second_cluster.url("delaywheel")) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_stopped_cluster_whose_remembered_port_was_taken_starts_on_the_next_free_one(
    second_cluster: embedded.Cluster,
) -> None:
    """Another clone's cluster (here a listening socket) took the port while this one was stopped: a given port is
    refused with the reason, a remembered one (`default_cluster`'s) moves on, and the move is remembered."""
    embedded.start(second_cluster)
    embedded.stop(second_cluster)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: over closing connections
        squatter.bind(("127.0.0.1", second_cluster.port))
        squatter.listen()
        with pytest.raises(embedded.EmbeddedError, match=f"port {second_cluster.port} in use"):
            embedded.start(second_cluster)

        moved = embedded.start(dataclasses.replace(second_cluster, movable=True))

        assert moved.port != second_cluster.port
        assert (second_cluster.root / "port").read_text() == str(moved.port)
        assert embedded.status(moved) == "running"
        with psycopg.connect(moved.url("delaywheel")) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert embedded.start(moved) == moved  # running: stays where it is
    embedded.stop(moved)


def test_a_cluster_stopped_under_its_clients_restarts_on_its_remembered_port(
    second_cluster: embedded.Cluster,
) -> None:
    """`db stop` while a deliverer or Airflow still holds connections leaves them closing on the cluster's port for a
    minute. PostgreSQL restarts over them, so a remembered port is not taken and the cluster does not move (it did:
    the probe bound without SO_REUSEADDR, and every client's URL pointed at the old port)."""
    movable = dataclasses.replace(second_cluster, movable=True)
    embedded.start(movable)
    clients = [psycopg.connect(movable.url("postgres")) for _ in range(3)]
    embedded.stop(movable)
    try:
        assert not embedded._port_taken(movable.port)
        assert embedded.start(movable) == movable
        with psycopg.connect(movable.url("delaywheel")) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        for client in clients:
            client.close()
    embedded.stop(movable)


def test_a_port_a_client_connection_holds_is_not_free() -> None:
    """A client's connection takes its local port from the range test clusters once picked theirs from: nothing
    listens there, yet a server's bind fails (a CI run lost a module's cluster to it). Such a port counts as taken."""
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        local = client.getsockname()[1]
        assert embedded._port_taken(local)
        assert embedded._free_port(local) != local


def test_start_creates_the_roles_and_the_store_runs_as_the_runtime(second_cluster: embedded.Cluster) -> None:
    """`db start` creates the owner and runtime roles (docs/operations.md, "Roles"); the store's URL is the runtime login's, a
    non-superuser, and `migrate` given it runs as the owner's login."""
    embedded.start(second_cluster)
    embedded.start(second_cluster)  # idempotent
    with psycopg.connect(second_cluster.admin_url()) as conn:
        roles = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT rolname, rolsuper, rolcanlogin FROM pg_roles WHERE rolname LIKE 'delaywheel%'"
            )
        }
    assert roles == {
        "delaywheel_owner": (False, False),
        "delaywheel_runtime": (False, False),
        embedded.OWNER_LOGIN: (False, True),
        embedded.RUNTIME_LOGIN: (False, True),
    }
    applied = migrate(second_cluster.url("delaywheel"))
    assert available()[-1].path.name in applied
    with Store(second_cluster.url("delaywheel"), Settings()) as store:
        assert store.conn.execute("SELECT current_user, current_setting('is_superuser')").fetchone() == (
            embedded.RUNTIME_LOGIN,
            "off",
        )
        store.prepare()
        assert store.conn.execute(
            "SELECT DISTINCT relowner::regrole::text FROM pg_class WHERE relname LIKE 'wheel_p%'"
        ).fetchall() == [("delaywheel_owner",)]


@pytest.fixture
def empty_db(server_url: str) -> Iterator[str]:
    """A database with no schema at all, for exercising the runner from scratch."""
    name = f"dwmig_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield psycopg.conninfo.make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def sql_copy(tmp_path: Path) -> Path:
    """A private copy of sql/, so a test can change or add files without touching the project's."""
    target = tmp_path / "sql"
    shutil.copytree(SQL_DIR, target)
    return target


def _recorded(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return [(v, n) for v, n in conn.execute("SELECT version, name FROM delaywheel.schema_migrations ORDER BY 1")]


def test_runner_applies_once_and_records_versions(empty_db: str, sql_copy: Path) -> None:
    expected = [(m.version, m.path.name) for m in available(sql_copy / "migrations")]
    assert current_version(empty_db) == 0
    installed = [p.name for p in definitions(sql_copy)]
    assert installed[-1] == "views.sql"  # the views use the functions
    assert migrate(empty_db, sql_copy) == [name for _, name in expected] + installed
    assert _recorded(empty_db) == expected
    assert current_version(empty_db) == expected[-1][0]
    assert migrate(empty_db, sql_copy) == []  # idempotent
    assert _recorded(empty_db) == expected
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('delaywheel.level_queue') IS NOT NULL").fetchone() == (True,)


def test_runner_refuses_a_newer_schema(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO delaywheel.schema_migrations (version, name, checksum) VALUES (999, '999_future.sql', 'x')"
        )
    with pytest.raises(MigrationError, match=r"version 999 .*newer than this code"):
        migrate(db_url)


def test_runner_refuses_a_changed_applied_file(empty_db: str, sql_copy: Path) -> None:
    migrate(empty_db, sql_copy)
    first = available(sql_copy / "migrations")[0].path
    first.write_text(first.read_text() + "\n-- edited after it was applied\n")
    with pytest.raises(MigrationError, match=f"{first.name} changed after it was applied"):
        migrate(empty_db, sql_copy)


def test_a_failing_migration_applies_nothing_of_itself(empty_db: str, sql_copy: Path) -> None:
    """Each file runs in its own transaction: a file that fails halfway leaves no table and no version."""
    migrate(empty_db, sql_copy)
    before = _recorded(empty_db)
    newest = available(sql_copy / "migrations")[-1].version
    (sql_copy / "migrations" / f"{newest + 1:03d}_broken.sql").write_text(
        "CREATE TABLE delaywheel.half_done (x int);\nSELECT 1/0;\n"
    )
    with pytest.raises(psycopg.errors.DivisionByZero):
        migrate(empty_db, sql_copy)
    assert _recorded(empty_db) == before
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('delaywheel.half_done')").fetchone() == (None,)


def test_badly_named_file_is_refused(sql_copy: Path) -> None:
    (sql_copy / "migrations" / "4_no_padding.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="NNN_snake_case"):
        available(sql_copy / "migrations")


def test_test_databases_are_migrated(db_url: str) -> None:
    assert dbname(db_url).startswith("dwtest_")
    assert current_version(db_url) == available()[-1].version


def test_hourly_wheel_partitions_are_kept_and_completed_by_four_hour_ones(empty_db: str) -> None:
    """The near wheel's partitions are 4 hours wide; hourly ones (an earlier width: two whole 4-hour blocks of them
    here) stay; a new block is one partition; a block whose first hour retire dropped gets only what nothing covers.
    Sends into each (one statement, or a batch) land, and every message is delivered once."""
    migrate(empty_db)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("SET ROLE delaywheel_owner")
        for hour in range(8):
            lo = t0 + timedelta(hours=hour)
            name = conn.execute("SELECT delaywheel.partition_name('wheel', %s)", (lo,)).fetchone()[0]  # type: ignore[index]
            conn.execute(
                sql.SQL("CREATE TABLE delaywheel.{} PARTITION OF delaywheel.wheel FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier(name), sql.Literal(lo), sql.Literal(lo + timedelta(hours=1))
                )
            )

    def partitions() -> list[tuple[int, int]]:  # (start, end) in hours after t0
        with psycopg.connect(empty_db) as conn:
            rows = conn.execute("SELECT lo, hi FROM delaywheel.partitions WHERE parent = 'wheel' ORDER BY lo")
            return [((lo - t0) // timedelta(hours=1), (hi - t0) // timedelta(hours=1)) for lo, hi in rows]

    assert partitions() == [(h, h + 1) for h in range(8)]
    with psycopg.connect(empty_db, autocommit=True) as conn:  # retire dropped the hour 04:00 (passed, drained)
        conn.execute("SELECT delaywheel.drop_partition('wheel', %s)", (t0 + timedelta(hours=4),))
    with Store(empty_db, Settings()) as store:
        sent = [
            store.send("orders", b"a", deliver_at=t0 + timedelta(hours=2, minutes=30), now=t0),
            *store.send_many(
                [Message("orders", b"b", deliver_at=t0 + timedelta(hours=h, minutes=30)) for h in (6, 9)], now=t0
            ),
        ]
    with Store(empty_db, Settings()) as store:  # a new process: nothing known of the partitions
        sent.append(store.send("orders", b"c", deliver_at=t0 + timedelta(hours=5, minutes=30), now=t0))
        assert partitions() == [*[(h, h + 1) for h in (0, 1, 2, 3, 4, 5, 6, 7)], (8, 12)]
        assert store.deliver_due(now=t0 + timedelta(hours=12)) == 4
        with psycopg.connect(empty_db) as conn:
            delivered = conn.execute("SELECT message_id FROM delaywheel.topic_messages ORDER BY 1").fetchall()
        assert [mid for (mid,) in delivered] == sorted(sent)


def _lines(url: str) -> list[tuple[str, int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT line, version, name FROM delaywheel.schema_migrations ORDER BY 1, 2").fetchall()


def test_the_store_line_has_no_shop_and_the_shop_brings_its_own(empty_db: str) -> None:
    """A fresh database: `migrate` creates the store's schema and nothing of the example (no `shop`); the shop's
    `schema.migrate` adds its own line, recorded apart, each idempotent."""
    assert migrate(empty_db) == [m.path.name for m in available()] + [p.name for p in definitions()]
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regnamespace('shop')").fetchone() == (None,)
    assert current_version(empty_db, "shop") == 0
    assert shop_schema.migrate(empty_db) == ["001_shop.sql", "002_shop_functions.sql"]
    assert shop_schema.migrate(empty_db) == []
    assert [(line, v) for line, v, _ in _lines(empty_db)] == [
        *[("delaywheel", m.version) for m in available()],
        ("shop", 1),
        ("shop", 2),
    ]
    assert current_version(empty_db) == available()[-1].version
    assert current_version(empty_db, "shop") == 2
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('shop.orders') IS NOT NULL").fetchone() == (True,)


def test_each_line_checks_its_own_versions(db_url: str) -> None:
    """A version newer than the code knows is refused in its own line only; the shop's line is checked as the
    store's is (a changed applied file)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO delaywheel.schema_migrations (line, version, name, checksum)"
            " VALUES ('shop', 99, '099_later.sql', 'x')"
        )
    assert migrate(db_url) == []
    with pytest.raises(MigrationError, match=r"version 99 \(099_later.sql\) of line shop, newer than this code"):
        migrate(db_url, shop_schema.LINE)


def test_migrations_are_read_as_package_data() -> None:
    """The folders come from importlib.resources, the package's own: what an installed wheel has too
    (tests/test_wheel_install.py runs them from one)."""
    assert str(SQL_DIR) == str(resources.files("delaywheel") / "sql")
    assert str(shop_schema.LINE.folder) == str(resources.files("delaywheel_shop") / "migrations")
    assert [m.path.name for m in available(shop_schema.LINE.folder)] == ["001_shop.sql", "002_shop_functions.sql"]


def test_the_embedded_cluster_is_an_explicit_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`embedded.store()` is a Store on the embedded cluster's store database as its runtime login, whatever URL is
    configured; `embedded.database_url()` (the CLI's) is the configured URL when there is one, else that database's."""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", "postgresql://app@db.example/store")
    cluster = embedded.default_cluster()
    assert embedded.database_url() == "postgresql://app@db.example/store"
    with embedded.store() as store:
        assert store.url == cluster.url("delaywheel")
        assert store.conn.execute("SELECT current_user").fetchone() == (embedded.RUNTIME_LOGIN,)
    monkeypatch.delenv("DELAYWHEEL_DATABASE_URL")
    monkeypatch.delenv("AIRFLOW__DELAYWHEEL__DATABASE_URL", raising=False)
    monkeypatch.setenv("AIRFLOW_CONFIG", "/nonexistent/airflow.cfg")
    assert embedded.database_url() == cluster.url("delaywheel")
