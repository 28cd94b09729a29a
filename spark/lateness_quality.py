"""Lateness quality: delivery lateness of a due-time window as a data contract (Great Expectations).

    spark-submit --jars /usr/share/java/postgresql.jar spark/lateness_quality.py --db-url URL \
        --window-minutes 15 --p99-ms default=5000,1=1500,wheel=2000

Reads the window's deliveries and due messages over JDBC, stores lateness per due minute, lane/level and
topic (count, p50, p95, p99, max) in `delaywheel.lateness_minutes`, validates the contract (zero early
deliveries, p99 within the threshold of each lane, no duplicate delivery, completeness), saves the
validation result in `delaywheel.validation_results`, writes an HTML report and prints its path. A broken
contract exits with an error naming each failed expectation and its figures (so the Airflow task fails).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import sparkjob

from delaywheel.batch import quality
from delaywheel.config import PROJECT_ROOT, load_settings
from delaywheel.db import connect

DEFAULT_REPORTS = PROJECT_ROOT / ".delaywheel" / "reports"


def main(argv: list[str] | None = None) -> quality.ContractResult:
    p = sparkjob.parser("Check delivery lateness of a due-time window against the contract.")
    p.add_argument("--start", type=sparkjob.instant, help="window start (due time); default: --end - window")
    p.add_argument("--end", type=sparkjob.instant, help="window end, exclusive; default: now - --settle-seconds")
    p.add_argument("--window-minutes", type=float, default=15.0)
    p.add_argument(
        "--settle-seconds",
        type=float,
        default=60.0,
        help="leave out the most recent due times: their deliveries may still be in flight",
    )
    p.add_argument("--p99-ms", default="5000", help="p99 lateness limit: MS, or default=MS,LEVEL=MS,wheel=MS")
    p.add_argument("--report-dir", type=sparkjob.text, help=f"where the HTML report goes (default: {DEFAULT_REPORTS})")
    args = p.parse_args(argv)
    settings = load_settings()
    ((_, url),) = sparkjob.stores(p, args, settings).items()  # one store: --db-url, or --store NAME with several
    thresholds = quality.Thresholds.parse(args.p99_ms)
    with connect(url, autocommit=True) as conn:
        clock = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    end = args.end or clock - timedelta(seconds=args.settle_seconds)
    start = args.start or end - timedelta(minutes=args.window_minutes)

    spark = sparkjob.session("delaywheel lateness quality")
    spark.sparkContext.setJobDescription(f"delaywheel lateness [{start.isoformat()}, {end.isoformat()})")
    deliveries = sparkjob.read_sql(spark, url, quality.deliveries_sql(start, end), split_column="message_id").cache()
    due = sparkjob.read_sql(spark, url, quality.due_sql(start, end, max(settings.levels)), split_column="split")
    deliveries.createOrReplaceTempView("deliveries")
    due.createOrReplaceTempView("due")
    minutes = [tuple(r) for r in spark.sql(quality.MINUTES_SQL).collect()]
    levels_frame = spark.sql(thresholds.levels_sql()).cache()
    levels = [r.asDict() for r in levels_frame.collect()]
    histogram = [(b.x, b.y) for b in (spark.sql(quality.HISTOGRAM_SQL).first().bins or [])]

    outcomes = spark.sql(quality.OUTCOMES_SQL).cache()
    result = quality.validate(
        {"deliveries": deliveries, "outcomes": outcomes, "levels": levels_frame}, levels, start, end
    )
    name = f"lateness_{start:%Y%m%dT%H%M%S}_{end:%Y%m%dT%H%M%S}.html"
    report = quality.render_report(Path(args.report_dir or DEFAULT_REPORTS) / name, result, levels, histogram)
    with connect(url, autocommit=True) as conn:
        quality.store_minutes(conn, minutes)
        result_id = quality.save_result(conn, result, str(report))
    print(
        json.dumps(
            {
                "job": "lateness_quality",
                "window": [start.isoformat(), end.isoformat()],
                "deliveries": sum(r["deliveries"] for r in levels),
                "minutes_rows": len(minutes),
                "success": result.success,
                "failed": [c.name for c in result.failed],
                "validation_result_id": result_id,
            }
        ),
        flush=True,
    )
    print(f"lateness report: {report}", flush=True)
    if not result.success:
        raise quality.ContractBroken(result.message())
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
