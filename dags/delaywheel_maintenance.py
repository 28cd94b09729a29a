"""delaywheel_maintenance: partitions ahead, delivered partitions retired, BRIN summaries, table sizes, vacuum.

Hourly, because partitions are hourly (level queue, near wheel) and daily (topics, far wheel):
- `prepare` creates the next hours' partitions so producers and deliverers never wait on DDL;
- `retire` DROPs partitions whose messages are all delivered (and topic partitions past
  `topic_retention`): whole-partition drops, never row DELETEs, so the hot tables do not bloat; rows a
  consumer group had not read are counted per group and topic, logged as warnings and in its XCom (`unread`);
- `summarize` adds the BRIN summaries autovacuum's queue dropped (cancel searches by them; the delivery
  loops do this every minute too);
- `table_sizes` reports every store table's size (partitions summed into their parent);
- `vacuum` runs VACUUM (ANALYZE) on the tables that need it: the small, constantly updated ones
  (checkpoints, wheel state, consumer offsets) collect dead rows; VACUUM cannot run inside a
  transaction, hence an autocommit connection.

With several stores (`stores` / DELAYWHEEL_STORES, docs/stores.md) every store needs all five: the DAG holds one
group of them per store, `store_<name>`, each on the store's connection `delaywheel_<name>`; the stores' chains run
side by side. With no stores configured the tasks are the single store's, on `delaywheel_default`, as always.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, TaskGroup, task

from delaywheel.airflow.connections import store_conn_id, store_names

if TYPE_CHECKING:
    from delaywheel import Store

# A table is vacuumed once its dead rows pass both bounds (autovacuum's own rule, with smaller numbers:
# these tables are tiny, but every delivery pass reads them).
DEAD_ROWS_MIN = 1000
DEAD_FRACTION = 0.2

SIZES = """
    SELECT coalesce(parent.relname, c.relname) AS "table", count(*) FILTER (WHERE c.relkind = 'r') AS partitions,
           sum(pg_total_relation_size(c.oid))::bigint AS bytes,
           sum(coalesce(s.n_live_tup, 0))::bigint AS live_rows, sum(coalesce(s.n_dead_tup, 0))::bigint AS dead_rows
    FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'delaywheel'
    LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
    LEFT JOIN pg_class parent ON parent.oid = i.inhparent
    LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
    WHERE c.relkind IN ('r', 'p')  -- a partitioned table without partitions yet still shows, with 0 bytes
    GROUP BY 1 ORDER BY 3 DESC
"""
NEEDS_VACUUM = """
    SELECT relname FROM pg_stat_user_tables
    WHERE schemaname = 'delaywheel' AND n_dead_tup >= %(min)s AND n_dead_tup >= %(fraction)s * greatest(n_live_tup, 1)
    ORDER BY n_dead_tup DESC
"""


def store_on(conn_id: str) -> Store:
    """The store on Airflow connection `conn_id`. The hook (with the postgres provider, psycopg and the store) is
    imported when a task runs, not each time the DAG processor parses this file (every 30 s)."""
    from delaywheel.airflow.hooks import DelayWheelHook

    return DelayWheelHook(conn_id).get_store()


with DAG(
    dag_id="delaywheel_maintenance",
    schedule="@hourly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=False,
    doc_md=__doc__,
    tags=["delaywheel"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
):

    @task
    def prepare(conn_id: str) -> None:
        with store_on(conn_id) as store:
            store.prepare()

    @task
    def retire(conn_id: str) -> list[dict[str, Any]]:
        with store_on(conn_id) as store:
            retired = store.retire()
        return [
            {
                "parent": r.parent,
                "partition": r.name,
                "rows": r.rows,
                "unread": [{"consumer_group": u.group, "topic": u.topic, "rows": u.rows} for u in r.unread],
            }
            for r in retired
        ]

    @task
    def summarize(conn_id: str) -> int:
        with store_on(conn_id) as store:
            return store.summarize()

    @task
    def table_sizes(conn_id: str) -> list[dict[str, Any]]:
        with store_on(conn_id) as store:
            cur = store.conn.execute(SIZES)
            names = [d.name for d in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    @task
    def vacuum(conn_id: str) -> list[str]:
        from psycopg import sql

        with store_on(conn_id) as store:
            tables = [r[0] for r in store.conn.execute(NEEDS_VACUUM, {"min": DEAD_ROWS_MIN, "fraction": DEAD_FRACTION})]
            for table in tables:  # store.conn is autocommit: VACUUM refuses to run in a transaction block
                store.conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier("delaywheel", table)))
        return tables

    for store in store_names():
        conn_id = store_conn_id(store)
        group = (
            contextlib.nullcontext() if store is None else TaskGroup(f"store_{store}", tooltip=f"connection {conn_id}")
        )
        with group:
            prepare(conn_id) >> retire(conn_id) >> summarize(conn_id) >> table_sizes(conn_id) >> vacuum(conn_id)
