"""Airflow in this process, on the project's PostgreSQL: what `dag.test()` needs (the demo, the tests).

Airflow reads its settings when it is first imported, so `configure` runs before anything imports it.
Metadata goes to a database beside the store's (never SQLite); connections are defined by environment,
as in `scripts/airflow.sh`: `delaywheel_default` is the store, `delaywheel_<name>` each store of `stores`
(DELAYWHEEL_STORES, docs/stores.md), `spark_default` is Spark local mode unless the user set it. Nothing here
imports Airflow.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel.config import PROJECT_ROOT, ConfigError, Settings, load_settings, option

SPARK_LOCAL = '{"conn_type": "spark", "host": "local[*]"}'


def as_url(conninfo: str, scheme: str = "postgresql", dbname: str | None = None) -> str:
    """`user=... dbname=...` → `postgresql://user@host:port/db`, the form Airflow connections take."""
    p = conninfo_to_dict(conninfo)
    auth = str(p.get("user", "postgres")) + (f":{p['password']}" if p.get("password") else "")
    return f"{scheme}://{auth}@{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{dbname or p['dbname']}"


def metadata_server(store_url: str) -> str:
    """Where Airflow's metadata database goes: the store's server, as the store's role; but the embedded cluster's
    runtime login may create nothing (README, "Roles"), so there Airflow keeps the cluster's superuser."""
    from delaywheel.dev.embedded import RUNTIME_LOGIN

    params = conninfo_to_dict(store_url)
    if params.get("user") == RUNTIME_LOGIN and params.get("host") in ("127.0.0.1", "localhost"):
        return make_conninfo(store_url, user="postgres", dbname="postgres")
    return make_conninfo(store_url, dbname="postgres")


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


def store_connections(settings: Settings | None = None) -> dict[str, str]:
    """One Airflow connection per configured store, as environment variables: `AIRFLOW_CONN_DELAYWHEEL_<NAME>` ->
    the store's URL (`hooks.store_conn_id` names it `delaywheel_<name>`); none with no stores configured. A URL
    listing several hosts (`postgresql://h1,h2/db`) is no Airflow connection URI: define that connection yourself
    (a variable already set wins, in `configure` and in scripts/airflow.sh)."""
    return {f"AIRFLOW_CONN_DELAYWHEEL_{name.upper()}": url for name, url in (settings or load_settings()).stores}


HANDOVER_SLOTS = 3  # `[delaywheel] deliver_handover_slots`' default


def deliver_pools(settings: Settings | None = None) -> dict[str, int]:
    """The deliver DAGs' pools and their slots: one per lane (levels + the wheel) for the running deliver run, and
    `[delaywheel] deliver_handover_slots` (3) for the next run's tasks while the two overlap. The next run's lane
    tasks therefore start a few at a time, as the old run's hand over, not all at once (DESIGN.md, "A rolling
    hand-over"). `delaywheel_deliver` for the single store; `delaywheel_deliver_<name>` per store with several."""
    settings = settings or load_settings()
    lanes = settings.max_level + 1
    raw = option("deliver_handover_slots")
    try:
        handover = HANDOVER_SLOTS if raw is None else int(raw)
    except ValueError:
        raise ConfigError(f"deliver_handover_slots: {raw!r} is not an integer") from None
    if not 1 <= handover <= lanes:
        raise ConfigError(f"deliver_handover_slots: {handover} is not between 1 and the lanes' number ({lanes})")
    slots = lanes + handover
    return {f"delaywheel_deliver_{name}": slots for name, _ in settings.stores} or {"delaywheel_deliver": slots}


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


# The secrets every Airflow process on one metadata database must share: file in AIRFLOW_HOME ->
# (environment variable, how to make one, shortest value accepted). The Fernet key encrypts connection and
# trigger arguments (e.g. the topic watchers'); the JWT secret signs task tokens (scheduler -> API server); the
# API secret key signs log requests (API server -> the scheduler's and triggerer's log servers). Both signing
# keys are used with HS512, which wants at least 64 bytes of key.
SECRETS: dict[str, tuple[str, Callable[[], str], int]] = {
    "fernet_key": ("AIRFLOW__CORE__FERNET_KEY", _fernet_key, 1),
    "jwt_secret": ("AIRFLOW__API_AUTH__JWT_SECRET", lambda: secrets.token_urlsafe(64), 64),
    "api_secret_key": ("AIRFLOW__API__SECRET_KEY", lambda: secrets.token_urlsafe(64), 64),
}


def shared_secrets(home: Path) -> dict[str, str]:
    """The secrets every Airflow process on one metadata database must share (`SECRETS`), generated once into
    AIRFLOW_HOME by whichever starts first (this, or `scripts/airflow.sh`, which calls it), mode 0600.

    A signing key shorter than 64 bytes (an existing AIRFLOW_HOME may hold one) is replaced: it only signs short-lived
    tokens. The Fernet key is never replaced once made: data is encrypted with it. Two processes starting at
    once agree: a new file appears whole (hard link of a finished temp file) and the first one wins."""
    home.mkdir(parents=True, exist_ok=True)
    values = {}
    for name, (variable, make, shortest) in SECRETS.items():
        path = home / name
        value = path.read_text().strip() if path.exists() else ""
        if len(value.encode()) < shortest:
            tmp = home / f".{name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(make() + "\n")
            try:
                if value:  # too short: replace it
                    os.replace(tmp, path)
                else:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:  # another process made it first (or left it empty): theirs, if whole
                        if not path.read_text().strip():
                            os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            value = path.read_text().strip()
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        values[variable] = value
    return values


def configure(
    store_url: str,
    *,
    metadata_db: str = "airflow",
    home: Path | None = None,
    replace: bool = False,
    store_connection: bool = True,
) -> dict[str, str]:
    """Point this process's Airflow at the store and a migrated metadata database (created if missing);
    returns Airflow's settings as applied (for subprocesses that need the same Airflow).

    Without `replace`, settings already in the environment win: Airflow may already be set up (and
    imported) in this process, and it cannot be pointed elsewhere once it is. `store_connection=False`
    leaves `delaywheel_default` to the caller (the tests set it per test database)."""
    server = metadata_server(store_url)
    with psycopg.connect(server, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (metadata_db,)).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(metadata_db)))
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
        for variable, url in store_connections().items():
            os.environ.setdefault(variable, url)
    os.environ.setdefault("AIRFLOW_CONN_SPARK_DEFAULT", SPARK_LOCAL)
    bin_dir = str(Path(sys.executable).parent)  # spark-submit comes with pyspark
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    done = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return {name: os.environ[name] for name in env}


if __name__ == "__main__":
    # For scripts/airflow.sh: `secrets AIRFLOW_HOME`, the shared secrets, and `connections`, the stores'
    # connections, as VARIABLE=value lines (it exports those not already set); `pools`, "POOL SLOTS" lines.
    if sys.argv[1:2] == ["secrets"] and len(sys.argv) == 3:
        lines = shared_secrets(Path(sys.argv[2])).items()
    elif sys.argv[1:] == ["connections"]:
        lines = store_connections().items()
    elif sys.argv[1:] == ["pools"]:
        try:
            pools = deliver_pools()
        except ConfigError as exc:
            sys.exit(f"delaywheel: {exc}")
        for pool, slots in pools.items():
            print(pool, slots)
        sys.exit(0)
    else:
        sys.exit("usage: python -m delaywheel.dev.local_airflow secrets AIRFLOW_HOME | connections | pools")
    for variable, value in lines:
        print(f"{variable}={value}")
