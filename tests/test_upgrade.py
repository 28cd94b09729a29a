"""Upgrades: a store built by the line before the baseline (tests/fixtures/line_before_baseline, 001-035, applied the
way migrate applied it then) upgrades with `delaywheel migrate` to the schema a fresh install has, and then delivers,
cancels and consumes what it held exactly as a fresh store holding the same does."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from delaywheel import Message, Store, migrate
from delaywheel.migrate import MigrationError, current_version
from tests.helpers import at

OLD_LINE = Path(__file__).parent / "fixtures" / "line_before_baseline"
PG_DUMP = Path("/usr/lib/postgresql/15/bin/pg_dump")


@pytest.fixture
def new_db(server_url: str) -> Iterator[Any]:
    """Makes empty databases on the test server, dropped afterwards."""
    names: list[str] = []

    def make() -> str:
        name = f"dwup_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        names.append(name)
        return psycopg.conninfo.make_conninfo(server_url, dbname=name)

    yield make
    with psycopg.connect(server_url, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def apply_old_line(url: str, upto: int = 35) -> None:
    """The line before the baseline, as migrate applied it: as the owner role, each file in its own transaction,
    recorded in schema_migrations under its name and checksum."""
    with psycopg.connect(url, autocommit=True) as conn:
        migrate.ensure_roles(conn)
        assert migrate.act_as_owner(conn)
        conn.execute("CREATE SCHEMA IF NOT EXISTS delaywheel")
        conn.execute(migrate._TRACKING)
        for path in sorted(OLD_LINE.glob("*.sql")):
            version = int(path.name[:3])
            if version > upto:
                break
            with conn.transaction():
                conn.execute(path.read_text())
                conn.execute(
                    "INSERT INTO delaywheel.schema_migrations (line, version, name, checksum) VALUES"
                    " ('delaywheel', %s, %s, %s)",
                    (version, path.name, hashlib.sha256(path.read_bytes()).hexdigest()),
                )


def migrate_cli(url: str) -> str:
    """`delaywheel migrate` as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "delaywheel.cli", "migrate"],
        env={**os.environ, "DELAYWHEEL_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def schema_dump(url: str) -> str:
    """`pg_dump --schema-only`, without its comments, blank lines and session settings."""
    out = subprocess.run(
        [str(PG_DUMP), "--schema-only", "--no-owner", url], capture_output=True, text=True, check=True
    ).stdout
    return "\n".join(
        line for line in out.splitlines() if line.strip() and not re.match(r"--|SET |SELECT pg_catalog|\\", line)
    )


def records(url: str) -> tuple[list[tuple[Any, ...]], ...]:
    """What migrate recorded, and the rows a store starts with."""
    with psycopg.connect(url) as conn:
        return (
            conn.execute("SELECT singleton, near_until FROM delaywheel.wheel_roll").fetchall(),
            conn.execute(
                "SELECT pass, cursor_at, cursor_id, horizon_xid, delivered FROM delaywheel.wheel_cursor"
            ).fetchall(),
            conn.execute("SELECT * FROM delaywheel.retention_floor").fetchall(),
            conn.execute("SELECT line, version, name FROM delaywheel.schema_migrations ORDER BY 1, 2").fetchall(),
            conn.execute("SELECT name, checksum FROM delaywheel.schema_definitions ORDER BY 1").fetchall(),
        )


def test_a_fresh_install_equals_an_upgraded_store(new_db: Any) -> None:
    fresh, old = new_db(), new_db()
    migrate_cli(fresh)
    apply_old_line(old)
    migrate_cli(old)
    assert schema_dump(old) == schema_dump(fresh)
    assert records(old) == records(fresh)
    assert current_version(old) == current_version(fresh) == migrate.available()[-1].version
    assert migrate.migrate(old) == []  # up to date


def test_a_store_part_way_along_the_old_line_is_refused(new_db: Any) -> None:
    url = new_db()
    apply_old_line(url, upto=30)
    with pytest.raises(MigrationError, match=r"035_repeated_cancel\.sql"):
        migrate.migrate(url)


def test_a_changed_definition_is_installed_again(new_db: Any, tmp_path: Path) -> None:
    """A definition file whose text changed is installed on the next migrate (CREATE OR REPLACE); the others are not."""
    url = new_db()
    copy = tmp_path / "sql"
    shutil.copytree(migrate.SQL_DIR, copy)  # type: ignore[arg-type]
    migrate.migrate(url, copy)
    lanes = copy / "lanes.sql"
    lanes.write_text(lanes.read_text() + "\nCOMMENT ON FUNCTION delaywheel.take_lane(integer, integer, text) IS 'x';\n")
    assert migrate.migrate(url, copy) == ["lanes.sql"]
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT obj_description('delaywheel.take_lane(integer, integer, text)'::regprocedure)")
        assert row.fetchone() == ("x",)
    assert migrate.migrate(url, copy) == []


# The scenario: what a store holds before the upgrade, then what it does after it.
BASE_TABLES = """
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'delaywheel' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND c.relname NOT IN ('schema_migrations', 'schema_definitions')
ORDER BY 1
"""


def hold(store: Store, t0: datetime) -> None:
    """Rows in every table: pending on levels, near wheel and far blocks, cancellations, topics, consumer offsets,
    set-aside, bulk claims, and the batch jobs' records."""
    for i in range(4):
        store.send("orders", {"level": i}, delay_level=3, key=f"level-{i}", now=t0)
        store.send("orders", {"near": i}, deliver_at=t0 + timedelta(hours=1, minutes=i), key=f"near-{i}", now=t0)
        store.send("orders", {"far": i}, deliver_at=t0 + timedelta(days=5, minutes=i), key=f"far-{i}", now=t0)
    store.send_many(
        [Message("orders", {"batch": i}, delay_level=3, key=f"batch-{i}") for i in range(20)]
        + [Message("orders", {"far-batch": i}, deliver_at=t0 + timedelta(days=6), key=f"fb-{i}") for i in range(20)],
        now=t0,
    )
    store.send("orders", {"now": 1}, delay_level=1, key="now-1", now=t0)
    assert store.deliver_due(now=t0 + timedelta(seconds=2)) == 1
    if store.conn.execute("SELECT to_regclass('delaywheel.consumer_leases')").fetchone() != (None,):
        batch = store.pull("orders", "g")
        assert [m.key for m in batch.messages] == ["now-1"]
        store.ack(batch)
    else:  # the old line's store: its group offset as its own pull and ack left it (one per topic, no leases)
        store.conn.execute(
            "INSERT INTO delaywheel.consumer_offsets (grp, topic, cursor_xid, cursor_offset, acked)"
            " SELECT 'g', 'orders', xid, queue_offset, 1 FROM delaywheel.topic_messages WHERE key = 'now-1'"
        )
        store.conn.commit()
    # the days' cancellations partitions first, so that each cancel is one CALL of the store's own procedure: the
    # two-step way calls the functions of sql/cancel.sql, which the old store has only once migrated
    store._cache.ensure(store.conn, "cancellations", [t0 + timedelta(seconds=10), t0 + timedelta(days=5, minutes=2)])
    if store.conn.execute("SELECT to_regclass('delaywheel.group_seeks')").fetchone() != (None,):  # a later change's
        store.seek("orders", "g", to="latest", by="t")  # table: filled where it exists (it moves nothing here)
    cancelled = store.cancel(key="level-1") + store.cancel(key="far-2") + store.cancel(key="batch-3")
    assert [r.outcome for r in cancelled] == ["cancelled"] * 3
    conn = store.conn
    with conn.transaction():
        conn.execute("INSERT INTO delaywheel.set_aside (message_id, lane, reason) VALUES (1, 'wheel', 'bad_body')")
        source = conn.execute("INSERT INTO delaywheel.bulk_sources (source) VALUES ('orders.csv') RETURNING id")
        conn.execute(
            "INSERT INTO delaywheel.bulk_claims (source_id, key, message_id) VALUES (%s, 'row-1', 1)",
            (source.fetchone()[0],),  # type: ignore[index]
        )
        conn.execute(
            "INSERT INTO delaywheel.quarantine (source, source_file, row_number, reason, detail)"
            " VALUES ('orders.csv', 'f', 1, 'bad_topic', 'd')"
        )
        conn.execute(
            "INSERT INTO delaywheel.reconcile_runs (requested_by, business, topic, missing, stale, created,"
            " cancelled, sample) VALUES ('t', 'orders', 'orders', 0, 0, 0, 0, '[]')"
        )
        conn.execute(
            "INSERT INTO delaywheel.replays (requested_by, due_from, due_until) VALUES ('t', %s, %s)", (t0, at(t0, 60))
        )
        conn.execute(
            "INSERT INTO delaywheel.validation_results (suite, window_start, window_end, success, failed, result)"
            " VALUES ('s', %s, %s, true, '{}', '{}')",
            (t0, t0),
        )
        conn.execute(
            "INSERT INTO delaywheel.lateness_minutes (minute, lane, level, topic, deliveries, p50_ms, p95_ms, p99_ms,"
            " max_ms) VALUES (%s, 'level', 1, 'orders', 1, 1, 1, 1, 1)",
            (t0,),
        )
        conn.execute("INSERT INTO delaywheel.topic_watch (topic) VALUES ('orders') ON CONFLICT DO NOTHING")
        conn.execute("INSERT INTO delaywheel.retention_floor DEFAULT VALUES ON CONFLICT DO NOTHING")
    store.summarize()
    empty = [
        t
        for (t,) in conn.execute(BASE_TABLES)
        if conn.execute(f"SELECT count(*) FROM delaywheel.{t}").fetchone() == (0,)
    ]
    # made by later changes (none on the old line), or left empty once a scenario step is over (a member leaves)
    after_the_baseline = {"group_retry_policies", "retired_unread", "consumer_members", "dlq_redrives", "dlq_redriven"}
    assert empty == [] or set(empty) <= {"wheel_cursor", "far_key_summaries", *after_the_baseline}, empty


def behave(store: Store, t0: datetime) -> dict[str, Any]:
    """Deliver, cancel and consume everything the store holds; what a caller sees, ids left out."""
    seen: dict[str, Any] = {}
    seen["cancel near"] = [r.outcome for r in store.cancel(key="near-0")]
    seen["levels"] = store.deliver_due(now=t0 + timedelta(seconds=15))
    seen["cancel delivered"] = [r.outcome for r in store.cancel(key="level-0")]
    seen["cancel again"] = [r.outcome for r in store.cancel(key="level-1")]
    seen["near"] = store.deliver_due(now=t0 + timedelta(hours=2))
    seen["far"] = store.deliver_due(now=t0 + timedelta(days=7))
    keys = []
    while batch := store.pull("orders", "g", 1000):
        keys += [m.key for m in batch.messages]
        store.ack(batch)
    seen["consumed"] = sorted(keys)
    seen["send after"] = store.deliver_due(now=t0 + timedelta(days=7)) == 0 and bool(
        store.send("orders", {"after": 1}, delay_level=1, key="after", now=t0 + timedelta(days=7))
    )
    seen["after"] = store.deliver_due(now=t0 + timedelta(days=7, seconds=2))
    batch = store.pull("orders", "g")
    seen["consumed after"] = [m.key for m in batch.messages]
    store.ack(batch)
    return seen


def test_an_upgraded_store_behaves_as_a_fresh_one(new_db: Any, t0: datetime) -> None:
    old, fresh = new_db(), new_db()
    apply_old_line(old)
    with Store(old) as store:
        hold(store, t0)
    migrate_cli(old)
    migrate_cli(fresh)
    with Store(fresh) as store:
        hold(store, t0)
    with Store(old) as store:
        upgraded = behave(store, t0)
    with Store(fresh) as store:
        expected = behave(store, t0)
    assert upgraded == expected
    # and what it does is what the store promises: nothing cancelled delivered, everything else once
    keys = [f"level-{i}" for i in (0, 2, 3)] + [f"near-{i}" for i in (1, 2, 3)] + [f"far-{i}" for i in (0, 1, 3)]
    keys += [f"batch-{i}" for i in range(20) if i != 3] + [f"fb-{i}" for i in range(20)]
    assert expected["consumed"] == sorted(keys)
    assert expected["cancel near"] == ["cancelled"]
    assert expected["cancel delivered"] == ["already_delivered"]
    assert expected["cancel again"] == ["already_cancelled"]
    assert expected["consumed after"] == ["after"]
