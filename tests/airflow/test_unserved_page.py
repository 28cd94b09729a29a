"""The Airflow page names a lane with due messages and no live deliverer (the `unserved` flag of `stats`), the sessions
holding delivery back and the rows retention dropped before a group read them, in the real API server app with
Airflow's auth (the fixtures of tests/airflow/conftest.py)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from delaywheel import Store
from delaywheel.locks import LANE_PRESENCE_LOCK
from delaywheel.produce.validation import Message
from tests.helpers import token

pytestmark = pytest.mark.airflow


def page(client: Any) -> str:
    client.cookies.set("_token", token(client, "admin"))
    try:
        response = client.get("/delaywheel/", headers={"accept": "text/html"})
    finally:
        client.cookies.clear()
    assert response.status_code == 200
    return str(response.text)


def test_the_page_names_the_lanes_with_due_messages_and_no_deliverer(
    client: Any, plugin_store: Store, db_url: str
) -> None:
    assert 'id="unserved"' not in page(client)  # nothing due: no banner
    now = plugin_store.clock()
    plugin_store.send("orders", {"n": 1}, delay_level=2, now=now - timedelta(seconds=8))  # due 3 s ago
    html = page(client)
    banner = html.split('<p id="unserved"', 1)[1].split("</p>", 1)[0]
    assert "<b>level 2</b>" in banner
    assert '<tr data-level="2" class="overdue unserved"' in html
    with psycopg.connect(db_url, autocommit=True) as deliverer:  # a live delivery loop holds the lane
        deliverer.execute("SELECT pg_advisory_lock_shared(%s, 2)", (LANE_PRESENCE_LOCK,))
        html = page(client)
        assert 'id="unserved"' not in html and '<tr data-level="2" class="overdue">' in html


def test_the_page_names_the_sessions_holding_delivery_back(client: Any, plugin_store: Store, db_url: str) -> None:
    """An idle transaction with an xid holds the commit horizon back (no lane delivers, no consumer reads past it):
    the page names its session, with its age."""
    with psycopg.connect(db_url, application_name="forgotten-order-tx") as idle:
        idle.execute("SELECT pg_current_xact_id()")
        time.sleep(1.2)
        html = page(client)
        holders = html.split('<div id="horizon-holders"', 1)[1].split("</div>", 1)[0]
        assert f"<td>{idle.info.backend_pid}</td>" in holders and "forgotten-order-tx" in holders
        idle.rollback()
    assert 'id="horizon-holders"' not in page(client)


def test_the_page_shows_what_retention_dropped_unread(client: Any, plugin_store: Store) -> None:
    """A topic day past the retention floor (2020: past it by the database's clock) retired with rows group b had not
    read: the page names the topic and group with the count, as `stats` does."""
    assert 'id="retired-unread"' not in page(client)
    day = datetime(2020, 1, 1, tzinfo=UTC)
    plugin_store.send_many([Message("orders", {"i": i}) for i in range(10)], now=day)
    for group, n in (("a", 10), ("b", 6)):
        assert plugin_store.ack(plugin_store.pull("orders", group, n)).acked == n
    plugin_store.retire(now=day + timedelta(days=8))
    section = page(client).split('<div id="retired-unread"', 1)[1].split("</div>", 1)[0]
    row = section.split('<tr data-topic="orders" data-group="b">', 1)[1].split("</tr>", 1)[0]
    assert '<td data-field="dropped">4</td>' in row and "topic_messages_p20200101t0000" in row
    assert 'data-group="a"' not in section
