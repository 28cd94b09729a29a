"""The delaywheel plugin inside Airflow's real API server app (`create_app`), with Airflow's real auth:
the simple auth manager issues the tokens, Airflow's `get_user` checks them, the plugin's routes read the store
through the `delaywheel_default` connection."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from delaywheel import Store
from delaywheel.airflow.web.charts import hourly
from delaywheel.ops.stats import as_json
from tests.helpers import token

pytestmark = pytest.mark.airflow

ROOT = Path(__file__).resolve().parents[2]

# Figures that depend on the moment they are computed, not on the store's content.
CLOCK_DEPENDENT = {"now", "oldest_overdue_s", "lag_s", "since_last_pass_s", "start", "end"}


def seed(store: Store) -> None:
    """Something on every panel: level backlog, a delivered level with a checkpoint, wheel messages at several
    horizons, a topic with a consumer group that has acked part of it."""
    now = store.clock()
    for i in range(7):
        store.send("orders.timeout", {"order": i}, delay_level=18)
    for i in range(5):  # sent "20 s ago" on the 10 s level: due already, delivered right away
        store.send("orders.paid", {"order": i}, delay_level=3, now=now - timedelta(seconds=20))
    for minutes in (2, 30, 30, 90, 60 * 30):
        store.send("wheel.reminder", {"in_min": minutes}, deliver_at=now + timedelta(minutes=minutes))
    store.deliver_level(3)
    batch = store.pull("orders.paid", "billing", max_messages=2)
    store.ack(batch)


def without_clock(stats: dict[str, Any]) -> dict[str, Any]:
    """The figures with the clock-dependent ones dropped, recursively."""
    if isinstance(stats, dict):
        return {k: without_clock(v) for k, v in stats.items() if k not in CLOCK_DEPENDENT}
    if isinstance(stats, list):
        return [without_clock(v) for v in stats]  # type: ignore[return-value]
    return stats


def test_plugin_is_registered_once_with_its_app_and_nav_link(client: Any) -> None:
    headers = {"Authorization": f"Bearer {token(client, 'admin')}"}
    plugins = {p["name"]: p for p in client.get("/api/v2/plugins", headers=headers).json()["plugins"]}
    assert plugins["delaywheel"]["fastapi_apps"][0]["url_prefix"] == "/delaywheel"
    view = plugins["delaywheel"]["external_views"][0]
    assert (view["destination"], view["url_route"], view["href"]) == ("nav", "delaywheel", "delaywheel/")
    errors = client.get("/api/v2/plugins/importErrors", headers=headers).json()
    assert errors["total_entries"] == 0, errors  # e.g. the same plugin found both in plugins/ and by entry point


TASK_CONTEXT = """
import json, sys
from airflow.sdk.execution_time.task_runner import TaskRunnerMarker
from airflow.sdk.listener import get_listener_manager
from airflow.sdk.plugins_manager import _get_plugins, integrate_macros_plugins
get_listener_manager().hook.on_starting(component=TaskRunnerMarker())  # what every task process does at its start
integrate_macros_plugins()  # and when it builds the task's context
heavy = ("fastapi", "airflow.api_fastapi.app", "delaywheel.store", "psycopg")
print(json.dumps({"plugins": [p.name for p in _get_plugins()[0]], "heavy": [m for m in heavy if m in sys.modules]}))
"""


def test_a_task_loads_the_plugin_without_its_app(airflow_db: dict[str, str]) -> None:
    """Airflow loads every plugin in every task process (macros, listeners) and DAG parse (timetables, links). The
    plugin then imports nothing heavy, and its listener imports nothing for a task process (`preload`). Building the
    dashboard app there (FastAPI, Airflow's API app, the store) cost each task start 1.2-1.5 s of CPU; the API server
    builds it at the first request (`DashboardApp`, served in the tests above)."""
    env = {**os.environ, **airflow_db, "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins")}
    done = subprocess.run(
        [sys.executable, "-c", TASK_CONTEXT], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "delaywheel" in result["plugins"]
    assert result["heavy"] == []


JOB_START = """
import json, sys
from airflow.jobs.job import Job
before = [m for m in sys.argv[1:] if m in sys.modules]
Job()  # Airflow calls the plugins' listeners here: the scheduler does before its executor forks the task workers
print(json.dumps({"before": before, "after": [m for m in sys.argv[1:] if m in sys.modules]}))
"""


def test_airflow_jobs_preload_what_our_tasks_run(airflow_db: dict[str, str]) -> None:
    """A task process forked from the scheduler (LocalExecutor) finds these imported instead of importing them itself,
    0.17-0.25 s of CPU each (`preload`); the test above shows a task process itself imports nothing for it."""
    from delaywheel.airflow.preload import TASK_MODULES

    env = {**os.environ, **airflow_db, "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins")}
    modules = ["psycopg", *TASK_MODULES]
    done = subprocess.run(
        [sys.executable, "-c", JOB_START, *modules], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"before": [], "after": modules}


SHIM = """
import importlib.metadata as md, runpy, sys
if sys.argv[1] == "uninstalled":  # only the plugins folder deployed: no delaywheel distribution to find
    found = md.distribution
    def without_delaywheel(name):
        if name == "delaywheel":
            raise md.PackageNotFoundError(name)
        return found(name)
    md.distribution = without_delaywheel
print("DelayWheelPlugin" in runpy.run_path(sys.argv[2]))
"""


@pytest.mark.parametrize(("deployed", "defines"), [("installed", False), ("uninstalled", True)])
def test_the_plugins_folder_shim_defines_the_plugin_only_when_the_package_is_not_installed(
    deployed: str, defines: bool
) -> None:
    """Installed, the entry point registers the plugin and the shim must stand down (a second definition is an
    import error, checked above); deployed as a plugins folder only, the shim is what registers it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins")}
    done = subprocess.run(
        [sys.executable, "-c", SHIM, deployed, str(ROOT / "plugins" / "delaywheel_plugin.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert done.stdout.split()[-1] == str(defines)


def test_anonymous_callers_are_refused(client: Any, plugin_store: Store) -> None:
    seed(plugin_store)
    assert client.get("/delaywheel/api/stats").status_code == 401
    assert client.get("/delaywheel/").status_code == 401
    browser = client.get("/delaywheel/", headers={"accept": "text/html"}, follow_redirects=False)
    assert browser.status_code == 303
    assert browser.headers["location"].startswith("/auth/login?next=")
    assert "orders.timeout" not in browser.text
    forged = client.get("/delaywheel/api/stats", headers={"Authorization": "Bearer not-a-jwt"})
    assert forged.status_code == 403


@pytest.mark.parametrize("path", ["openapi.json", "docs", "docs/oauth2-redirect", "redoc"])
def test_the_app_serves_no_schema_or_api_docs(client: Any, plugin_store: Store, path: str) -> None:
    """FastAPI's own OpenAPI schema and docs pages are off: they were served to anyone, outside the routes' auth,
    naming every route and its parameters. Nothing uses them, logged in or not."""
    assert client.get(f"/delaywheel/{path}").status_code == 404
    bearer = {"Authorization": f"Bearer {token(client, 'admin')}"}
    assert client.get(f"/delaywheel/{path}", headers=bearer).status_code == 404


def test_json_api_gives_the_store_figures_to_a_logged_in_user(client: Any, plugin_store: Store) -> None:
    seed(plugin_store)
    response = client.get("/delaywheel/api/stats", headers={"Authorization": f"Bearer {token(client, 'vera')}"})
    assert response.status_code == 200
    served = response.json()
    expected = as_json(plugin_store.stats())
    assert served.pop("window_s") == 300
    assert without_clock(served) == without_clock(expected)
    level = {row["level"]: row for row in served["levels"]}
    assert (level[18]["backlog"], level[3]["backlog"], level[3]["delivered"]) == (7, 0, 5)
    assert level[3]["lateness_p50_s"] is not None
    assert served["wheel"]["pending"] == 5
    topics = {(t["topic"], t["consumer_group"]): t for t in served["topics"]}
    assert (topics[("orders.paid", "billing")]["depth"], topics[("orders.paid", "billing")]["lag"]) == (5, 3)
    assert served["quarantine"]["total"] == 0 and served["set_aside"]["total"] == 0


def test_json_api_and_cli_give_numbers_of_the_same_types(
    client: Any, plugin_store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delaywheel stats --json` gave `extract()`'s numerics as strings where the web API gave numbers."""
    from delaywheel.cli import main
    from tests.helpers import number_paths

    seed(plugin_store)
    served = client.get("/delaywheel/api/stats", headers={"Authorization": f"Bearer {token(client, 'vera')}"}).json()
    assert served.pop("window_s") == 300
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    capsys.readouterr()  # the API server's access log
    assert main(["stats", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert number_paths(served) == number_paths(printed)
    assert isinstance(served["levels"][2]["lateness_p50_s"], float) and isinstance(
        printed["levels"][2]["lateness_p50_s"], float
    )
    assert isinstance(printed["wheel"]["pending"], int) and isinstance(printed["levels"][0]["delay"], float)


def test_page_shows_the_same_figures_with_the_ui_session_cookie(client: Any, plugin_store: Store) -> None:
    """The Airflow UI keeps its JWT in the `_token` cookie; the page (shown in the UI's iframe) relies on it."""
    seed(plugin_store)
    client.cookies.set("_token", token(client, "admin"))
    try:
        page = client.get("/delaywheel/", headers={"accept": "text/html"})
    finally:
        client.cookies.clear()
    assert page.status_code == 200
    stats = plugin_store.stats()
    html = page.text
    level18 = next(row for row in stats["levels"] if row["level"] == 18)
    assert f'<td data-field="backlog">{level18["backlog"]}</td>' in html
    assert 'data-field="pending">5<' in html
    shown = bar_values(html, "histogram-chart")
    assert [v for _, v in shown] == [v for _, v in hourly(stats["wheel"]["histogram_24h"])] == [3, 1] + [0] * 22
    assert len({label for label, _ in shown}) == 24  # one label per hour from now, none twice
    assert sum(v for _, v in shown) == 4  # due in 2, 30, 30 and 90 minutes
    assert dict(bar_values(html, "horizon-chart")) == {"overdue": 0, "≤ 1 min": 0, "≤ 1 h": 3, "≤ 24 h": 1, "later": 1}
    assert '<p id="quarantine-total">0 row(s)' in html and '<p id="set-aside-total">0 message(s)' in html
    assert "signed in as admin" in html
    assert '<a href="/delaywheel/api/stats">JSON</a>' in html  # the mount prefix, not the app's own root


def bar_values(html: str, svg_id: str) -> list[tuple[str, int]]:
    """(label, value) of every bar of one inline SVG chart, in drawing order."""
    svg = html.split(f'<svg id="{svg_id}"', 1)[1].split("</svg>", 1)[0]
    return [(label, int(value)) for label, value in re.findall(r'<rect data-label="([^"]*)" data-value="(\d+)"', svg)]


def test_page_fits_1280_px_with_long_figures(
    client: Any, plugin_store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The page cut its last column at 1280 px. With 16-digit checkpoints, 12-digit counts and long quarantine and
    set-aside details, nothing reaches past the window (checked in headless Chromium)."""
    from playwright.sync_api import sync_playwright

    from delaywheel.airflow.web import app as web

    seed(plugin_store)
    plain = web.current_stats

    def long_figures() -> dict[str, Any]:
        stats = plain()
        now = stats["now"]
        for level in stats["levels"]:
            level.update(
                checkpoint_xid=4294967296123,
                checkpoint_id=9007199254740991,
                checkpoint_at=now,
                head_due=now,
                delivered=123456789012,
                backlog=12345678901,
                lateness_p50_s=0.123,
                lateness_p99_s=654.3,
                delivered_in_window=12345678,
            )
        detail = "body is not valid JSON: Expecting ',' delimiter: line 1 column 5 (char 4) " * 4
        stats["quarantine"] = {
            "total": 1,
            "by_reason": [{"reason": "bad_body", "count": 1, "last_at": now}],
            "recent": [
                {
                    "source": "s",
                    "source_file": "/data/input/orders-2026-11-24-part-00017.parquet",
                    "row_number": 123456,
                    "reason": "bad_body",
                    "detail": detail,
                    "quarantined_at": now,
                }
            ],
        }
        stats["set_aside"] = {
            "total": 1,
            "by_reason": [{"reason": "bad_properties", "count": 1, "last_at": now}],
            "recent": [
                {
                    "message_id": 9007199254740991,
                    "lane": "level",
                    "level": 3,
                    "topic": "orders.timeout.very-long-topic-name",
                    "key": "order-1234567890",
                    "deliver_at": now,
                    "reason": "bad_properties",
                    "detail": detail,
                    "set_aside_at": now,
                }
            ],
        }
        return stats

    monkeypatch.setattr(web, "current_stats", long_figures)
    client.cookies.set("_token", token(client, "admin"))
    try:
        html = client.get("/delaywheel/", headers={"accept": "text/html"}).text
    finally:
        client.cookies.clear()
    assert "9007199254740991" in html and 'id="set-aside"' in html and 'id="quarantine"' in html
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_content(html)
        page.screenshot(path=str(tmp_path / "dashboard-1280.png"), full_page=True)
        widths = page.evaluate("""() => ({
            page: document.documentElement.scrollWidth, window: window.innerWidth,
            cut: [...document.querySelectorAll('.scroll')].filter(e => e.scrollWidth > e.clientWidth).map(e => e.firstElementChild.id),
            right: Math.max(...[...document.querySelectorAll('table, svg')].map(e => e.getBoundingClientRect().right)),
        })""")
        browser.close()
    assert widths["page"] <= widths["window"] and widths["right"] <= widths["window"], widths
    assert widths["cut"] == [], widths
