"""Applies the store's SQL: numbered schema changes, each once, then the functions, procedures and views whenever
their text changed.

The SQL lives in the repository's top-level `sql/`, shipped in the wheel as `delaywheel/sql` (read through
`importlib.resources`, so an installed wheel migrates as a checkout does). `sql/migrations/NNN_snake_case.sql` are the
schema changes (a baseline, then one file per change), each applied once in its own transaction, in order, recorded
in `delaywheel.schema_migrations` under its line's name. Every other `sql/*.sql` file holds current definitions
(`CREATE OR REPLACE`), installed after the changes when its checksum differs from the one recorded in
`delaywheel.schema_definitions`, or whenever a change was applied in the same run (a change may drop what a definition
made). Beside the store's line `delaywheel`, an application may keep its own line of changes (the shop example's,
line `shop`), applied by that application.

Migrations run as the store's owner role, `delaywheel_owner` (DESIGN.md "Roles"): the connecting role sets it
(`SET ROLE`) when it may, so the schemas and everything in them belong to the owner whichever login ran them. Given
the store's runtime URL, `migrate` connects with the owner's URL instead: `DELAYWHEEL_OWNER_URL`, or, with no database
URL configured, the owner's login in place of the runtime's on a local server (the embedded cluster's logins).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib import resources
from importlib.resources.abc import Traversable

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel.config import load_settings
from delaywheel.locks import MIGRATE_LOCK

SQL_DIR: Traversable = resources.files("delaywheel") / "sql"  # the checkout's sql/, linked into the package
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
# Installed last: views use the functions (level_queue and wheel_far unpack segments with spread).
_VIEWS = "views.sql"
# The line before the baseline: a store it built records _OLD_FIRST … _OLD_LAST's name. At that line's last
# version a store is at the baseline, whose record replaces that line's; at an earlier one it is refused.
_OLD_FIRST = "001_store.sql"
_OLD_LAST = (35, "035_repeated_cancel.sql")
OWNER_ROLE = "delaywheel_owner"  # owns the schemas, runs the migrations
RUNTIME_ROLE = "delaywheel_runtime"  # sends, delivers, consumes, cancels; no DDL but through sql/partitions.sql
GROUP_ROLES = (OWNER_ROLE, RUNTIME_ROLE)
# The login roles the embedded cluster (delaywheel.dev.embedded) and docker-compose make members of the group roles.
OWNER_LOGIN = "delaywheel_migrator"
RUNTIME_LOGIN = "delaywheel_app"


class MigrationError(RuntimeError):
    """The database and the code disagree about the schema; the message says how."""


@dataclass(frozen=True)
class Line:
    """A line of schema changes: `folder` holds its numbered files; `schemas`, the schemas they create;
    `definitions`, a folder of files of current definitions installed after the changes (the store's `sql/`)."""

    name: str
    folder: Traversable
    schemas: tuple[str, ...]
    definitions: Traversable | None = None


# The store's own line: the changes in sql/migrations/, the definitions in sql/.
STORE = Line("delaywheel", SQL_DIR / "migrations", schemas=("delaywheel",), definitions=SQL_DIR)


@dataclass(frozen=True)
class Migration:
    version: int
    path: Traversable

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def definitions(folder: Traversable = SQL_DIR) -> list[Traversable]:
    """The definition files in `folder`, in the order they are installed: by name, the views last."""
    found = [p for p in folder.iterdir() if p.name.endswith(".sql")]
    return sorted(found, key=lambda p: (p.name == _VIEWS, p.name))


def available(folder: Traversable = STORE.folder) -> list[Migration]:
    """The line's files in `folder`, in version order."""
    found = []
    for path in sorted((p for p in folder.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name):
        match = _NAME.match(path.name)
        if not match:
            raise MigrationError(f"{path.name}: migration files are named NNN_snake_case.sql")
        found.append(Migration(int(match.group(1)), path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version number in {folder}")
    return found


def ensure_roles(conn: psycopg.Connection) -> None:
    """Create the group roles if they are missing and this session may (a superuser, or CREATEROLE); as a superuser
    also give the owner CREATE on this database (it creates the schemas). Idempotent; without the right to, it
    leaves all as it is, and the baseline (sql/migrations/001_baseline.sql) says what a superuser must do."""
    row = conn.execute("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user").fetchone()
    superuser, createrole = row if row else (False, False)
    existing = {
        r[0] for r in conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (list(GROUP_ROLES),))
    }
    if superuser or createrole:
        for role in GROUP_ROLES:
            if role not in existing:
                with contextlib.suppress(psycopg.errors.DuplicateObject):  # another migrator, just now
                    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
    if superuser:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        database = row[0]
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(database), sql.Identifier(OWNER_ROLE))
        )


def act_as_owner(conn: psycopg.Connection) -> bool:
    """`SET ROLE delaywheel_owner` if it exists and this session may. False: the changes run as the session's role
    (the baseline then says what a superuser must do)."""
    row = conn.execute(
        "SELECT to_regrole(%(owner)s) IS NOT NULL AND pg_has_role(current_user, %(owner)s, 'MEMBER'),"
        " current_user = %(owner)s",
        {"owner": OWNER_ROLE},
    ).fetchone()
    may, already = row if row else (False, False)
    if not may or already:
        return bool(already)
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(OWNER_ROLE)))
    return True


@contextlib.contextmanager
def _as_the_owner_only() -> Iterator[None]:
    """A schema change this role may not make: say which role may."""
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f'{exc}: migrations run as {OWNER_ROLE} (README, "Roles"); give `migrate` the owner\'s URL'
            " (DELAYWHEEL_OWNER_URL), or run it as a member of that role or a superuser"
        ) from exc


def owner_url(url: str) -> str:
    """The URL migrations connect with for `url`: the configured owner's when `url` is the store's configured
    runtime URL (`DELAYWHEEL_DATABASE_URL` with `DELAYWHEEL_OWNER_URL` set); with no database URL configured, the
    owner's login when `url` is the runtime's login on this machine (an embedded cluster's); otherwise `url` itself
    (one URL configured: that one, which sets the owner role when it may)."""
    settings = load_settings()
    if settings.database_url and settings.owner_url and url == settings.database_url:
        return settings.owner_url
    if not settings.database_url:
        params = conninfo_to_dict(url)
        if params.get("user") == RUNTIME_LOGIN and params.get("host") in ("127.0.0.1", "localhost"):
            return make_conninfo(url, user=OWNER_LOGIN)
    return url


# The record of every line's versions. Made here, not by a migration: it must exist before the first one runs.
_TRACKING = """
CREATE TABLE IF NOT EXISTS delaywheel.schema_migrations (
    version int NOT NULL, name text NOT NULL, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),
    line text NOT NULL DEFAULT 'delaywheel', PRIMARY KEY (line, version))
"""
# A record from before lines: keyed by the version alone, every row the store's line's.
_ADD_LINES = """
ALTER TABLE delaywheel.schema_migrations ADD COLUMN line text NOT NULL DEFAULT 'delaywheel',
    DROP CONSTRAINT schema_migrations_pkey, ADD PRIMARY KEY (line, version)
"""
# The checksums of the definitions installed (sql/*.sql), by file name; the runtime reads it (an up-to-date store).
_DEFINITIONS = """
CREATE TABLE IF NOT EXISTS delaywheel.schema_definitions (
    name text PRIMARY KEY, checksum text NOT NULL, installed_at timestamptz NOT NULL DEFAULT now())
"""
_DEFINITIONS_READ = (
    f"REVOKE ALL ON delaywheel.schema_definitions FROM {RUNTIME_ROLE};"
    f" GRANT SELECT ON delaywheel.schema_definitions TO {RUNTIME_ROLE}"
)
_TRACKING_STATE = """
SELECT to_regclass('delaywheel.schema_migrations') IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('delaywheel.schema_migrations')
               AND attname = 'line' AND NOT attisdropped),
       to_regclass('delaywheel.schema_definitions') IS NOT NULL
"""
_INSTALLED = """
INSERT INTO delaywheel.schema_definitions (name, checksum) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, installed_at = excluded.installed_at
"""


def migrate(url: str, line: Line | Traversable = STORE) -> list[str]:
    """Apply `line`'s pending changes as the owner role, then install its definitions whose text changed (all of them
    when a change was applied); returns the file names applied and installed (empty when up to date). `line` may be a
    folder: the store's SQL read from there (a test's private copy of sql/)."""
    line = line if isinstance(line, Line) else replace(STORE, folder=line / "migrations", definitions=line)
    migrations = available(line.folder)
    applied_now: list[str] = []
    with psycopg.connect(owner_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
        try:
            ensure_roles(conn)
            as_owner = act_as_owner(conn)
            # DDL only when needed: IF NOT EXISTS still needs CREATE, and the runtime role finds an up-to-date store
            exists, has_lines, has_definitions = conn.execute(_TRACKING_STATE).fetchone() or (False, False, False)
            if not exists or not has_lines or (line.definitions is not None and not has_definitions):
                with _as_the_owner_only():
                    conn.execute("CREATE SCHEMA IF NOT EXISTS delaywheel")
                    if not exists or not has_lines:
                        conn.execute(_TRACKING if not exists else _ADD_LINES)
                    if line.definitions is not None and not has_definitions:
                        conn.execute(_DEFINITIONS)
                        if conn.execute("SELECT to_regrole(%s)", (RUNTIME_ROLE,)).fetchone() != (None,):
                            conn.execute(_DEFINITIONS_READ)
            done = {
                r[0]: (r[1], r[2])
                for r in conn.execute(
                    "SELECT version, name, checksum FROM delaywheel.schema_migrations WHERE line = %s", (line.name,)
                )
            }
            if line.name == STORE.name and done.get(1, ("",))[0] == _OLD_FIRST:
                done = _at_the_baseline(conn, done, migrations[0])
            newest_known = max((m.version for m in migrations), default=0)
            if done and max(done) > newest_known:
                raise MigrationError(
                    f"the database schema is at version {max(done)} ({done[max(done)][0]}) of line {line.name},"
                    f" newer than this code knows ({newest_known}); upgrade before running it against this database"
                )
            for migration in migrations:
                if migration.version in done:
                    if done[migration.version][1] != migration.checksum:
                        raise MigrationError(
                            f"{migration.path.name} changed after it was applied; add a new migration instead"
                        )
                    continue
                if not as_owner:  # the roles may have come with the last file (they are cluster-wide)
                    as_owner = act_as_owner(conn)
                with _as_the_owner_only(), conn.transaction():
                    conn.execute(migration.path.read_text())
                    conn.execute(
                        "INSERT INTO delaywheel.schema_migrations (line, version, name, checksum)"
                        " VALUES (%s, %s, %s, %s)",
                        (line.name, migration.version, migration.path.name, migration.checksum),
                    )
                applied_now.append(migration.path.name)
            if line.definitions is not None:
                applied_now += _install(conn, definitions(line.definitions), everything=bool(applied_now))
        finally:
            conn.execute("RESET ROLE")
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))
    return applied_now


def _at_the_baseline(
    conn: psycopg.Connection, done: dict[int, tuple[str, str]], baseline: Migration
) -> dict[int, tuple[str, str]]:
    """A store recorded by the line before the baseline: at its last version, the baseline's record replaces its
    records (the schema is the baseline's; the definitions are installed after, as on any upgrade)."""
    if done.get(_OLD_LAST[0], ("",))[0] != _OLD_LAST[1]:
        newest = max(done)
        raise MigrationError(
            f"the database schema is at version {newest} ({done[newest][0]}) of the line before the baseline, which"
            f" this code upgrades from its last version ({_OLD_LAST[1]}) only"
        )
    with _as_the_owner_only(), conn.transaction():
        conn.execute("DELETE FROM delaywheel.schema_migrations WHERE line = %s", (STORE.name,))
        conn.execute(
            "INSERT INTO delaywheel.schema_migrations (line, version, name, checksum) VALUES (%s, %s, %s, %s)",
            (STORE.name, baseline.version, baseline.path.name, baseline.checksum),
        )
    return {baseline.version: (baseline.path.name, baseline.checksum)}


def _install(conn: psycopg.Connection, files: list[Traversable], everything: bool) -> list[str]:
    """Install the definition `files` whose checksum differs from the one recorded (`everything`: all of them), in one
    transaction, recording their checksums. Bodies are not checked at creation (the files refer to each other)."""
    recorded: dict[str, str] = {
        name: checksum for name, checksum in conn.execute("SELECT name, checksum FROM delaywheel.schema_definitions")
    }
    checksums = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in files}
    changed = [path for path in files if everything or recorded.get(path.name) != checksums[path.name]]
    if not changed:
        return []
    with _as_the_owner_only(), conn.transaction():
        conn.execute("SET LOCAL check_function_bodies = off")
        for path in changed:
            conn.execute(path.read_text())
            conn.execute(_INSTALLED, (path.name, checksums[path.name]))
    return [path.name for path in changed]


def current_version(url: str, line: str = STORE.name) -> int:
    """The newest version of `line` recorded in the database (0: none)."""
    with psycopg.connect(url, autocommit=True) as conn:
        exists, has_lines, _ = conn.execute(_TRACKING_STATE).fetchone() or (False, False, False)
        if not exists or (not has_lines and line != STORE.name):  # (a record from before lines: the store's only)
            return 0
        row = conn.execute(
            "SELECT coalesce(max(version), 0) FROM delaywheel.schema_migrations"
            + (" WHERE line = %s" if has_lines else ""),
            (line,) if has_lines else None,
        ).fetchone()
        return int(row[0]) if row else 0
