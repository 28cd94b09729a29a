"""Bulk enqueue's pyarrow reader of Parquet row groups: rows numbered as Spark numbers them, and every input it
cannot read as Spark would is left to Spark (`plan` says None)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from delaywheel.batch import row_groups
from delaywheel.batch.input_rows import FILE_COLUMN, ROW_COLUMN

WANTED = pa.schema([("key", pa.string()), ("deliver_at", pa.timestamp("us", "UTC"))])


def _write(path: Path, rows: int, group: int, **columns: pa.Array) -> str:
    """A Parquet file and its name as Spark's `inputFiles()` lists it."""
    defaults = {
        "Key": pa.array([f"k{i}" for i in range(rows)]),
        "deliver_at": pa.array([datetime(2030, 1, 1, tzinfo=UTC)] * rows, pa.timestamp("us", "UTC")),
        "extra": pa.array(range(rows)),
    }
    pq.write_table(pa.table(defaults | columns), path, row_group_size=group)
    return "file://" + str(path).replace(" ", "%20")


def test_rows_keep_their_file_and_number_across_row_groups(tmp_path: Path) -> None:
    listed = [_write(tmp_path / "a b.parquet", 23, 10), _write(tmp_path / "c.parquet", 5, 2)]

    groups = row_groups.plan(listed, WANTED)

    assert groups is not None
    assert [(g.file.rsplit("/", 1)[1], g.row_group, g.first_row) for g in groups] == [
        ("a%20b.parquet", 0, 1),
        ("a%20b.parquet", 1, 11),
        ("a%20b.parquet", 2, 21),
        ("c.parquet", 0, 1),
        ("c.parquet", 1, 3),
        ("c.parquet", 2, 5),
    ]
    assert groups[0].file == f"file:{tmp_path}/a%20b.parquet"  # as Spark's _metadata.file_path has it
    tasks = pa.RecordBatch.from_pylist(
        [{"file": g.file, "row_group": g.row_group, "first_row": g.first_row} for g in groups[1:4]]
    )

    rows = pa.Table.from_batches(list(row_groups.read([tasks], WANTED, batch_rows=4)))

    assert rows.schema.names == ["key", "deliver_at", FILE_COLUMN, ROW_COLUMN]
    assert rows.schema.field("deliver_at").type == pa.timestamp("us", "UTC")
    assert rows.column("key").to_pylist() == [f"k{i}" for i in range(10, 23)] + ["k0", "k1"]
    assert rows.column(ROW_COLUMN).to_pylist() == [*range(11, 24), 1, 2]
    assert set(rows.column(FILE_COLUMN).to_pylist()) == {groups[1].file, groups[3].file}


def test_inputs_spark_must_read(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.parquet", 4, 2)
    nanos = _write(tmp_path / "nanos.parquet", 4, 2, deliver_at=pa.array([0] * 4, pa.timestamp("ns", "UTC")))
    naive = _write(tmp_path / "naive.parquet", 4, 2, deliver_at=pa.array([0] * 4, pa.timestamp("us")))
    twice = _write(tmp_path / "twice.parquet", 4, 2, KEY=pa.array(["x"] * 4))  # Key and KEY: ambiguous

    assert row_groups.plan([good], WANTED) is not None
    assert row_groups.plan([good], pa.schema([*WANTED, ("region", pa.string())])) is None  # a partition column
    assert row_groups.plan([good, nanos], WANTED) is None  # Spark reads it as microseconds
    assert row_groups.plan([naive], WANTED) is None  # Spark reads it as TIMESTAMP_NTZ
    assert row_groups.plan([twice], WANTED) is None
    assert row_groups.plan([good, "hdfs://namenode/data/orders.parquet"], WANTED) is None
    assert row_groups.spark_file_path("s3a://bucket/a%20b.parquet") == "s3a://bucket/a%20b.parquet"
