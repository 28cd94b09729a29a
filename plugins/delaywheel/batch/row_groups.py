"""Parquet row groups read by pyarrow in Spark's Python workers: bulk enqueue's reader for local Parquet files.

Spark's own reader decodes Parquet into the JVM's rows and encodes them again as Arrow for the Python workers that
write them; with two cores that round trip competes with PostgreSQL for CPU. When the input allows it Spark only
hands out row groups, and each worker reads its own with pyarrow, skipping the JVM's rows. Rows come
out as Spark's reader would give them: the same column names and types, `_file` as Spark's `_metadata.file_path`
and `_row` as its row index + 1, so the claims of keyless rows (`file#row`) are the same whichever reader wrote
them. Any input where that is not plainly so is left to Spark's reader (`plan` returns None).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from delaywheel.batch.input_rows import FILE_COLUMN, ROW_COLUMN

SCHEMA = "file string, row_group int, first_row long"  # one row per RowGroup, as Spark schedules them


@dataclass(frozen=True)
class RowGroup:
    file: str  # as Spark's `_metadata.file_path` names it: file:/dir/name%20with%20spaces.parquet
    row_group: int
    first_row: int  # 1-based record number of its first row within the file


def spark_file_path(listed: str) -> str:
    """A file as `_metadata.file_path` names it, from `DataFrame.inputFiles()`: the same URI but for the
    empty authority (file:///x → file:/x)."""
    return "file:/" + listed[len("file:///") :] if listed.startswith("file:///") else listed


def local_path(file: str) -> str:
    return unquote(urlsplit(file).path)


def physical_columns(file_schema: pa.Schema, wanted: pa.Schema) -> list[str] | None:
    """The file's name for each wanted column, matched without regard to case as Spark does by default; None
    when one is missing (a partition column, say), ambiguous or stored as another type than Spark reads it as."""
    by_name: dict[str, list[pa.Field]] = {}
    for f in file_schema:
        by_name.setdefault(f.name.lower(), []).append(f)
    names = []
    for field in wanted:
        found = by_name.get(field.name.lower(), [])
        if len(found) != 1 or found[0].type != field.type:
            return None
        names.append(found[0].name)
    return names


def plan(listed: Iterable[str], wanted: pa.Schema) -> list[RowGroup] | None:
    """Every row group of the files Spark listed for the input, or None unless each file is on the local file
    system and holds every wanted column (Spark's Arrow schema of the mapped columns) as the same type."""
    groups = []
    for file in map(spark_file_path, listed):
        if urlsplit(file).scheme != "file":
            return None  # HDFS, S3 and the like: Spark's file systems, not pyarrow's
        with pq.ParquetFile(local_path(file)) as parquet:
            if physical_columns(parquet.schema_arrow, wanted) is None:
                return None
            metadata = parquet.metadata
        first = 1
        for index in range(metadata.num_row_groups):
            groups.append(RowGroup(file, index, first))
            first += metadata.row_group(index).num_rows
    return groups


def read(tasks: Iterable[pa.RecordBatch], wanted: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The rows of each row group in `tasks` (batches of SCHEMA), as the wanted columns plus `_file` and `_row`;
    each file is opened once for its consecutive row groups."""
    names = [*wanted.names, FILE_COLUMN, ROW_COLUMN]
    groups = (RowGroup(**g) for task in tasks for g in task.to_pylist())
    for file, same_file in itertools.groupby(groups, key=lambda g: g.file):
        with pq.ParquetFile(local_path(file)) as parquet:
            columns = physical_columns(parquet.schema_arrow, wanted)
            if columns is None:  # the file changed since it was planned
                raise ValueError(f"{file} no longer holds the columns {', '.join(wanted.names)} as planned")
            for group in same_file:
                yield from _batches(parquet, group, columns, names, batch_rows)


def _batches(
    parquet: pq.ParquetFile, group: RowGroup, columns: list[str], names: list[str], batch_rows: int
) -> Iterator[pa.RecordBatch]:
    row = group.first_row
    for batch in parquet.iter_batches(batch_rows, row_groups=[group.row_group], columns=sorted(set(columns))):
        count = batch.num_rows
        file = pa.array([group.file], pa.string()).take(np.zeros(count, np.int32))
        rows = pa.array(np.arange(row, row + count, dtype=np.int64))
        yield pa.RecordBatch.from_arrays([*map(batch.column, columns), file, rows], names=names)
        row += count
