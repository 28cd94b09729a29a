"""docker-compose.yml cannot run here (no Docker engine): check it against the code instead."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from delaywheel.config import parse_levels
from delaywheel.dev import embedded

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
AIRFLOW = ["airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]
SPARK_WORKERS = ["spark-worker-1", "spark-worker-2"]
ENV = SERVICES["airflow-scheduler"]["environment"]
SCRIPT = (ROOT / "scripts" / "airflow.sh").read_text()


def test_every_service_of_the_platform_is_there_with_a_health_check() -> None:
    assert {"postgres", "airflow-init", *AIRFLOW, "spark-master", *SPARK_WORKERS} <= set(SERVICES)
    for name, service in SERVICES.items():
        if name != "airflow-init":
            assert "healthcheck" in service, f"{name} has no health check"
    for name in AIRFLOW:
        assert SERVICES[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"


def test_mounted_project_paths_exist() -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    mounted = {v.split(":")[0] for v in SERVICES["airflow-scheduler"]["volumes"]}
    assert {"./airflow.cfg", "./dags", "./plugins", "./sql", "./spark", "./examples"} <= mounted


def test_connections_the_dags_use_are_defined() -> None:
    used = set()
    for dag_file in (ROOT / "dags").glob("*.py"):
        used |= set(re.findall(r"conn_id\s*=\s*[\"']([a-z0-9_]+)[\"']", dag_file.read_text()))
    used |= {"delaywheel_default", "spark_default"}
    env = SERVICES["airflow-scheduler"]["environment"]
    defined = {key.removeprefix("AIRFLOW_CONN_").lower() for key in env if key.startswith("AIRFLOW_CONN_")}
    assert used <= defined, f"connections used by DAGs but not defined in compose: {used - defined}"
    assert env["AIRFLOW_CONN_SPARK_DEFAULT"].find("spark://spark-master") >= 0
    # `make airflow` too: Airflow 3 creates no default connections (spark_default would otherwise mean yarn)
    for conn_id in used:
        assert f"export AIRFLOW_CONN_{conn_id.upper()}" in SCRIPT, f"scripts/airflow.sh does not define {conn_id}"
    assert """AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type":"spark","host":"local[*]"}'""" in SCRIPT


def test_api_server_is_reachable_from_other_containers() -> None:
    # airflow.cfg binds loopback for local runs; the workers' Execution API URL and the published port need more
    assert ENV["AIRFLOW__API__HOST"] == "0.0.0.0"
    assert ENV["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith("http://airflow-apiserver:8080/")
    assert "8080:8080" in SERVICES["airflow-apiserver"]["ports"]


def test_mounted_plugins_come_before_the_installed_copy() -> None:
    """Airflow appends the plugins folder to the end of sys.path, after the copy the image pip-installed:
    PYTHONPATH puts the mounted one first, so edits apply without a rebuild."""
    plugins = ENV["AIRFLOW__CORE__PLUGINS_FOLDER"]
    assert f"./plugins:{plugins}:ro" in SERVICES["airflow-scheduler"]["volumes"]
    assert ENV["PYTHONPATH"].split(":")[0] == plugins


def test_image_runs_the_locked_environment() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^apache-airflow==3\.3\.2$", lock, re.M)
    dockerfile = (ROOT / SERVICES["airflow-scheduler"]["build"]["dockerfile"]).read_text()
    assert "requirements.lock" in dockerfile
    images = {s.get("image") for s in SERVICES.values()}
    assert "postgres:16" in images
    for name in [*AIRFLOW, "spark-master", *SPARK_WORKERS, "airflow-init"]:
        assert SERVICES[name]["image"] == SERVICES["airflow-scheduler"]["image"], name


def test_compose_and_code_agree_on_the_deliver_pool() -> None:
    init = SERVICES["airflow-init"]["command"].replace("$$", "$")  # `$$` is compose's escape for `$`
    assert "delaywheel migrate" in init and "python -m delaywheel_shop migrate" in init and "airflow db migrate" in init
    assert re.search(
        r"python -m delaywheel.dev.local_airflow pools \| while read -r pool slots;\s*"
        r"do airflow pools set \$pool \$slots ",
        init,
    )
    # the same pools as scripts/airflow.sh makes
    assert '"$PY" -m delaywheel.dev.local_airflow pools | while read -r pool slots' in SCRIPT
    # the deliver DAG: its tasks run in this pool, at most levels + 1 + deliver_handover_slots of them at once
    dag = (ROOT / "dags" / "delaywheel_deliver.py").read_text()
    assert 'POOL = "delaywheel_deliver"' in dag and '"pool": pool' in dag
    assert "LEVELS = SETTINGS.levels" in dag and "max_active_tasks=2 * (len(LEVELS) + 1)" in dag
    # what it prints with the airflow.cfg the containers mount (AIRFLOW_CONFIG) is that number
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DELAYWHEEL_LEVELS",
            "AIRFLOW__DELAYWHEEL__LEVELS",
            "DELAYWHEEL_STORES",
            "DELAYWHEEL_DELIVER_HANDOVER_SLOTS",
            "AIRFLOW__DELAYWHEEL__DELIVER_HANDOVER_SLOTS",
        )
    }
    env["AIRFLOW_CONFIG"] = str(ROOT / "airflow.cfg")
    assert "./airflow.cfg:" + ENV["AIRFLOW_CONFIG"] + ":ro" in SERVICES["airflow-scheduler"]["volumes"]
    out = subprocess.run(
        [sys.executable, "-m", "delaywheel.dev.local_airflow", "pools"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pools = {pool: int(slots) for pool, slots in (line.split() for line in out.splitlines())}
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "airflow.cfg")
    slots = len(parse_levels(cfg.get("delaywheel", "levels"))) + 1 + cfg.getint("delaywheel", "deliver_handover_slots")
    assert pools == {"delaywheel_deliver": slots}
    assert cfg.getint("core", "parallelism") > slots  # room beside the deliver DAG


def test_compose_postgres_runs_with_the_embedded_clusters_settings() -> None:
    """The settings the store was measured with (bench/RESULTS.md), wherever it runs."""
    command = SERVICES["postgres"]["command"].split()
    assert command[0] == "postgres"
    given = dict(option.split("=", 1) for option in command[2::2])
    expected = {k: v for k, v in embedded.SERVER_OPTIONS.items() if k != "listen_addresses"}
    assert given == {**expected, "wal_compression": "lz4"}


def test_services_run_as_the_runtime_role_and_only_migrate_as_the_owner() -> None:
    """docs/operations.md, "Roles": every service reaches the store as the runtime login; only airflow-init's `delaywheel
    migrate` gets the owner's URL; Airflow's metadata has its own role; the init script creates them all."""
    from psycopg.conninfo import conninfo_to_dict

    from delaywheel.migrate import OWNER_ROLE, RUNTIME_ROLE

    def user(url: str) -> str:
        return str(conninfo_to_dict(url.replace("postgresql+psycopg2://", "postgresql://"))["user"])

    for name, service in SERVICES.items():
        env = service.get("environment", {})
        if name == "postgres":
            continue
        assert user(env["DELAYWHEEL_DATABASE_URL"]) == "delaywheel_app", name
        assert user(env["AIRFLOW_CONN_DELAYWHEEL_DEFAULT"]) == "delaywheel_app", name
        assert user(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]) == "airflow", name
        assert ("DELAYWHEEL_OWNER_URL" in env) == (name == "airflow-init"), name
    owner = SERVICES["airflow-init"]["environment"]["DELAYWHEEL_OWNER_URL"]
    assert user(owner) == "delaywheel_migrator"
    assert (
        conninfo_to_dict(owner)["dbname"] == conninfo_to_dict(ENV["DELAYWHEEL_DATABASE_URL"])["dbname"] == "delaywheel"
    )
    assert SERVICES["postgres"]["environment"]["POSTGRES_USER"] == "postgres"
    init = (ROOT / "docker" / "postgres-init.sql").read_text()
    mounted = [v for v in SERVICES["postgres"]["volumes"] if v.startswith("./docker/postgres-init.sql:")]
    assert mounted and mounted[0].split(":")[1].startswith("/docker-entrypoint-initdb.d/")
    for statement in (
        f"CREATE ROLE {OWNER_ROLE} NOLOGIN",
        f"CREATE ROLE {RUNTIME_ROLE} NOLOGIN",
        f"CREATE ROLE delaywheel_migrator LOGIN PASSWORD 'delaywheel_migrator' IN ROLE {OWNER_ROLE}",
        f"CREATE ROLE delaywheel_app LOGIN PASSWORD 'delaywheel_app' IN ROLE {RUNTIME_ROLE}",
        f"GRANT CREATE, CONNECT ON DATABASE delaywheel TO {OWNER_ROLE}",
        f"GRANT CONNECT ON DATABASE delaywheel TO {RUNTIME_ROLE}",
        "REVOKE CONNECT, TEMPORARY ON DATABASE delaywheel FROM PUBLIC",
        "CREATE DATABASE airflow OWNER airflow",
    ):
        assert statement in init, statement
    # the passwords in the URLs are the ones the init script sets
    for url in (owner, ENV["DELAYWHEEL_DATABASE_URL"], ENV["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]):
        params = conninfo_to_dict(url.replace("postgresql+psycopg2://", "postgresql://"))
        assert f"CREATE ROLE {params['user']} LOGIN PASSWORD '{params['password']}'" in init


def test_two_spark_workers_share_the_input_volume_with_the_driver_and_reports_are_writable() -> None:
    """Every Spark worker joins the master with a work folder uid 50000 may write (pyspark's default is inside
    root's site-packages). Bulk enqueue's executors read input files at the path the driver gives them, so the input
    volume is mounted at the default input root in the containers that run Airflow's tasks (the Spark driver) and on
    every worker; lateness reports go to a volume at the default report folder. Both are folders the image makes for
    uid 50000, which a new named volume takes over."""
    workers = {name: s for name, s in SERVICES.items() if "deploy.worker.Worker" in s.get("command", "")}
    assert sorted(workers) == SPARK_WORKERS
    master = SERVICES["spark-master"]["command"].split()
    master_url = f"spark://{master[master.index('--host') + 1]}:{master[master.index('--port') + 1]}"
    for name, service in workers.items():
        command = service["command"].split()
        assert command[command.index("org.apache.spark.deploy.worker.Worker") + 1] == master_url, name
        assert command[command.index("--work-dir") + 1].startswith("/tmp/"), name
        assert service["depends_on"]["spark-master"]["condition"] == "service_healthy", name
    # the default input roots and report folder where the containers run (DELAYWHEEL_HOME, the mounted airflow.cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELAYWHEEL_", "AIRFLOW__DELAYWHEEL__"))}
    env |= {
        "DELAYWHEEL_HOME": ENV["DELAYWHEEL_HOME"],
        "AIRFLOW_CONFIG": str(ROOT / "airflow.cfg"),
        "PYTHONPATH": str(ROOT / "spark"),
    }
    code = (
        "import json, lateness_quality; from delaywheel.config import load_settings; "
        "print(json.dumps([load_settings().input_roots, str(lateness_quality.DEFAULT_REPORTS)]))"
    )
    roots, reports = json.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    )
    # LocalExecutor runs tasks in the scheduler, CeleryExecutor in its workers
    drivers = [
        name
        for name, s in SERVICES.items()
        if s.get("command", "").startswith(("airflow scheduler", "airflow celery worker"))
    ]
    assert "airflow-scheduler" in drivers
    assert {"delaywheel-input", "delaywheel-reports"} <= set(COMPOSE["volumes"])
    for name in [*drivers, *workers]:
        mounts = dict(v.split(":")[:2] for v in SERVICES[name]["volumes"])
        assert mounts.get("delaywheel-input") == roots[0], f"{name}: no input volume at the input root {roots[0]}"
        if name in drivers:
            assert mounts.get("delaywheel-reports") == reports, name
    dockerfile = (ROOT / SERVICES["airflow-scheduler"]["build"]["dockerfile"]).read_text()
    assert "useradd --create-home --uid 50000 airflow" in dockerfile and dockerfile.rstrip().endswith("USER airflow")
    assert f"mkdir -p {roots[0]} {reports}" in dockerfile
    assert f"chown -R airflow {roots[0]} {Path(reports).parent}" in dockerfile
