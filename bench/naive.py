"""The naive design from the seeds, built on the same PostgreSQL for comparison with the timing wheel:
one table indexed on due time; producers COPY into it; consumers take the due head with
`FOR UPDATE SKIP LOCKED`, DELETE it and insert it into a topic table, in one statement per batch.
It has fewer indexes than the wheel (no key or xid index), which favours it on enqueue."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

import psycopg

from .common import copy_rows

DDL = """
CREATE SCHEMA naive;
CREATE TABLE naive.queue (
    id          bigserial   PRIMARY KEY,
    topic       text        NOT NULL,
    key         text,
    tags        text,
    properties  jsonb,
    body        bytea       NOT NULL,
    is_json     boolean     NOT NULL,
    deliver_at  timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL
);
CREATE INDEX queue_due ON naive.queue (deliver_at);
CREATE TABLE naive.topic (
    queue_offset bigserial,
    message_id   bigint      NOT NULL,
    topic        text        NOT NULL,
    key          text,
    tags         text,
    properties   jsonb,
    body         bytea       NOT NULL,
    is_json      boolean     NOT NULL,
    deliver_at   timestamptz NOT NULL,
    delivered_at timestamptz NOT NULL
);
CREATE INDEX topic_read ON naive.topic (topic, queue_offset);
"""
COLUMNS = ("topic", "key", "tags", "properties", "body", "is_json", "deliver_at", "enqueued_at")
TYPES = ["text", "text", "text", "jsonb", "bytea", "bool", "timestamptz", "timestamptz"]

_DELIVER = """
WITH m AS (
    DELETE FROM naive.queue WHERE id IN (
        SELECT id FROM naive.queue WHERE deliver_at <= %(now)s
        ORDER BY deliver_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING *)
INSERT INTO naive.topic (message_id, topic, key, tags, properties, body, is_json, deliver_at, delivered_at)
SELECT id, topic, key, tags, properties, body, is_json, deliver_at, clock_timestamp() FROM m
"""


def create(conn: psycopg.Connection) -> None:
    conn.execute(DDL)


def enqueue(conn: psycopg.Connection, rows: Iterable[tuple]) -> None:
    """A producer: one COPY of (topic, key, tags, properties, body, is_json, deliver_at, enqueued_at) rows."""
    with conn.transaction():
        copy_rows(conn, "naive.queue", COLUMNS, TYPES, rows)


def deliver(conn: psycopg.Connection, now: datetime, limit: int) -> int:
    """A consumer's batch: move up to `limit` due messages into the topic table; returns how many."""
    with conn.transaction():
        return conn.execute(_DELIVER, {"now": now, "limit": limit}).rowcount


def fill(conn: psycopg.Connection, count: int, first_due: datetime, span: timedelta, body: bytes) -> None:
    """Pending backdrop: `count` messages due uniformly in [first_due, first_due + span), 1M per transaction."""
    for start in range(0, count, 1_000_000):
        with conn.transaction():
            conn.execute(
                "INSERT INTO naive.queue (topic, key, tags, body, is_json, deliver_at, enqueued_at)"
                " SELECT 'bench.backdrop', 'backdrop-' || g, 'created', %(body)s, false,"
                " %(lo)s + random() * %(span)s, clock_timestamp()"
                " FROM generate_series(%(a)s::bigint, %(b)s::bigint) g",
                {"body": body, "lo": first_due, "span": span, "a": start + 1, "b": min(count, start + 1_000_000)},
            )
