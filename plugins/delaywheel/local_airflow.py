"""Airflow in this process, on the project's PostgreSQL: what `dag.test()` needs (the demo, the tests).

Airflow reads its settings when it is first imported, so `configure` runs before anything imports it.
Metadata goes to a database beside the store's (never SQLite); connections are defined by environment,
as in `scripts/airflow.sh`: `delaywheel_default` is the store, `spark_default` is Spark local mode unless
the user set it. Nothing here imports Airflow.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .config import PROJECT_ROOT

SPARK_LOCAL = '{"conn_type": "spark", "host": "local[*]"}'


def as_url(conninfo: str, scheme: str = "postgresql", dbname: str | None = None) -> str:
    """`user=... dbname=...` → `postgresql://user@host:port/db`, the form Airflow connections take."""
    p = conninfo_to_dict(conninfo)
    auth = str(p.get("user", "postgres")) + (f":{p['password']}" if p.get("password") else "")
    return f"{scheme}://{auth}@{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{dbname or p['dbname']}"


def metadata_env(server_url: str, metadata_db: str, home: Path) -> dict[str, str]:
    """Airflow's settings: metadata in `metadata_db` on the store's server, the project's config, DAGs and plugins."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_CONFIG": str(PROJECT_ROOT / "airflow.cfg"),
        "DELAYWHEEL_HOME": str(PROJECT_ROOT),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": as_url(server_url, "postgresql+psycopg2", metadata_db),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_ROOT / "plugins"),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }


def shared_secrets(home: Path) -> dict[str, str]:
    """The secrets every Airflow process on one metadata database must share, generated once into
    AIRFLOW_HOME by whichever starts first (this, or `scripts/airflow.sh`, which keeps the same files):
    the Fernet key encrypts connection and trigger arguments (e.g. the topic watchers'), the JWT secret
    signs task tokens."""
    from cryptography.fernet import Fernet

    makers = {"fernet_key": lambda: Fernet.generate_key().decode(), "jwt_secret": lambda: secrets.token_urlsafe(32)}
    values = {}
    for name, make in makers.items():
        path = home / name
        if not path.exists() or not path.read_text().strip():
            path.touch(mode=0o600)
            path.write_text(make() + "\n")
        values[name] = path.read_text().strip()
    return {"AIRFLOW__CORE__FERNET_KEY": values["fernet_key"], "AIRFLOW__API_AUTH__JWT_SECRET": values["jwt_secret"]}


def configure(store_url: str, *, metadata_db: str = "airflow", home: Path | None = None,
              replace: bool = False, store_connection: bool = True) -> dict[str, str]:
    """Point this process's Airflow at the store and a migrated metadata database (created if missing);
    returns Airflow's settings as applied (for subprocesses that need the same Airflow).

    Without `replace`, settings already in the environment win: Airflow may already be set up (and
    imported) in this process, and it cannot be pointed elsewhere once it is. `store_connection=False`
    leaves `delaywheel_default` to the caller (the tests set it per test database)."""
    server = make_conninfo(store_url, dbname="postgres")
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (metadata_db,)).fetchone():
            conn.execute(f'CREATE DATABASE "{metadata_db}"')
    env = metadata_env(server, metadata_db, home or PROJECT_ROOT / ".delaywheel" / "airflow")
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    env |= shared_secrets(Path(env["AIRFLOW_HOME"]))
    for name, value in env.items():
        if replace:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)
    if store_connection:
        os.environ["AIRFLOW_CONN_DELAYWHEEL_DEFAULT"] = as_url(store_url)  # read at run time: always this store
    os.environ.setdefault("AIRFLOW_CONN_SPARK_DEFAULT", SPARK_LOCAL)
    bin_dir = str(Path(sys.executable).parent)  # spark-submit comes with pyspark
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    done = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return {name: os.environ[name] for name in env}
