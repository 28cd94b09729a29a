"""delaywheel_redeliver: catch up a backlog, replay a due-time range, or reconcile timers, with Spark.

Trigger it from the UI with the form:
- `catch-up`: after the deliverers were down, deliver every overdue message, all levels and the wheel in
  parallel, through the deliverers' own passes (the Airflow deliverers resume right after, no gap, no twice);
- `replay`: deliver again every message due in [from, until) to its topic or `target_topic`; each replay is
  recorded in `delaywheel.replays` and never puts the same message into the same topic twice;
- `reconcile`: compare `table` (rows matching `predicate` need a timer keyed by `key_column`) with the
  pending timers of `topic`: create the missing ones (due at `due_column`, or `delay_seconds` from now),
  cancel the stale ones, record it in `delaywheel.reconcile_runs`.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from delaywheel.airflow.spark import spark_job

with DAG(
    dag_id="delaywheel_redeliver",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delaywheel", "spark"],
    doc_md=__doc__,
    params={
        "mode": Param("catch-up", type="string", enum=["catch-up", "replay", "reconcile"]),
        "batch": Param(50000, type="integer", minimum=1, description="catch-up: messages per delivery pass"),
        "from": Param("", type="string", description="replay: first due time, ISO-8601 (UTC if no offset)"),
        "until": Param("", type="string", description="replay: end of the due range (exclusive)"),
        "source_topic": Param("", type="string", description="replay: only this topic (empty: all)"),
        "target_topic": Param("", type="string", description="replay: into this topic (empty: each message's own)"),
        "table": Param("", type="string", description="reconcile: schema.table of the business rows"),
        "key_column": Param("", type="string", description="reconcile: the column that is the timer's key"),
        "predicate": Param("", type="string", description="reconcile: SQL, rows that need a timer"),
        "topic": Param("", type="string", description="reconcile: the timers' topic"),
        "due_column": Param("", type="string", description="reconcile: when a created timer fires (a column)"),
        "delay_seconds": Param("", type="string", pattern=r"^(\d+(\.\d*)?)?$",
                               description="reconcile: or, a created timer fires this many seconds after it is "
                                           "created (empty: not given; give exactly one of due_column and this)"),
    },
) as dag:
    spark_job("redeliver", "redeliver", [
        "--mode", "{{ params.mode }}", "--batch", "{{ params.batch }}",
        "--from", "{{ params['from'] }}", "--until", "{{ params.until }}",
        "--source-topic", "{{ params.source_topic }}", "--target-topic", "{{ params.target_topic }}",
        "--table", "{{ params.table }}", "--key-column", "{{ params.key_column }}",
        "--predicate", "{{ params.predicate }}", "--topic", "{{ params.topic }}",
        "--due-column", "{{ params.due_column }}", "--delay-seconds", "{{ params.delay_seconds }}",
    ])
