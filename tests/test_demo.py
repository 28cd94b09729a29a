"""The README's main job at small scale, for real: Spark order generator, deliverer, customers, sweep, GX."""

from __future__ import annotations

import json

import pytest

from delaywheel import Store
from delaywheel.demo import run_demo


@pytest.mark.spark
def test_demo_end_to_end(db_url: str, tmp_path, capsys) -> None:
    assert run_demo(2000, timeout="6s", period="4s", url=db_url, out=tmp_path, json_output=True) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("\n{\n") + 1:printed.rindex("\n}") + 2])  # the --json summary
    assert summary["placed"] == 2000 and summary["still_pending"] == 0
    assert summary["paid"] + summary["cancelled_by_timeout"] + summary["cancelled_by_customer"] == 2000
    assert summary["cancelled_by_timeout"] > 0 and summary["late_payments_refused"] > 0
    assert summary["timers_delivered_early"] == 0 and summary["quality"] == "passed"
    with Store(db_url) as store:
        # every fired timer was applied once; the group offset is at the end of the topic
        processed, cancelled = store.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE cancelled) FROM shop.processed_messages").fetchone()
        assert cancelled == summary["cancelled_by_timeout"]
        delivered = store.conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = 'shop.order-timeout'").fetchone()[0]
        assert delivered == processed
    assert "passed" in (tmp_path / "report.html").read_text()
