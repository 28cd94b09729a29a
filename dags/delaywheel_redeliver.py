"""delaywheel_redeliver: catch up a backlog, replay a due-time range, or reconcile timers, with Spark.

Trigger it from the UI with the form:
- `catch-up`: after the deliverers were down, deliver every overdue message, all levels and the wheel in
  parallel, through the deliverers' own passes (the Airflow deliverers resume right after, no gap, no twice);
- `replay`: deliver again every message due in [from, until) to its topic or `target_topic`; each replay is
  recorded in `delaywheel.replays` and never puts the same message into the same topic twice;
- `reconcile`: compare `table` (rows matching `predicate` need a timer keyed by `key_column`) with the
  pending timers of `topic`: create the missing ones (due at `due_column`, or `delay_seconds` from now),
  cancel the stale ones, record it in `delaywheel.reconcile_runs`. `table`, `key_column` and `due_column` are names
  looked up in the catalog, and `predicate` is one expression over the table's columns (e.g. `status = 'pending'`),
  checked before anything runs: no subqueries, no statements, only pure functions (README, "What a caller may pass").

Optional fields may stay empty (the form sends null). The DAG changes data, so in a deployment with the FAB auth
manager it is triggered by the `delaywheel_operator` role (`access_control`), besides the roles allowed every DAG.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from delaywheel.airflow.forms import COLUMN, ISO_8601, OPERATOR_ACCESS, TABLE, TOPIC
from delaywheel.airflow.spark import spark_job

with DAG(
    dag_id="delaywheel_redeliver",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delaywheel", "spark"],
    doc_md=__doc__,
    access_control=OPERATOR_ACCESS,
    params={
        "store": Param(
            None,
            type=["null", "string"],
            pattern=r"^([a-z][a-z0-9_]{0,39})?$",
            description="with several stores (docs/stores.md): the store to work on (empty: catch-up drains every store; replay and reconcile need one)",
        ),
        "mode": Param("catch-up", type="string", enum=["catch-up", "replay", "reconcile"]),
        "batch": Param(50000, type="integer", minimum=1, description="catch-up: messages per delivery pass"),
        # Optional fields are nullable: the form sends an empty field as null (a plain "string" would be required).
        "from": Param(
            None,
            type=["null", "string"],
            pattern=ISO_8601,
            description="replay: first due time, ISO-8601 (UTC if no offset)",
        ),
        "until": Param(
            None, type=["null", "string"], pattern=ISO_8601, description="replay: end of the due range (exclusive)"
        ),
        "source_topic": Param(
            None, type=["null", "string"], pattern=TOPIC, description="replay: only this topic (empty: all)"
        ),
        "target_topic": Param(
            None,
            type=["null", "string"],
            pattern=TOPIC,
            description="replay: into this topic (empty: each message's own)",
        ),
        "table": Param(
            None, type=["null", "string"], pattern=TABLE, description="reconcile: schema.table of the business rows"
        ),
        "key_column": Param(
            None, type=["null", "string"], pattern=COLUMN, description="reconcile: the column that is the timer's key"
        ),
        "predicate": Param(
            None,
            type=["null", "string"],
            maxLength=20000,
            description="reconcile: which rows need a timer, one expression over the table's columns, "
            "e.g. status = 'pending' (no subqueries; empty: every row)",
        ),
        "topic": Param(None, type=["null", "string"], pattern=TOPIC, description="reconcile: the timers' topic"),
        "due_column": Param(
            None,
            type=["null", "string"],
            pattern=COLUMN,
            description="reconcile: when a created timer fires (a column)",
        ),
        "delay_seconds": Param(
            None,
            type=["null", "string"],
            pattern=r"^(\d+(\.\d*)?)?$",
            description="reconcile: or, a created timer fires this many seconds after it is "
            "created (empty: not given; give exactly one of due_column and this)",
        ),
    },
) as dag:
    spark_job(
        "redeliver",
        "redeliver",
        [
            "--mode",
            "{{ params.mode }}",
            "--batch",
            "{{ params.batch }}",
            "--from",
            "{{ params['from'] or '' }}",
            "--until",
            "{{ params.until or '' }}",
            "--source-topic",
            "{{ params.source_topic or '' }}",
            "--target-topic",
            "{{ params.target_topic or '' }}",
            "--table",
            "{{ params.table or '' }}",
            "--key-column",
            "{{ params.key_column or '' }}",
            "--predicate",
            "{{ params.predicate or '' }}",
            "--topic",
            "{{ params.topic or '' }}",
            "--due-column",
            "{{ params.due_column or '' }}",
            "--delay-seconds",
            "{{ params.delay_seconds or '' }}",
        ],
    )
