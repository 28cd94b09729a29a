"""delaywheel_bulk_enqueue: enqueue millions of delayed messages from files or a query, with Spark.

Trigger it from the UI with the form: an input path or glob (CSV, JSON lines, Parquet) or a PostgreSQL
query, a column mapping and a topic. Every row is checked by the rules of `send`; bad rows go to
`delaywheel.quarantine` with reason, file and row number; triggering the same input again enqueues nothing
new (idempotency by source and key). The job's counts are the last JSON line of the task log.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from delaywheel.airflow.spark import spark_job

with DAG(
    dag_id="delaywheel_bulk_enqueue",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    tags=["delaywheel", "spark"],
    doc_md=__doc__,
    params={
        "input": Param("", type="string", title="Input path or glob",
                       description="CSV, JSON lines or Parquet; leave empty to read a query instead"),
        "query": Param("", type="string", title="Or: PostgreSQL query", description="read over JDBC"),
        "source_url": Param("", type="string", title="Query database",
                            description="PostgreSQL URL of the database the query reads (empty: the store's)"),
        "format": Param("", type="string", enum=["", "csv", "json", "parquet"],
                        description="empty: from the file name"),
        "map": Param("", type="string", title="Column mapping",
                     description="FIELD=COLUMN,… for topic, key, body, tags, properties and one of "
                                 "delay_level, delay_ms, deliver_at; unmapped fields use same-named columns"),
        "topic": Param("", type="string", description="the topic of every row, if no topic column is mapped"),
        "body_format": Param("json", type="string", enum=["json", "text", "bytes"],
                             description="what a text body column holds"),
        "source": Param("", type="string", title="Idempotency source",
                        description="re-running with the same source skips rows already enqueued "
                                    "(default: the input path or query)"),
        "chunk": Param(50000, type="integer", minimum=1, description="rows per transaction in each partition"),
        "partitions": Param("", type="string", pattern=r"^([1-9]\d*)?$",
                            description="repartition the input to this many writers (empty: at least one per core)"),
        "parquet_reader": Param("auto", type="string", enum=["auto", "spark"], title="Parquet reader",
                                description="auto: local Parquet row groups read by pyarrow in the workers where "
                                            "they read as Spark reads them; spark: always Spark's reader"),
    },
) as dag:
    spark_job("bulk_enqueue", "bulk_enqueue", [
        "--input", "{{ params.input }}", "--query", "{{ params.query }}", "--source-url", "{{ params.source_url }}",
        "--format", "{{ params.format }}",
        "--map", "{{ params.map }}", "--topic", "{{ params.topic }}", "--body-format", "{{ params.body_format }}",
        "--source", "{{ params.source }}", "--chunk", "{{ params.chunk }}", "--partitions", "{{ params.partitions }}",
        "--parquet-reader", "{{ params.parquet_reader }}",
    ])
