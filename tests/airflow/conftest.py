"""The Airflow tests' shared fixtures: Airflow's API server app with real auth (`client`) and a store made the
plugin's `delaywheel_default` connection (`plugin_store`). Every test here is marked `airflow` (tests/conftest.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from delaywheel import Store
from tests.helpers import USERS, connection_uri


@pytest.fixture(scope="module")
def client(airflow_db: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Airflow's API server app with login required (two users with known passwords), plugins loaded."""
    passwords = tmp_path_factory.mktemp("auth") / "passwords.json"
    passwords.write_text(json.dumps({name: pw for name, (_, pw) in USERS.items()}))
    env = {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{n}:{role}" for n, (role, _) in USERS.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "delaywheel-plugin-test-secret-" + "x" * 40,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    with TestClient(create_app()) as test_client:
        yield test_client
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def plugin_store(store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The test's store, made the `delaywheel_default` connection the plugin reads."""
    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", connection_uri(db_url))
    return store
