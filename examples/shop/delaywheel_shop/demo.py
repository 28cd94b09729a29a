"""The README's main job: the order-timeout story, end to end, on the embedded default.

Orders are placed over a period by the Spark order generator (each with its timeout message, in the
same transaction); simulated customers pay (most on time, some late), cancel or abandon their carts;
the deliverer delivers due timeouts; the sweep cancels unpaid orders and releases their stock; then
the outcome is checked with Great Expectations and reported in words, figures and a chart.

The continuous parts run as they would in production, each its own process with its own log file in the
report folder: the deliverer (`delaywheel deliver`, every lane), the sweep (`python -m delaywheel_shop sweep`, a
waiting consumer of the order timeouts: it sleeps until the topic's delivery notification) and the customers
(`python -m delaywheel_shop customers`). The demo places no order before each has said it is ready, fails at once,
naming the process and its log, if one exits early, stops them with SIGTERM at the end (each finishes its batch
and exits 0), and kills any still running when it leaves for whatever reason (an error, Ctrl-C, SIGTERM).
Under `make airflow` the same parts are the DAGs `delaywheel_deliver`, `shop_order_sweep` and `shop_customers`.

The one-shot steps run as the project's Airflow DAGs through `airflow dags test` (`dag.test()`: real operators,
the Spark jobs through SparkSubmitOperator on `spark_default` = local[*], Airflow's metadata on the same
PostgreSQL): `shop_place_orders`, `shop_order_sweep` (a last pass, until idle), `shop_reconcile` and
`delaywheel_lateness_quality`. The orders are placed once Spark has started (the demo prints how long that took):
each order's deadline, timer and customer plan count from its own placement, so Spark's start adds wall time,
never lateness.

The contract (order_quality.CONTRACT_P99_S / CONTRACT_MAX_S): timeout cancellations p99 within 1 s of the
deadline, none later than 3 s, none early. A run that misses it, or any other rule, exits 1 and says on stderr
which figure missed, its value and the limit.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import IO, Any

from delaywheel.config import PROJECT_ROOT, parse_duration
from delaywheel.dev import embedded, local_airflow
from delaywheel.store import Store
from delaywheel_shop import orders, schema

REPORTS = PROJECT_ROOT / ".delaywheel" / "reports"
READY_S = 120.0  # a continuous part not ready by then has failed to start
STOP_S = 30.0  # SIGTERM gives a part this long to finish its batch and exit, before SIGKILL

# The continuous parts: name (in messages and log files), what it is, its command line (`python -m …`): the library's
# deliverer, the shop's own sweep and customers.
PARTS: list[tuple[str, str, list[str]]] = [
    (
        "deliverer",
        "delaywheel deliver, every lane",
        ["delaywheel.cli", "deliver", "--duration", "7d", "--progress-every", "10"],
    ),
    ("sweep", "delaywheel_shop sweep, the waiting consumer of the order timeouts", ["delaywheel_shop", "sweep"]),
    ("customers", "delaywheel_shop customers", ["delaywheel_shop", "customers"]),
]
_READY = re.compile(r"^delaywheel(?:_shop)? [a-z ]+: ready", re.MULTILINE)


class DemoFailed(Exception):
    """A step of the demo failed; the message names it and where its log is."""


@dataclass
class Part:
    name: str
    what: str
    log_path: Path
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    def describe(self) -> str:
        return f"the {self.name} ({self.what}, pid {self.process.pid})"


class Parts:
    """The continuous parts as child processes of the demo. `close()` (also at interpreter exit) makes sure none
    outlives it: SIGTERM, then SIGKILL after STOP_S."""

    def __init__(self, url: str, out: Path) -> None:
        env = {**os.environ, "DELAYWHEEL_DATABASE_URL": url}
        self.parts: list[Part] = []
        self.stopping = False
        atexit.register(self.close)
        for name, what, argv in PARTS:
            log_path = out / f"{name}.log"
            log = open(log_path, "wb")  # noqa: SIM115  # closed by close()
            process = subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            self.parts.append(Part(name, what, log_path, process, log))

    def check(self) -> None:
        """Fail loudly if a part has exited before the demo asked it to."""
        for part in self.parts:
            code = part.process.poll()
            if code is not None and not self.stopping:
                raise DemoFailed(f"{part.describe()} exited early with code {code}; its log: {part.log_path}")

    def wait_ready(self) -> float:
        """Wait until every part has printed its ready line; returns how long that took."""
        started = time.monotonic()
        waiting = list(self.parts)
        while waiting:
            self.check()
            waiting = [p for p in waiting if not _READY.search(p.log_path.read_text(errors="replace"))]
            if waiting and time.monotonic() - started > READY_S:
                raise DemoFailed(
                    f"{waiting[0].describe()} was not ready after {READY_S:g} s; its log: {waiting[0].log_path}"
                )
            time.sleep(0.1)
        return time.monotonic() - started

    def stop(self) -> dict[str, dict[str, Any]]:
        """SIGTERM every part, wait for each to finish its batch; a part that does not exit 0 fails the demo."""
        self.stopping = True
        for part in self.parts:
            part.process.terminate()
        report = {}
        for part in self.parts:
            try:
                code = part.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                raise DemoFailed(
                    f"{part.describe()} did not stop within {STOP_S:g} s of SIGTERM; its log: {part.log_path}"
                ) from None
            if code != 0:
                raise DemoFailed(f"{part.describe()} exited with code {code} on SIGTERM; its log: {part.log_path}")
            report[part.name] = {"pid": part.process.pid, "exit_code": code, "log": str(part.log_path)}
        return report

    def close(self) -> None:
        self.stopping = True
        for part in self.parts:
            if part.process.poll() is None:
                part.process.terminate()
        for part in self.parts:
            try:
                part.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                part.process.kill()
                part.process.wait()
            part.log.close()
        atexit.unregister(self.close)


def _counts(store: Store) -> dict[str, int]:
    rows = store.conn.execute("SELECT status, count(*) FROM shop.orders GROUP BY status").fetchall()
    return {status: int(n) for status, n in rows}


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_demo's cleanup, as Ctrl-C does


def run_demo(
    n_orders: int,
    *,
    timeout: str = "20s",
    period: str = "30s",
    json_output: bool = False,
    url: str | None = None,
    out: Path | None = None,
) -> int:
    """Returns 0 when every business rule and the lateness contract held, 1 otherwise (stderr says which)."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if _main_thread() else None
    try:
        return _run(n_orders, timeout=timeout, period=period, json_output=json_output, url=url, out=out)
    except DemoFailed as exc:
        print(f"DEMO FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _run(n_orders: int, *, timeout: str, period: str, json_output: bool, url: str | None, out: Path | None) -> int:
    out = out or REPORTS / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    timeout_td = parse_duration(timeout, "--timeout")
    parse_duration(period, "--period")
    store = Store(url or embedded.database_url())  # no URL given or configured: the embedded cluster
    applied = schema.migrate(store.url)
    store.prepare()
    print(f"store: {store.url} (migrations applied now: {', '.join(applied) or 'none needed'})", flush=True)
    print("Airflow: migrating its metadata database (the demo runs its DAGs through `airflow dags test`)", flush=True)
    local_airflow.configure(store.url)
    orders.reset(store, stock_per_sku=n_orders * 9 // orders.SKUS + 100)
    clock_start = store.clock()
    parts = Parts(store.url, out)
    try:
        ready_s = parts.wait_ready()
        print(
            f"continuous parts ready in {ready_s:.1f} s, each its own process: "
            + "; ".join(f"{p.name} pid {p.process.pid} (log {p.log_path})" for p in parts.parts),
            flush=True,
        )
        print(
            f"placing {n_orders} orders over {period} with a {timeout} payment timeout: DAG shop_place_orders "
            "(Spark order generator, local[*])",
            flush=True,
        )
        launched = store.clock()
        progress = _progress(store, parts)
        placed = _run_dag(
            "shop_place_orders",
            out,
            {"orders": n_orders, "timeout": timeout, "period": period, "first_id": 1},
            watch=progress,
        )
        if placed != "success":
            raise DemoFailed(f"DAG shop_place_orders ended {placed}; its log: {out / 'shop_place_orders.log'}")
        spark = _spark_start(store, out, launched)
        print(spark["line"], flush=True)
        # every planned customer action (late payments come up to 1.8 x timeout after placing) and every
        # timeout must have happened before the outcome is judged
        settle_by = time.monotonic() + 2.0 * timeout_td.total_seconds() + 10
        while True:
            progress()
            counts = _counts(store)
            row = store.conn.execute(
                "SELECT count(*) FROM shop.customer_plan WHERE NOT done AND action <> 'abandon'"
            ).fetchone()
            open_plans = row[0] if row else 0
            if counts.get("pending", 0) == 0 and open_plans == 0:
                break
            if time.monotonic() > settle_by:
                print(
                    f"  still unsettled after the expected time ({counts}, {open_plans} customer actions to come):"
                    " reporting what there is",
                    flush=True,
                )
                break
            time.sleep(0.5)
        processes = parts.stop()
        print("continuous parts stopped by SIGTERM, each exit 0", flush=True)
    finally:
        parts.close()
    from delaywheel_shop.order_quality import verify

    swept = _run_dag("shop_order_sweep", out, {"until_idle": True})
    print(f"last sweep (DAG shop_order_sweep): {swept}", flush=True)
    reconcile_state = _run_dag("shop_reconcile", out)
    reconciled = _latest(
        store,
        "SELECT missing, stale FROM delaywheel.reconcile_runs WHERE started_at >= %s ORDER BY id DESC LIMIT 1",
        clock_start,
    )
    print(
        f"reconcile (DAG shop_reconcile, Spark): {reconciled.get('missing')} orders missing a timer, "
        f"{reconciled.get('stale')} stale timers cancelled ({reconcile_state})",
        flush=True,
    )
    lateness_state = _run_dag(
        "delaywheel_lateness_quality",
        out,
        {"start": clock_start.isoformat(), "end": store.clock().isoformat(), "report_dir": str(out / "lateness")},
    )
    lateness = _latest(
        store,
        "SELECT success, failed, report_path FROM delaywheel.validation_results"
        " WHERE validated_at >= %s ORDER BY id DESC LIMIT 1",
        clock_start,
    )
    print(
        "delivery lateness contract (DAG delaywheel_lateness_quality, Spark + Great Expectations): "
        f"{'passed' if lateness.get('success') else 'FAILED ' + str(lateness.get('failed'))}; "
        f"report {lateness.get('report_path')}",
        flush=True,
    )
    result = verify(store, out, since=clock_start)
    store.close()
    runs = {
        "shop_place_orders": placed,
        "shop_order_sweep": swept,
        "shop_reconcile": reconcile_state,
        "delaywheel_lateness_quality": lateness_state,
    }
    failures = [
        *result.failures,
        *(
            f"DAG {dag} ended {state}; its log: {out / (dag + '.log')}"
            for dag, state in runs.items()
            if state != "success"
        ),
    ]
    if not lateness.get("success"):
        failures.append(f"delivery lateness contract FAILED: {lateness.get('failed')}")
    summary = {
        "orders": n_orders,
        **result.summary,
        "reconcile": reconciled,
        "delivery_lateness_contract": "passed" if lateness.get("success") else "FAILED",
        "airflow_runs": runs,
        "processes": processes,
        "spark_start_s": spark["start_s"],
        "first_order_after_s": spark["first_order_s"],
        "failures": failures,
        "report": str(out / "report.html"),
    }
    print(json.dumps(summary, default=str, indent=2) if json_output else result.text, flush=True)
    print(f"\nreport: {out / 'report.html'}", flush=True)
    for line in failures:
        print(line, file=sys.stderr, flush=True)
    return 0 if result.success and not failures else 1


def _progress(store: Store, parts: Parts) -> Callable[[], None]:
    """Supervise the parts (often) and print the orders' progress (every 5 s) while the demo waits."""
    shown = time.monotonic()

    def tick() -> None:
        nonlocal shown
        parts.check()
        if time.monotonic() - shown >= 5:
            shown = time.monotonic()
            print(f"  orders: {_counts(store) or 'none placed yet (Spark is starting)'}", flush=True)

    return tick


def _spark_start(store: Store, out: Path, launched: datetime) -> dict[str, Any]:
    """How long the order generator took to place its first orders after its DAG run was launched, and how much
    of that was Spark's own start (the generator's log line): measured, for the one line that says why."""
    row = store.conn.execute("SELECT min(placed_at) FROM shop.orders").fetchone()
    first = (row[0] - launched).total_seconds() if row and row[0] else None
    found = re.findall(
        r"order generator: Spark started in ([\d.]+) s", (out / "shop_place_orders.log").read_text(errors="replace")
    )
    start = float(found[-1]) if found else None
    line = (
        f"Spark: first orders placed {first:.1f} s after the DAG run was launched (Airflow's `dags test` start, "
        f"then Spark's JVM and local[*] session: {start if start is not None else '?'} s); deadlines, timers and "
        "customer plans count from each order's placement, so this start-up adds wall time, not lateness"
        if first is not None
        else "Spark: no order was placed"
    )
    return {"first_order_s": None if first is None else round(first, 1), "start_s": start, "line": line}


def _run_dag(
    dag_id: str, out: Path, conf: dict[str, Any] | None = None, watch: Callable[[], None] | None = None
) -> str:
    """One run of a DAG through `airflow dags test` (`dag.test()` in its own process, so its task log goes
    to `out/<dag_id>.log` and not to this console); `watch` is called twice a second meanwhile (it raises to
    abandon the run, which is then killed). Returns the run's final state."""
    command = [sys.executable, "-m", "airflow", "dags", "test", dag_id, *(["--conf", json.dumps(conf)] if conf else [])]
    path = out / f"{dag_id}.log"
    with open(path, "w") as log:
        # its own process group, so that abandoning it also ends its spark-submit and JVM
        run = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            while run.poll() is None:
                if watch is not None:
                    watch()
                time.sleep(0.5)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    states = re.findall(r"DagRun Finished: dag_id=\S+,.*? state=(\w+)", path.read_text(errors="replace"))
    return states[-1] if states else f"not run (exit {run.returncode}; see {path})"


def _latest(store: Store, sql: str, since: datetime) -> dict[str, Any]:
    cur = store.conn.execute(sql, (since,))
    row = cur.fetchone()
    return {} if row is None else dict(zip([c.name for c in cur.description or []], row, strict=True))
