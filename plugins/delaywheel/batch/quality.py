"""Delivery lateness as a data contract (DESIGN.md invariant 4), checked with Great Expectations.

The queries that read a window out of PostgreSQL, the Spark SQL that aggregates it, the expectation suites
and the report live here; the Spark job only wires them together. GX and matplotlib are imported lazily
(they are heavy), and nothing here imports Spark: the frames handed to `validate` are whatever GX's Spark
data source accepts.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from delaywheel.ops.stats import LATENESS_S
from delaywheel.pending import cancelled, segment_messages

SUITE = "delaywheel_lateness"
LANES_NOT_LEVELS = ("wheel", "direct")


# --- reading a window (PostgreSQL SQL, run through JDBC) ----------------------------------------------


def _ts(t: datetime) -> sql.Composable:
    """A time as a quoted timestamptz literal (psycopg's quoting: the reader takes one text statement, no parameters)."""
    return sql.Literal(t.astimezone(UTC))


# Every non-replay delivery of a message due in [start, end), with its lateness (stats.LATENESS_S) in milliseconds.
_DELIVERIES = sql.SQL("""
        SELECT message_id, topic, origin AS lane, coalesce(level, 0)::int AS level, deliver_at,
               (({lateness}) * 1000)::float8 AS lateness_ms
        FROM delaywheel.topic_messages
        WHERE origin <> 'replay' AND deliver_at >= {start} AND deliver_at < {end}
          AND delivered_at >= {start} - interval '1 day'""")


def deliveries_sql(start: datetime, end: datetime) -> str:
    """Every non-replay delivery of a message due in [start, end), with its lateness in milliseconds (computed
    here: the delivery time itself would be one more timestamp per row for JDBC to carry and parse)."""
    return _DELIVERIES.format(lateness=LATENESS_S, start=_ts(start), end=_ts(end)).as_string()


# Every queued message due in [start, end) and whether it is cancelled (pending.cancelled): the level segments
# enqueued since `enqueued_from` (a level row is enqueued at most the longest level's delay before it is due, which
# prunes partitions), the near wheel, and the far blocks of those days.
_DUE = sql.SQL("""
        SELECT d.id AS message_id, d.split, d.lane, d.level, d.topic, d.deliver_at, {cancelled} AS cancelled
        FROM (SELECT m.id, s.id_first AS split, 'level' AS lane, s.level::int AS level, m.topic, s.deliver_at
              FROM delaywheel.level_segments s, {level_messages}
              WHERE {window} AND enqueued_at >= {enqueued_from} AND enqueued_at < {end}
              UNION ALL
              SELECT id, id, 'wheel', 0, topic, deliver_at FROM delaywheel.wheel WHERE {window}
              UNION ALL
              SELECT m.id, s.id_first, 'wheel', 0, m.topic, m.due AT TIME ZONE 'UTC'
              FROM delaywheel.wheel_far_segments s, {far_messages}
              WHERE s.block > {start} - interval '1 day' AND s.block < {end}
                AND m.due AT TIME ZONE 'UTC' >= {start} AND m.due AT TIME ZONE 'UTC' < {end}) d""")


def due_sql(start: datetime, end: datetime, longest_level: timedelta) -> str:
    """Every queued message due in [start, end) (direct messages are delivered at enqueue), and whether it
    was cancelled. A level row is enqueued at most `longest_level` before it is due: that prunes partitions.

    Segments are unnested here for the two arrays wanted, not through the views (which unnest bodies and
    keys too), and `split` is the segment's first id: a parallel reader's `split % n = i` then picks whole
    segments before they are unnested, instead of every reader unnesting every segment."""
    window = sql.SQL("deliver_at >= {} AND deliver_at < {}").format(_ts(start), _ts(end))
    return _DUE.format(
        cancelled=cancelled("d"),
        level_messages=segment_messages("id", "topic"),
        far_messages=segment_messages("id", "topic", "due"),
        window=window,
        enqueued_from=_ts(start - longest_level),
        start=_ts(start),
        end=_ts(end),
    ).as_string()


# --- aggregating (Spark SQL over the views `deliveries` and `due`) -------------------------------------

# One percentile_approx with an array of percentages builds one quantile summary per group, not one per figure.
MINUTES_SQL = """
    SELECT minute_us, lane, level, topic, deliveries, p[0] AS p50_ms, p[1] AS p95_ms, p[2] AS p99_ms, max_ms
    FROM (SELECT unix_micros(date_trunc('MINUTE', deliver_at)) AS minute_us, lane, level, topic,
                 count(*) AS deliveries, percentile_approx(lateness_ms, array(0.5, 0.95, 0.99), 10000) AS p,
                 max(lateness_ms) AS max_ms
          FROM deliveries GROUP BY 1, 2, 3, 4)"""

OUTCOMES_SQL = """
    SELECT d.message_id, d.lane, d.level, d.topic, d.deliver_at,
           CASE WHEN x.message_id IS NOT NULL THEN 'delivered' WHEN d.cancelled THEN 'cancelled' ELSE 'missing' END
               AS outcome
    FROM due d LEFT JOIN (SELECT DISTINCT message_id FROM deliveries) x ON x.message_id = d.message_id"""

HISTOGRAM_SQL = "SELECT histogram_numeric(lateness_ms, 40) AS bins FROM deliveries"


@dataclass(frozen=True)
class Thresholds:
    """p99 lateness allowed per lane key ('1'..'18', 'wheel', 'direct'), with a default for the others."""

    default_ms: float = 5000.0
    per_lane: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Lane keys and numbers only: `levels_sql` writes them into Spark SQL text (no psycopg there, and the job
        runs one text statement), so anything else is refused here rather than quoted there."""
        for name, value in [("default", self.default_ms), *self.per_lane.items()]:
            if not (name == "default" or name.isdigit() or name in LANES_NOT_LEVELS):
                raise ValueError(f"p99 threshold lane {name!r}: use a level number, wheel or direct")
            if not (isinstance(value, int | float) and math.isfinite(value)):
                raise ValueError(f"p99 threshold for {name!r}: {value!r} is not a finite number of milliseconds")

    @classmethod
    def parse(cls, text: str) -> Thresholds:
        """'5000' or 'default=5000,1=1500,wheel=2000' (milliseconds)."""
        default, per_lane = cls.default_ms, {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.rpartition("=")
            if not sep or name == "default":
                default = float(value)
            elif name.isdigit() or name in LANES_NOT_LEVELS:
                per_lane[name] = float(value)
            else:
                raise ValueError(f"p99 threshold {part!r}: use LEVEL=MS, wheel=MS, direct=MS or default=MS")
        return cls(default, per_lane)

    def levels_sql(self) -> str:
        """Per-lane summary of `deliveries` with the threshold each lane is held to."""
        pairs = ", ".join(f"'{k}', {float(v)}D" for k, v in self.per_lane.items())  # checked in __post_init__
        lookup = f"element_at(map({pairs}), lane_key)" if pairs else "CAST(NULL AS DOUBLE)"
        return f"""
            SELECT lane_key, deliveries, p[0] AS p50_ms, p[1] AS p99_ms, max_ms,
                   coalesce({lookup}, {float(self.default_ms)}D) AS threshold_ms
            FROM (SELECT CASE WHEN lane = 'level' THEN CAST(level AS STRING) ELSE lane END AS lane_key,
                         count(*) AS deliveries, percentile_approx(lateness_ms, array(0.5, 0.99), 10000) AS p,
                         max(lateness_ms) AS max_ms
                  FROM deliveries GROUP BY 1)"""


def store_minutes(conn: psycopg.Connection, rows: list[tuple[Any, ...]]) -> int:
    """Upsert (minute_us, lane, level, topic, deliveries, p50, p95, p99, max) rows: re-running a window
    replaces its figures instead of adding to them."""
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(
            """
            INSERT INTO delaywheel.lateness_minutes AS m
                (minute, lane, level, topic, deliveries, p50_ms, p95_ms, p99_ms, max_ms)
            VALUES (to_timestamp(%s / 1e6), %s, %s, %s, %s, %s, %s, %s, %s)
            ON CONFLICT (minute, lane, level, topic) DO UPDATE SET deliveries = excluded.deliveries,
                p50_ms = excluded.p50_ms, p95_ms = excluded.p95_ms, p99_ms = excluded.p99_ms,
                max_ms = excluded.max_ms, computed_at = clock_timestamp()
            """,
            rows,
        )
    return len(rows)


# --- the contract (Great Expectations) -----------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One expectation's outcome, with the figures a person needs to act on it."""

    name: str
    expectation: str
    success: bool
    figures: str


@dataclass
class ContractResult:
    start: datetime
    end: datetime
    checks: list[Check]
    results: dict[str, Any]  # frame name -> GX validation result (JSON dict)

    @property
    def success(self) -> bool:
        return all(c.success for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.success]

    def message(self) -> str:
        lines = [f"lateness contract broken for due window [{self.start.isoformat()}, {self.end.isoformat()}):"]
        lines += [f"  - {c.name} ({c.expectation}) failed: {c.figures}" for c in self.failed]
        return "\n".join(lines)


class ContractBroken(RuntimeError):
    """A lateness expectation failed; the message names each failed expectation and its figures."""


def _expectations() -> dict[str, list[Any]]:
    """frame name -> GX expectations, each tagged with its contract name: what the contract says, in GX terms."""
    import great_expectations as gx

    e = gx.expectations

    def named(name: str, expectation: type, **kwargs: Any) -> Any:
        return expectation(meta={"contract": name}, **kwargs)

    return {
        "deliveries": [
            named("zero_early_deliveries", e.ExpectColumnValuesToBeBetween, column="lateness_ms", min_value=0),
            named("no_duplicate_delivery", e.ExpectColumnValuesToBeUnique, column="message_id"),
        ],
        "outcomes": [
            named(
                "completeness", e.ExpectColumnValuesToBeInSet, column="outcome", value_set=["delivered", "cancelled"]
            ),
        ],
        "levels": [
            named(
                "p99_within_threshold",
                e.ExpectColumnPairValuesAToBeGreaterThanB,
                column_A="threshold_ms",
                column_B="p99_ms",
                or_equal=True,
            ),
        ],
    }


def _figures(name: str, result: dict[str, Any], levels: list[dict[str, Any]]) -> str:
    bad, total = result.get("unexpected_count", 0), result.get("element_count", 0)
    sample = result.get("partial_unexpected_list", [])[:5]
    if name == "zero_early_deliveries":
        return f"{bad} of {total} deliveries early (lateness ms, e.g. {sample})"
    if name == "no_duplicate_delivery":
        return f"{bad} of {total} deliveries share a message id (e.g. message ids {sample})"
    if name == "completeness":
        return f"{bad} of {total} messages due in the window neither delivered nor cancelled"
    over = [
        f"{r['lane_key']}: p99 {r['p99_ms']:.0f} ms > {r['threshold_ms']:.0f} ms"
        for r in levels
        if r["p99_ms"] > r["threshold_ms"]
    ]
    return f"{bad} of {total} lanes over their p99 threshold ({'; '.join(over)})"


def _raised(info: dict[str, Any]) -> str | None:
    """GX reports a metric that failed to compute in `exception_info` (flat, or one entry per metric) instead of
    raising: a broken check must not pass for a data failure, nor for a success."""
    entries = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    messages = [str(e.get("exception_message")) for e in entries if e.get("raised_exception")]
    return "; ".join(messages) or None


def validate(frames: dict[str, Any], levels: list[dict[str, Any]], start: datetime, end: datetime) -> ContractResult:
    """Validate the window's frames ('deliveries', 'outcomes', 'levels': Spark DataFrames) with an ephemeral
    GX context and a Spark data source; `levels` are the collected rows of the 'levels' frame."""
    import great_expectations as gx

    context = gx.get_context(mode="ephemeral")
    source = context.data_sources.add_spark(name="delaywheel")
    checks: list[Check] = []
    results: dict[str, Any] = {}
    for frame, expectations in _expectations().items():
        suite = gx.ExpectationSuite(name=f"{SUITE}.{frame}")
        for expectation in expectations:
            suite.add_expectation(expectation)
        suite = context.suites.add(suite)
        batch = (
            source.add_dataframe_asset(name=frame)
            .add_batch_definition_whole_dataframe("window")
            .get_batch(batch_parameters={"dataframe": frames[frame]})
        )
        outcome = batch.validate(suite)
        results[frame] = outcome.to_json_dict()
        for r in outcome.results:
            config = r.expectation_config
            assert config is not None and config.meta is not None
            name = config.meta["contract"]
            error = _raised(r.exception_info or {})
            figures = f"GX could not evaluate it: {error}" if error else _figures(name, r.result, levels)
            checks.append(Check(name, config.type, bool(r.success) and not error, figures))
    return ContractResult(start, end, checks, results)


def save_result(conn: psycopg.Connection, result: ContractResult, report_path: str | None) -> int:
    row = conn.execute(
        "INSERT INTO delaywheel.validation_results (suite, window_start, window_end, success, failed, result,"
        " report_path) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
        (
            SUITE,
            result.start,
            result.end,
            result.success,
            [c.name for c in result.failed],
            Jsonb(json.loads(json.dumps(result.results, default=str))),
            report_path,
        ),
    ).fetchone()
    assert row is not None
    return int(row[0])


# --- the report ------------------------------------------------------------------------------------------


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def render_report(
    path: Path, result: ContractResult, levels: list[dict[str, Any]], histogram: list[tuple[float, float]]
) -> Path:
    """A self-contained HTML page: the checks, a lateness histogram and the per-lane table as pictures."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    if histogram:
        xs, ys = zip(*sorted(histogram), strict=True)
        width = (max(xs) - min(xs)) / max(len(xs), 1) or 1.0
        ax.bar(xs, ys, width=width, color="#4477aa")
    ax.axvline(0, color="#cc3311", linewidth=1)
    ax.set_xlabel("lateness (ms) = delivered_at - deliver_at")
    ax.set_ylabel("deliveries")
    ax.set_title("Delivery lateness")
    hist_png = _png(fig)
    plt.close(fig)

    rows = sorted(
        levels,
        key=lambda r: (
            not r["lane_key"].isdigit(),
            int(r["lane_key"]) if r["lane_key"].isdigit() else 0,
            r["lane_key"],
        ),
    )
    fig, ax = plt.subplots(figsize=(8, 0.4 + 0.3 * max(len(rows), 1)))
    ax.axis("off")
    cells = [
        [
            r["lane_key"],
            f"{r['deliveries']:,}",
            f"{r['p50_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
            f"{r['max_ms']:.0f}",
            f"{r['threshold_ms']:.0f}",
            "ok" if r["p99_ms"] <= r["threshold_ms"] else "OVER",
        ]
        for r in rows
    ]
    if cells:
        table = ax.table(
            cellText=cells,
            colLabels=["lane", "deliveries", "p50 ms", "p99 ms", "max ms", "p99 limit", ""],
            loc="center",
        )
        table.scale(1, 1.2)
    table_png = _png(fig)
    plt.close(fig)

    items = "".join(
        f"<li class={'ok' if c.success else 'fail'}><b>{html.escape(c.name)}</b> ({html.escape(c.expectation)}): "
        f"{'passed' if c.success else 'FAILED'} &mdash; {html.escape(c.figures)}</li>"
        for c in result.checks
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>delaywheel lateness</title>"
        "<style>body{font-family:sans-serif;margin:2em} .ok{color:#227733} .fail{color:#cc3311}</style>"
        f"<h1>Delivery lateness: {'contract met' if result.success else 'contract BROKEN'}</h1>"
        f"<p>Due window [{html.escape(result.start.isoformat())}, {html.escape(result.end.isoformat())})</p>"
        f"<ul>{items}</ul><h2>Lateness histogram</h2><img alt='lateness histogram' src='data:image/png;base64,{hist_png}'>"
        f"<h2>Per lane</h2><img alt='per-lane lateness table' src='data:image/png;base64,{table_png}'>"
    )
    return path
