"""The order-timeout DAGs (issue 6) parse with their Spark tasks (the sweep's runs: test_shop_sweep.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.airflow


@pytest.fixture
def shop_dags(store_connection: str) -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    assert bag.import_errors == {}
    return bag.dags


def test_shop_dags_parse_with_their_spark_tasks(shop_dags: dict[str, Any]) -> None:
    place = shop_dags["shop_place_orders"].get_task("place_orders")
    assert place._conn_id == "spark_default" and place.application.endswith("delaywheel_shop/order_generator.py")
    reconcile = shop_dags["shop_reconcile"].get_task("reconcile")
    assert "--key-column" in reconcile.application_args and "timer_key" in reconcile.application_args
    assert shop_dags["shop_customers"].max_active_runs == 1
