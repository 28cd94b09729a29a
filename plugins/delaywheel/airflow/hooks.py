"""`DelayWheelHook`: the store behind an Airflow connection (PostgreSQL, default id `delaywheel_default`).

Built on the postgres provider's `PostgresHook`, so the connection is an ordinary Postgres connection
(UI form, `AIRFLOW_CONN_DELAYWHEEL_DEFAULT=postgresql://...`, secrets backends). The store itself speaks
psycopg 3, so the hook hands it a plain `postgresql://` URL rather than the SQLAlchemy one.

Triggers run in the triggerer's event loop, where one blocking call stalls every other trigger: they use
`aconnect()` / `next_due_async()` (psycopg's AsyncConnection, connection looked up with `aget_connection`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from sqlalchemy.engine import URL

from delaywheel import Store, load_settings
from delaywheel.db import with_session_options
from delaywheel.pending import LEVEL_HEAD, WHEEL_HEAD

from .connections import DEFAULT_CONN_ID, store_conn_id, store_names, topic_conn_ids, topic_stores

__all__ = [  # the connection helpers live in `connections` (light for DAG files) and are kept importable from here
    "CLOCK",
    "DelayWheelHook",
    "head_query",
    "next_due_async",
    "store_conn_id",
    "store_names",
    "topic_conn_ids",
    "topic_stores",
]

CLOCK = "SELECT clock_timestamp() + make_interval(secs => %(offset)s)"


def head_query(level: int | None) -> tuple[str, dict[str, Any]]:
    """The read-only query for a lane's next due time (`level=None` is the wheel)."""
    return (WHEEL_HEAD, {}) if level is None else (LEVEL_HEAD, {"level": level})


class DelayWheelHook(PostgresHook):
    """The delaywheel store on an Airflow Postgres connection; `get_store()` is the Python API.

    :param delaywheel_conn_id: the Airflow connection of the store, an ordinary Postgres connection (default
        ``delaywheel_default``). Other keyword arguments are `PostgresHook`'s.
    """

    conn_name_attr = "delaywheel_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    hook_name = "delaywheel"

    def __init__(self, delaywheel_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(delaywheel_conn_id=delaywheel_conn_id, **kwargs)  # DbApiHook sets self.delaywheel_conn_id

    @staticmethod
    def url_of(conn: Any) -> str:
        """A psycopg 3 URL (`postgresql://user:pw@host:port/db?sslmode=...`) for an Airflow Connection."""
        extra = {k: str(v) for k, v in conn.extra_dejson.items() if k not in PostgresHook.ignored_extra_options}
        return URL.create(
            "postgresql",
            username=conn.login or None,
            password=conn.password or None,
            host=conn.host or None,
            port=int(conn.port) if conn.port else None,
            database=conn.schema or None,
            query=extra,
        ).render_as_string(hide_password=False)

    @property
    def url(self) -> str:
        return self.url_of(self.connection)

    def get_store(self) -> Store:
        """A Store on this connection with the settings from airflow.cfg / environment (one per thread)."""
        return Store(self.url, load_settings())

    def next_due(self, level: int | None, *, now_offset_s: float = 0.0) -> tuple[datetime | None, datetime]:
        """(the lane's next due time or None, the database clock shifted by `now_offset_s`)."""
        sql, params = head_query(level)
        with psycopg.connect(
            with_session_options(self.url), autocommit=True, application_name="delaywheel-sensor"
        ) as conn:
            head = conn.execute(sql, params).fetchone()
            clock = conn.execute(CLOCK, {"offset": now_offset_s}).fetchone()
        assert clock is not None
        return (head[0] if head else None), clock[0]

    async def aurl(self) -> str:
        """The URL, looked up without blocking the event loop (for triggers)."""
        return self.url_of(await self.aget_connection(self.delaywheel_conn_id))

    async def aconnect(self) -> psycopg.AsyncConnection:
        """An autocommit AsyncConnection: LISTEN needs autocommit; the one trigger that writes (the topic
        watcher's mark) does so in explicit transactions."""
        return await psycopg.AsyncConnection.connect(
            with_session_options(await self.aurl()), autocommit=True, application_name="delaywheel-trigger"
        )


async def next_due_async(
    conn: psycopg.AsyncConnection, level: int | None, now_offset_s: float
) -> tuple[datetime | None, datetime]:
    """`DelayWheelHook.next_due` on an open AsyncConnection, which a trigger keeps through its wait and looks on at
    every wake: the head's read is prepared there, planned once per connection. Planned per call, the wheel's head
    is planned over every near-wheel partition ahead of the cursor, most of a look. A sensor's
    poke (`next_due`) connects afresh each time and has nothing to reuse a plan on."""
    sql, params = head_query(level)
    head = await (await conn.execute(sql, params, prepare=True)).fetchone()
    clock = await (await conn.execute(CLOCK, {"offset": now_offset_s})).fetchone()
    assert clock is not None
    return (head[0] if head else None), clock[0]
