"""A listener of the plugin: Airflow's long-lived processes import, once, what delaywheel's tasks run.

Under the LocalExecutor (fork, Linux's default) a task process is forked from a worker, itself forked from the
scheduler when its executor started: the task finds imported whatever the scheduler had imported by then, and imports
anything else itself. A deliver lane task's `execute` would import psycopg, the store, the runner and the postgres
provider in each task process, one per lane all at once at every deliver run's start, on a machine whose cores the
deliveries and consumers share (DESIGN.md, "What sets its p99 on two cores").

Airflow calls `on_starting` when it builds a job: the scheduler's before its executor forks the workers, the
triggerer's and the DAG processor's (whose triggers and parses then find the modules too). The task SDK calls it as
well, in every task process, with a `TaskRunnerMarker`: there nothing is imported, so a task that is not ours pays
nothing. Nothing is imported at this module's import either: Airflow imports the plugin, and with it this listener,
in every task process and every DAG parse.
"""

from __future__ import annotations

import importlib
import sys

from airflow.listeners import hookimpl

# What the operators' and the consumer's `execute` import, and what the DAG files import at their parse.
TASK_MODULES = (
    "delaywheel.deliver.runner",
    "delaywheel.consume.consumer",
    "delaywheel.consume.lease",
    "delaywheel.airflow.hooks",
    "delaywheel.airflow.operators",
)


@hookimpl
def on_starting(component: object) -> None:
    """Import `TASK_MODULES` when `component` is one of Airflow's jobs (scheduler, triggerer, DAG processor)."""
    jobs = sys.modules.get("airflow.jobs.job")  # a job's process has imported it: no import here to find out
    if jobs is not None and isinstance(component, jobs.Job):
        for name in TASK_MODULES:
            importlib.import_module(name)
