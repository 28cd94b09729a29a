"""What every delaywheel Spark job shares: the session, the database URL, JDBC reads, arguments.

The jobs are scripts (`spark-submit spark/<job>.py`), so this sits beside them and is imported as a
top-level module; code that runs on executors lives in the `delaywheel` library instead, which every
executor can import.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession

from delaywheel.batch import bulk
from delaywheel.config import Settings
from delaywheel.db import connect
from delaywheel.ops.predicate import read_only_session
from delaywheel.ops.progress import Progress
from delaywheel.partitions import PartitionCache

JDBC_JAR = os.environ.get("DELAYWHEEL_JDBC_JAR", "/usr/share/java/postgresql.jar")  # Debian libpostgresql-jdbc-java
COUNTS = "kind string, reason string, n long"
_COUNTS_ARROW = pa.schema([("kind", pa.string()), ("reason", pa.string()), ("n", pa.int64())])
# The jobs' JVM logging (spark/log4j2.properties): WARN unless DELAYWHEEL_SPARK_LOG_LEVEL says otherwise.
LOG4J2 = Path(__file__).resolve().with_name("log4j2.properties")
LOG4J2_OPTION = f"-Dlog4j2.configurationFile=file:{LOG4J2}"
_LIBPQ_EXTRAS = {"sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout", "options", "application_name"}


def session(app: str) -> SparkSession:
    """The job's session. The master comes from spark-submit (the Airflow `spark_default` connection);
    run directly, it is local[*]. Times are UTC end to end.

    Run directly (not by spark-submit, which `delaywheel.airflow.spark` configures the same way), the JVM it
    starts logs at WARN unless DELAYWHEEL_SPARK_LOG_LEVEL asks for more (LOG4J2), and in local mode the driver
    and its UI listen on 127.0.0.1 only (Spark binds its UI to SPARK_LOCAL_IP, else to every interface)."""
    builder = (
        SparkSession.builder.appName(app)
        .config("spark.jars", JDBC_JAR)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", os.environ.get("DELAYWHEEL_SHUFFLE_PARTITIONS", "8"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # not launched by spark-submit, which sets the master
        master = os.environ.get("DELAYWHEEL_SPARK_MASTER", "local[*]")
        builder = builder.master(master).config("spark.driver.extraJavaOptions", LOG4J2_OPTION)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # read when the JVM starts, at getOrCreate
        # Python workers run `python3` from PATH unless told otherwise: without the project's venv on PATH
        # they would miss the delaywheel library. Use this interpreter (PYSPARK_PYTHON still wins).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return builder.getOrCreate()


def db_url(raw: str) -> str:
    """A libpq URL from what Airflow templates (`conn.delaywheel_default.get_uri()` gives `postgres://…`,
    possibly with Airflow-only extras in the query string), keeping only parameters libpq knows."""
    params = conninfo_to_dict(raw if "://" not in raw else "postgresql://" + raw.split("://", 1)[1].split("?", 1)[0])
    if "?" in raw:
        for pair in raw.split("?", 1)[1].split("&"):
            name, _, value = pair.partition("=")
            if name in _LIBPQ_EXTRAS:
                params[name] = value
    return make_conninfo("", **params)


def jdbc_options(url: str) -> dict[str, str]:
    """The Spark JDBC options (url, user, password, driver) for a libpq URL."""
    p = conninfo_to_dict(url)
    host, port, db = p.get("host", "localhost"), p.get("port", "5432"), p.get("dbname", "postgres")
    options = {"url": f"jdbc:postgresql://{host}:{port}/{db}", "driver": "org.postgresql.Driver",
               "user": str(p.get("user", "postgres"))}
    if p.get("password"):
        options["password"] = str(p["password"])
    if p.get("sslmode"):
        options["url"] += f"?sslmode={p['sslmode']}"
    return options


def read_sql(spark: SparkSession, url: str, sql: str, *, split_column: str | None = None,
             partitions: int | None = None) -> DataFrame:
    """A PostgreSQL query as a DataFrame; with `split_column` (an integer column) it is read by
    `partitions` parallel connections, each taking the rows where split_column % partitions = i."""
    reader = spark.read.format("jdbc").options(**jdbc_options(url)).option("fetchsize", "20000")
    if split_column is None:
        return reader.option("query", sql).load()
    n = partitions or spark.sparkContext.defaultParallelism
    options = jdbc_options(url)
    properties = {k: v for k, v in options.items() if k != "url"} | {"fetchsize": "20000"}
    predicates = [f"{split_column} % {n} = {i}" for i in range(n)]
    return spark.read.jdbc(options["url"], f"({sql}) AS q", predicates=predicates, properties=properties)


def read_only_sql(spark: SparkSession, url: str, sql: str, timeout: timedelta) -> DataFrame:
    """A query shaped by a caller (a checked bulk-enqueue query, reconcile's business rows) as a DataFrame, read in
    a READ ONLY session with a statement timeout (`predicate.read_only_session`)."""
    init = read_only_session(int(timeout.total_seconds() * 1000))
    return (spark.read.format("jdbc").options(**jdbc_options(url)).option("fetchsize", "20000")
            .option("sessionInitStatement", init).option("query", sql).load())


def write_rows(df: DataFrame, url: str, settings: Settings, mapping: bulk.ColumnMap, source: str, *,
               now: datetime | None = None, chunk: int = 50_000, job: str = "bulk enqueue",
               read: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None) -> bulk.Counts:
    """Write every partition of input rows through `bulk.write_chunk`: its own connection per partition,
    `chunk` rows per transaction, its counts on stderr as it goes (`progress.Progress`, lines starting with
    `job`); returns the summed counts. With `read`, a partition holds what `read` turns into its input rows
    (`row_groups.read`: Parquet row groups)."""

    def write_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        total, cache = bulk.Counts(), PartitionCache()
        progress = Progress(f"{job}, partition {TaskContext.get().partitionId()}", "rows")  # type: ignore[union-attr]
        with connect(url, autocommit=True) as conn:
            for rows in bulk.chunks(read(batches) if read else batches, chunk):
                total.add(bulk.write_chunk(conn, settings, cache, rows, mapping, source, now=now))
                progress.update(total.rows, total.summary())
        progress.update(total.rows, total.summary(), done=True)
        yield pa.RecordBatch.from_pylist([{"kind": k, "reason": r, "n": n} for k, r, n in total.as_rows()],
                                         schema=_COUNTS_ARROW)

    rows = df.mapInArrow(write_partition, COUNTS).collect()
    return bulk.Counts.from_rows((r.kind, r.reason, r.n) for r in rows)


def instant(text: str) -> datetime | None:
    """An ISO-8601 argument; a time without an offset is UTC. Empty (an unset DAG param) means not given."""
    if not text.strip():
        return None
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def text(value: str) -> str | None:
    """A text argument; empty (an unset DAG param) means not given."""
    return value.strip() or None


def integer(value: str) -> int | None:
    """An integer argument; empty (an unset DAG param) means not given."""
    return int(value) if value.strip() else None


def number(value: str) -> float | None:
    """A numeric argument; empty (an unset DAG param) means not given."""
    return float(value) if value.strip() else None


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--db-url", required=True, help="the store's PostgreSQL URL (libpq or Airflow's get_uri())")
    p.add_argument("--requested-by", default=os.environ.get("USER", "spark"), help="who asked (audit rows)")
    return p
