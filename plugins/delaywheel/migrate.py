"""Applies the numbered SQL files in `sql/`: each once, each in its own transaction, in order.

Migrations run as the store's owner role, `delaywheel_owner` (DESIGN.md "Roles"): the connecting role sets it
(`SET ROLE`) when it may, so the schema and everything in it belong to the owner whichever login ran them. Given the
store's runtime URL (the configured one, or the embedded cluster's), `migrate` connects with the owner's URL instead:
`DELAYWHEEL_OWNER_URL`, or the embedded cluster's owner login.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel.locks import MIGRATE_LOCK

SQL_DIR = Path(__file__).resolve().with_name("migrations")
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
OWNER_ROLE = "delaywheel_owner"  # owns the schema, runs the migrations
RUNTIME_ROLE = "delaywheel_runtime"  # sends, delivers, consumes, cancels; no DDL but through migrations/017's functions
GROUP_ROLES = (OWNER_ROLE, RUNTIME_ROLE)


class MigrationError(RuntimeError):
    """The database and the code disagree about the schema; the message says how."""


@dataclass(frozen=True)
class Migration:
    version: int
    path: Path

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def available(sql_dir: Path = SQL_DIR) -> list[Migration]:
    found = []
    for path in sorted(sql_dir.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise MigrationError(f"{path.name}: migration files are named NNN_snake_case.sql")
        found.append(Migration(int(match.group(1)), path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version number in {sql_dir}")
    return found


def ensure_roles(conn: psycopg.Connection) -> None:
    """Create the group roles if they are missing and this session may (a superuser, or CREATEROLE); as a superuser
    also give the owner CREATE on this database (it creates the schemas). Idempotent; without the right to, it
    leaves all as it is, and migrations/017 says what a superuser must do."""
    row = conn.execute("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user").fetchone()
    superuser, createrole = row if row else (False, False)
    existing = {r[0] for r in conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (list(GROUP_ROLES),))}
    if superuser or createrole:
        for role in GROUP_ROLES:
            if role not in existing:
                with contextlib.suppress(psycopg.errors.DuplicateObject):  # another migrator, just now
                    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
    if superuser:
        database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(database), sql.Identifier(OWNER_ROLE)))


# Every object in the store's schemas not yet the owner's (a database migrated before migrations/017, by a single role):
# schemas, then relations (a sequence owned by a column follows its table), then functions.
_ADOPT = """
DO $$
DECLARE
    item record;
BEGIN
    FOR item IN SELECT format('ALTER SCHEMA %I OWNER TO delaywheel_owner', nspname) AS ddl
                FROM pg_namespace WHERE nspname IN ('delaywheel', 'shop')
                  AND nspowner <> 'delaywheel_owner'::regrole
    LOOP EXECUTE item.ddl; END LOOP;
    FOR item IN SELECT format('ALTER %s %I.%I OWNER TO delaywheel_owner',
                              CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                             WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END,
                              n.nspname, c.relname) AS ddl
                FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname IN ('delaywheel', 'shop') AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
                  AND c.relowner <> 'delaywheel_owner'::regrole
                  AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                           AND d.objid = c.oid AND d.deptype IN ('a', 'i')))
    LOOP EXECUTE item.ddl; END LOOP;
    FOR item IN SELECT format('ALTER ROUTINE %s OWNER TO delaywheel_owner', p.oid::regprocedure) AS ddl
                FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname IN ('delaywheel', 'shop') AND p.proowner <> 'delaywheel_owner'::regrole
    LOOP EXECUTE item.ddl; END LOOP;
END $$
"""
_NOT_ADOPTED = """
    SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname IN ('delaywheel', 'shop') AND c.relowner <> %(owner)s::regrole
    UNION ALL SELECT count(*) FROM pg_namespace WHERE nspname IN ('delaywheel', 'shop') AND nspowner <> %(owner)s::regrole
"""


def act_as_owner(conn: psycopg.Connection) -> bool:
    """`SET ROLE delaywheel_owner` if it exists and this session may; first hand it whatever of the store's schemas
    another role owns (a store migrated before the roles existed). False: the migrations run as the session's role,
    as they did before the roles existed."""
    row = conn.execute(
        "SELECT to_regrole(%(owner)s) IS NOT NULL AND pg_has_role(current_user, %(owner)s, 'MEMBER'),"
        " current_user = %(owner)s", {"owner": OWNER_ROLE}).fetchone()
    may, already = row if row else (False, False)
    if not may or already:
        return bool(already)
    adopt(conn)
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(OWNER_ROLE)))
    return True


def adopt(conn: psycopg.Connection) -> None:
    """Give `delaywheel_owner` whatever of the store's schemas another role owns (a store migrated before the roles
    existed, by a single role); needs a superuser or the objects' owner."""
    if any(r[0] for r in conn.execute(_NOT_ADOPTED, {"owner": OWNER_ROLE})):
        try:
            conn.execute(_ADOPT)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise MigrationError(
                f"objects of the store's schemas belong to another role, and this one may not give them to {OWNER_ROLE}"
                f" ({exc}); run `delaywheel migrate` once as a superuser or as their owner (README, \"Roles\")"
            ) from exc


@contextlib.contextmanager
def _as_the_owner_only() -> Iterator[None]:
    """A schema change this role may not make: say which role may."""
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(
            f"{exc}: migrations run as {OWNER_ROLE} (README, \"Roles\"); give `migrate` the owner's URL"
            " (DELAYWHEEL_OWNER_URL), or run it as a member of that role or a superuser"
        ) from exc


def owner_url(url: str) -> str:
    """The URL migrations connect with for `url`: the configured owner's when `url` is the store's configured
    runtime URL (`DELAYWHEEL_DATABASE_URL` with `DELAYWHEEL_OWNER_URL` set), the embedded cluster's owner login
    when it is an embedded cluster's runtime login; otherwise `url` itself (one URL configured: as before)."""
    from delaywheel.config import load_settings
    from delaywheel.dev import embedded

    settings = load_settings()
    if settings.database_url and settings.owner_url and url == settings.database_url:
        return settings.owner_url
    if not settings.database_url:
        cluster = embedded.default_cluster()
        for database in embedded.DATABASES:
            if url == cluster.url(database):
                return cluster.owner_url(database)
        params = conninfo_to_dict(url)  # any embedded cluster's runtime login (e.g. a test's own cluster)
        if params.get("user") == embedded.RUNTIME_LOGIN and params.get("host") in ("127.0.0.1", "localhost"):
            return make_conninfo(url, user=embedded.OWNER_LOGIN)
    return url


def migrate(url: str, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply pending migrations as the owner role; returns the names applied (empty when up to date)."""
    migrations = available(sql_dir)
    applied_now: list[str] = []
    with psycopg.connect(owner_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
        try:
            ensure_roles(conn)
            as_owner = act_as_owner(conn)
            # only when missing: IF NOT EXISTS still needs CREATE, and the runtime role finds an up-to-date store
            if conn.execute("SELECT to_regclass('delaywheel.schema_migrations') IS NULL").fetchone() != (False,):
                with _as_the_owner_only():
                    conn.execute("CREATE SCHEMA IF NOT EXISTS delaywheel")
                    conn.execute(
                        "CREATE TABLE IF NOT EXISTS delaywheel.schema_migrations ("
                        " version int PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                        " applied_at timestamptz NOT NULL DEFAULT now())"
                    )
            done = {v: (n, c) for v, n, c in conn.execute("SELECT version, name, checksum FROM delaywheel.schema_migrations")}
            newest_known = max((m.version for m in migrations), default=0)
            if done and max(done) > newest_known:
                raise MigrationError(
                    f"the database schema is at version {max(done)} ({done[max(done)][0]}), newer than this code "
                    f"knows ({newest_known}); upgrade delaywheel before running it against this database"
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
                    conn.execute(migration.path.read_text())  # type: ignore[arg-type]
                    conn.execute(
                        "INSERT INTO delaywheel.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (migration.version, migration.path.name, migration.checksum),
                    )
                applied_now.append(migration.path.name)
        finally:
            conn.execute("RESET ROLE")
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))
    return applied_now


def current_version(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('delaywheel.schema_migrations') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return 0
        row = conn.execute("SELECT coalesce(max(version), 0) FROM delaywheel.schema_migrations").fetchone()
        return int(row[0]) if row else 0
