"""delaywheel_lateness_quality: delivery lateness as a data contract, every 15 minutes, with Spark and
Great Expectations.

Each run checks the due-time window of the last `window_minutes` (ending `settle_seconds` ago, so deliveries
in flight are not counted as missing): zero early deliveries, p99 lateness within `p99_ms` per lane, no
duplicate delivery, every message due delivered or cancelled. Aggregates go to
`delaywheel.lateness_minutes`, the GX result to `delaywheel.validation_results`, and the HTML report's path
is printed in the task log. A broken contract fails the task with the failed expectations and figures.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from delaywheel.airflow.forms import ISO_8601
from delaywheel.airflow.spark import spark_job

# What the form accepts before a run is created (the job parses them again).
P99_LIMITS = r"^\s*((default|wheel|direct|\d+)=)?\d+(\.\d*)?(\s*,\s*((default|wheel|direct|\d+)=)?\d+(\.\d*)?)*\s*$"

with DAG(
    dag_id="delaywheel_lateness_quality",
    schedule=timedelta(minutes=15),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delaywheel", "spark", "data-quality"],
    doc_md=__doc__,
    params={
        "store": Param(
            None,
            type=["null", "string"],
            pattern=r"^([a-z][a-z0-9_]{0,39})?$",
            description="with several stores (docs/stores.md): the store to work on (empty: the only store; needed with several)",
        ),
        "window_minutes": Param(15, type="number", minimum=0.1, description="length of the due-time window"),
        "settle_seconds": Param(60, type="number", minimum=0, description="leave out the most recent due times"),
        # Optional fields are nullable: the form sends an empty field as null (a plain "string" would be required).
        "start": Param(
            None,
            type=["null", "string"],
            pattern=ISO_8601,
            description="or: an explicit window start (ISO-8601, UTC if no offset; empty: end - window)",
        ),
        "end": Param(
            None,
            type=["null", "string"],
            pattern=ISO_8601,
            description="and end, exclusive (empty: now - settle_seconds)",
        ),
        "p99_ms": Param(
            "5000",
            type="string",
            pattern=P99_LIMITS,
            title="p99 limits (ms)",
            description="MS, or default=MS,LEVEL=MS,wheel=MS,direct=MS",
        ),
        "report_dir": Param(
            None, type=["null", "string"], description="where the HTML report goes (empty: .delaywheel/reports)"
        ),
    },
) as dag:
    spark_job(
        "lateness_quality",
        "lateness_quality",
        [
            "--window-minutes",
            "{{ params.window_minutes }}",
            "--settle-seconds",
            "{{ params.settle_seconds }}",
            "--start",
            "{{ params.start or '' }}",
            "--end",
            "{{ params.end or '' }}",
            "--p99-ms",
            "{{ params.p99_ms }}",
            "--report-dir",
            "{{ params.report_dir or '' }}",
        ],
    )
