"""An Asset-scheduled consumer DAG wakes for its group's retries, on a quiet topic as on a busy one.

A message a consumer fails comes back through its group's retry topic (`%RETRY%<group>`) after the retry level's
delay; `pull` reads it there. A DAG scheduled on the topic's Asset alone never ran for it: the retry waited for the
next ordinary message on the topic, and on a quiet topic for ever. The template is scheduled on
`consumer_schedule(TOPIC, GROUP)`, the topic's Asset or the retry topic's, each with its watcher.

The first test runs the parsed template's own watchers against the store; the second runs a copy of the template,
made as docs/airflow.md tells a user to, in a live Airflow (`scripts/airflow.sh`: scheduler, triggerer, DAG
processor, API server) with the deliver DAG, fails one message and sends nothing else: the retry must be handled by a
later run within the retry level's delay and a few seconds."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from delaywheel import Settings, Store, parse_levels
from tests.helpers import SCRIPT, ours, processes, script_env, trigger_events

pytestmark = pytest.mark.airflow

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "dags" / "consumer_template.py"
RETRY_URI = "delaywheel://topics/%25RETRY%25orders-template"


def test_the_templates_schedule_wakes_it_for_its_groups_retries(store_connection: str, db_url: str) -> None:
    """The template's schedule is the topic's Asset or its group's retry topic's (either event starts a run, not
    both), and the retry topic's watcher announces a retry while the topic itself stays quiet. The template was
    scheduled on the topic's Asset alone: no watcher saw the retry."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import AssetAny

    bag = DagBag(dag_folder=str(TEMPLATE))
    assert bag.import_errors == {}
    condition = bag.dags["delaywheel_consumer_template"].timetable.asset_condition
    assert isinstance(condition, AssetAny), condition
    assets = {asset.uri: asset for asset in condition.objects}
    assert list(assets) == ["delaywheel://topics/orders", RETRY_URI]
    watchers = {uri: [w.trigger for w in asset.watchers] for uri, asset in assets.items()}
    assert [t.topic for ts in watchers.values() for t in ts] == ["orders", "%RETRY%orders-template"]

    (topic_watcher,) = watchers["delaywheel://topics/orders"]
    (retry_watcher,) = watchers[RETRY_URI]
    topic_watcher.poll_interval = retry_watcher.poll_interval = 0.1
    with Store(db_url, Settings(levels=parse_levels("1s 1s 1s"))) as store:  # the first retry's level: 1 s
        sent = store.send("orders", {"n": 1})  # level 0: in the topic at once
        (event,) = trigger_events(topic_watcher, 2, 3.0)
        assert event.payload["count"] == 1
        assert trigger_events(retry_watcher, 1, 0.5) == []  # nothing failed yet

        batch = store.pull("orders", "orders-template", 10)
        assert [m.message_id for m in batch.messages] == [sent]
        store.ack(batch, {sent})  # failed: onto the retry ladder's first level
        time.sleep(1.1)
        assert store.deliver_level(3).delivered == 1  # the retry, due, into the group's retry topic

        assert trigger_events(topic_watcher, 1, 1.0) == []  # the topic is quiet
        (event,) = trigger_events(retry_watcher, 2, 5.0)
        assert (event.payload["topic"], event.payload["count"]) == ("%RETRY%orders-template", 1)
        (retry,) = store.pull("orders", "orders-template", 10).messages
        assert (retry.idempotency_id, retry.reconsume_times, retry.source_topic) == (
            sent,
            1,
            "%RETRY%orders-template",
        )


# The live test: levels whose third (the first retry's, `retry.FIRST_RETRY_LEVEL`) is RETRY_DELAY_S long.
LEVELS, RETRY_DELAY_S = "1s 2s 5s", 5.0
# From the retry falling due to its handling: the retry watcher's look (on the delivery's NOTIFY, else within its 1-s
# poll), the scheduler making the run, a LocalExecutor task start, a pull. Measured here beside other test runs:
# 1.3-1.4 s (6.8-7.8 s from the failure's handling).
SLACK_S = 15.0
STARTED_WITHIN_S = 300  # script start -> the deliver task running and the topic's watcher looking (~60 s here)
TOPIC, GROUP, DAG_ID = "quiet", "quiet-consumer", "quiet_consumer"

# The template's handle() replaced as a user would: this one records each message it is given (to RECORDS, one line
# each: idempotency id, reconsume times, the topic read, when handled, when due) and fails each first delivery.
HANDLE = '''def handle(messages: list[Delivered]) -> set[int]:
    """Record each message; fail each first delivery (its retry must come back on its own)."""
    import time

    with open(RECORDS, "a") as out:
        for m in messages:
            out.write(f"{m.idempotency_id}\\t{m.reconsume_times}\\t{m.source_topic}\\t{time.time():.3f}\\t"
                      f"{m.deliver_at.timestamp():.3f}\\n")
    return {m.message_id for m in messages if m.reconsume_times == 0}
'''


def consumer_copy(records: Path) -> str:
    """dags/consumer_template.py as docs/airflow.md tells a user to copy it: dag_id, TOPIC, GROUP and handle()."""
    text = TEMPLATE.read_text()
    for old, new in (
        ('dag_id="delaywheel_consumer_template"', f"dag_id={DAG_ID!r}"),
        ('TOPIC = "orders"', f"TOPIC = {TOPIC!r}"),
        ('GROUP = "orders-template"', f"GROUP = {GROUP!r}\nRECORDS = {str(records)!r}"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    text, n = re.subn(r"def handle\(.*?\n    return set\(\)\n", lambda _: HANDLE, text, flags=re.S)
    assert n == 1
    return text


def records_of(path: Path) -> list[tuple[int, int, str, float, float]]:
    if not path.exists():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    return [(int(i), int(n), topic, float(at), float(due)) for i, n, topic, at, due in rows]


@pytest.mark.timeout(600)
def test_a_live_consumer_dag_handles_its_retry_on_a_quiet_topic(
    tmp_path: Path, server_url: str, db_url: str, metadata_db: str, store: Store
) -> None:
    """One message on a topic nothing else is sent to; the consumer DAG fails it. A later run, started by the retry
    topic's watcher, handles the retry within the retry level's delay and SLACK_S; nothing else is handled."""
    home, run_dir, dags = tmp_path / "airflow", tmp_path / "run", tmp_path / "dags"
    run_dir.mkdir()
    dags.mkdir()
    records = tmp_path / "handled.tsv"
    shutil.copy(ROOT / "dags" / "delaywheel_deliver.py", dags)
    (dags / f"{DAG_ID}.py").write_text(consumer_copy(records))
    env = script_env(home, db_url, metadata_db) | {
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",  # the copy starts unpaused; its watchers run
        "AIRFLOW__DELAYWHEEL__DELIVER_TASKS": "one",  # one deliver task serves the three levels and the wheel
        "DELAYWHEEL_LEVELS": LEVELS,
    }
    meta = make_conninfo(server_url, dbname=metadata_db)
    output = tmp_path / "airflow.sh.log"
    with output.open("wb") as out:
        script = subprocess.Popen(
            [str(SCRIPT)], cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    sessions: set[int] = set()
    try:
        started = time.monotonic()
        while not (deliver_running(meta) and watching(store)):
            assert script.poll() is None, output.read_text()[-5000:]
            assert time.monotonic() - started < STARTED_WITHIN_S, output.read_text()[-5000:]
            time.sleep(1)
        sessions = {pid for pid, (cwd, sid, _) in processes().items() if cwd == str(run_dir) and sid == pid}

        sent = store.send(TOPIC, {"order": 1})  # level 0: in the topic at once; nothing else is sent to it
        deadline = time.monotonic() + 60 + RETRY_DELAY_S + SLACK_S
        while len(records_of(records)) < 2 and time.monotonic() < deadline:
            assert script.poll() is None, output.read_text()[-5000:]
            time.sleep(0.5)
        time.sleep(3)  # a third handling (a duplicate) would show up now
        handled = records_of(records)
        runs = consumer_runs(meta)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGINT)  # Ctrl-C: the script stops every service in order
            try:
                script.wait(timeout=150)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)
                script.wait()
        for pid in ours(run_dir, sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    assert [(i, n, topic) for i, n, topic, _, _ in handled] == [(sent, 0, TOPIC), (sent, 1, f"%RETRY%{GROUP}")], (
        handled,
        runs,
    )
    (_, _, _, failed_at, _), (_, _, _, retried_at, retry_due) = handled
    print(f"retry handled {retried_at - failed_at:.1f} s after the failure, {retried_at - retry_due:.1f} s after due")
    assert retried_at - retry_due <= SLACK_S, (handled, runs)
    assert retried_at - failed_at <= RETRY_DELAY_S + SLACK_S, (handled, runs)
    # the second run was started by the retry topic's event, the first by the topic's
    triggered_by = [uri for _, uri in runs]
    assert triggered_by[:2] == [f"delaywheel://topics/{TOPIC}", f"delaywheel://topics/%25RETRY%25{GROUP}"], runs


def deliver_running(meta: str) -> bool:
    with contextlib.suppress(psycopg.Error), psycopg.connect(meta, connect_timeout=5) as conn:  # not migrated yet
        return bool(
            conn.execute(
                "SELECT 1 FROM task_instance WHERE dag_id = 'delaywheel_deliver' AND state = 'running'"
            ).fetchone()
        )
    return False


def watching(store: Store) -> bool:
    """The topic's watcher has looked once (a first look makes the topic's mark). Not the retry topic's: a DAG
    scheduled on the topic alone has none, and must fail below, on the retry never handled. (A retry watcher that
    first looks after the retry arrived still announces it: a new mark starts before every message.)"""
    return store.conn.execute("SELECT 1 FROM delaywheel.topic_watch WHERE topic = %s", (TOPIC,)).fetchone() is not None


def consumer_runs(meta: str) -> list[tuple[str, str]]:
    """(run id, the uri of the Asset event that started it) of each run of the consumer copy, in order."""
    with psycopg.connect(meta, connect_timeout=5) as conn:
        return conn.execute(
            "SELECT dr.run_id, a.uri FROM dag_run dr"
            " JOIN dagrun_asset_event dae ON dae.dag_run_id = dr.id"
            " JOIN asset_event ae ON ae.id = dae.event_id JOIN asset a ON a.id = ae.asset_id"
            " WHERE dr.dag_id = %s ORDER BY dr.id, ae.id",
            (DAG_ID,),
        ).fetchall()
