"""The delaywheel Spark jobs as Airflow tasks: one `SparkSubmitOperator` shape for every job's DAG.

The Spark connection (`spark_default`) decides where a job runs: `local[*]` by default, or a cluster
(`spark://host:7077`, `yarn`, `k8s://…`) by editing that connection; nothing in the DAGs changes. The store's
URL comes from the `delaywheel_default` connection at run time (templated, never read while parsing).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from delaywheel.config import PROJECT_ROOT

SPARK_DIR = PROJECT_ROOT / "spark"
JDBC_JAR = os.environ.get("DELAYWHEEL_JDBC_JAR", "/usr/share/java/postgresql.jar")
DB_URL = "{{ conn.delaywheel_default.get_uri() }}"
# Who asked, for audit rows: the user who triggered the run, else the scheduler.
REQUESTED_BY = "{{ dag_run.triggering_user_name or 'scheduler' }}"


def spark_job(task_id: str, job: str, args: list[str], **kwargs: Any) -> SparkSubmitOperator:
    """`spark-submit spark/<job>.py --db-url <store> <args…>` on the `spark_default` connection.

    Executors need the delaywheel library: with `local[*]` they use this interpreter (PYSPARK_PYTHON); on a
    cluster, install delaywheel into the cluster's Python and set DELAYWHEEL_SPARK_PYTHON to it."""
    python = os.environ.get("DELAYWHEEL_SPARK_PYTHON", sys.executable)
    return SparkSubmitOperator(
        task_id=task_id,
        conn_id="spark_default",
        application=str(SPARK_DIR / f"{job}.py"),
        py_files=str(SPARK_DIR / "sparkjob.py"),
        jars=JDBC_JAR,
        name=f"delaywheel-{job}",
        application_args=["--db-url", DB_URL, "--requested-by", REQUESTED_BY, *args],
        env_vars={"PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": python, "TZ": "UTC"},
        **kwargs,
    )
