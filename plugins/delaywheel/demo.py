"""The README's main job: the order-timeout story, end to end, on the embedded default.

Orders are placed over a period by the Spark order generator (each with its timeout message, in the
same transaction); simulated customers pay (most on time, some late), cancel or abandon their carts;
the deliverer delivers due timeouts; the sweep cancels unpaid orders and releases their stock; then
the outcome is checked with Great Expectations and reported in words, figures and a chart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from . import orders, runner
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
    orders.reset(store, stock_per_sku=n_orders * 9 // orders.SKUS + 100)
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = _background(stop, store.url, errors)
    clock_start = store.clock()
    print(f"placing {n_orders} orders over {period} with a {timeout} payment timeout (Spark local[*]); "
          f"Spark log: {out / 'order-generator.log'}", flush=True)
    with open(out / "order-generator.log", "w") as log:
        generator = subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "spark" / "order_generator.py"), "--db-url", store.url,
             "--orders", str(n_orders), "--timeout", timeout, "--period", period],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
        assert generator.stdout is not None
        for line in generator.stdout:
            print("  " + line.rstrip(), flush=True)
        if generator.wait() != 0:
            stop.set()
            print(f"order generator failed (exit {generator.returncode}); see {out / 'order-generator.log'}")
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

    reconcile_code, reconciled = _spark_job(out, "redeliver", [
        "--db-url", store.url, "--mode", "reconcile", "--table", "shop.orders", "--key-column", "timer_key",
        "--predicate", "status = 'pending'", "--topic", orders.TOPIC, "--due-column", "deadline"])
    print(f"reconcile (Spark): {reconciled.get('missing')} orders missing a timer, {reconciled.get('stale')} "
          f"stale timers cancelled (exit {reconcile_code})", flush=True)
    lateness_code, lateness = _spark_job(out, "lateness_quality", [
        "--db-url", store.url, "--start", clock_start.isoformat(), "--end", store.clock().isoformat(),
        "--report-dir", str(out / "lateness")])
    print(f"delivery lateness contract (Spark + Great Expectations) over {lateness.get('deliveries')} deliveries: "
          f"{'passed' if lateness_code == 0 else 'FAILED ' + str(lateness.get('failed'))}; report in {out / 'lateness'}",
          flush=True)
    result = verify(store, out, since=clock_start)
    store.close()
    success = result.success and reconcile_code == 0 and lateness_code == 0
    summary = {"orders": n_orders, **result.summary, "reconcile": reconciled,
               "delivery_lateness_contract": "passed" if lateness_code == 0 else "FAILED",
               "report": str(out / "report.html")}
    print(json.dumps(summary, default=str, indent=2) if json_output else result.text, flush=True)
    print(f"\nreport: {out / 'report.html'}")
    return 0 if success else 1


def _spark_job(out: Path, job: str, args: list[str]) -> tuple[int, dict[str, Any]]:
    """Run one of the project's Spark jobs (local[*]); returns its exit code and the JSON line it printed."""
    with open(out / f"{job}.log", "w") as log:
        done = subprocess.run([sys.executable, str(PROJECT_ROOT / "spark" / f"{job}.py"), *args],
                              stdout=subprocess.PIPE, stderr=log, text=True)
    reports = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(reports[-1]) if reports else {}

