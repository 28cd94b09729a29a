"""docker-compose.yml cannot run here (no Docker engine): check it against the code instead."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
AIRFLOW = ["airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]


def test_every_service_of_the_platform_is_there_with_a_health_check() -> None:
    assert {"postgres", "airflow-init", *AIRFLOW, "spark-master", "spark-worker"} <= set(SERVICES)
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
    assert {"./airflow.cfg", "./dags", "./plugins", "./spark", "./sql"} <= mounted


def test_connections_the_dags_use_are_defined() -> None:
    used = set()
    for dag_file in (ROOT / "dags").glob("*.py"):
        used |= set(re.findall(r"conn_id\s*=\s*[\"']([a-z0-9_]+)[\"']", dag_file.read_text()))
    used |= {"delaywheel_default", "spark_default"}
    env = SERVICES["airflow-scheduler"]["environment"]
    defined = {key.removeprefix("AIRFLOW_CONN_").lower() for key in env if key.startswith("AIRFLOW_CONN_")}
    assert used <= defined, f"connections used by DAGs but not defined in compose: {used - defined}"
    assert env["AIRFLOW_CONN_SPARK_DEFAULT"].find("spark://spark-master") >= 0


def test_image_runs_the_locked_environment() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^apache-airflow==3\.3\.2$", lock, re.M)
    dockerfile = (ROOT / SERVICES["airflow-scheduler"]["build"]["dockerfile"]).read_text()
    assert "requirements.lock" in dockerfile
    images = {s.get("image") for s in SERVICES.values()}
    assert "postgres:16" in images
    for name in [*AIRFLOW, "spark-master", "spark-worker", "airflow-init"]:
        assert SERVICES[name]["image"] == SERVICES["airflow-scheduler"]["image"], name


def test_compose_and_code_agree_on_the_deliver_pool() -> None:
    init = SERVICES["airflow-init"]["command"]
    assert "airflow pools set delaywheel_deliver" in init
    assert "delaywheel migrate" in init and "airflow db migrate" in init
    assert "delaywheel_deliver" in (ROOT / "dags" / "delaywheel_deliver.py").read_text()
