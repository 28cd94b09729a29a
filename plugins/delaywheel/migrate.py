"""Applies the numbered SQL files in `sql/`: each once, each in its own transaction, in order."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import psycopg

from .config import PROJECT_ROOT

SQL_DIR = PROJECT_ROOT / "sql"
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
_LOCK_KEY = 0x64770001  # advisory lock: one migrator at a time


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


def migrate(url: str, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply pending migrations; returns the names applied (empty when up to date)."""
    migrations = available(sql_dir)
    applied_now: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
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
                with conn.transaction():
                    conn.execute(migration.path.read_text())  # type: ignore[arg-type]
                    conn.execute(
                        "INSERT INTO delaywheel.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (migration.version, migration.path.name, migration.checksum),
                    )
                applied_now.append(migration.path.name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
    return applied_now


def current_version(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('delaywheel.schema_migrations') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return 0
        row = conn.execute("SELECT coalesce(max(version), 0) FROM delaywheel.schema_migrations").fetchone()
        return int(row[0]) if row else 0
