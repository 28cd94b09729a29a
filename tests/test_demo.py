"""The README's main job at small scale, for real: its DAGs through `airflow dags test` (Spark order generator,
reconcile, lateness contract), the deliverer, customers and sweep, GX."""

from __future__ import annotations

import json

import pytest

from delaywheel import Store
from delaywheel.demo import run_demo


@pytest.mark.spark
@pytest.mark.airflow
def test_demo_end_to_end(airflow_db: dict[str, str], db_url: str, tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", "")  # the demo points it at its store; restored after
    assert run_demo(2000, timeout="6s", period="4s", url=db_url, out=tmp_path, json_output=True) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("\n{\n") + 1:printed.rindex("\n}") + 2])  # the --json summary
    assert summary["placed"] == 2000 and summary["still_pending"] == 0
    assert summary["paid"] + summary["cancelled_by_timeout"] + summary["cancelled_by_customer"] == 2000
    assert summary["cancelled_by_timeout"] > 0 and summary["late_payments_refused"] > 0
    assert summary["timers_delivered_early"] == 0 and summary["quality"] == "passed"
    assert summary["airflow_runs"] == dict.fromkeys(
        ["shop_place_orders", "shop_order_sweep", "shop_reconcile", "delaywheel_lateness_quality"], "success")
    assert summary["delivery_lateness_contract"] == "passed"
    with Store(db_url) as store:
        # every fired timer was applied once; the group offset is at the end of the topic
        processed, cancelled = store.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE cancelled) FROM shop.processed_messages").fetchone()
        assert cancelled == summary["cancelled_by_timeout"]
        delivered = store.conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = 'shop.order-timeout'").fetchone()[0]
        assert delivered == processed
    assert "passed" in (tmp_path / "report.html").read_text()
