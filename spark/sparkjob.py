"""What every delaywheel Spark job shares: the session, the database URL, JDBC reads, arguments.

The jobs are scripts (`spark-submit spark/<job>.py`), so this sits beside them and is imported as a
top-level module, first: before any other third-party import it makes sure the driver runs under a Python that has
the library (`_run_driver_under_library_python`). Code that runs on executors lives in the `delaywheel` library,
which `session` ships to a cluster's executors with this module (`library_zip`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

# What a job's driver imports besides pyspark (which spark-submit puts on PYTHONPATH for any interpreter).
_DRIVER_NEEDS = ("pyarrow", "psycopg", "delaywheel")
_REEXEC_MARK = "DELAYWHEEL_SPARK_DRIVER_REEXEC"


def _installation_python() -> str | None:
    """The interpreter of the Python installation (a venv, or the system's) that spark-submit belongs to: the pip
    `pyspark` is <prefix>/lib/pythonX.Y/site-packages/pyspark, which spark-submit exports as SPARK_HOME. None for a
    Spark distribution unpacked elsewhere."""
    home = Path(os.environ.get("SPARK_HOME", "/"))
    if home.name != "pyspark" or home.parent.name != "site-packages" or len(home.parents) < 4:
        return None
    python = home.parents[3] / "bin" / home.parents[1].name
    return str(python) if python.is_file() else None


def _run_driver_under_library_python() -> None:
    """spark-submit starts a Python driver with PYSPARK_DRIVER_PYTHON, else PYSPARK_PYTHON, else `python3` from
    PATH: with neither set and another Python first on PATH, the job dies with `No module named 'pyarrow'`. If this
    interpreter lacks what the job imports, become the job again (same process, arguments and environment, so the
    py4j gateway's port and secret too) under the Python of spark-submit's own installation, which has the library
    when delaywheel was installed beside pyspark. Once at most; otherwise the import error stands, and
    PYSPARK_DRIVER_PYTHON is the remedy (docs/spark-cluster.md)."""
    if os.environ.get(_REEXEC_MARK) or all(importlib.util.find_spec(name) for name in _DRIVER_NEEDS):
        return
    python = _installation_python()
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        return
    os.environ[_REEXEC_MARK] = python
    os.execv(python, [python, *sys.argv])


_run_driver_under_library_python()

# The imports below need the library's Python, which the call above has made sure of.
import psycopg  # noqa: E402
import pyarrow as pa  # noqa: E402
from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: E402
from pyspark import TaskContext  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402

import delaywheel  # noqa: E402
from delaywheel.batch import bulk  # noqa: E402
from delaywheel.config import ConfigError, Settings  # noqa: E402
from delaywheel.db import connect  # noqa: E402
from delaywheel.ops.predicate import read_only_session  # noqa: E402
from delaywheel.ops.progress import Progress  # noqa: E402
from delaywheel.partitions import PartitionCache  # noqa: E402

JDBC_JAR = os.environ.get("DELAYWHEEL_JDBC_JAR", "/usr/share/java/postgresql.jar")  # Debian libpostgresql-jdbc-java
COUNTS = "store string, kind string, reason string, n long"
_COUNTS_ARROW = pa.schema([("store", pa.string()), ("kind", pa.string()), ("reason", pa.string()), ("n", pa.int64())])
# The jobs' JVM logging (spark/log4j2.properties): WARN unless DELAYWHEEL_SPARK_LOG_LEVEL says otherwise.
LOG4J2 = Path(__file__).resolve().with_name("log4j2.properties")
LOG4J2_OPTION = f"-Dlog4j2.configurationFile=file:{LOG4J2}"
_LIBPQ_EXTRAS = {"sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout", "options", "application_name"}
ONE_STORE = "default"  # the name of the one store a --db-url gives, as `Stores` names the single store


def executor_python() -> str:
    """The Python the executors run: DELAYWHEEL_SPARK_PYTHON (a cluster's interpreter that has delaywheel's pinned
    dependencies), else PYSPARK_PYTHON as given, else this driver's own interpreter, which must then exist at the same
    path on every worker (a loopback cluster; one image for the driver and the workers, as in docker-compose.yml)."""
    return os.environ.get("DELAYWHEEL_SPARK_PYTHON") or os.environ.get("PYSPARK_PYTHON") or sys.executable


@functools.cache
def library_zip() -> Path:
    """The delaywheel package this driver imports, and this module at the top level as the jobs import it, as one
    zip for the executors' sys.path: a cluster's Python then needs only the library's dependencies, and runs the
    driver's exact code. Built once per driver, in a temporary folder removed when the driver exits."""
    package = Path(delaywheel.__file__).parent
    folder = Path(tempfile.mkdtemp(prefix="delaywheel-spark-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "delaywheel.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(package.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                archive.write(file, Path("delaywheel") / file.relative_to(package))
        archive.write(__file__, "sparkjob.py")
    return path


def session(app: str) -> SparkSession:
    """The job's session. The master comes from spark-submit (the Airflow `spark_default` connection);
    run directly, it is local[*]. Times are UTC end to end.

    Executors run `executor_python()` (PYSPARK_PYTHON, which the SparkContext reads when it starts: without it they
    ran `python3` from the worker's PATH, which need not have the library); on a cluster they also get the library
    itself (`library_zip`). Local executors run this interpreter, which imports the library as the driver does.

    Run directly (not by spark-submit, which `delaywheel.airflow.spark` configures the same way), the JVM it
    starts logs at WARN unless DELAYWHEEL_SPARK_LOG_LEVEL asks for more (LOG4J2), and in local mode the driver
    and its UI listen on 127.0.0.1 only (Spark binds its UI to SPARK_LOCAL_IP, else to every interface)."""
    os.environ["PYSPARK_PYTHON"] = executor_python()
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
    spark = builder.getOrCreate()
    if not str(spark.sparkContext.master).startswith("local"):
        spark.sparkContext.addPyFile(str(library_zip()))
    return spark


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
    options = {
        "url": f"jdbc:postgresql://{host}:{port}/{db}",
        "driver": "org.postgresql.Driver",
        "user": str(p.get("user", "postgres")),
    }
    if p.get("password"):
        options["password"] = str(p["password"])
    if p.get("sslmode"):
        options["url"] += f"?sslmode={p['sslmode']}"
    return options


def read_sql(
    spark: SparkSession, url: str, sql: str, *, split_column: str | None = None, partitions: int | None = None
) -> DataFrame:
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
    return (
        spark.read.format("jdbc")
        .options(**jdbc_options(url))
        .option("fetchsize", "20000")
        .option("sessionInitStatement", init)
        .option("query", sql)
        .load()
    )


def stores(
    p: argparse.ArgumentParser, args: argparse.Namespace, settings: Settings, *, every: bool = False
) -> dict[str, str]:
    """The stores a job works on, name -> libpq URL (docs/stores.md). `--db-url URL`: that database alone, named
    `default`, as with one store. `--store NAME`: that configured store, at its URL in `stores` (DELAYWHEEL_STORES;
    an Airflow task builds it from the stores' connections, `delaywheel.airflow.spark`). Neither: every configured
    store when `every` (bulk enqueue routes rows over them, catch-up drains them all), else the only one. Anything
    else stops the job with the reason (`p.error`), before Spark starts."""
    configured = dict(settings.stores)
    names = ", ".join(configured) or "none"
    if args.store and args.store not in configured:
        p.error(f"--store {args.store!r}: not a configured store (stores: {names}; DELAYWHEEL_STORES)")
    if args.db_url and args.store:
        p.error("give --db-url or --store, not both")
    if args.db_url:
        return {ONE_STORE: db_url(args.db_url)}
    if args.store:
        return {args.store: db_url(configured[args.store])}
    if not configured:
        p.error("give --db-url (or configure stores: DELAYWHEEL_STORES, and name one with --store)")
    if every or len(configured) == 1:
        return {name: db_url(url) for name, url in configured.items()}
    p.error(f"several stores are configured ({names}): name one with --store NAME")


def write_rows(
    df: DataFrame,
    urls: Mapping[str, str],
    settings: Settings,
    mapping: bulk.ColumnMap,
    source: str,
    *,
    now: datetime | None = None,
    chunk: int = 50_000,
    job: str = "bulk enqueue",
    read: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None,
) -> dict[str, bulk.Counts]:
    """Write every partition of input rows through `bulk.write_chunk`: `chunk` rows per transaction, its counts on
    stderr as it goes (`progress.Progress`, lines starting with `job`); returns the counts of each store written to.
    `urls` names the stores (name -> URL): with one, every row goes there; with several, each row goes to its topic's
    store by `settings.routes` (`bulk.StoreSplit`), and a chunk is one transaction in each store it has rows for, a
    partition connecting to a store when it first has rows for it. With `read`, a partition holds what `read` turns
    into its input rows (`row_groups.read`: Parquet row groups)."""
    if not urls:
        raise ConfigError("write_rows: no store to write to")
    urls = dict(urls)

    def write_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        total, counts = bulk.Counts(), dict[str, bulk.Counts]()
        split = bulk.StoreSplit(urls, settings.routes, mapping) if len(urls) > 1 else None  # made here: not pickled
        progress = Progress(f"{job}, partition {TaskContext.get().partitionId()}", "rows")  # type: ignore[union-attr]
        with contextlib.ExitStack() as opened:
            conns: dict[str, tuple[psycopg.Connection, PartitionCache]] = {}
            for rows in bulk.chunks(read(batches) if read else batches, chunk):
                for name, part in split.split(rows) if split else [(next(iter(urls)), rows)]:
                    if name not in conns:
                        conns[name] = opened.enter_context(connect(urls[name], autocommit=True)), PartitionCache()
                    conn, cache = conns[name]
                    done = bulk.write_chunk(conn, settings, cache, part, mapping, source, now=now)
                    counts.setdefault(name, bulk.Counts()).add(done)
                    total.add(done)
                progress.update(total.rows, total.summary())
        progress.update(total.rows, total.summary(), done=True)
        yield pa.RecordBatch.from_pylist(
            [{"store": name, "kind": k, "reason": r, "n": n} for name, c in counts.items() for k, r, n in c.as_rows()],
            schema=_COUNTS_ARROW,
        )

    rows = df.mapInArrow(write_partition, COUNTS).collect()
    written = {r.store for r in rows}
    return {
        name: bulk.Counts.from_rows((r.kind, r.reason, r.n) for r in rows if r.store == name)
        for name in urls
        if name in written
    }


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
    p.add_argument(
        "--db-url", type=text, help="the store's PostgreSQL URL (libpq or Airflow's get_uri()), with one store"
    )
    p.add_argument("--store", type=text, help="with several stores (DELAYWHEEL_STORES): the one to work on")
    p.add_argument("--requested-by", default=os.environ.get("USER", "spark"), help="who asked (audit rows)")
    return p
