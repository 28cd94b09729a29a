"""delaywheel_bulk_enqueue: enqueue millions of delayed messages from files or a query, with Spark.

Trigger it from the UI with the form: an input path or glob (CSV, JSON lines, Parquet) or a PostgreSQL
query, a column mapping and a topic. Every row is checked by the rules of `send`; bad rows go to
`delaywheel.quarantine` with reason, file and row number; triggering the same input again enqueues nothing
new (idempotency by source and key). The job's counts are the last JSON line of the task log.

What the form may name is limited by configuration: the input must lie under an input root
(`DELAYWHEEL_INPUT_ROOTS`, default the project's `data/` and `.delaywheel/input/`), the query must be one read-only
SELECT (run in a READ ONLY session with a statement timeout), and its database must be the store or an allowed source
(`DELAYWHEEL_ALLOWED_SOURCES`: Airflow connection ids or URLs). Optional fields may stay empty (the form sends null).
The DAG changes data, so in a deployment with the FAB auth manager it is triggered by the `delaywheel_operator` role
(`access_control`), besides the roles allowed every DAG.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from delaywheel.airflow.forms import OPERATOR_ACCESS, TOPIC
from delaywheel.airflow.spark import spark_job

with DAG(
    dag_id="delaywheel_bulk_enqueue",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    tags=["delaywheel", "spark"],
    doc_md=__doc__,
    access_control=OPERATOR_ACCESS,
    params={
        # Optional fields are nullable: the form sends an empty field as null (a plain "string" would be required).
        "input": Param(
            None,
            type=["null", "string"],
            title="Input path or glob",
            description="CSV, JSON lines or Parquet under an input root (DELAYWHEEL_INPUT_ROOTS); "
            "leave empty to read a query instead",
        ),
        "query": Param(
            None,
            type=["null", "string"],
            title="Or: PostgreSQL query",
            maxLength=20000,
            description="one read-only SELECT, read over JDBC in a read-only session",
        ),
        "source_url": Param(
            None,
            type=["null", "string"],
            title="Query database",
            description="an allowed source (DELAYWHEEL_ALLOWED_SOURCES: an Airflow connection id or "
            "URL) for the query (empty: the store's database)",
        ),
        # Not a nullable enum: Airflow 3's form has refused to render an enum holding null (apache/airflow#62049).
        "format": Param(
            "auto", type="string", enum=["auto", "csv", "json", "parquet"], description="auto: from the file name"
        ),
        "map": Param(
            None,
            type=["null", "string"],
            title="Column mapping",
            pattern=r"^\s*([a-z_]+\s*=\s*[^,=]+(\s*,\s*[a-z_]+\s*=\s*[^,=]+)*)?\s*$",
            description="FIELD=COLUMN,… for topic, key, body, tags, properties and one of "
            "delay_level, delay_ms, deliver_at; unmapped fields use same-named columns",
        ),
        "topic": Param(
            None,
            type=["null", "string"],
            pattern=TOPIC,
            description="the topic of every row, if no topic column is mapped",
        ),
        "body_format": Param(
            "json", type="string", enum=["json", "text", "bytes"], description="what a text body column holds"
        ),
        "source": Param(
            None,
            type=["null", "string"],
            title="Idempotency source",
            description="re-running with the same source skips rows already enqueued "
            "(default: the input path or query)",
        ),
        "chunk": Param(50000, type="integer", minimum=1, description="rows per transaction in each partition"),
        "partitions": Param(
            None,
            type=["null", "string"],
            pattern=r"^([1-9]\d*)?$",
            description="repartition the input to this many writers (empty: at least one per core)",
        ),
        "parquet_reader": Param(
            "auto",
            type="string",
            enum=["auto", "spark"],
            title="Parquet reader",
            description="auto: local Parquet row groups read by pyarrow in the workers where "
            "they read as Spark reads them; spark: always Spark's reader",
        ),
    },
) as dag:
    spark_job(
        "bulk_enqueue",
        "bulk_enqueue",
        [
            "--input",
            "{{ params.input or '' }}",
            "--query",
            "{{ params.query or '' }}",
            "--source-url",
            "{{ params.source_url or '' }}",
            "--format",
            "{{ params.format }}",
            "--map",
            "{{ params.map or '' }}",
            "--topic",
            "{{ params.topic or '' }}",
            "--body-format",
            "{{ params.body_format }}",
            "--source",
            "{{ params.source or '' }}",
            "--chunk",
            "{{ params.chunk }}",
            "--partitions",
            "{{ params.partitions or '' }}",
            "--parquet-reader",
            "{{ params.parquet_reader }}",
        ],
    )
