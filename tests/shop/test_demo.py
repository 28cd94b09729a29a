"""The README's main job at small scale, for real: its DAGs through `airflow dags test` (Spark order generator,
reconcile, lateness contract), the deliverer, customers and sweep as processes of their own, GX."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from delaywheel_shop import orders
from delaywheel_shop.demo import DemoFailed, Parts, run_demo
from psycopg.conninfo import make_conninfo

from delaywheel import Store


def _children() -> set[int]:
    """This process's living children (zombies too: a part not waited for)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.mark.spark
@pytest.mark.airflow
def test_demo_end_to_end(
    airflow_db: dict[str, str], db_url: str, tmp_path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", "")  # the demo points it at its store; restored after
    assert run_demo(2000, timeout="6s", period="4s", url=db_url, out=tmp_path, json_output=True) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.index("\n{\n") + 1 : printed.rindex("\n}") + 2])  # the --json summary
    assert summary["placed"] == 2000 and summary["still_pending"] == 0
    assert summary["paid"] + summary["cancelled_by_timeout"] + summary["cancelled_by_customer"] == 2000
    assert summary["cancelled_by_timeout"] > 0 and summary["late_payments_refused"] > 0
    assert summary["timers_delivered_early"] == 0 and summary["quality"] == "passed"
    assert summary["airflow_runs"] == dict.fromkeys(
        ["shop_place_orders", "shop_order_sweep", "shop_reconcile", "delaywheel_lateness_quality"], "success"
    )
    assert summary["delivery_lateness_contract"] == "passed" and summary["failures"] == []
    assert summary["cancellation_lateness_max_ms"] <= 3000
    # the continuous parts ran as processes of their own, were ready, stopped on SIGTERM with exit 0, and are gone
    parts = summary["processes"]
    assert set(parts) == {"deliverer", "sweep", "customers"}
    pids = {part["pid"] for part in parts.values()}
    assert len(pids) == 3 and os.getpid() not in pids and not pids & _children()
    for name, part in parts.items():
        assert part["exit_code"] == 0
        assert "ready" in Path(part["log"]).read_text(), name
    assert "delaywheel_shop sweep: ready" in (tmp_path / "sweep.log").read_text()
    with Store(db_url) as store:
        # every fired timer was applied once; the group offset is at the end of the topic
        processed, cancelled = store.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE cancelled) FROM shop.processed_messages"
        ).fetchone()
        assert cancelled == summary["cancelled_by_timeout"]
        delivered = store.conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = 'shop.order-timeout'"
        ).fetchone()[0]
        assert delivered == processed
        # each order's deadline and customer plan count from its own placement, whenever Spark placed it
        offsets = store.conn.execute(
            "SELECT o.order_id, c.act_at - o.placed_at, o.deadline - o.placed_at"
            " FROM shop.orders o JOIN shop.customer_plan c USING (order_id)"
        ).fetchall()
    planned = {p.order_id: p.act_after for p in orders.plan_orders(1, 2000, timedelta(seconds=6))}
    assert {order_id: act for order_id, act, _ in offsets} == planned
    assert {deadline for _, _, deadline in offsets} == {timedelta(seconds=6)}
    assert "passed" in (tmp_path / "report.html").read_text()


def test_a_part_that_exits_early_fails_the_demo_naming_it(server_url: str, tmp_path) -> None:
    """A continuous part that cannot start (here: no such database) stops the demo before any order is placed,
    with the part's name and log in the message, and leaves no process behind."""
    parts = Parts(make_conninfo(server_url, dbname="dwtest_no_such_db"), tmp_path)
    try:
        with pytest.raises(
            DemoFailed,
            match=r"^the (deliverer|sweep|customers) \(delaywheel(?:_shop)? .*, pid \d+\) exited early "
            rf"with code 2; its log: {tmp_path}/\1\.log$",
        ) as failed:
            parts.wait_ready()  # whichever fails first
    finally:
        parts.close()
    assert "does not exist" in Path(str(failed.value).rsplit("its log: ", 1)[1]).read_text()
    assert not {p.process.pid for p in parts.parts} & _children()
