"""End to end in a real browser: Airflow's API server (UI + our plugin), scheduler and DAG processor on the
project's PostgreSQL; headless Chromium (Debian's, never a downloaded one) logs in through the UI, triggers the
consumer template DAG with parameters from the trigger form, then opens the delaywheel page from the navigation
and checks its figures against the store. A second test opens the trigger form of every DAG the DagBag loads
from dags/ and submits it with its defaults (each DAG paused, so nothing heavy runs); the run must be created.
Screenshots (one per form: form-<dag_id>.png) and service logs go to test-output/browser/."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from delaywheel import Store
from tests.helpers import free_ports, fresh_database

pytestmark = [pytest.mark.browser, pytest.mark.airflow]

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "test-output" / "browser"
CHROMIUM = "/usr/bin/chromium"
METADATA_DB = f"airflow_browser_{os.getpid()}"  # its own: a scheduler must not pick up other sessions' runs
DAG_ID = "delaywheel_consumer_template"  # consumes topic "orders" as group "orders-template"
TOPIC, GROUP = "orders", "orders-template"
USER, PASSWORD = "admin", "browser-test-pw"
STARTUP_S = 150.0


@dataclass
class Airflow:
    base: str
    token: str

    def api(self, path: str, method: str = "GET", **kwargs: Any) -> Any:
        response = httpx.request(
            method, f"{self.base}{path}", headers={"Authorization": f"Bearer {self.token}"}, timeout=30, **kwargs
        )
        response.raise_for_status()
        return response.json() if response.content else None


def wait_for(what: str, check: Any, timeout: float, procs: list[subprocess.Popen[bytes]]) -> Any:
    """Poll `check()` until it returns something truthy; fail early if an Airflow service died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"Airflow service exited while waiting for {what}: {dead} (logs in {OUT})"
        try:
            if result := check():
                return result
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (logs in {OUT})")


@pytest.fixture(scope="module")
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """The module's store: its Airflow (`airflow`), started once for both tests, reads it (`store` is on it too)."""
    with fresh_database(server_url, template_db) as url:
        yield url


@pytest.fixture(scope="module")
def airflow(
    airflow_db: dict[str, str], server_url: str, db_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Airflow]:
    """API server + scheduler + DAG processor on a fresh metadata database, started once for the module's tests (tens
    of seconds each start); the store is the module's database."""
    tmp_path = tmp_path_factory.mktemp("browser")
    OUT.mkdir(parents=True, exist_ok=True)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {METADATA_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {METADATA_DB}")
    server, store = conninfo_to_dict(server_url), conninfo_to_dict(db_url)
    pg = f"{server.get('user', 'postgres')}@{server.get('host', '127.0.0.1')}:{server.get('port', 5432)}"
    port, worker_log_port, trigger_log_port = free_ports(3)
    base = f"http://127.0.0.1:{port}"
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({USER: PASSWORD}))
    env = {
        **os.environ,
        **airflow_db,
        "AIRFLOW_HOME": str(tmp_path / "home"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://{pg}/{METADATA_DB}",
        "AIRFLOW_CONN_DELAYWHEEL_DEFAULT": f"postgresql://{pg}/{store['dbname']}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "browser-test-" + "s" * 52,
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
        "AIRFLOW__CORE__PARALLELISM": "4",
    }
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    # No `delaywheel_deliver` pool here on purpose: the continuous deliver DAG's tasks wait for it, so nothing
    # but the triggered consumer run changes the store while the page is compared with it.
    procs: list[subprocess.Popen[bytes]] = []
    for name, args in (
        ("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]),
        ("scheduler", ["scheduler"]),
        ("dag-processor", ["dag-processor"]),
    ):
        log = (OUT / f"{name}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "airflow", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        wait_for(
            "the API server",
            lambda: httpx.get(f"{base}/api/v2/monitor/health", timeout=5).status_code == 200,
            STARTUP_S,
            procs,
        )
        token = httpx.post(f"{base}/auth/token", json={"username": USER, "password": PASSWORD}, timeout=30)
        af = Airflow(base, token.json()["access_token"])
        wait_for(f"{DAG_ID} to be parsed", lambda: af.api(f"/api/v2/dags/{DAG_ID}"), STARTUP_S, procs)
        yield af
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {METADATA_DB} WITH (FORCE)")


def finished(airflow: Airflow, run_id: str) -> dict[str, Any] | None:
    run = airflow.api(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")
    return run if run["state"] in ("success", "failed") else None


def launch(p: Any, height: int = 1100) -> Any:
    browser = p.chromium.launch(
        executable_path=CHROMIUM,
        args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
    )
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.set_default_timeout(60_000)
    return browser, page


def sign_in(page: Any, airflow: Airflow, path: str) -> None:
    """Open `path`, which sends an anonymous browser to Airflow's login, sign in, and land back on `path`."""
    page.goto(f"{airflow.base}{path}")
    page.wait_for_url("**/auth/login**")  # the dashboard redirects at once, the UI's own pages by script
    page.get_by_label("Username").fill(USER)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{airflow.base}{path}")  # back where we were going, now signed in


def seed(store: Store) -> None:
    """Ten messages delivered into the consumer's topic, a level-18 backlog, wheel messages due in 45 min (two)
    and in 30 h (one: pending, but outside the next-24 h histogram)."""
    now = store.clock()
    for i in range(10):
        store.send(TOPIC, {"order": i}, delay_level=1, now=now - timedelta(seconds=5))
    # A pass delivers only below the commit horizon: the maintenance DAG's transactions on this database (it
    # runs once at startup) can hold it back for a moment, so pass until all ten are in the topic.
    delivered, deadline = 0, time.monotonic() + 60
    while delivered < 10 and time.monotonic() < deadline:
        delivered += store.deliver_level(1).delivered
        time.sleep(0.2)
    for i in range(4):
        store.send("orders.timeout", {"order": i}, delay_level=18)
    for minutes in (45, 45, 60 * 30):
        store.send("reminders", {"in": minutes}, deliver_at=now + timedelta(minutes=minutes))


def test_login_trigger_with_params_and_dashboard_matches_store(airflow: Airflow, store: Store) -> None:
    from playwright.sync_api import expect, sync_playwright

    seed(store)
    with sync_playwright() as p:
        browser, page = launch(p)

        # Anonymous: the dashboard's API is refused, the page sends the browser to Airflow's login.
        assert page.request.get(f"{airflow.base}/delaywheel/api/stats").status == 401
        sign_in(page, airflow, "/delaywheel/")
        expect(page.locator("h1")).to_have_text("delaywheel", timeout=60_000)

        # Trigger the consumer with parameters from the UI's trigger form: one batch of three messages.
        page.goto(f"{airflow.base}/dags/{DAG_ID}")
        page.get_by_test_id("trigger-dag-button").click()
        dialog = page.get_by_role("dialog")
        dialog.locator("input[name=element_batch_size]").fill("3")
        dialog.locator("input[name=element_max_batches]").fill("1")
        dialog.get_by_role("button", name="Advanced Options").click()
        dialog.get_by_label("Run ID").fill("ui_browser_run")
        dialog.get_by_test_id("trigger-dag-submit").click()
        page.wait_for_url("**/runs/ui_browser_run**")
        run = wait_for("the triggered run to finish", lambda: finished(airflow, "ui_browser_run"), 180, [])
        assert run["state"] == "success", run
        assert run["conf"] == {"batch_size": 3, "max_batches": 1, "tags": "*", "start": "earliest"}  # (defaults)

        # The delaywheel page, reached from the navigation (Browse menu), shown in the UI's iframe.
        page.goto(f"{airflow.base}/")
        page.get_by_role("button", name="Browse").click()
        page.get_by_role("menuitem", name="Delaywheel").click()
        page.wait_for_url("**/plugin/delaywheel")
        frame = page.frame_locator("iframe")
        try:
            expect(frame.locator("h1")).to_have_text("delaywheel", timeout=60_000)
        finally:
            page.screenshot(path=str(OUT / "airflow-nav-delaywheel.png"), full_page=True)

        stats = store.stats()
        shown_level = {
            int(row.get_attribute("data-level") or 0): {
                field: row.locator(f"td[data-field={field}]").inner_text()
                for field in ("backlog", "checkpoint", "delivered")
            }
            for row in frame.locator("#levels tr[data-level]").all()
        }
        expected_level = {
            row["level"]: {
                "backlog": str(row["backlog"]),
                "delivered": str(row["delivered"]),
                "checkpoint": f"{row['checkpoint_xid']}, {row['checkpoint_id']}",
            }
            for row in stats["levels"]
        }
        assert shown_level == expected_level
        assert (shown_level[18]["backlog"], shown_level[1]["delivered"]) == ("4", "10")
        assert frame.locator("#wheel [data-field=pending]").inner_text() == str(stats["wheel"]["pending"]) == "3"
        shown_topics = {
            (row.get_attribute("data-topic"), row.get_attribute("data-group") or None): (
                row.locator("td[data-field=depth]").inner_text(),
                row.locator("td[data-field=lag]").inner_text(),
            )
            for row in frame.locator("#topics tr[data-topic]").all()
        }
        expected_topics = {
            (t["topic"], t["consumer_group"]): (str(t["depth"]), str(t["lag"]) if t["consumer_group"] else "—")
            for t in stats["topics"]
        }
        assert shown_topics == expected_topics
        assert shown_topics[(TOPIC, GROUP)] == ("10", "7")  # the UI-triggered run consumed exactly its 3
        bars = frame.locator("#histogram-chart rect[data-value]")
        assert sum(int(v or 0) for v in bars.evaluate_all("els => els.map(e => e.dataset.value)")) == 2

        page.goto(f"{airflow.base}/delaywheel/")
        page.screenshot(path=str(OUT / "delaywheel-page.png"), full_page=True)
        browser.close()


def dagbag() -> dict[str, Any]:
    """Every DAG the DagBag loads from dags/: a new DAG is covered without editing this test."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    return dict(bag.dags)


def parsed_dag_ids(airflow: Airflow) -> set[str]:
    return {d["dag_id"] for d in airflow.api("/api/v2/dags?limit=1000")["dags"]}


def test_every_dags_trigger_form_submits_with_its_defaults(airflow: Airflow) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    dags = dagbag()
    dag_ids = sorted(dags)
    assert len(dag_ids) >= 10
    wait_for("every DAG to be parsed", lambda: set(dag_ids) <= parsed_dag_ids(airflow), STARTUP_S, [])
    # Paused, a triggered run stays queued: the form is what is tested, not the jobs (Spark on 2 cores). The
    # form offers to unpause the DAG on trigger; the test unticks that and checks the DAG stayed paused.
    for dag_id in dag_ids:
        airflow.api(f"/api/v2/dags/{dag_id}", "PATCH", json={"is_paused": True})
    # The deliver DAG's lanes as the grid lists them: in level order (Airflow sorts a DAG's top level by node id).
    grid = [node["label"] for node in airflow.api("/ui/grid/structure/delaywheel_deliver")]
    assert grid[:3] == ["level 1 (1s)", "level 2 (5s)", "level 3 (10s)"] and grid[-2] == "timing wheel", grid
    assert grid.index("level 2 (5s)") < grid.index("level 10 (6m)")

    problems: dict[str, str] = {}
    with sync_playwright() as p:
        browser, page = launch(p, height=2000)  # tall: the longest form fits in one screenshot
        sign_in(page, airflow, "/")
        for dag_id in dag_ids:
            run_id = f"ui_form_{dag_id}"
            page.goto(f"{airflow.base}/dags/{dag_id}")
            page.get_by_test_id("trigger-dag-button").click()
            dialog = page.get_by_role("dialog")
            submit = dialog.get_by_test_id("trigger-dag-submit")
            expect(submit).to_be_visible()
            unpause = dialog.get_by_text(re.compile(r"^Unpause .* on trigger$"))
            unpause.click()  # ticked by default: untick it, the DAG stays paused
            page.screenshot(path=str(OUT / f"form-{dag_id}.png"), full_page=True)  # the run parameters, as shown
            if not submit.is_enabled():  # the form refuses its own defaults
                problems[dag_id] = "Trigger disabled with the defaults"
                continue
            dialog.get_by_role("button", name="Advanced Options").click()
            dialog.get_by_label("Run ID").fill(run_id)
            submit.click()
            try:
                page.wait_for_url(f"**/runs/{run_id}**", timeout=30_000)
            except PlaywrightTimeout as error:  # collect every DAG's outcome, fail once at the end
                page.screenshot(path=str(OUT / f"form-{dag_id}-submitted.png"), full_page=True)
                problems[dag_id] = f"no run page after submitting: {error}"
                continue
            run = airflow.api(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
            dag = airflow.api(f"/api/v2/dags/{dag_id}")
            if run["state"] not in ("queued", "running") or run["run_type"] != "manual" or not dag["is_paused"]:
                problems[dag_id] = f"run {run['state']}, {run['run_type']}, DAG paused: {dag['is_paused']}"
            elif set(run["conf"] or {}) != set(dags[dag_id].params):  # the form sent every field
                problems[dag_id] = f"conf {run['conf']} is not the DAG's params {sorted(dags[dag_id].params)}"
            if dag_id == "delaywheel_deliver":  # its run page shows the grid: lanes in level order
                expect(page.get_by_text("level 10 (6m)").first).to_be_visible()
                page.screenshot(path=str(OUT / "grid-delaywheel_deliver.png"), full_page=True)
            airflow.api(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", "DELETE")

        # What can be checked is checked before a run exists: a start that is not ISO-8601 is refused.
        page.goto(f"{airflow.base}/dags/delaywheel_lateness_quality")
        page.get_by_test_id("trigger-dag-button").click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_text(re.compile(r"^Unpause .* on trigger$")).click()
        dialog.locator("input[name=element_start]").fill("yesterday")
        dialog.get_by_test_id("trigger-dag-submit").click()
        expect(
            dialog.get_by_text(re.compile(r"Invalid input for param start: 'yesterday' does not match"))
        ).to_be_visible()  # Airflow validates the params against their schema before creating the run
        page.screenshot(path=str(OUT / "form-delaywheel_lateness_quality-invalid-start.png"), full_page=True)
        runs = airflow.api("/api/v2/dags/delaywheel_lateness_quality/dagRuns")
        assert runs["total_entries"] == 0, runs
        browser.close()
    assert problems == {}, problems
