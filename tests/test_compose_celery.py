"""docker-compose.celery.yml cannot run here (no Docker engine): check it against docker-compose.yml, airflow.cfg
and the Celery setup tests/airflow/test_celery.py runs, merging the two files as Compose does."""

from __future__ import annotations

import configparser
import re
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from delaywheel.config import parse_duration, parse_levels

ROOT = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
CELERY = yaml.safe_load((ROOT / "docker-compose.celery.yml").read_text())["services"]
AIRFLOW = ["airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]
WORKERS = ["airflow-worker-1", "airflow-worker-2"]
CFG = configparser.ConfigParser(interpolation=None)
CFG.read(ROOT / "airflow.cfg")


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of two definitions: mappings key by key, anything else replaced (enough for these files,
    which override no sequence)."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def service(name: str) -> dict[str, Any]:
    """A service as `docker compose -f docker-compose.yml -f docker-compose.celery.yml` sees it: the base
    definition (or the one `extends` names, without its depends_on) with the override merged on top."""
    own = CELERY.get(name, {})
    if "extends" in own:
        assert own["extends"]["file"] == "docker-compose.yml"
        parent = {k: v for k, v in BASE[own["extends"]["service"]].items() if k != "depends_on"}
        return merge(parent, {k: v for k, v in own.items() if k != "extends"})
    return merge(BASE.get(name, {}), own)


def env(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in service(name)["environment"].items()}


def deliver_slots() -> int:
    """The deliver DAG's pool as airflow.cfg sizes it (tests/test_compose.py checks it is the code's)."""
    return 2 * (len(parse_levels(CFG.get("delaywheel", "levels"))) + 1)


def test_the_override_adds_redis_and_two_workers_and_changes_only_airflow_services() -> None:
    assert set(CELERY) == {"redis", *AIRFLOW, *WORKERS}
    untouched = set(BASE) - set(CELERY)
    assert {"postgres", "spark-master"} <= untouched
    for name in untouched:  # the same definition as without Celery
        assert service(name) == BASE[name], name


def test_every_airflow_process_runs_celery_on_the_same_broker_backend_and_settings() -> None:
    scheduler = env("airflow-scheduler")
    broker = urlsplit(scheduler["AIRFLOW__CELERY__BROKER_URL"])
    assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379)
    # the result backend is Airflow's metadata database, as the same role
    backend = urlsplit(scheduler["AIRFLOW__CELERY__RESULT_BACKEND"].removeprefix("db+"))
    metadata_db = urlsplit(scheduler["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert scheduler["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql://")
    assert (backend.username, backend.password, backend.hostname, backend.port, backend.path) == (
        metadata_db.username,
        metadata_db.password,
        metadata_db.hostname,
        metadata_db.port,
        metadata_db.path,
    )
    for name in [*AIRFLOW, *WORKERS]:
        mine = env(name)
        assert mine["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        # Whatever else the scheduler is given (connections, secrets, paths) every process has, with the same
        # value: a worker signs task tokens and decrypts connections as the scheduler and API server do.
        same = {k: v for k, v in scheduler.items() if k != "DELAYWHEEL_OWNER_URL"}
        assert {k: mine.get(k) for k in same} == same, name
        assert service(name)["image"] == service("airflow-scheduler")["image"], name


def test_both_workers_are_distinct_and_each_holds_a_whole_hand_over() -> None:
    hostnames = set()
    for name in WORKERS:
        worker = service(name)
        command = worker["command"].split()
        assert command[:3] == ["airflow", "celery", "worker"], name
        hostname = command[command.index("--celery-hostname") + 1]
        queues = command[command.index("--queues") + 1].split(",")
        assert queues == ["default"], name  # [operators] default_queue: where every delaywheel task goes
        assert worker["healthcheck"]["test"][-2:] == ["--destination", f"celery@{hostname}"], name
        assert worker["hostname"] == name  # a task's recorded host is a name other containers resolve
        hostnames.add(hostname)
        # each worker alone takes the deliver DAG's whole hand-over, with room beside it: the survivor of two
        concurrency = int(env(name)["AIRFLOW__CELERY__WORKER_CONCURRENCY"])
        assert concurrency > deliver_slots() > 16, name
        assert CFG.getint("core", "parallelism") >= concurrency
        # what the scheduler's tasks had under LocalExecutor: the mounted project, and the input volume the Spark
        # driver (now in the worker) and the Spark executors both read
        assert worker["volumes"] == BASE["airflow-scheduler"]["volumes"], name
        assert any(v.startswith("delaywheel-input:") for v in worker["volumes"]), name
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    assert len(hostnames) == len(WORKERS)
    assert service("airflow-scheduler")["depends_on"]["redis"]["condition"] == "service_healthy"


def test_a_dead_worker_is_noticed_before_a_lease_ends_and_a_running_lane_is_neither_redelivered_nor_cut() -> None:
    scheduler = env("airflow-scheduler")
    lease = CFG.getfloat("delaywheel", "deliver_lease_seconds")
    overlap = CFG.getfloat("delaywheel", "deliver_overlap_seconds")
    timeout = int(scheduler["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"])
    # longer than a live task's own tolerance of failed heartbeats (one every [workers] min_heartbeat_interval,
    # 5 s by default), shorter than a lease
    assert CFG.getint("workers", "max_failed_heartbeats") * 5 < timeout < lease
    # a deliver task runs up to its lease, the overlap and the hand-over grace (another overlap): Redis must not
    # hand it to a second worker meanwhile, and a worker stopping (warm shutdown) waits that long for its tasks
    assert int(scheduler["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"]) > lease + 2 * overlap
    for name in WORKERS:
        assert parse_duration(service(name)["stop_grace_period"], name).total_seconds() > lease + 2 * overlap


def test_redis_is_healthy_private_and_keeps_nothing() -> None:
    redis = service("redis")
    assert redis["image"].startswith("redis:7")
    assert "ports" not in redis  # reached by service name inside the project's network only
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert '--save ""' in redis["command"] and "--appendonly no" in redis["command"]


def test_image_adds_the_pinned_celery_provider_to_the_base_image() -> None:
    build = service("airflow-scheduler")["build"]
    assert build["context"] == "."
    base = build["additional_contexts"]["delaywheel"].removeprefix("service:")
    assert service(base)["image"] == BASE["airflow-scheduler"]["image"]  # the image docker/Dockerfile builds
    dockerfile = (ROOT / build["dockerfile"]).read_text()
    assert re.search(r"^FROM delaywheel$", dockerfile, re.M)
    pins = dict(re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][^\s\\]*)", dockerfile))
    assert pins["apache-airflow-providers-celery"] == "3.26.0"
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M))
    normal = {name.lower().replace("_", "-"): version for name, version in lock.items()}
    for name, version in pins.items():  # nothing the lock pins is changed
        assert normal.get(name.lower().replace("_", "-"), version) == version, name
    try:
        installed = {name: metadata.version(name) for name in pins}
    except metadata.PackageNotFoundError:
        pytest.skip("the Celery provider is not installed here (docs/celery.md): cannot compare versions")
    assert installed == pins  # the versions tests/airflow/test_celery.py runs with
