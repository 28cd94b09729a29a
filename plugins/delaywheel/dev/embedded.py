"""A project-local PostgreSQL cluster for development: the `delaywheel` command's database when no database URL is
configured, and `store()`'s. Never started on the side: the library's `Store` takes a URL (`Store(url)`).

PostgreSQL refuses to run as root; CI runs as root, so as root the cluster is owned by and run as
the `postgres` system user (created by Debian's packages) through `runuser`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import psycopg
from psycopg import sql

from delaywheel.config import PROJECT_ROOT, Settings, load_settings
from delaywheel.locks import SETUP_LOCK
from delaywheel.migrate import OWNER_LOGIN, OWNER_ROLE, RUNTIME_LOGIN, RUNTIME_ROLE
from delaywheel.store import Store

DATABASES = ("delaywheel", "airflow")
# The cluster's login roles are the project's (migrate.OWNER_LOGIN, RUNTIME_LOGIN; README, "Roles"): members of the
# group roles the baseline grants to. The cluster authenticates local connections by `trust` (loopback only, a
# development cluster): the roles bound what the store's SQL may do, not who may connect.
INSTALL_HINT = (
    "no PostgreSQL server binaries found. Install them (Debian/Ubuntu: `apt-get install postgresql`; "
    "then `make setup` again), or set DELAYWHEEL_PG_BIN to the folder holding initdb and pg_ctl, "
    "or set DELAYWHEEL_DATABASE_URL to an existing PostgreSQL 14+ server."
)


# Settings the embedded cluster changes from PostgreSQL's defaults, each for a reason (and `shared_buffers`,
# sized to the machine at start: `server_options`):
SERVER_OPTIONS = {
    "listen_addresses": "127.0.0.1",  # loopback only
    "max_connections": "300",  # Airflow's services + tests + Spark executors share this cluster
    "max_wal_size": "8GB",  # bulk COPY without checkpoint storms
    "checkpoint_timeout": "15min",
}


def server_options(cluster: Cluster, bindir: Path) -> dict[str, str]:
    """SERVER_OPTIONS plus two chosen at start, not at import (DAGs import this module):
    `shared_buffers`, a quarter of the memory this machine (or its container) may use, PostgreSQL's usual
    advice, between 128 MB and 8 GB, so the indexes of millions of pending messages stay cached; and
    `wal_compression`. After each checkpoint the first change to a page logs the whole page; with millions
    pending, the near wheel's index pages are many, and compressing their images with pglz (`on`) slows enqueue
    markedly for a while after every checkpoint; lz4 does the same for a small part of that cost. A server built
    without lz4 keeps pglz."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    text = limit.read_text().strip() if limit.exists() else ""
    if text.isdigit():
        memory = min(memory, int(text))
    probe = _run_as_owner(
        [str(bindir / "postgres"), "-D", str(cluster.data_dir), "-C", "wal_compression", "-c", "wal_compression=lz4"]
    )
    return {
        **SERVER_OPTIONS,
        "shared_buffers": f"{max(128, min(8192, memory // 4 // 2**20))}MB",
        "wal_compression": "lz4" if probe.returncode == 0 else "on",
    }


class EmbeddedError(RuntimeError):
    """The embedded cluster cannot be found, created or started; the message says what to do."""


@dataclass(frozen=True)
class Cluster:
    """:param movable: the port is only remembered (the project's cluster, `default_cluster`), not chosen by the
    user (`DELAYWHEEL_PG_PORT`) or a caller: a start that finds it taken by another program moves to the next free
    port and remembers that one."""

    root: Path
    port: int
    movable: bool = False

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_file(self) -> Path:
        return self.root / "postgresql.log"

    def url(self, database: str = "delaywheel") -> str:
        """The store's runtime login (`delaywheel_app`, a member of `delaywheel_runtime`): what the store uses."""
        return self._url(RUNTIME_LOGIN, database)

    def owner_url(self, database: str = "delaywheel") -> str:
        """The owner's login (`delaywheel_migrator`, a member of `delaywheel_owner`): what `migrate` uses."""
        return self._url(OWNER_LOGIN, database)

    def admin_url(self, database: str = "postgres") -> str:
        """The cluster's superuser: creating databases and roles (the tests, the benchmarks), Airflow's metadata."""
        return self._url("postgres", database)

    def _url(self, user: str, database: str) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"


DEFAULT_PORT = 54329


def default_cluster() -> Cluster:
    """The project's cluster: in `.delaywheel/pg`, or, when running as root in a folder the `postgres`
    user cannot reach (e.g. under /root), in /var/tmp keyed by the project path. Its port is the first
    free one from 54329, remembered in the cluster folder so later runs find it again; a start that finds it taken by
    another program (another clone's cluster, started while this one was stopped) moves to the next free one."""
    if "DELAYWHEEL_PG_DIR" in os.environ:
        root = Path(os.environ["DELAYWHEEL_PG_DIR"])
    elif os.geteuid() == 0 and not _reachable_by_others(PROJECT_ROOT):
        digest = hashlib.sha256(str(PROJECT_ROOT).encode()).hexdigest()[:10]
        root = Path("/var/tmp") / f"delaywheel-pg-{digest}"
    else:
        root = PROJECT_ROOT / ".delaywheel" / "pg"
    if "DELAYWHEEL_PG_PORT" in os.environ:
        return Cluster(root=root, port=int(os.environ["DELAYWHEEL_PG_PORT"]))
    pid_file, port_file = root / "data" / "postmaster.pid", root / "port"
    if pid_file.exists():  # a running (or crashed) server: its port is line 4
        lines = pid_file.read_text().splitlines()
        if len(lines) > 3 and lines[3].strip().isdigit():
            return Cluster(root=root, port=int(lines[3]), movable=True)
    if port_file.exists():
        return Cluster(root=root, port=int(port_file.read_text()), movable=True)
    return Cluster(root=root, port=_free_port(DEFAULT_PORT), movable=True)


def _reachable_by_others(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def _port_taken(port: int) -> bool:
    """The loopback port cannot be bound the way PostgreSQL binds it: something listens there, or a socket is bound
    to it. A connect alone misses the second: a client's connection takes its local port from the same range
    (32768-60999 here), and a server's bind then fails although no connect would succeed. The probe sets
    SO_REUSEADDR as PostgreSQL does, so the closing connections a stopped server leaves on its own port (FIN-WAIT,
    TIME-WAIT, for a minute) do not count: PostgreSQL restarts over them, and a cluster must not move for them."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _free_port(start: int) -> int:
    for port in range(start, start + 100):
        if not _port_taken(port):
            return port
    raise EmbeddedError(f"no free port in {start}..{start + 99}; set DELAYWHEEL_PG_PORT")


def find_bindir() -> Path:
    """The newest PostgreSQL server binaries on this machine."""
    candidates = []
    if os.environ.get("DELAYWHEEL_PG_BIN"):
        candidates.append(Path(os.environ["DELAYWHEEL_PG_BIN"]))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major, reverse=True)]
    if pg_ctl := shutil.which("pg_ctl"):
        candidates.append(Path(pg_ctl).resolve().parent)
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists() and (candidate / "postgres").exists():
            return candidate
    raise EmbeddedError(INSTALL_HINT)


def _major(path: str) -> int:
    try:
        return int(Path(path).parent.name)
    except ValueError:
        return 0


def _run_as_owner(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise EmbeddedError(
                "running as root, and PostgreSQL refuses to run as root: create a `postgres` user "
                "(`apt-get install postgresql` does) or run as a normal user."
            ) from None
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, text=True, capture_output=True)


def _prepare_dirs(cluster: Cluster) -> None:
    cluster.socket_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for path in (cluster.root, cluster.socket_dir, *([cluster.data_dir] if cluster.data_dir.exists() else [])):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        probe = _run_as_owner(["test", "-w", str(cluster.root)])
        if probe.returncode != 0:
            raise EmbeddedError(
                f"the postgres user cannot reach {cluster.root} (a parent folder is not readable by others); "
                "set DELAYWHEEL_PG_DIR to a folder it can use, e.g. /var/tmp/delaywheel-pg"
            )


def status(cluster: Cluster | None = None) -> str:
    """'running', 'stopped' or 'absent'."""
    cluster = cluster or default_cluster()
    if not (cluster.data_dir / "PG_VERSION").exists():
        return "absent"
    result = _run_as_owner([str(find_bindir() / "pg_ctl"), "status", "-D", str(cluster.data_dir)])
    return "running" if result.returncode == 0 else "stopped"


def start(cluster: Cluster | None = None) -> Cluster:
    """Create the cluster if needed, start it if stopped, create the databases; safe to call again."""
    cluster = cluster or default_cluster()
    bindir = find_bindir()
    cluster.root.mkdir(parents=True, exist_ok=True)
    running = status(cluster) == "running"  # (one pg_ctl call: every command without a database URL comes here)
    if not running and cluster.movable and _port_taken(cluster.port):
        # another program (often another clone's cluster) took the remembered port while this one was stopped
        cluster = replace(cluster, port=_free_port(cluster.port + 1))
    (cluster.root / "port").write_text(str(cluster.port))
    _prepare_dirs(cluster)
    if not (cluster.data_dir / "PG_VERSION").exists():
        result = _run_as_owner(
            [
                str(bindir / "initdb"),
                "-D",
                str(cluster.data_dir),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-instructions",
            ]
        )
        if result.returncode != 0:
            raise EmbeddedError(f"initdb failed:\n{result.stderr.strip()}")
    if not running:
        options = " ".join(f"-c {k}={v}" for k, v in server_options(cluster, bindir).items())
        options += f" -p {cluster.port} -k {cluster.socket_dir}"
        result = _run_as_owner(
            [
                str(bindir / "pg_ctl"),
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(cluster.data_dir),
                "-l",
                str(cluster.log_file),
                "-o",
                options,
            ]
        )
        if result.returncode != 0:
            tail = cluster.log_file.read_text()[-2000:] if cluster.log_file.exists() else ""
            raise EmbeddedError(f"PostgreSQL did not start (port {cluster.port} in use?):\n{result.stderr}\n{tail}")
    _create_databases(cluster)
    return cluster


def _create_databases(cluster: Cluster) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = psycopg.connect(cluster.admin_url("postgres"), autocommit=True)
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:  # closing the connection releases the lock
        conn.execute("SELECT pg_advisory_lock(%s)", (SETUP_LOCK,))
        existing = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
        for name in DATABASES:
            if name not in existing:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        create_roles(conn, databases=("delaywheel",))


def create_roles(
    conn: psycopg.Connection,
    *,
    databases: tuple[str, ...] = (),
    owner_login: str = OWNER_LOGIN,
    runtime_login: str = RUNTIME_LOGIN,
) -> None:
    """The store's roles (README, "Roles"), idempotently, as a superuser: the group roles `delaywheel_owner` and
    `delaywheel_runtime` (NOLOGIN; what the baseline grants to), a login for each (no password: the embedded cluster
    trusts loopback), the owner's CREATE on `databases` (it creates the schemas), and nothing for the runtime beyond
    its group: no superuser, no CREATEDB or CREATEROLE, no file or
    program access (pg_read_server_files, pg_write_server_files, pg_execute_server_program). On `databases`, CONNECT
    is the two group roles' alone (revoked from PUBLIC)."""
    # one read of what is there, so a start with everything in place changes nothing and costs one query
    wanted = ((OWNER_ROLE, owner_login), (RUNTIME_ROLE, runtime_login))
    names = [name for pair in wanted for name in pair]
    powers = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")
    attributes = {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT rolname, rolsuper OR rolcreatedb OR rolcreaterole OR rolreplication OR rolbypassrls FROM pg_roles"
            " WHERE rolname = ANY(%s)",
            (names,),
        )
    }
    memberships = {
        (r[0], r[1])
        for r in conn.execute(
            "SELECT m.rolname, g.rolname FROM pg_auth_members a JOIN pg_roles m ON m.oid = a.member"
            " JOIN pg_roles g ON g.oid = a.roleid WHERE m.rolname = ANY(%s)",
            (names,),
        )
    }
    for role, login in wanted:
        for name, options in ((role, "NOLOGIN"), (login, "LOGIN INHERIT")):
            if name not in attributes:
                with contextlib.suppress(psycopg.errors.DuplicateObject):  # another process, just now
                    conn.execute(sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(name)))
            elif attributes[name]:
                conn.execute(
                    sql.SQL("ALTER ROLE {} NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS").format(
                        sql.Identifier(name)
                    )
                )
        if (login, role) not in memberships:
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role), sql.Identifier(login)))
        for power in powers:
            for name in (role, login):
                if (name, power) in memberships:
                    conn.execute(sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(power), sql.Identifier(name)))
    for database in databases:
        # Only the store's roles reach the store: a login that may connect can take the lanes' advisory locks or hold
        # the commit horizon back with an idle transaction, stopping every lane and consumer.
        db = sql.Identifier(database)
        conn.execute(sql.SQL("GRANT CREATE, CONNECT ON DATABASE {} TO {}").format(db, sql.Identifier(OWNER_ROLE)))
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(db, sql.Identifier(RUNTIME_ROLE)))
        conn.execute(sql.SQL("REVOKE CONNECT, TEMPORARY ON DATABASE {} FROM PUBLIC").format(db))


def stop(cluster: Cluster | None = None, mode: Literal["fast", "immediate"] = "fast") -> str:
    """:param mode: pg_ctl's shutdown mode: `fast` rolls back what is in flight and writes a checkpoint;
    `immediate` is a crash (tests: what was committed without waiting for its flush may be undone at the restart)."""
    cluster = cluster or default_cluster()
    if status(cluster) != "running":
        return "already stopped"
    result = _run_as_owner([str(find_bindir() / "pg_ctl"), "stop", "-w", "-m", mode, "-D", str(cluster.data_dir)])
    if result.returncode != 0:
        raise EmbeddedError(f"pg_ctl stop failed: {result.stderr.strip()}")
    return "stopped"


def database_url(settings: Settings | None = None) -> str:
    """The `delaywheel` command's database: the configured URL; with none configured, the embedded cluster's store
    database, started first if it is not running (idempotent)."""
    settings = settings or load_settings()
    if settings.database_url:
        return settings.database_url
    return start().url("delaywheel")


def store(settings: Settings | None = None) -> Store:
    """A Store on the embedded cluster's store database (started first if need be), whatever URL is configured: the
    explicit choice of the development cluster, in place of a URL. Migrate it first (`delaywheel migrate`)."""
    return Store(start().url("delaywheel"), settings)
