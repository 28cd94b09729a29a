"""The Spark jobs on a standalone cluster of two workers on loopback (`spark_cluster`), submitted by plain
`spark-submit --master spark://…` with no PYSPARK_* variable and a `python3` on PATH that lacks the library, as
docs/spark-cluster.md says they run: bulk enqueue counts and quarantines exactly what a local run does; catch-up
delivers every due message exactly once, its executors in a Python that has the library's dependencies but not the
library, which the job ships itself. Each job's wall time is printed (`pytest -s`), for docs/spark-cluster.md."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sparkjob import JDBC_JAR

from delaywheel import Store
from tests.helpers import (
    SPARK_DIR,
    SPARK_HOME,
    SparkCluster,
    bulk_rows,
    fresh_database,
    quarantine_rows,
    send_backlog,
    written,
)

SUBMIT = SPARK_HOME / "bin" / "spark-submit"  # what the venv's .venv/bin/spark-submit runs
GOOD_ROWS = 20_000  # besides bulk_rows' 80 good and 9 bad ones: enough for two writers on two executors


def submit(
    cluster: SparkCluster, master: str, job: str, args: list[str], log: Path, env: dict[str, str]
) -> tuple[dict[str, Any], float]:
    """`spark-submit --master MASTER --jars <JDBC jar> <job>.py ARGS` (docs/spark-cluster.md) in the cluster's
    environment plus `env`; returns the job's JSON line and its wall time in seconds. Spark's log goes to `log`."""
    started = time.monotonic()
    with log.open("w") as err:
        done = subprocess.run(
            [str(SUBMIT), "--master", master, "--jars", JDBC_JAR, str(SPARK_DIR / f"{job}.py"), *args],
            env=cluster.env | env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=600,
        )
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"{job} on {master} failed:\n" + "\n".join(log.read_text().splitlines()[-40:])
    (line,) = [text for text in done.stdout.splitlines() if text.startswith('{"job"')]
    return json.loads(line), seconds


def test_bulk_enqueue_on_the_cluster_counts_and_quarantines_as_a_local_run(
    spark_cluster: SparkCluster, server_url: str, template_db: str, t0: datetime, tmp_path: Path
) -> None:
    rows, bad = bulk_rows(t0)
    rows += [
        {
            "topic": "orders",
            "key": f"g{i}",
            "body": json.dumps({"g": i}),
            "delay_level": str(1 + i % 18),
            "deliver_at": "",
        }
        for i in range(GOOD_ROWS)
    ]
    path = tmp_path / "orders.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    good = len(rows) - len(bad)
    seconds = {}
    for master in (spark_cluster.master, "local[2]"):
        with fresh_database(server_url, template_db) as url, Store(url) as store:
            report, seconds[master] = submit(
                spark_cluster,
                master,
                "bulk_enqueue",
                [
                    "--db-url",
                    url,
                    "--input",
                    str(path),
                    "--now",
                    t0.isoformat(),
                    "--partitions",
                    "2",
                    "--chunk",
                    "2000",
                ],
                tmp_path / f"bulk-{master.split(':')[0]}.log",
                {"DELAYWHEEL_INPUT_ROOTS": str(tmp_path)},
            )

            assert report == {
                "job": "bulk_enqueue",
                "rows": len(rows),
                "enqueued": good,
                "skipped_already_enqueued": 0,
                "quarantined": len(bad),
                "reasons": dict(Counter(bad.values())),
            }, master
            assert written(store) == good
            assert {n: reason for n, (reason, _) in quarantine_rows(store).items()} == bad
    assert "delaywheel bulk enqueue" in spark_cluster.completed_apps()
    print(f"\nbulk enqueue, {len(rows):,} CSV rows: " + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()))


def test_catch_up_on_the_cluster_is_exactly_once(
    spark_cluster: SparkCluster, store: Store, db_url: str, t0: datetime, tmp_path: Path
) -> None:
    send_backlog(store, t0, 4000)
    store.cancel(key="m8")  # a wheel message
    store.cancel(key="m9")  # a level message
    outage_end = t0 + timedelta(minutes=40)
    due = store.conn.execute(
        "SELECT count(*) FROM (SELECT id, deliver_at FROM delaywheel.level_queue UNION ALL"
        " SELECT id, deliver_at FROM delaywheel.wheel UNION ALL SELECT id, deliver_at FROM delaywheel.wheel_far) m"
        " WHERE deliver_at <= %s AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = m.id)",
        (outage_end,),
    ).fetchone()[0]  # type: ignore[index]
    # The executors' Python: this interpreter and its site-packages (pyarrow, psycopg) without their .pth files, so
    # without the editable delaywheel; it notes each start.
    starts = tmp_path / "python-starts"
    python = tmp_path / "deps-only-python"
    python.write_text(
        f'#!/bin/sh\necho $$ >> {starts}\nPYTHONPATH="{sysconfig.get_paths()["purelib"]}'
        f'${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} -S "$@"\n'
    )
    python.chmod(0o755)
    assert subprocess.run([str(python), "-c", "import delaywheel"], capture_output=True).returncode != 0
    starts.unlink()

    report, seconds = submit(
        spark_cluster,
        spark_cluster.master,
        "redeliver",
        ["--db-url", db_url, "--now", outage_end.isoformat(), "--mode", "catch-up", "--batch", "300"],
        tmp_path / "catch-up.log",
        {"DELAYWHEEL_SPARK_PYTHON": str(python)},
    )

    assert 1000 < report["delivered"] == due < 4000
    assert starts.read_text().split()  # the executors ran that Python: the library they imported was the job's zip
    assert "delaywheel redeliver (catch-up)" in spark_cluster.completed_apps()
    assert store.deliver_due(now=t0 + timedelta(hours=3)) == 4000 - 2 - report["delivered"]
    rows = store.conn.execute(
        "SELECT message_id, key, deliver_at, delivered_at FROM delaywheel.topic_messages"
    ).fetchall()
    assert len(rows) == len({r[0] for r in rows}) == 4000 - 2  # exactly once, nothing lost
    assert not {"m8", "m9"} & {r[1] for r in rows}
    assert all(delivered >= due_at for _, _, due_at, delivered in rows)  # never early
    print(f"\ncatch-up of {report['delivered']:,} due messages on {spark_cluster.master}: {seconds:.1f} s")
