"""Reconcile timers with a business table: create the missing timers, cancel the stale ones.

Nothing here delivers or cancels by a second path: missing timers are written by the bulk writer (`batch.bulk`),
stale ones cancelled through `Store.cancel_matching`. Spark (spark/redeliver.py) joins the business keys with the
pending timers; every name and the predicate are checked here first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from delaywheel.ops.cancel import Match
from delaywheel.ops.predicate import catalog_table, check_column, check_column_name, check_expression, split_table
from delaywheel.pending import PENDING, not_cancelled
from delaywheel.produce.validation import check_topic


@dataclass(frozen=True)
class Reconcile:
    """Business rows (`table` WHERE `predicate` AND every `filters` column = value) need a timer in `topic` keyed
    by `key_column`. Nothing here is SQL text run as given: `table`, `key_column`, `due_column` and the filter columns
    are looked up in the catalog and quoted (`psycopg.sql.Identifier`), values are bound, and `predicate` is one
    expression over the table's own columns, checked like `cancel_matching`'s `where` (`predicate.check_expression`);
    empty or None: every row."""

    table: str
    key_column: str
    predicate: str | None
    topic: str
    due_column: str | None = None  # the timer's due time; else `delay`
    delay: timedelta | None = None
    filters: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        split_table(self.table)
        check_column_name(self.key_column, what="key column")
        if self.due_column:
            check_column_name(self.due_column, what="due column")
        for column in self.filters:
            check_column_name(column, what="filter column")
        if self.predicate and self.predicate.strip():
            check_expression(self.predicate, None, what="reconcile predicate")  # columns: checked in resolve()
        check_topic(self.topic)
        if (self.due_column is None) == (self.delay is None):
            raise ValueError("reconcile needs exactly one of a due column or a delay for the timers it creates")

    @property
    def label(self) -> str:
        conditions = [
            *([self.predicate.strip()] if self.predicate and self.predicate.strip() else []),
            *(f"{c} = {v!r}" for c, v in sorted(self.filters.items())),
        ]
        return f"{self.table}.{self.key_column} WHERE {' AND '.join(conditions) or 'true'}"

    def resolve(self, conn: psycopg.Connection) -> _Business:
        """The business table as the catalog has it: every name checked, the predicate checked over its columns."""
        schema, table, columns = catalog_table(conn, self.table, what="reconcile table")
        label = f"{schema}.{table}"
        key = check_column(self.key_column, columns, label, what="key column")
        due = check_column(self.due_column, columns, label, what="due column") if self.due_column else None
        conditions: list[sql.Composable] = []
        params: dict[str, object] = {"rc_topic": self.topic}
        if self.predicate and self.predicate.strip():
            checked = check_expression(self.predicate, columns, qualifier="b", what="reconcile predicate")
            conditions.append(sql.SQL("({})").format(sql.SQL(checked.replace("%", "%%"))))
        for i, (column, value) in enumerate(sorted(self.filters.items())):
            ident = sql.SQL("b.{}").format(sql.Identifier(check_column(column, columns, label, what="filter column")))
            if value is None:
                conditions.append(sql.SQL("{} IS NULL").format(ident))
            else:
                params[f"rc_{i}"] = value
                conditions.append(sql.SQL("{} = {}").format(ident, sql.Placeholder(f"rc_{i}")))
        where = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
        return _Business(
            sql.Identifier(schema, table), sql.Identifier(key), sql.Identifier(due) if due else None, where, params
        )

    def needed_sql(self, conn: psycopg.Connection) -> str:
        """Keys (and due times) of the business rows that need a timer, and whether one was delivered already
        (then it is not missing: the business row is the consumer's to settle); one SELECT, values inlined by the
        client library (for Spark's JDBC reader, which runs it in a read-only session)."""
        b = self.resolve(conn)
        query = sql.SQL(
            "SELECT b.{key}::text AS key, {due} AS deliver_at,"
            " EXISTS (SELECT 1 FROM delaywheel.topic_messages t WHERE t.origin <> 'replay'"
            " AND t.topic = %(rc_topic)s AND t.key = b.{key}::text) AS delivered"
            " FROM {table} b WHERE {where}"
        ).format(
            key=b.key,
            due=sql.SQL("b.{}").format(b.due) if b.due else sql.SQL("NULL::timestamptz"),
            table=b.table,
            where=b.where,
        )
        return _inline(conn, query, b.params)

    def pending_sql(self, conn: psycopg.Connection) -> str:
        """Keys of the pending, not cancelled timers in the topic (the cancel module's idea of pending)."""
        query = sql.SQL(
            "SELECT DISTINCT p.key FROM ({pending}) p WHERE p.topic = %(rc_topic)s AND p.key IS NOT NULL"
            " AND {not_cancelled}"
        ).format(pending=sql.SQL(PENDING), not_cancelled=not_cancelled("p"))
        return _inline(conn, query, {"rc_topic": self.topic})

    def stale_match(self, conn: psycopg.Connection) -> Match:
        """`cancel_matching` condition: pending timers in the topic that no business row needs any more."""
        b = self.resolve(conn)
        return Match(
            sql.SQL(
                "p.topic = %(rc_topic)s AND p.key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM {table} b"
                " WHERE b.{key}::text = p.key AND {where})"
            ).format(table=b.table, key=b.key, where=b.where),
            b.params,
        )


@dataclass(frozen=True)
class _Business:
    table: sql.Identifier
    key: sql.Identifier
    due: sql.Identifier | None
    where: sql.Composable
    params: dict[str, object]


def _inline(conn: psycopg.Connection, query: sql.Composable, params: Mapping[str, object]) -> str:
    """One statement's text with its values quoted by psycopg (for readers that take text only, like Spark's JDBC)."""
    return psycopg.ClientCursor(conn).mogrify(query, params)  # type: ignore[arg-type]  # a Composed


def record_reconcile(
    conn: psycopg.Connection,
    job: Reconcile,
    requested_by: str,
    *,
    missing: int,
    stale: int,
    created: int,
    cancelled: int,
    sample: dict[str, list[str]],
) -> int:
    row = conn.execute(
        "INSERT INTO delaywheel.reconcile_runs (requested_by, business, topic, missing, stale, created, cancelled,"
        " sample) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        (requested_by, job.label, job.topic, missing, stale, created, cancelled, Jsonb(sample)),
    ).fetchone()
    assert row is not None
    return int(row[0])
