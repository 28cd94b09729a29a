"""The order-timeout outcome as a data contract, checked with Great Expectations, reported in words and charts.

Rules: every order unpaid at its deadline is cancelled by the timeout; no paid order is cancelled; no payment made in
time is refused (which happens when the customers' worker processes it only after the sweep applied the order's
timeout: the outcome rules allow it, a customer who paid in time would not); stock is conserved (initial = on hand +
reserved + sold) and nothing stays reserved once every order is settled; timeout cancellations are never early and
their lateness is within the contract.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
from psycopg import sql

from delaywheel.ops.stats import LATENESS_P50_P99
from delaywheel.store import Store
from delaywheel_shop.orders import TOPIC

CONTRACT_P99_S = 1.0  # lateness of a timeout cancellation (deadline -> order cancelled), 99th percentile
CONTRACT_MAX_S = 3.0

_ORDERS = """
SELECT o.order_id, o.status,
       EXISTS (SELECT 1 FROM shop.payments p WHERE p.order_id = o.order_id AND p.accepted AND p.paid_at < o.deadline) AS paid_in_time,
       EXISTS (SELECT 1 FROM shop.payments p WHERE p.order_id = o.order_id AND NOT p.accepted AND p.paid_at < o.deadline)
           AS refused_in_time,
       (o.status = 'cancelled_customer' AND o.cancelled_at < o.deadline) AS customer_cancelled_in_time,
       extract(epoch FROM o.cancelled_at - o.deadline)::float8 AS cancel_lateness_s
FROM shop.orders o
"""


@dataclass
class Verdict:
    success: bool
    summary: dict[str, Any]
    text: str
    results: list[dict[str, Any]]
    failures: list[str]  # one line per rule broken, naming the figure, its value and the contract


def _frames(store: Store) -> tuple[pd.DataFrame, pd.DataFrame]:
    cur = store.conn.execute(_ORDERS)
    orders = pd.DataFrame(cur.fetchall(), columns=[d.name for d in cur.description or []])
    # rule columns as 0/1: GX cannot serialise numpy booleans in its results
    orders["timeout_rule_ok"] = (
        orders.paid_in_time | orders.customer_cancelled_in_time | (orders.status == "cancelled_timeout")
    ).astype(int)
    orders["paid_rule_ok"] = ((orders.status == "paid") == orders.paid_in_time).astype(int)
    orders["in_time_payment_rule_ok"] = (~orders.refused_in_time).astype(int)
    cur = store.conn.execute(
        "SELECT sku, initial_stock - on_hand - reserved - sold AS stock_gap, reserved FROM shop.products"
    )
    products = pd.DataFrame(cur.fetchall(), columns=[d.name for d in cur.description or []])
    return orders, products


def _validate(orders: pd.DataFrame, products: pd.DataFrame) -> list[dict[str, Any]]:
    """Run the suites with an ephemeral GX context; one dict per expectation with its figures."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # GX's per-metric progress bars would drown the demo's own output
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    source = context.data_sources.add_pandas("shop")
    cancellations = orders[orders.status == "cancelled_timeout"][["order_id", "cancel_lateness_s"]]
    suites: dict[str, tuple[pd.DataFrame, list[Any]]] = {
        "orders": (
            orders,
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="timeout_rule_ok",
                    value_set=[1],
                    meta={"rule": "every order unpaid at its deadline is cancelled"},
                ),
                gxe.ExpectColumnValuesToBeInSet(
                    column="paid_rule_ok",
                    value_set=[1],
                    meta={"rule": "an order is paid exactly when it was paid in time: no paid order is cancelled"},
                ),
                gxe.ExpectColumnValuesToBeInSet(
                    column="in_time_payment_rule_ok",
                    value_set=[1],
                    meta={"rule": "no payment made in time is refused: the customers kept up with their plan"},
                ),
                gxe.ExpectColumnValuesToBeUnique(column="order_id", meta={"rule": "each order once"}),
            ],
        ),
        "products": (
            products,
            [
                gxe.ExpectColumnValuesToBeBetween(
                    column="stock_gap",
                    min_value=0,
                    max_value=0,
                    meta={"rule": "stock conserved: initial = on hand + reserved + sold"},
                ),
                gxe.ExpectColumnValuesToBeBetween(
                    column="reserved",
                    min_value=0,
                    max_value=0,
                    meta={"rule": "no stock left reserved once every order is settled"},
                ),
            ],
        ),
        "cancellations": (
            cancellations,
            [
                gxe.ExpectColumnMinToBeBetween(
                    column="cancel_lateness_s", min_value=0, meta={"rule": "no order cancelled before its deadline"}
                ),
                # "p99 within X" as "at least 99 % within X" (GX 1.24's quantile expectation cannot
                # serialise its result for pandas data)
                gxe.ExpectColumnValuesToBeBetween(
                    column="cancel_lateness_s",
                    max_value=CONTRACT_P99_S,
                    mostly=0.99,
                    meta={"rule": f"cancellation lateness p99 within {CONTRACT_P99_S:g} s"},
                ),
                gxe.ExpectColumnMaxToBeBetween(
                    column="cancel_lateness_s",
                    max_value=CONTRACT_MAX_S,
                    meta={"rule": f"cancellation lateness at most {CONTRACT_MAX_S:g} s"},
                ),
            ],
        ),
    }
    results = []
    for name, (frame, expectations) in suites.items():
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        suite = context.suites.add(gx.ExpectationSuite(name=f"shop_{name}", expectations=expectations))
        validation = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        outcome = validation.run(batch_parameters={"dataframe": frame})
        for r in outcome.results:
            config = r.expectation_config
            assert config is not None  # GX fills it for every result of a suite run
            results.append(
                {
                    "table": name,
                    "expectation": config.type,
                    "rule": (config.meta or {})["rule"],
                    "success": bool(r.success),
                    "observed": _plain(r.result.get("observed_value")),
                    "unexpected": r.result.get("unexpected_count"),
                    "examples": r.result.get("partial_unexpected_list", [])[:5],
                }
            )
    return results


def _ms(seconds: float | None) -> float | None:
    """A figure in seconds (from SQL or pandas) as milliseconds, to 0.1 ms, for the summary."""
    return None if seconds is None else round(float(seconds) * 1000, 1)


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers, for the report and the JSON file."""
    return value.item() if hasattr(value, "item") else value


def _chart(orders: pd.DataFrame) -> str:
    """Outcome counts and the cancellation-lateness histogram, as one base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    counts = orders.status.value_counts().sort_index()
    left.bar(counts.index, counts.values, color=["#c0392b", "#e67e22", "#27ae60", "#7f8c8d"][: len(counts)])
    left.set_title("orders by outcome")
    left.tick_params(axis="x", labelrotation=15)
    lateness_ms = orders.loc[orders.status == "cancelled_timeout", "cancel_lateness_s"].dropna() * 1000
    right.hist(lateness_ms, bins=50, color="#2c7fb8")
    right.axvline(CONTRACT_P99_S * 1000, color="#c0392b", linestyle="--", label=f"contract p99 {CONTRACT_P99_S:g} s")
    right.axvline(CONTRACT_MAX_S * 1000, color="#7b241c", linestyle=":", label=f"contract max {CONTRACT_MAX_S:g} s")
    right.set_title("timeout cancellation lateness (ms after the deadline)")
    right.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


# The order timers' delivery lateness: p50 and p99 (the store's one definition, stats.LATENESS_P50_P99) and how many
# were delivered before their due time (invariant 1: none).
_TIMER_LATENESS = sql.SQL("""
    SELECT p[1], p[2], early FROM (
        SELECT {p50_p99} AS p, count(*) FILTER (WHERE delivered_at < deliver_at) AS early
        FROM delaywheel.topic_messages WHERE topic = %(topic)s AND delivered_at >= %(since)s) l
""").format(p50_p99=LATENESS_P50_P99)


# Refused payments: made after their order's deadline (the plan's late payers), and made in time but processed after
# the order's timeout was applied (the customers fell behind); and how long after it was made each payment was
# processed (p99, max).
_PAYMENTS = """
SELECT count(*) FILTER (WHERE NOT p.accepted AND p.paid_at >= o.deadline),
       count(*) FILTER (WHERE NOT p.accepted AND p.paid_at < o.deadline),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM p.processed_at - p.paid_at)),
       max(extract(epoch FROM p.processed_at - p.paid_at))
FROM shop.payments p JOIN shop.orders o USING (order_id)
"""


def verify(store: Store, out: Path, *, since: datetime) -> Verdict:
    """Check the outcome and write report.html and validation.json under `out`."""
    orders, products = _frames(store)
    results = _validate(orders, products)
    success = all(r["success"] for r in results)
    lateness = orders.loc[orders.status == "cancelled_timeout", "cancel_lateness_s"].dropna()
    payments = store.conn.execute(_PAYMENTS).fetchone()
    delivery = store.conn.execute(_TIMER_LATENESS, {"topic": TOPIC, "since": since}).fetchone()
    counts = orders.status.value_counts().to_dict()
    summary = {
        "placed": len(orders),
        "paid": counts.get("paid", 0),
        "cancelled_by_timeout": counts.get("cancelled_timeout", 0),
        "cancelled_by_customer": counts.get("cancelled_customer", 0),
        "still_pending": counts.get("pending", 0),
        "late_payments_refused": int(payments[0]) if payments else 0,
        "in_time_payments_refused": int(payments[1]) if payments else 0,
        "payment_processing_p99_ms": _ms(payments[2]) if payments else None,
        "payment_processing_max_ms": _ms(payments[3]) if payments else None,
        "cancellation_lateness_p50_ms": _ms(lateness.quantile(0.5)) if len(lateness) else None,
        "cancellation_lateness_p99_ms": _ms(lateness.quantile(0.99)) if len(lateness) else None,
        "cancellation_lateness_max_ms": _ms(lateness.max()) if len(lateness) else None,
        "timer_delivery_lateness_p50_ms": _ms(delivery[0]) if delivery else None,
        "timer_delivery_lateness_p99_ms": _ms(delivery[1]) if delivery else None,
        "timers_delivered_early": int(delivery[2]) if delivery else None,
        "quality": "passed" if success else "FAILED",
        "expectations_passed": f"{sum(r['success'] for r in results)}/{len(results)}",
    }
    text = _words(summary, results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"summary": summary, "results": results}, default=str, indent=2))
    rows = "".join(
        f"<tr class={'ok' if r['success'] else 'bad'}><td>{'passed' if r['success'] else 'FAILED'}</td>"
        f"<td>{html.escape(r['rule'])}</td><td><code>{r['expectation']}</code> on {r['table']}</td>"
        f"<td>{html.escape(str(r['observed'] if r['observed'] is not None else r['unexpected']))}</td></tr>"
        for r in results
    )
    (
        out / "report.html"
    ).write_text(f"""<!doctype html><meta charset=utf-8><title>delaywheel order-timeout report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} td,th{{padding:4px 8px;border-bottom:1px solid #ddd}}
.ok td:first-child{{color:#27ae60}} .bad td:first-child{{color:#c0392b;font-weight:bold}}</style>
<h1>Order timeouts: {summary["quality"]}</h1>
<p>{"</p><p>".join(html.escape(line) for line in text.splitlines() if line)}</p>
<img alt="orders by outcome and cancellation lateness" src="data:image/png;base64,{_chart(orders)}">
<h2>Expectations (Great Expectations)</h2>
<table><tr><th>result</th><th>rule</th><th>expectation</th><th>observed / unexpected</th></tr>{rows}</table>""")
    return Verdict(success, summary, text, results, _failures(lateness, results))


def _failures(lateness: pd.Series, results: list[dict[str, Any]]) -> list[str]:
    """What a user must see without opening the report: the lateness figure that missed the contract with its
    value (the quantiles as the summary computes them), and any other rule broken."""
    lines = []
    if len(lateness):
        for name, value, limit in (
            ("p99", float(lateness.quantile(0.99)), CONTRACT_P99_S),
            ("max", float(lateness.max()), CONTRACT_MAX_S),
        ):
            if value > limit:
                lines.append(f"CONTRACT FAILED: cancellation lateness {name} {value:.2f} s > {limit:g} s")
        if float(lateness.min()) < 0:
            lines.append(f"CONTRACT FAILED: an order was cancelled {-float(lateness.min()):.2f} s before its deadline")
    lateness_rules = {r["rule"] for r in results if r["table"] == "cancellations"}
    lines += [f"QUALITY FAILED: {r['rule']}" for r in results if not r["success"] and r["rule"] not in lateness_rules]
    return lines


def _words(s: dict[str, Any], results: list[dict[str, Any]]) -> str:
    failed = [r for r in results if not r["success"]]
    lines = [
        f"{s['placed']} orders were placed: {s['paid']} were paid in time, {s['cancelled_by_timeout']} were cancelled "
        f"by their timeout and their stock released, {s['cancelled_by_customer']} were cancelled by the customer; "
        f"{s['still_pending']} are still pending. {s['late_payments_refused']} payments arrived after the deadline and were refused."
        + (
            f" {s['in_time_payments_refused']} payments made in time were refused: the customers' worker processed"
            " them after the sweep had applied their orders' timeouts."
            if s["in_time_payments_refused"]
            else ""
        )
        + (
            f" The customers' worker processed payments {s['payment_processing_p99_ms']} ms (p99) /"
            f" {s['payment_processing_max_ms']} ms (max) after they were made."
            if s["payment_processing_max_ms"] is not None
            else ""
        ),
        f"Timeout cancellations happened {s['cancellation_lateness_p50_ms']} ms after the deadline at the median and "
        f"{s['cancellation_lateness_p99_ms']} ms at the 99th percentile, {s['cancellation_lateness_max_ms']} ms at most "
        f"(contract: p99 within {CONTRACT_P99_S:g} s, "
        f"none later than {CONTRACT_MAX_S:g} s, none early). The timers themselves reached their topic "
        f"{s['timer_delivery_lateness_p50_ms']} ms (p50) / {s['timer_delivery_lateness_p99_ms']} ms (p99) after due, "
        f"{s['timers_delivered_early']} early.",
        f"Data quality: {s['quality']} ({s['expectations_passed']} expectations met)."
        + (
            ""
            if not failed
            else " Failed: "
            + "; ".join(
                f"{r['rule']} ({'observed ' + str(r['observed']) if r['observed'] is not None else str(r['unexpected']) + ' rows break it'})"
                for r in failed
            )
        ),
    ]
    return "\n".join(lines)
