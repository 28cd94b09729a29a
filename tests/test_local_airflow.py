"""Airflow in-process setup (the demo's `airflow dags test` runs): its secrets are the ones `make airflow` uses.

A metadata database written by `make airflow` holds trigger arguments (the topic watchers') encrypted with the
Fernet key in AIRFLOW_HOME; the demo on the same database must decrypt them, so both read the same files."""

from __future__ import annotations

import re
import stat
from pathlib import Path

from cryptography.fernet import Fernet

from delaywheel.local_airflow import shared_secrets

ROOT = Path(__file__).resolve().parents[1]


def test_secrets_are_made_once_and_shared_with_scripts_airflow_sh(tmp_path: Path) -> None:
    first = shared_secrets(tmp_path)
    assert shared_secrets(tmp_path) == first  # generated once, then read
    Fernet(first["AIRFLOW__CORE__FERNET_KEY"].encode())  # a valid key
    for name in ("fernet_key", "jwt_secret"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    script = (ROOT / "scripts" / "airflow.sh").read_text()
    for variable, name in (("AIRFLOW__CORE__FERNET_KEY", "fernet_key"), ("AIRFLOW__API_AUTH__JWT_SECRET", "jwt_secret")):
        assert re.search(rf'export {variable}="\$\{{{variable}:-\$\(secret {name} ', script), (variable, name)
        assert variable in first
