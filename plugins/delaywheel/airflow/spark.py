"""The delaywheel Spark jobs as Airflow tasks: one `SparkSubmitOperator` shape for every job's DAG.

The Spark connection (`spark_default`) decides where a job runs: `local[*]` by default, or a cluster
(`spark://host:7077`, `yarn`, `k8s://…`) by editing that connection; nothing in the DAGs changes. The store's
URL comes from the `delaywheel_default` connection at run time (templated, never read while parsing). With several
stores (docs/stores.md) the job gets them all as DELAYWHEEL_STORES, each at its connection's URL
(`delaywheel_<name>`), and `--store NAME` when it works on one (`spark_job(store=…)`).

Spark's JVM logs at WARN (`spark/log4j2.properties`; DELAYWHEEL_SPARK_LOG_LEVEL=info in the worker's
environment asks for Spark's INFO lines), so a task log shows the jobs' own progress lines and result, not
hundreds of Spark INFO lines. On a `local[…]` master the driver and its UI listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseHook

from delaywheel.batch.inputs import connection_ids, connection_variable
from delaywheel.config import ConfigError, load_settings

from .connections import store_conn_id

# The job scripts: the checkout's top-level spark/, which the package links as delaywheel/spark and the wheel
# carries, so an installed delaywheel can submit them too.
SPARK_DIR = Path(__file__).resolve().parents[1] / "spark"
LOG4J2 = SPARK_DIR / "log4j2.properties"
JDBC_JAR = os.environ.get("DELAYWHEEL_JDBC_JAR", "/usr/share/java/postgresql.jar")
DB_URL = "{{ conn.delaywheel_default.get_uri() }}"
STORE_PARAM = "{{ params.get('store') or '' }}"  # a DAG's `store` form field, if it has one
# Who asked, for audit rows: the user who triggered the run, else the scheduler.
REQUESTED_BY = "{{ dag_run.triggering_user_name or 'scheduler' }}"


class DelaywheelSparkSubmitOperator(SparkSubmitOperator):
    """SparkSubmitOperator that keeps a local Spark on loopback: Spark binds its driver and UI to SPARK_LOCAL_IP,
    else to every interface. The master is only known at run time (the `spark_default` connection), and a
    cluster's executors must reach the driver, so SPARK_LOCAL_IP is set only for a `local[…]` master."""

    def execute(self, context: Any) -> None:
        try:
            master = BaseHook.get_connection(self._conn_id).host or ""
        except Exception:  # no such connection: the hook falls back to its own default (yarn)
            master = ""
        if master.startswith("local"):
            self.env_vars = {"SPARK_LOCAL_IP": "127.0.0.1", **(self.env_vars or {})}
        self.env_vars = {**_allowed_connections(), **_stores(), **(self.env_vars or {})}
        super().execute(context)


def _allowed_connections() -> dict[str, str]:
    """The allowed bulk-query sources that are Airflow connection ids, as AIRFLOW_CONN_<ID> variables for the job:
    the job reads them from its environment (batch/inputs.py), so only this module of the library talks to Airflow.
    A connection the worker does not know is left out; the job then refuses that source, naming it."""
    found = {}
    for conn_id in connection_ids(load_settings().allowed_sources):
        name = connection_variable(conn_id)
        if name in os.environ:
            continue
        try:
            found[name] = str(BaseHook.get_connection(conn_id).get_uri())
        except Exception:  # no such connection here
            continue
    return found


def _stores() -> dict[str, str]:
    """DELAYWHEEL_STORES for the job, with several stores: each configured store, by its configured name and in its
    configured order, at the URL of its Airflow connection `delaywheel_<name>` (the one its deliver DAG uses), or at
    its configured URL where this worker has no such connection. The job's routing table is the configuration's
    (DELAYWHEEL_ROUTES, inherited). Nothing with no stores configured: the job gets --db-url."""
    from .hooks import DelayWheelHook  # the postgres provider: when a job is submitted, not when a DAG is parsed

    entries = []
    for name, url in load_settings().stores:
        with contextlib.suppress(Exception):  # no such connection here: the configured URL
            url = DelayWheelHook(store_conn_id(name)).url
        entries.append(f"{name}={url}")
    return {"DELAYWHEEL_STORES": ",".join(entries)} if entries else {}


def _store_args(store: str | None) -> list[str]:
    """How a job is told its store (the choice read when the DAG file is parsed, as the DAGs' per-store tasks are):
    with one store, the `delaywheel_default` connection's URL; with several, their URLs come through `_stores`.
    `--store` is `store` when given, else the run's `store` parameter when the DAG's form has one (empty otherwise):
    with several stores and no store named, bulk enqueue routes each row to its topic's store, catch-up drains every
    store, and the jobs on one store (replay, reconcile, lateness quality) refuse to guess."""
    settings = load_settings()
    if store and not settings.stores:
        raise ConfigError(f"spark_job(store={store!r}): no stores are configured (DELAYWHEEL_STORES)")
    chosen = ["--store", store or STORE_PARAM]
    return chosen if settings.stores else ["--db-url", DB_URL, *chosen]


def spark_job(
    task_id: str, job: str | Path, args: list[str], *, store: str | None = None, **kwargs: Any
) -> SparkSubmitOperator:
    """`spark-submit spark/<job>.py --db-url <store> <args…>` on the `spark_default` connection; `job`
    may instead be the path of an application's own job file (the shop's order generator), which can import
    `sparkjob` like the library's jobs. With several stores, `store` names the one the job works on, if any
    (`_store_args`; it may be a template, such as a form's field).

    The driver runs this interpreter, which has the library. The job itself picks the executors' Python
    (`sparkjob.executor_python`: DELAYWHEEL_SPARK_PYTHON from this worker's environment, else this interpreter's
    path, which must then exist on every Spark worker) and ships the library to a cluster's executors
    (docs/spark-cluster.md)."""
    return DelaywheelSparkSubmitOperator(
        task_id=task_id,
        conn_id="spark_default",
        application=str(job if isinstance(job, Path) else SPARK_DIR / f"{job}.py"),
        py_files=str(SPARK_DIR / "sparkjob.py"),
        jars=JDBC_JAR,
        name=f"delaywheel-{Path(job).stem}",
        application_args=[*_store_args(store), "--requested-by", REQUESTED_BY, *args],
        env_vars={"PYSPARK_DRIVER_PYTHON": sys.executable, "TZ": "UTC"},
        conf={"spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{LOG4J2}", **kwargs.pop("conf", {})},
        **kwargs,
    )
