"""Behind a connection pooler (issue 21, item 5; docs/poolers.md): PgBouncer in transaction-pooling mode in front of
the store's cluster, the store's runtime login authenticated by PgBouncer's own user list.

What a producer needs works through it: a send and a cancel, once the pooler ignores the `options` startup parameter
(the store's `-c jit=off`, set instead on the role in the database). What needs a session does not, and these tests
show it: psycopg's prepared statements collide between two clients, a session advisory lock (the consumer group's)
no longer keeps a second consumer of the group out, and a LISTEN hears nothing.

The pool has one server connection, so two clients' transactions always share it: with more, the same happens
whenever they land on the same one, which is what a pool is for, so a test of it would only be flaky.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel import Settings, Store
from delaywheel.channels import lane_channel
from delaywheel.dev import embedded
from delaywheel.migrate import OWNER_ROLE, migrate
from tests.helpers import free_ports

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).exists()), None
)
pytestmark = pytest.mark.skipif(
    PGBOUNCER is None, reason="pgbouncer is not installed: `apt-get install -y pgbouncer` (scripts/setup.sh --test)"
)

PASSWORD = "pooled-" + uuid.uuid4().hex[:8]  # PgBouncer's user list; the cluster itself trusts loopback
TOPIC = "pool.orders"


@pytest.fixture(scope="module")
def pool_db(server_url: str) -> Iterator[str]:
    """A fresh database migrated by the owner's login, the runtime's `jit = off` set on its role in that database
    (what replaces the `options` startup parameter a pooler drops); yields its name."""
    name = f"dwpool_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        embedded.create_roles(conn)
        conn.execute(f"CREATE DATABASE {name}")
        conn.execute(f"GRANT CREATE ON DATABASE {name} TO {OWNER_ROLE}")
        conn.execute(f"ALTER ROLE {embedded.RUNTIME_LOGIN} IN DATABASE {name} SET jit = off")
    migrate(make_conninfo(server_url, dbname=name, user=embedded.OWNER_LOGIN))
    yield name
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def pgbouncer(server_url: str, pool_db: str) -> Iterator[Callable[..., str]]:
    """Starts PgBouncer (transaction pooling, one server connection) on a free loopback port in front of `pool_db`;
    returns the runtime login's URL through it. Stopped by its pid at the end."""
    started: list[Path] = []
    server = conninfo_to_dict(server_url)

    def start(*, ignore_options: bool = True) -> str:
        folder = Path(tempfile.mkdtemp(prefix="delaywheel-pgbouncer-"))
        (port,) = free_ports(1)
        (folder / "userlist.txt").write_text(f'"{embedded.RUNTIME_LOGIN}" "{PASSWORD}"\n')
        (folder / "pgbouncer.ini").write_text(f"""[databases]
{pool_db} = host={server.get("host", "127.0.0.1")} port={server.get("port", 5432)} dbname={pool_db}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = md5
auth_file = {folder}/userlist.txt
pool_mode = transaction
default_pool_size = 1
max_client_conn = 20
{"ignore_startup_parameters = options" if ignore_options else ""}
logfile = {folder}/pgbouncer.log
pidfile = {folder}/pgbouncer.pid
""")
        command = [str(PGBOUNCER), "-d", str(folder / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root; the cluster's own user runs it
            user = pwd.getpwnam("postgres")
            for path in (folder, *folder.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, f"pgbouncer did not start: {result.stderr} {result.stdout}"
        started.append(folder)
        deadline = time.monotonic() + 10
        while not (folder / "pgbouncer.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return make_conninfo(
            host="127.0.0.1",
            port=port,
            dbname=pool_db,
            user=embedded.RUNTIME_LOGIN,
            password=PASSWORD,
            connect_timeout=5,
        )

    yield start
    for folder in started:
        pid = int((folder / "pgbouncer.pid").read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def direct(server_url: str, pool_db: str) -> str:
    """The runtime login straight to the cluster: what deliverers and consumers use."""
    return make_conninfo(server_url, dbname=pool_db, user=embedded.RUNTIME_LOGIN)


def test_a_store_connection_is_refused_unless_the_pooler_ignores_the_options_parameter(
    pgbouncer: Callable[..., str],
) -> None:
    with (
        pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"),
        Store(pgbouncer(ignore_options=False), Settings()) as store,
    ):
        store.clock()


def test_send_and_cancel_work_through_transaction_pooling(pgbouncer: Callable[..., str], direct: str) -> None:
    with Store(pgbouncer(), Settings()) as store:
        assert store.conn.execute("SHOW jit").fetchone() == ("off",)  # the role's setting, not the startup option
        by_id = store.send(TOPIC, {"order": 1}, delay=timedelta(minutes=5), key="pool-1")
        store.send(TOPIC, {"order": 2}, delay_level=3, key="pool-2")
        many = store.send_many([])  # nothing: no transaction
        assert many == []
        assert [r.outcome for r in store.cancel(message_id=by_id)] == ["cancelled"]
        assert [r.outcome for r in store.cancel(key="pool-2")] == ["cancelled"]
        assert [r.outcome for r in store.cancel(key="pool-2")] == ["already_cancelled"]
    with psycopg.connect(direct) as conn:
        assert conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (2,)


def test_two_producers_collide_on_prepared_statements(pgbouncer: Callable[..., str]) -> None:
    """psycopg prepares a statement on the server after its fifth run (`prepare_threshold`), under a name of its
    own connection: behind transaction pooling another client's connection made the same name on the same server
    connection, or this one's is on another server connection. PgBouncer 1.21+ tracks them (`max_prepared_statements`);
    the 1.18 of Debian 12 does not."""
    url = pgbouncer()
    with (
        Store(url, Settings()) as a,
        Store(url, Settings()) as b,
        pytest.raises((errors.DuplicatePreparedStatement, errors.InvalidSqlStatementName)),
    ):
        for i in range(10):
            for store in (a, b):
                store.send(TOPIC, {"order": i}, delay_level=3, key=f"collide-{i}")


def test_a_listen_through_transaction_pooling_hears_nothing(pgbouncer: Callable[..., str], direct: str) -> None:
    """Deliverers and consumers wait on LISTEN; a producer's NOTIFY reaches a direct listener, not a pooled one:
    the server connection that ran the LISTEN went back to the pool when its transaction ended."""
    channel = lane_channel(None)  # a timer's due time is announced on the wheel's channel
    listeners = [psycopg.connect(url, autocommit=True) for url in (direct, pgbouncer())]
    try:
        for conn in listeners:
            conn.execute(f"LISTEN {channel}")
        with Store(direct, Settings()) as producer:
            producer.send(TOPIC, {"order": 1}, delay=timedelta(seconds=30), key="heard")
        heard = [[n.channel for n in conn.notifies(timeout=2.0, stop_after=1)] for conn in listeners]
    finally:
        for conn in listeners:
            conn.close()
    assert heard[0] == [channel]
    assert heard[1] == []
