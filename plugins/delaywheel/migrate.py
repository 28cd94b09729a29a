"""Applies migrations: numbered SQL files, each once, each in its own transaction, in order, one line at a time.

A line is a folder of `NNN_snake_case.sql` files shipped with the code as package data (read through
`importlib.resources`, so an installed wheel migrates as a checkout does), numbered on its own and recorded under its
name in `delaywheel.schema_migrations`: the store's line `delaywheel` (this package's `migrations/`), and beside it
any application's own (the shop example's `delaywheel_shop/migrations/`, line `shop`), applied by that application.

Migrations run as the store's owner role, `delaywheel_owner` (DESIGN.md "Roles"): the connecting role sets it
(`SET ROLE`) when it may, so the schemas and everything in them belong to the owner whichever login ran them. Given
the store's runtime URL, `migrate` connects with the owner's URL instead: `DELAYWHEEL_OWNER_URL`, or, with no database
URL configured, the owner's login in place of the runtime's on a local server (the embedded cluster's logins).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.resources.abc import Traversable

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel.config import load_settings
from delaywheel.locks import MIGRATE_LOCK

SQL_DIR: Traversable = resources.files("delaywheel") / "migrations"
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
OWNER_ROLE = "delaywheel_owner"  # owns the schemas, runs the migrations
RUNTIME_ROLE = "delaywheel_runtime"  # sends, delivers, consumes, cancels; no DDL but through migrations/017's functions
GROUP_ROLES = (OWNER_ROLE, RUNTIME_ROLE)
# The login roles the embedded cluster (delaywheel.dev.embedded) and docker-compose make members of the group roles.
OWNER_LOGIN = "delaywheel_migrator"
RUNTIME_LOGIN = "delaywheel_app"


class MigrationError(RuntimeError):
    """The database and the code disagree about the schema; the message says how."""


@dataclass(frozen=True)
class Line:
    """A line of migrations. `schemas`: the schemas its files create, which `migrate` hands to the owner role when
    another role owns them (a store migrated before the roles existed). `moved`: versions of this line that another
    line applied before they moved here, {version here: (line, version there)}; where the old record is found, the
    version here counts as applied (recorded, not run), so a database migrated before the move stays valid."""

    name: str
    folder: Traversable
    schemas: tuple[str, ...]
    moved: Mapping[int, tuple[str, int]] = field(default_factory=dict)


# The store's own line. Its version 6 (`006_shop.sql`, the shop example's schema) moved to the shop's line: stores
# migrated before still record it here, with no file of that number now; a recorded version without a file is
# passed over, so they stay valid. No new file may take the number 6.
STORE = Line("delaywheel", SQL_DIR, schemas=("delaywheel",))


@dataclass(frozen=True)
class Migration:
    version: int
    path: Traversable

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def available(folder: Traversable = SQL_DIR) -> list[Migration]:
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
    leaves all as it is, and migrations/017 says what a superuser must do."""
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


# What of `schemas` is not yet the owner's (a database migrated before migrations/017, by a single role), as the
# statements that give it to the owner: schemas, then relations (a sequence owned by a column follows its table), then
# functions.
_NOT_ADOPTED = """
SELECT 1 AS step, format('ALTER SCHEMA %%I OWNER TO %%I', nspname, %(owner)s::text) AS ddl
FROM pg_namespace WHERE nspname = ANY(%(schemas)s) AND nspowner <> %(owner)s::regrole
UNION ALL
SELECT 2, format('ALTER %%s %%I.%%I OWNER TO %%I', CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                 WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END, n.nspname, c.relname, %(owner)s::text)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
  AND c.relowner <> %(owner)s::regrole
  AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
           AND d.objid = c.oid AND d.deptype IN ('a', 'i')))
UNION ALL
SELECT 3, format('ALTER ROUTINE %%s OWNER TO %%I', p.oid::regprocedure, %(owner)s::text)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = ANY(%(schemas)s) AND p.proowner <> %(owner)s::regrole
ORDER BY step
"""


def act_as_owner(conn: psycopg.Connection, schemas: tuple[str, ...] = STORE.schemas) -> bool:
    """`SET ROLE delaywheel_owner` if it exists and this session may; first hand it whatever of `schemas` another
    role owns (a store migrated before the roles existed). False: the migrations run as the session's role, as they
    did before the roles existed."""
    row = conn.execute(
        "SELECT to_regrole(%(owner)s) IS NOT NULL AND pg_has_role(current_user, %(owner)s, 'MEMBER'),"
        " current_user = %(owner)s",
        {"owner": OWNER_ROLE},
    ).fetchone()
    may, already = row if row else (False, False)
    if not may or already:
        return bool(already)
    adopt(conn, schemas)
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(OWNER_ROLE)))
    return True


def adopt(conn: psycopg.Connection, schemas: tuple[str, ...] = STORE.schemas) -> None:
    """Give `delaywheel_owner` whatever of `schemas` another role owns (a store migrated before the roles existed,
    by a single role), in one transaction; needs a superuser or the objects' owner."""
    statements = [r[1] for r in conn.execute(_NOT_ADOPTED, {"owner": OWNER_ROLE, "schemas": list(schemas)})]
    if not statements:
        return
    try:
        with conn.transaction():
            for statement in statements:
                conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f"objects of the store's schemas belong to another role, and this one may not give them to {OWNER_ROLE}"
            f' ({exc}); run `delaywheel migrate` once as a superuser or as their owner (README, "Roles")'
        ) from exc


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
    (one URL configured: as before)."""
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
_TRACKING_STATE = """
SELECT to_regclass('delaywheel.schema_migrations') IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('delaywheel.schema_migrations')
               AND attname = 'line' AND NOT attisdropped)
"""


def migrate(url: str, line: Line | Traversable = STORE) -> list[str]:
    """Apply `line`'s pending migrations as the owner role; returns the names applied (empty when up to date). A
    version moved from another line and applied there is recorded, not run, and named with where it came from.
    `line` may be a folder: the store's line read from there (a test's private copy)."""
    line = line if isinstance(line, Line) else replace(STORE, folder=line)
    migrations = available(line.folder)
    applied_now: list[str] = []
    with psycopg.connect(owner_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
        try:
            ensure_roles(conn)
            as_owner = act_as_owner(conn, line.schemas)
            # DDL only when needed: IF NOT EXISTS still needs CREATE, and the runtime role finds an up-to-date store
            exists, has_lines = conn.execute(_TRACKING_STATE).fetchone() or (False, False)
            if not exists or not has_lines:
                with _as_the_owner_only():
                    conn.execute("CREATE SCHEMA IF NOT EXISTS delaywheel")
                    conn.execute(_TRACKING if not exists else _ADD_LINES)
            recorded = {
                (r[0], r[1]): (r[2], r[3])
                for r in conn.execute("SELECT line, version, name, checksum FROM delaywheel.schema_migrations")
            }
            done = {version: entry for (of_line, version), entry in recorded.items() if of_line == line.name}
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
                    as_owner = act_as_owner(conn, line.schemas)
                before = line.moved.get(migration.version)
                was = (
                    f"{recorded[before][0]} of line {before[0]}"  # applied there: record it here, not run it
                    if before is not None and before in recorded
                    else None
                )
                with _as_the_owner_only(), conn.transaction():
                    if was is None:
                        conn.execute(migration.path.read_text())
                    conn.execute(
                        "INSERT INTO delaywheel.schema_migrations (line, version, name, checksum)"
                        " VALUES (%s, %s, %s, %s)",
                        (line.name, migration.version, migration.path.name, migration.checksum),
                    )
                applied_now.append(
                    migration.path.name if was is None else f"{migration.path.name} (applied before as {was})"
                )
        finally:
            conn.execute("RESET ROLE")
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))
    return applied_now


def current_version(url: str, line: str = STORE.name) -> int:
    """The newest version of `line` recorded in the database (0: none)."""
    with psycopg.connect(url, autocommit=True) as conn:
        exists, has_lines = conn.execute(_TRACKING_STATE).fetchone() or (False, False)
        if not exists or (not has_lines and line != STORE.name):  # (a record from before lines: the store's only)
            return 0
        row = conn.execute(
            "SELECT coalesce(max(version), 0) FROM delaywheel.schema_migrations"
            + (" WHERE line = %s" if has_lines else ""),
            (line,) if has_lines else None,
        ).fetchone()
        return int(row[0]) if row else 0
