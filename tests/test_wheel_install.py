"""The package people install (issue 20, item 5): the wheel built from this checkout, installed into a fresh virtual
environment outside it, migrates an empty database and sends, delivers and pulls a message there, run from a folder
that is not the checkout. Nothing of the checkout is on the path: the SQL (sql/, linked into the package) comes out
of the installed package.
The wheel carries the Spark jobs (spark/, linked into the package) and nothing of the example application beside the
library (examples/shop).

The runtime dependencies are the core's imports (psycopg with its libpq, pglast for checked predicates, pyarrow,
numpy and pgpq for bulk work), at requirements.lock's versions, from a wheelhouse in `.delaywheel/wheelhouse`
(filled once from the package index, then used offline), with setuptools for the build.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from delaywheel.dev import embedded
from delaywheel.migrate import OWNER_ROLE

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / ".delaywheel" / "wheelhouse"
RUNTIME = ["psycopg[binary]", "pglast", "pyarrow", "numpy", "pgpq"]
BUILD = ["setuptools>=68"]  # pyproject.toml's build-system.requires


def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _wheelhouse() -> Path:
    """The dependencies' wheels, pinned by requirements.lock: offline when all are there, else from the index."""
    wanted = ["--only-binary=:all:", "-c", str(ROOT / "requirements.lock"), "-d", str(WHEELHOUSE), *RUNTIME, *BUILD]
    if _pip("download", "--no-index", "--find-links", str(WHEELHOUSE), *wanted).returncode != 0:
        fetched = _pip("download", *wanted, timeout=600)
        assert fetched.returncode == 0, f"could not fetch the runtime dependencies' wheels:\n{fetched.stderr[-3000:]}"
    return WHEELHOUSE


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment outside the checkout holding the wheel built from it and the runtime
    dependencies only; returns its bin folder."""
    wheelhouse = _wheelhouse()
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # the files the build reads, so the build leaves nothing in the shared checkout
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "plugins", source / "plugins", ignore=ignore)  # with what its links point to (spark/)
    built = _pip(
        "wheel", "--no-deps", "--no-index", "--find-links", str(wheelhouse), "-w", str(work / "dist"), str(source)
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("delaywheel-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    target = ["--python", str(venv / "bin" / "python"), "install", "--no-index", "--find-links", str(wheelhouse)]
    for step in (["-c", str(ROOT / "requirements.lock"), *RUNTIME], ["--no-deps", str(wheel)]):
        done = _pip(*target, *step, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin"


@pytest.fixture
def empty_store(server_url: str) -> Iterator[tuple[str, str]]:
    """An empty database (not the fixtures' migrated template: the installed package migrates it) with the roles
    as `db start` makes them; yields (the owner login's URL, the runtime login's)."""
    name = f"dwwheel_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        embedded.create_roles(conn)
        conn.execute(f"CREATE DATABASE {name}")
        conn.execute(f"GRANT CREATE ON DATABASE {name} TO {OWNER_ROLE}")
    yield (
        make_conninfo(server_url, dbname=name, user=embedded.OWNER_LOGIN),
        make_conninfo(server_url, dbname=name, user=embedded.RUNTIME_LOGIN),
    )
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_the_installed_wheel_migrates_sends_delivers_and_pulls(
    installed: Path, empty_store: tuple[str, str], tmp_path: Path
) -> None:
    owner, runtime = empty_store
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "PATH": f"{installed}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "DELAYWHEEL_DATABASE_URL": runtime,
        "DELAYWHEEL_OWNER_URL": owner,
        "AIRFLOW_CONFIG": str(elsewhere / "airflow.cfg"),
    }  # (none there)

    def run(*argv: str) -> str:
        done = subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{argv} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    where = run(
        "python",
        "-c",
        "import delaywheel, delaywheel.config as c, importlib.util as u, json, pathlib, sys;"
        " print(delaywheel.__file__, c.PROJECT_ROOT, sys.path, u.find_spec('delaywheel_shop'),"
        " json.dumps([p.name for p in (pathlib.Path(delaywheel.__file__).parent / 'spark').iterdir()]), sep='\\n')",
    ).splitlines()
    assert where[0].startswith(str(installed.parent / "lib")), where
    assert where[1] == str(elsewhere)  # an installed package's project folder: the working directory
    assert str(ROOT) not in where[2], where
    assert where[3] == "None", where  # the example application is not in the library's wheel
    # the Spark jobs are, for SparkSubmitOperator on an installed system
    jobs = {"bulk_enqueue.py", "redeliver.py", "lateness_quality.py", "sparkjob.py", "log4j2.properties"}
    assert jobs <= set(json.loads(where[4])), where

    # the store's SQL is, read through importlib.resources: every file of the checkout's sql/
    shipped = run(
        "python",
        "-c",
        "import importlib.resources as r, json; d = r.files('delaywheel') / 'sql';"
        " print(json.dumps(sorted([p.name for p in d.iterdir()] + ['migrations/' + p.name for p in (d / 'migrations').iterdir()])))",
    )
    in_checkout = [p.name for p in (ROOT / "sql").iterdir()] + [
        f"migrations/{p.name}" for p in (ROOT / "sql" / "migrations").iterdir()
    ]
    assert json.loads(shipped) == sorted(in_checkout)

    applied = run("delaywheel", "migrate")
    assert applied.startswith("applied: 001_baseline.sql, ") and "shop" not in applied, applied
    assert "views.sql" in applied and "level_pass.sql" in applied, applied  # the definitions, installed
    sent = json.loads(
        run(
            "delaywheel",
            "send",
            "--topic",
            "wheel.check",
            "--body",
            '{"n": 1}',
            "--level",
            "1",
            "--key",
            "k1",
            "--json",
        )
    )
    delivered = json.loads(run("delaywheel", "deliver", "--duration", "60s", "--until-idle", "--json"))
    assert delivered["delivered"] == 1, delivered
    pulled = json.loads(run("delaywheel", "pull", "--topic", "wheel.check", "--group", "g", "--ack", "--json"))
    assert [(m["message_id"], m["key"], m["body"]) for m in pulled] == [(sent["message_id"], "k1", {"n": 1})]
    assert json.loads(run("delaywheel", "pull", "--topic", "wheel.check", "--group", "g", "--json")) == []
    moved = subprocess.run(
        ["delaywheel", "shop", "migrate"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )  # the example's commands are its own: the library names the command instead
    assert moved.returncode == 2 and "python -m delaywheel_shop migrate" in moved.stderr, moved.stderr
    with psycopg.connect(runtime) as conn:
        assert conn.execute("SELECT current_user, to_regnamespace('shop') IS NULL").fetchone() == (
            embedded.RUNTIME_LOGIN,
            True,
        )
