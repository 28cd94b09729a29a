"""The delaywheel plugin inside Airflow's real API server app (`create_app`), with Airflow's real auth:
the simple auth manager issues the tokens, Airflow's `get_user` checks them, the plugin's routes read the store
through the `delaywheel_default` connection."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from delaywheel import Store
from delaywheel.airflow.web.charts import hourly
from delaywheel.stats import as_json

pytestmark = pytest.mark.airflow

USERS = {"admin": ("admin", "admin-pw"), "vera": ("viewer", "viewer-pw")}
# Figures that depend on the moment they are computed, not on the store's content.
CLOCK_DEPENDENT = {"now", "oldest_overdue_s", "lag_s", "since_last_pass_s", "start", "end"}


def connection_uri(db_url: str) -> str:
    """The test database as an Airflow connection URI (Airflow reads `AIRFLOW_CONN_<ID>` on every lookup)."""
    p = conninfo_to_dict(db_url)
    return f"postgresql://{p.get('user', 'postgres')}@{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{p['dbname']}"


@pytest.fixture(scope="module")
def client(airflow_db: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Airflow's API server app with login required (two users with known passwords), plugins loaded."""
    passwords = tmp_path_factory.mktemp("auth") / "passwords.json"
    passwords.write_text(json.dumps({name: pw for name, (_, pw) in USERS.items()}))
    env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{n}:{role}" for n, (role, _) in USERS.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "delaywheel-plugin-test-secret-" + "x" * 40,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    with TestClient(create_app()) as test_client:
        yield test_client
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def plugin_store(store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The test's store, made the `delaywheel_default` connection the plugin reads."""
    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", connection_uri(db_url))
    return store


def token(client: Any, user: str) -> str:
    response = client.post("/auth/token", json={"username": user, "password": USERS[user][1]})
    assert response.status_code == 201, response.text
    return str(response.json()["access_token"])


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


def test_json_api_and_cli_give_numbers_of_the_same_types(client: Any, plugin_store: Store, db_url: str,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`delaywheel stats --json` gave `extract()`'s numerics as strings where the web API gave numbers."""
    from delaywheel.cli import main
    from tests.test_stats import number_paths

    seed(plugin_store)
    served = client.get("/delaywheel/api/stats", headers={"Authorization": f"Bearer {token(client, 'vera')}"}).json()
    assert served.pop("window_s") == 300
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    capsys.readouterr()  # the API server's access log
    assert main(["stats", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert number_paths(served) == number_paths(printed)
    assert isinstance(served["levels"][2]["lateness_p50_s"], float) and isinstance(printed["levels"][2]["lateness_p50_s"], float)
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
