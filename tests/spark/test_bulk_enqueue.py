"""Bulk enqueue through Spark: the same rules as `send`, bad rows quarantined with reason, file and row
number, and a re-run of the same input enqueues nothing new."""

from __future__ import annotations

import csv
import json
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import bulk_enqueue
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delaywheel import Store
from tests.helpers import bulk_rows, quarantine_rows, written


@pytest.fixture(autouse=True)
def input_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Inputs are read only under the configured roots: these tests write theirs under tmp_path."""
    monkeypatch.setenv("DELAYWHEEL_INPUT_ROOTS", str(tmp_path))
    return tmp_path


def test_csv_good_and_bad_rows_then_rerun_adds_nothing(
    spark: object, store: Store, db_url: str, t0: datetime, tmp_path: Path
) -> None:
    rows, bad = bulk_rows(t0)
    path = tmp_path / "orders.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    argv = ["--db-url", db_url, "--input", str(path), "--now", t0.isoformat(), "--partitions", "2", "--chunk", "25"]

    first = bulk_enqueue.main(argv)

    good = len(rows) - len(bad)
    assert (first.rows, first.enqueued, first.skipped, first.rejected) == (len(rows), good, 0, len(bad))
    assert written(store) == good
    quarantined = quarantine_rows(store)
    assert {n: reason for n, (reason, _) in quarantined.items()} == bad
    assert all(file.endswith("orders.csv") for _, file in quarantined.values())
    level_rows = store.conn.execute("SELECT key, level, deliver_at FROM delaywheel.level_queue ORDER BY id").fetchall()
    assert [(k, lv, due) for k, lv, due in level_rows if k == "k3"] == [("k3", 3, t0 + timedelta(seconds=10))]

    again = bulk_enqueue.main(argv)

    assert (again.enqueued, again.skipped, again.rejected) == (0, good, len(bad))
    assert written(store) == good
    assert quarantine_rows(store) == quarantined


def test_json_lines_and_parquet_keep_row_numbers(
    spark: object, store: Store, db_url: str, t0: datetime, tmp_path: Path
) -> None:
    lines = [json.dumps({"topic": "pay", "key": f"j{i}", "body": {"i": i}, "delay_level": 4}) for i in range(30)]
    lines[11] = '{"topic": "pay", "key": "j11", '  # cut off: the reader cannot parse it
    lines[20] = json.dumps({"topic": "pay", "key": "j20", "body": {"i": 20}, "delay_level": 99})  # clamped: valid
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")

    counts = bulk_enqueue.main(["--db-url", db_url, "--input", str(tmp_path / "events.jsonl"), "--now", t0.isoformat()])

    assert (counts.enqueued, counts.rejected, dict(counts.reasons)) == (29, 1, {"malformed_record": 1})
    assert {n: reason for n, (reason, _) in quarantine_rows(store).items()} == {12: "malformed_record"}
    assert store.conn.execute(
        "SELECT level, requested_level FROM delaywheel.level_queue WHERE key = 'j20'"
    ).fetchone() == (18, 99)

    table = pa.table(
        {
            "order_id": pa.array(range(1000, 1050), pa.int64()),
            "payload": [json.dumps({"order": i}) for i in range(50)],
            "wait_ms": [60_000.0] * 49 + [-5.0],
        }
    )  # the last row has a negative delay
    pq.write_table(table, tmp_path / "orders.parquet", row_group_size=10)

    counts = bulk_enqueue.main(
        [
            "--db-url",
            db_url,
            "--input",
            str(tmp_path / "orders.parquet"),
            "--topic",
            "orders",
            "--map",
            "key=order_id,body=payload,delay_ms=wait_ms",
            "--now",
            t0.isoformat(),
        ]
    )

    assert (counts.enqueued, counts.rejected) == (49, 1)
    assert {n: reason for n, (reason, f) in quarantine_rows(store).items() if f.endswith(".parquet")} == {
        50: "bad_delay"
    }
    due = store.conn.execute(
        "SELECT deliver_at FROM delaywheel.wheel WHERE key = '1000' UNION ALL"
        " SELECT deliver_at FROM delaywheel.wheel_far WHERE key = '1000'"
    ).fetchone()
    assert due == (t0 + timedelta(minutes=1),)


def test_query_source_over_jdbc(spark: object, store: Store, db_url: str, t0: datetime) -> None:
    query = (
        "SELECT 'q' || g AS key, 'orders' AS topic, CASE WHEN g = 7 THEN -1 ELSE g * 1000 END AS delay_ms,"
        " json_build_object('n', g)::text AS body FROM generate_series(1, 20) g ORDER BY g"
    )

    counts = bulk_enqueue.main(["--db-url", db_url, "--query", query, "--now", t0.isoformat()])
    again = bulk_enqueue.main(["--db-url", db_url, "--query", query, "--now", t0.isoformat()])

    assert (counts.rows, counts.enqueued, counts.rejected) == (20, 19, 1)
    assert (again.enqueued, again.skipped, again.rejected) == (0, 19, 1)
    assert quarantine_rows(store) == {7: ("bad_delay", "query")}
    assert store.conn.execute("SELECT count(*) FROM delaywheel.idempotency WHERE source = %s", (query,)).fetchone() == (
        19,
    )


def _messages(store: Store) -> Counter[tuple[object, ...]]:
    """Every written message's fields (not its id or enqueue time), counted."""
    fields = "topic, key, tags, properties, body, deliver_at"
    return Counter(
        row
        for t in ("level_queue", "wheel", "wheel_far")
        for row in store.conn.execute(f"SELECT {fields} FROM delaywheel.{t}").fetchall()
    )


def test_parquet_row_groups_by_pyarrow_match_sparks_reader(
    spark: object, store: Store, db_url: str, t0: datetime, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Local Parquet is read a row group per task by pyarrow: the same rows, quarantine entries and claims as
    Spark's reader gives, so either reader's re-run finds the other's claims (keyless rows are claimed by
    file#row, with the file as Spark names it)."""
    n = 40
    table = pa.table(
        {
            "TOPIC": ["orders"] * n,
            "key": [None if i % 3 == 0 else f"p{i}" for i in range(n)],  # a third keyless
            "body": [json.dumps({"i": i}) for i in range(n)],
            "lvl": pa.array(
                [None if i % 2 else -2 if i == 32 else i % 18 + 1 for i in range(n)], pa.int32()
            ),  # row 33 bad
            "due": pa.array(
                [t0 + timedelta(minutes=i) if i % 2 else None for i in range(n)], pa.timestamp("us", "UTC")
            ),
        }
    )
    path = tmp_path / "orders 1é.parquet"
    pq.write_table(table, path, row_group_size=6)
    argv = [
        "--db-url",
        db_url,
        "--input",
        str(path),
        "--now",
        t0.isoformat(),
        "--map",
        "topic=TOPIC,delay_level=lvl,deliver_at=due",
        "--chunk",
        "5",
    ]

    first = bulk_enqueue.main(argv)

    assert "2 partitions (row groups read by pyarrow)" in capfd.readouterr().out
    assert (first.rows, first.enqueued, first.rejected, dict(first.reasons)) == (n, n - 1, 1, {"bad_level": 1})
    quarantined = quarantine_rows(store)
    spark_file = spark.read.parquet(str(path)).select("_metadata.file_path").first()[0]  # type: ignore[attr-defined]
    assert quarantined == {33: ("bad_level", spark_file)}
    written = _messages(store)

    again = bulk_enqueue.main([*argv, "--parquet-reader", "spark"])

    assert "(Spark's reader)" in capfd.readouterr().out
    assert (again.enqueued, again.skipped, again.rejected) == (0, n - 1, 1)
    assert quarantine_rows(store) == quarantined

    bulk_enqueue.main([*argv, "--parquet-reader", "spark", "--source", "once more"])

    assert _messages(store) == Counter({row: 2 * k for row, k in written.items()})


def test_parquet_partition_directories_are_read_by_spark(
    spark: object, store: Store, db_url: str, t0: datetime, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    for level in (2, 5):
        (tmp_path / f"level={level}").mkdir()
        pq.write_table(
            pa.table({"key": [f"l{level}-{i}" for i in range(10)], "body": ["{}"] * 10}),
            tmp_path / f"level={level}" / "part-0.parquet",
            row_group_size=3,
        )

    counts = bulk_enqueue.main(
        [
            "--db-url",
            db_url,
            "--input",
            str(tmp_path),
            "--format",
            "parquet",
            "--topic",
            "orders",
            "--map",
            "delay_level=level",
            "--now",
            t0.isoformat(),
        ]
    )

    assert "(Spark's reader)" in capfd.readouterr().out
    assert counts.enqueued == 20
    assert store.conn.execute(
        "SELECT level, count(*) FROM delaywheel.level_queue GROUP BY 1 ORDER BY 1"
    ).fetchall() == [(2, 10), (5, 10)]


# --- what a form may give (issue 18): each refused before Spark starts, with a clear error and nothing written ---


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            [
                "--query",
                "WITH d AS (DELETE FROM delaywheel.cancellations RETURNING message_id) SELECT message_id::text"
                " AS key FROM d",
                "--topic",
                "orders",
            ],
            "data-modifying WITH",
        ),
        (
            ["--query", "SELECT 'k' AS key, 'orders' AS topic, 0 AS delay_level; DROP TABLE public.victim"],
            "2 statements",
        ),
        (["--query", "SELECT pg_read_file('/etc/hostname') AS body, 'orders' AS topic"], "pg_read_file()"),
        (["--query", "SELECT rolname AS key, rolpassword AS body FROM pg_authid", "--topic", "orders"], "system table"),
        (["--input", "/etc/passwd", "--format", "csv", "--topic", "orders"], "not under an input root"),
        (
            ["--query", "SELECT 1 AS key", "--source-url", "postgresql://postgres@127.0.0.1:54329/postgres"],
            "not an allowed source",
        ),
    ],
)
def test_form_fields_are_checked(
    store: Store, db_url: str, tmp_path: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.conn.execute("CREATE TABLE public.victim (x int)")
    with pytest.raises(SystemExit) as exited:
        bulk_enqueue.main(["--db-url", db_url, *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert store.conn.execute("SELECT to_regclass('public.victim')").fetchone() == ("victim",)
    assert store.conn.execute("SELECT count(*) FROM delaywheel.bulk_claims").fetchone() == (0,)


def test_input_outside_the_roots_through_a_symlink(
    store: Store, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.csv").write_text("key,body\nk1,{}\n")
    (root / "innocent.csv").symlink_to(outside / "secret.csv")
    monkeypatch.setenv("DELAYWHEEL_INPUT_ROOTS", str(root))
    for path in (root / "innocent.csv", root / ".." / "elsewhere" / "secret.csv", root / "*.csv"):
        with pytest.raises(SystemExit):
            bulk_enqueue.main(["--db-url", db_url, "--input", str(path), "--topic", "orders"])


def test_caller_shaped_reads_run_in_a_read_only_session(spark: object, store: Store, db_url: str) -> None:
    """The defence behind the checks: even a query that got past them could neither write nor run long."""
    import sparkjob

    store.conn.execute("CREATE SEQUENCE public.counter")
    with pytest.raises(Exception, match="read-only transaction"):
        sparkjob.read_only_sql(spark, db_url, "SELECT nextval('public.counter') AS n", timedelta(seconds=30)).collect()
    with pytest.raises(Exception, match="statement timeout"):
        sparkjob.read_only_sql(spark, db_url, "SELECT pg_sleep(5) AS s", timedelta(milliseconds=200)).collect()
    assert store.conn.execute("SELECT last_value, is_called FROM public.counter").fetchone() == (1, False)
