"""Least privilege (issue 18, finding 2; docs/operations.md, "Roles"): the store runs as a non-superuser runtime role on a database
migrated by the owner role, and everything it does, partition maintenance included, works; what it must not do
fails."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from delaywheel_shop import orders
from delaywheel_shop import schema as shop_schema
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel import Settings, Store
from delaywheel.dev import embedded
from delaywheel.migrate import (
    OWNER_ROLE,
    RUNTIME_ROLE,
    SQL_DIR,
    MigrationError,
    available,
    definitions,
    migrate,
    owner_url,
)
from delaywheel.produce.validation import Message

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def test_the_owner_owns_everything_and_the_runtime_is_no_superuser(role_db: tuple[str, str], server_url: str) -> None:
    owner, runtime = role_db
    with psycopg.connect(make_conninfo(server_url, dbname=conninfo_to_dict(owner)["dbname"])) as admin:
        owners = admin.execute(
            "SELECT DISTINCT relowner::regrole::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('delaywheel', 'shop')"
            " UNION SELECT DISTINCT nspowner::regrole::text FROM pg_namespace WHERE nspname IN ('delaywheel', 'shop')"
            " UNION SELECT DISTINCT proowner::regrole::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'delaywheel'"
        ).fetchall()
        assert owners == [(OWNER_ROLE,)]
        definers = dict(
            admin.execute(
                "SELECT proname, array_to_string(proconfig, ',') FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'delaywheel' AND prosecdef"
            ).fetchall()
        )
        assert set(definers) == {"ensure_partition", "lock_partition", "drop_partition", "summarize_brin"}
        assert set(definers.values()) == {"search_path=pg_catalog, pg_temp"}
    with psycopg.connect(runtime) as conn:
        row = conn.execute(
            "SELECT r.rolsuper, r.rolcreatedb, r.rolcreaterole, r.rolbypassrls, pg_has_role(current_user, %s, 'MEMBER'),"
            " pg_has_role(current_user, %s, 'MEMBER'), pg_has_role(current_user, 'pg_read_server_files', 'MEMBER'),"
            " pg_has_role(current_user, 'pg_execute_server_program', 'MEMBER'),"
            " pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER'),"
            " has_schema_privilege('delaywheel', 'CREATE'), has_table_privilege('delaywheel.topic_messages', 'TRUNCATE'),"
            " has_table_privilege('delaywheel.topic_messages', 'DELETE')"
            " FROM pg_roles r WHERE r.rolname = current_user",
            (RUNTIME_ROLE, OWNER_ROLE),
        ).fetchone()
    assert row == (False, False, False, False, True, False, False, False, False, False, False, False)


def test_the_runtime_runs_the_whole_lifecycle(role_db: tuple[str, str]) -> None:
    """Send (levels, near wheel, far wheel), deliver, advance the wheel with a roll, pull/ack, cancel by id and key,
    prepare, summarize, retire, stats: all as the runtime role."""
    _, runtime = role_db
    with Store(runtime, Settings()) as store:
        assert store.conn.execute("SELECT current_user").fetchone() == (embedded.RUNTIME_LOGIN,)
        store.prepare(now=T0)
        level = store.send("orders", {"n": 1}, delay_level=2, key="level", now=T0)
        near = store.send("orders", {"n": 2}, delay=timedelta(hours=2), key="near", now=T0)
        far = store.send("orders", {"n": 3}, delay=timedelta(days=10), key="far", now=T0)
        many = store.send_many(
            [Message("orders", {"i": i}, key=f"m{i}", delay=timedelta(days=10, minutes=i)) for i in range(50)], now=T0
        )
        by_id = store.send("orders", {"n": 4}, delay=timedelta(hours=3), now=T0)
        by_key = store.send("orders", {"n": 5}, delay=timedelta(days=12), key="cancel-me", now=T0)
        assert [r.outcome for r in store.cancel(message_id=by_id)] == ["cancelled"]
        assert [(r.message_id, r.outcome) for r in store.cancel(key="cancel-me")] == [(by_key, "cancelled")]
        far_blocks = "SELECT count(*) FROM delaywheel.partitions WHERE parent = 'wheel_far_segments'"
        assert store.conn.execute(far_blocks).fetchone() == (2,)

        assert store.deliver_level(2, now=T0 + timedelta(seconds=5)).delivered == 1
        assert store.advance_wheel(now=T0 + timedelta(hours=2)).delivered == 1
        store.conn.commit()
        # a far day enters the near window: the pass rolls it (lock, move, drop) and delivers what is due
        end = T0 + timedelta(days=13)
        delivered = 0
        while (result := store.advance_wheel(now=end)).delivered or result.more:
            delivered += result.delivered
        assert delivered == 51
        assert store.conn.execute(far_blocks).fetchone() == (0,)
        batch = store.pull("orders", "g", 1000)
        assert sorted(m.message_id for m in batch.messages) == sorted([level, near, far, *many])
        assert store.ack(batch).acked == 53
        assert len(store.pull("orders", "g", 1000).messages) == 0

        store.prepare(now=end)
        store.summarize()
        stats = store.stats(now=end)
        assert stats
        tables = "SELECT name FROM delaywheel.partitions WHERE parent = ANY(%s)"
        hot = ["level_segments", "wheel", "wheel_far_segments", "topic_messages", "cancellations"]
        before = {r[0] for r in store.conn.execute(tables, (hot,))}
        retired = store.retire(now=end + timedelta(days=30))
        assert {r.parent for r in retired} == {"level_segments", "wheel", "topic_messages", "cancellations"}
        assert {r[0] for r in store.conn.execute(tables, (hot,))} == before - {r.name for r in retired}
        assert store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone() == (0,)


def test_the_runtime_seeks_a_group_and_may_only_append_to_the_record(role_db: tuple[str, str]) -> None:
    """`group_seeks` is an audit trail: the runtime writes its rows with the seek and reads them, changes none."""
    _, runtime = role_db
    with Store(runtime, Settings()) as store:
        store.send("orders", {"n": 1})
        store.ack(store.pull("orders", "g"))
        assert store.seek("orders", "g", to="earliest").by == embedded.RUNTIME_LOGIN
        assert len(store.pull("orders", "g")) == 1
        for statement in ("UPDATE delaywheel.group_seeks SET sought_by = 'x'", "DELETE FROM delaywheel.group_seeks"):
            with pytest.raises(errors.InsufficientPrivilege):
                store.conn.execute(statement)


def test_the_shop_line_grants_the_runtime_its_own_tables(role_db: tuple[str, str]) -> None:
    """A fresh store has no `shop` schema, so the baseline granted nothing on it; the shop's own line, run by the
    owner's login, creates it owned by the owner and gives the runtime what the demo and the sweep do there: reset
    (TRUNCATE), place orders with their timeouts, and settle them."""
    owner, runtime = role_db
    with psycopg.connect(runtime) as conn:
        assert conn.execute("SELECT to_regnamespace('shop')").fetchone() == (None,)
    assert shop_schema.migrate(owner) == ["001_shop.sql", "002_shop_functions.sql"]
    timeout = timedelta(seconds=30)
    with Store(runtime, Settings()) as store:
        orders.reset(store, stock_per_sku=100)
        plans = orders.plan_orders(1, 20, timeout)
        assert orders.place_orders(store, plans, timeout, now=T0) == 20
        store.deliver_due(now=T0 + 2 * timeout)
        assert orders.sweep(store, now=T0 + 2 * timeout).messages > 0
        owners = store.conn.execute(
            "SELECT DISTINCT relowner::regrole::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'shop' UNION SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'shop'"
        ).fetchall()
    assert owners == [(OWNER_ROLE,)]


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("DROP TABLE delaywheel.topic_messages", errors.InsufficientPrivilege),
        ("CREATE TABLE delaywheel.intruder (x int)", errors.InsufficientPrivilege),
        ("CREATE TABLE public.intruder (x int)", errors.InsufficientPrivilege),
        ("ALTER TABLE delaywheel.wheel ADD COLUMN x int", errors.InsufficientPrivilege),
        ("TRUNCATE delaywheel.topic_messages", errors.InsufficientPrivilege),
        ("DELETE FROM delaywheel.level_checkpoint", errors.InsufficientPrivilege),
        ("INSERT INTO delaywheel.schema_migrations VALUES (999, 'x', 'x')", errors.InsufficientPrivilege),
        # what retention dropped unread is the owner's record (drop_partition writes it): the runtime only reads it
        ("UPDATE delaywheel.retired_unread SET dropped = 0", errors.InsufficientPrivilege),
        ("DELETE FROM delaywheel.retired_unread", errors.InsufficientPrivilege),
        (
            "INSERT INTO delaywheel.retired_unread VALUES ('g', 't', 1, 1, now(), now(), 1, 'p', '1')",
            errors.InsufficientPrivilege,
        ),
        ("COPY (SELECT 1) TO PROGRAM 'id > /tmp/delaywheel-roles-test'", errors.InsufficientPrivilege),
        ("COPY delaywheel.quarantine FROM '/etc/hostname'", errors.InsufficientPrivilege),
        ("SELECT pg_read_file('/etc/hostname')", errors.InsufficientPrivilege),
        ("SELECT pg_ls_dir('.')", errors.InsufficientPrivilege),
        ("CREATE FUNCTION delaywheel.f() RETURNS int LANGUAGE sql AS 'SELECT 1'", errors.InsufficientPrivilege),
        ("SET ROLE delaywheel_owner", errors.InsufficientPrivilege),
        ("SET ROLE postgres", errors.InsufficientPrivilege),
        # the DDL functions take a store parent and a whole aligned range only, never another table
        ("SELECT delaywheel.drop_partition('schema_migrations', now())", errors.InvalidParameterValue),
        ("SELECT delaywheel.lock_partition('schema_migrations')", errors.InvalidParameterValue),
        (
            "SELECT delaywheel.ensure_partition('topic_messages; DROP TABLE x', now(), now())",
            errors.InvalidParameterValue,
        ),
        (
            "SELECT delaywheel.ensure_partition('wheel', '2030-01-01 00:30+00', '2030-01-01 01:30+00')",
            errors.InvalidParameterValue,
        ),
        (
            "SELECT delaywheel.ensure_partition('wheel', '2030-01-01 00:00+00', '2030-01-09 00:00+00')",
            errors.InvalidParameterValue,
        ),
        (  # the near wheel's partitions are 4 hours wide (sql/partitions.sql): an hour, as code before it asked, or 4 hours
            # not aligned to the epoch, are refused
            "SELECT delaywheel.ensure_partition('wheel', '2030-01-01 00:00+00', '2030-01-01 01:00+00')",
            errors.InvalidParameterValue,
        ),
        (
            "SELECT delaywheel.ensure_partition('wheel', '2030-01-01 02:00+00', '2030-01-01 06:00+00')",
            errors.InvalidParameterValue,
        ),
        ("SELECT delaywheel.summarize_brin('delaywheel.topic_messages_message')", errors.InvalidParameterValue),
    ],
)
def test_the_runtime_may_not(role_db: tuple[str, str], statement: str, error: type[Exception]) -> None:
    _, runtime = role_db
    with psycopg.connect(runtime) as conn, pytest.raises(error):
        conn.execute(statement)  # type: ignore[arg-type]


def test_the_runtime_drops_only_partitions(role_db: tuple[str, str]) -> None:
    """drop_partition takes a parent and a bound: it drops that partition and nothing else (no such one: false)."""
    _, runtime = role_db
    with psycopg.connect(runtime, autocommit=True) as conn:
        conn.execute("SELECT delaywheel.ensure_partition('topic_messages', %s, %s)", (T0, T0 + timedelta(days=1)))
        assert conn.execute(
            "SELECT delaywheel.drop_partition('topic_messages', %s)", (T0 - timedelta(days=1),)
        ).fetchone() == (False,)
        assert conn.execute("SELECT delaywheel.drop_partition('topic_messages', %s)", (T0,)).fetchone() == (True,)
        assert conn.execute("SELECT to_regclass('delaywheel.topic_messages_p20300101t0000')").fetchone() == (None,)
        assert conn.execute("SELECT to_regclass('delaywheel.topic_messages')").fetchone() != (None,)


def _deliver_one_per_lane(store: Store) -> None:
    """A level message and a wheel timer, each delivered by its lane's next pass: nothing held the horizon back."""
    store.send("orders", b"x", delay_level=1, now=T0)
    assert store.deliver_level(1, now=T0 + timedelta(seconds=1)).delivered == 1
    assert store.send("orders", b"y", delay=timedelta(seconds=3), now=T0)
    assert store.advance_wheel(now=T0 + timedelta(seconds=3)).delivered == 1


def test_other_databases_transactions_do_not_hold_the_runtime_back(role_db: tuple[str, str], server_url: str) -> None:
    """The commit horizon (db.COMMIT_HORIZON) leaves out transactions of other databases (Airflow's metadata) by their
    backend_xid in pg_stat_activity. PostgreSQL shows every role a session's database and backend_xid (query text
    and the like need pg_read_all_stats, which the runtime does not hold and does not need): a transaction of another
    role, open with an xid in another database, does not hold the runtime's deliveries back."""
    _, runtime = role_db
    with psycopg.connect(server_url) as other, Store(runtime, Settings()) as store:
        xid = other.execute("SELECT pg_current_xact_id()::text").fetchone()[0]  # type: ignore[index]
        seen = store.conn.execute(
            "SELECT backend_xid::text, query, pg_has_role('pg_read_all_stats', 'MEMBER')"
            " FROM pg_stat_activity WHERE pid = %s",
            (other.info.backend_pid,),
        ).fetchone()
        assert seen == (xid, "<insufficient privilege>", False)
        store.conn.commit()
        _deliver_one_per_lane(store)
        other.rollback()


def test_an_autovacuum_workers_transaction_does_not_hold_the_runtime_back(
    role_db: tuple[str, str], server_url: str
) -> None:
    """The commit horizon also leaves out transactions of processes that run as no role (usesysid NULL in
    pg_stat_activity, visible to every role): an autovacuum worker's ANALYZE holds an xid while it writes
    pg_statistic, and never writes a topic row. To hold one open for seconds, a table's extended statistics
    evaluate a slow expression after the ANALYZE has written its columns' statistics; autovacuum is made to visit
    every second. The runtime sees that worker's xid in its own database, and delivers past it."""
    _, runtime = role_db
    admin = make_conninfo(server_url, dbname=conninfo_to_dict(runtime)["dbname"])
    with psycopg.connect(admin, autocommit=True) as conn, psycopg.connect(server_url, autocommit=True) as cluster:
        conn.execute(
            "CREATE FUNCTION public.slowly(i int) RETURNS int LANGUAGE plpgsql IMMUTABLE"
            " AS $$ BEGIN PERFORM pg_sleep(0.002); RETURN i; END $$"
        )
        conn.execute(
            "CREATE TABLE public.analyzed_slowly (i int) WITH (autovacuum_analyze_threshold = 1,"
            " autovacuum_analyze_scale_factor = 0, autovacuum_vacuum_insert_threshold = 2000000000)"
        )
        conn.execute(
            "CREATE STATISTICS public.analyzed_slowly_stats ON (public.slowly(i)), (i + 1) FROM public.analyzed_slowly"
        )
        conn.execute("INSERT INTO public.analyzed_slowly SELECT g FROM generate_series(1, 10000) g")
        cluster.execute("ALTER SYSTEM SET autovacuum_naptime = 1")
        cluster.execute("SELECT pg_reload_conf()")
        try:
            worker = None
            deadline = time.monotonic() + 60
            while worker is None and time.monotonic() < deadline:
                worker = conn.execute(
                    "SELECT pid, backend_xid::text FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
                    " AND datname = current_database() AND backend_xid IS NOT NULL"
                    " AND query LIKE '%%analyzed_slowly%%'"
                ).fetchone()
                time.sleep(0.1)
            assert worker is not None, "no autovacuum worker analysed the table within 60 s"
            with Store(runtime, Settings()) as store:
                seen = store.conn.execute(
                    "SELECT usesysid, backend_type, backend_xid::text FROM pg_stat_activity WHERE pid = %s",
                    (worker[0],),
                ).fetchone()
                assert seen == (None, None, worker[1])
                store.conn.commit()
                _deliver_one_per_lane(store)
            still = conn.execute("SELECT backend_xid::text FROM pg_stat_activity WHERE pid = %s", (worker[0],))
            assert still.fetchone() == (worker[1],), "the worker's transaction ended before the deliveries"
        finally:
            cluster.execute("ALTER SYSTEM RESET autovacuum_naptime")
            cluster.execute("SELECT pg_reload_conf()")
            conn.execute(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
                " AND datname = current_database()"
            )


def test_migrate_connects_as_the_configured_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the store's runtime URL, `migrate` uses the owner's: DELAYWHEEL_OWNER_URL, or the embedded cluster's
    owner login. One URL configured: that one, as before."""
    for name in (
        "DELAYWHEEL_DATABASE_URL",
        "DELAYWHEEL_OWNER_URL",
        "AIRFLOW__DELAYWHEEL__DATABASE_URL",
        "AIRFLOW__DELAYWHEEL__OWNER_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONFIG", "/nonexistent/airflow.cfg")
    cluster = embedded.default_cluster()
    assert conninfo_to_dict(cluster.url())["user"] == embedded.RUNTIME_LOGIN
    assert conninfo_to_dict(owner_url(cluster.url("delaywheel"))) == conninfo_to_dict(cluster.owner_url("delaywheel"))
    assert conninfo_to_dict(cluster.owner_url())["user"] == embedded.OWNER_LOGIN
    assert owner_url("postgresql://someone@elsewhere/db") == "postgresql://someone@elsewhere/db"
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", "postgresql://app@db/store")
    assert owner_url("postgresql://app@db/store") == "postgresql://app@db/store"
    monkeypatch.setenv("DELAYWHEEL_OWNER_URL", "postgresql://migrator@db/store")
    assert owner_url("postgresql://app@db/store") == "postgresql://migrator@db/store"
    assert owner_url("postgresql://app@db/other") == "postgresql://app@db/other"


def test_migrate_as_the_runtime_role_changes_nothing(
    role_db: tuple[str, str], server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only the runtime's URL (an external server, DELAYWHEEL_OWNER_URL unset): an up-to-date store is up to date;
    a schema change is refused with a MigrationError naming the owner role and DELAYWHEEL_OWNER_URL."""
    _, runtime = role_db
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", runtime)
    monkeypatch.delenv("DELAYWHEEL_OWNER_URL", raising=False)
    assert owner_url(runtime) == runtime
    assert migrate(runtime) == []
    name = f"dwroles_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        with pytest.raises(MigrationError, match=r"migrations run as delaywheel_owner.*DELAYWHEEL_OWNER_URL"):
            migrate(make_conninfo(runtime, dbname=name))
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_what_later_migrations_create_is_granted_to_the_runtime(role_db: tuple[str, str], tmp_path: Path) -> None:
    """Default privileges (set by the baseline): a table and a function a later migration adds are the runtime's to
    use as the others (rows in, out and updated; no DELETE), with no GRANT in the migration."""
    owner, runtime = role_db
    sql_copy = tmp_path / "sql"
    shutil.copytree(SQL_DIR, sql_copy)
    newest = available(sql_copy / "migrations")[-1].version
    (sql_copy / "migrations" / f"{newest + 1:03d}_later.sql").write_text(
        "CREATE TABLE delaywheel.later (id bigint GENERATED ALWAYS AS IDENTITY, note text);\n"
        "CREATE FUNCTION delaywheel.later_count() RETURNS bigint LANGUAGE sql AS 'SELECT count(*) FROM delaywheel.later';\n"
    )
    later = f"{newest + 1:03d}_later.sql"
    assert migrate(owner, sql_copy) == [later, *(p.name for p in definitions(sql_copy))]  # all installed after a change
    with psycopg.connect(runtime, autocommit=True) as conn:
        conn.execute("INSERT INTO delaywheel.later (note) VALUES ('a')")
        conn.execute("UPDATE delaywheel.later SET note = 'b'")
        assert conn.execute("SELECT delaywheel.later_count()").fetchone() == (1,)
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("DELETE FROM delaywheel.later")
        owners = conn.execute("SELECT relowner::regrole::text FROM pg_class WHERE relname = 'later'").fetchone()
    assert owners == (OWNER_ROLE,)


def test_airflow_metadata_keeps_its_own_role() -> None:
    """The embedded runtime login may create nothing, so Airflow's metadata (the demo, `configure`) goes to the
    cluster's superuser there; with any other store URL, to that URL's role, as before."""
    from delaywheel.dev.local_airflow import metadata_server

    cluster = embedded.default_cluster()
    assert conninfo_to_dict(metadata_server(cluster.url()))["user"] == "postgres"
    assert conninfo_to_dict(metadata_server(cluster.url()))["dbname"] == "postgres"
    external = conninfo_to_dict(metadata_server("postgresql://app:pw@db.example:5432/store"))
    assert (external["user"], external["password"], external["dbname"]) == ("app", "pw", "postgres")


@pytest.fixture
def closed_db(server_url: str, roles: None) -> Iterator[tuple[str, str]]:
    """A store database whose CONNECT `db start` gave to the store's roles alone; yields (admin URL, runtime URL)."""
    name = f"dwclosed_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
        embedded.create_roles(conn, databases=(name,))
    migrate(make_conninfo(server_url, dbname=name, user=embedded.OWNER_LOGIN))
    yield make_conninfo(server_url, dbname=name), make_conninfo(server_url, dbname=name, user=embedded.RUNTIME_LOGIN)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_only_the_stores_roles_may_connect(closed_db: tuple[str, str], server_url: str) -> None:
    """A login with no grants that could connect took the lanes' advisory-lock ids or held the commit horizon back
    with an idle transaction, stopping every lane and consumer: `db start` revokes CONNECT from PUBLIC."""
    admin, runtime = closed_db
    stranger = f"stranger_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {stranger} LOGIN")
    try:
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            psycopg.connect(make_conninfo(admin, user=stranger)).close()
        with Store(runtime, Settings()) as store:
            assert store.stats()["public_connect"] is False
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {stranger}")


def test_stats_warn_while_public_may_connect(role_db: tuple[str, str]) -> None:
    with Store(role_db[1], Settings()) as store:
        assert store.stats()["public_connect"] is True


def test_stats_name_the_sessions_that_hold_the_commit_horizon_back(closed_db: tuple[str, str]) -> None:
    """An idle transaction with an xid holds every lane and consumer back: stats name it, with its age where the
    reader may see it (its own role's sessions; a superuser's shows who, not since when)."""
    admin, runtime = closed_db
    with (
        psycopg.connect(make_conninfo(runtime, application_name="order-service")) as mine,
        psycopg.connect(admin) as theirs,
        Store(runtime, Settings()) as store,
    ):
        mine.execute("SELECT pg_current_xact_id()")
        theirs.execute("SELECT pg_current_xact_id()")
        time.sleep(1.2)
        holders = {h["pid"]: h for h in store.stats()["horizon_holders"]}
        mine_seen, theirs_seen = holders[mine.info.backend_pid], holders[theirs.info.backend_pid]
        assert mine_seen["application_name"] == "order-service" and mine_seen["age_s"] >= 1.0
        assert mine_seen["state"] == "idle in transaction" and mine_seen["role"] == embedded.RUNTIME_LOGIN
        assert theirs_seen["age_s"] is None and theirs_seen["role"] == "postgres"
        mine.rollback()
        theirs.rollback()
        time.sleep(0.1)
        assert not store.stats()["horizon_holders"]
