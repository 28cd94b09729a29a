"""The README's main job: the order-timeout story, end to end, on the embedded default.

Orders are placed over a period by the Spark order generator (each with its timeout message, in the
same transaction); simulated customers pay (most on time, some late), cancel or abandon their carts;
the deliverer delivers due timeouts; the sweep cancels unpaid orders and releases their stock; then
the outcome is checked with Great Expectations and reported in words, figures and a chart.

The one-shot steps run as the project's Airflow DAGs through `airflow dags test` (`dag.test()`: real operators, the Spark jobs
through SparkSubmitOperator on `spark_default` = local[*], Airflow's metadata on the same PostgreSQL):
`shop_place_orders`, `shop_order_sweep` (a last pass), `shop_reconcile` and `delaywheel_lateness_quality`.
The continuous work (the deliverer, the customers, the sweep while orders fall due) runs the same library
loops as the DAGs' tasks on threads here, because a scheduled or Asset-triggered run per tick would add
Airflow's scheduling delay to every cancellation; under `make airflow` they are `delaywheel_deliver`,
`shop_customers` and `shop_order_sweep`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from . import local_airflow, orders, runner
from .config import PROJECT_ROOT, parse_duration
from .migrate import migrate
from .store import Store

REPORTS = PROJECT_ROOT / ".delaywheel" / "reports"


def _counts(store: Store) -> dict[str, int]:
    rows = store.conn.execute("SELECT status, count(*) FROM shop.orders GROUP BY status").fetchall()
    return {status: int(n) for status, n in rows}


def _background(stop: threading.Event, url: str, errors: list[BaseException]) -> list[threading.Thread]:
    """The deliverer, the customers and the sweep, each on its own thread and connection (as they would
    be separate Airflow tasks), so a slow one does not hold up the others."""

    def guarded(body: Callable[[Store], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                with Store(url) as store:
                    body(store)
            except BaseException as exc:  # surfaced by the main thread
                errors.append(exc)
                stop.set()
        return run

    def deliver(store: Store) -> None:
        runner.run(store, [*range(1, store.settings.max_level + 1), None], 24 * 3600, stop=stop)

    def customers(store: Store) -> None:
        while not stop.wait(0.1):
            orders.act_customers(store)

    def sweep(store: Store) -> None:
        while not stop.wait(0.05):
            orders.sweep(store)
        orders.sweep(store)

    threads = [threading.Thread(target=guarded(body), name=body.__name__) for body in (deliver, customers, sweep)]
    for thread in threads:
        thread.start()
    return threads


def run_demo(
    n_orders: int,
    *,
    timeout: str = "20s",
    period: str = "30s",
    json_output: bool = False,
    url: str | None = None,
    out: Path | None = None,
) -> int:
    """Returns 0 when every business rule held, 1 otherwise (the report says which)."""
    out = out or REPORTS / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    store = Store(url)
    applied = migrate(store.url)
    store.prepare()
    timeout_td = parse_duration(timeout, "--timeout")
    print(f"store: {store.url} (migrations applied now: {', '.join(applied) or 'none needed'})", flush=True)
    print("Airflow: migrating its metadata database (the demo runs its DAGs through `airflow dags test`)", flush=True)
    local_airflow.configure(store.url)
    orders.reset(store, stock_per_sku=n_orders * 9 // orders.SKUS + 100)
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = _background(stop, store.url, errors)
    clock_start = store.clock()
    print(f"placing {n_orders} orders over {period} with a {timeout} payment timeout: DAG shop_place_orders "
          "(Spark order generator, local[*])", flush=True)
    placing = threading.Thread(target=_report_while, args=(placing_done := threading.Event(), store.url, sys.stdout))
    placing.start()
    try:
        placed = _run_dag("shop_place_orders", out,
                          {"orders": n_orders, "timeout": timeout, "period": period, "first_id": 1})
    finally:
        placing_done.set()
        placing.join()
    if placed != "success":
        stop.set()
        print(f"shop_place_orders ended {placed}; its task log: {out / 'shop_place_orders.log'}")
        return 1
    # every planned customer action (late payments come up to 1.8 x timeout after placing) and every
    # timeout must have happened before the outcome is judged
    settle_by = time.monotonic() + 2.0 * timeout_td.total_seconds() + 10
    while not stop.is_set():
        counts = _counts(store)
        open_plans = store.conn.execute("SELECT count(*) FROM shop.customer_plan WHERE NOT done AND action <> 'abandon'").fetchone()
        print(f"  orders: {counts}; customer actions still to come: {open_plans[0] if open_plans else '?'}", flush=True)
        if counts.get("pending", 0) == 0 and open_plans and open_plans[0] == 0:
            break
        if time.monotonic() > settle_by:
            print("  still unsettled after the expected time: reporting what there is", flush=True)
            break
        time.sleep(5)
    stop.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    from .order_quality import verify

    swept = _run_dag("shop_order_sweep", out)
    print(f"last sweep (DAG shop_order_sweep): {swept}", flush=True)
    reconcile_state = _run_dag("shop_reconcile", out)
    reconciled = _latest(store, "SELECT missing, stale FROM delaywheel.reconcile_runs WHERE started_at >= %s"
                                " ORDER BY id DESC LIMIT 1", clock_start)
    print(f"reconcile (DAG shop_reconcile, Spark): {reconciled.get('missing')} orders missing a timer, "
          f"{reconciled.get('stale')} stale timers cancelled ({reconcile_state})", flush=True)
    lateness_state = _run_dag("delaywheel_lateness_quality", out, {
        "start": clock_start.isoformat(), "end": store.clock().isoformat(), "report_dir": str(out / "lateness")})
    lateness = _latest(store, "SELECT success, failed, report_path FROM delaywheel.validation_results"
                              " WHERE validated_at >= %s ORDER BY id DESC LIMIT 1", clock_start)
    print("delivery lateness contract (DAG delaywheel_lateness_quality, Spark + Great Expectations): "
          f"{'passed' if lateness.get('success') else 'FAILED ' + str(lateness.get('failed'))}; "
          f"report {lateness.get('report_path')}", flush=True)
    result = verify(store, out, since=clock_start)
    store.close()
    success = (result.success and swept == "success" and reconcile_state == "success"
               and lateness_state == "success" and bool(lateness.get("success")))
    summary = {"orders": n_orders, **result.summary, "reconcile": reconciled,
               "delivery_lateness_contract": "passed" if lateness.get("success") else "FAILED",
               "airflow_runs": {"shop_place_orders": placed, "shop_order_sweep": swept,
                                "shop_reconcile": reconcile_state, "delaywheel_lateness_quality": lateness_state},
               "report": str(out / "report.html")}
    print(json.dumps(summary, default=str, indent=2) if json_output else result.text, flush=True)
    print(f"\nreport: {out / 'report.html'}")
    return 0 if success else 1


def _report_while(done: threading.Event, url: str, console: TextIO) -> None:
    """Progress while a DAG run holds the main thread (its own output goes to its log file)."""
    with Store(url) as store:
        while not done.wait(5):
            counts = _counts(store)
            print(f"  orders: {counts or 'none placed yet (Spark is starting)'}", file=console, flush=True)


def _run_dag(dag_id: str, out: Path, conf: dict[str, Any] | None = None) -> str:
    """One run of a DAG through `airflow dags test` (`dag.test()` in its own process, so its task log goes
    to `out/<dag_id>.log` and not to this console). Returns the run's final state."""
    command = [sys.executable, "-m", "airflow", "dags", "test", dag_id, *(["--conf", json.dumps(conf)] if conf else [])]
    path = out / f"{dag_id}.log"
    with open(path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    states = re.findall(r"DagRun Finished: dag_id=\S+,.*? state=(\w+)", path.read_text(errors="replace"))
    return states[-1] if states else f"not run (exit {done.returncode}; see {path})"


def _latest(store: Store, sql: str, since: datetime) -> dict[str, Any]:
    cur = store.conn.execute(sql, (since,))  # type: ignore[arg-type]
    row = cur.fetchone()
    return {} if row is None else dict(zip([c.name for c in cur.description or []], row, strict=True))
