"""Airflow in-process setup (the demo's `airflow dags test` runs): its secrets are the ones `make airflow` uses.

A metadata database written by `make airflow` holds trigger arguments (the topic watchers') encrypted with the
Fernet key in AIRFLOW_HOME; the demo on the same database must decrypt them, so both read the same files.
(tests/test_airflow_script.py checks that every service `scripts/airflow.sh` starts gets them.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

from delaywheel.dev.local_airflow import SECRETS, shared_secrets

ROOT = Path(__file__).resolve().parents[2]
VARIABLES = {"AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"}


def test_secrets_are_made_once_and_shared_with_scripts_airflow_sh(tmp_path: Path) -> None:
    first = shared_secrets(tmp_path)
    assert set(first) == VARIABLES == {variable for variable, _, _ in SECRETS.values()}
    assert shared_secrets(tmp_path) == first  # generated once, then read
    Fernet(first["AIRFLOW__CORE__FERNET_KEY"].encode())  # a valid key
    for variable in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
        assert len(first[variable].encode()) >= 64  # HS512's key size (PyJWT warns below it)
    for name in SECRETS:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".*.tmp"))
    # scripts/airflow.sh exports what this prints (unless already set), for every service it starts.
    printed = subprocess.run(
        [sys.executable, "-m", "delaywheel.dev.local_airflow", "secrets", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert dict(line.split("=", 1) for line in printed.splitlines()) == first
    script = (ROOT / "scripts" / "airflow.sh").read_text()
    assert '"$PY" -m delaywheel.dev.local_airflow secrets "$AIRFLOW_HOME"' in script


def test_a_short_signing_key_is_replaced_and_the_fernet_key_kept(tmp_path: Path) -> None:
    """This project used to make a 43-byte JWT secret; HS512 wants 64. The Fernet key stays: data is encrypted
    with it."""
    fernet = Fernet.generate_key().decode()
    (tmp_path / "fernet_key").write_text(fernet + "\n")
    (tmp_path / "jwt_secret").write_text("x" * 43 + "\n")
    (tmp_path / "jwt_secret").chmod(0o644)
    values = shared_secrets(tmp_path)
    assert values["AIRFLOW__CORE__FERNET_KEY"] == fernet
    assert len(values["AIRFLOW__API_AUTH__JWT_SECRET"]) >= 64
    assert (tmp_path / "jwt_secret").read_text().strip() == values["AIRFLOW__API_AUTH__JWT_SECRET"]
    for name in SECRETS:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def pools(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m delaywheel.dev.local_airflow pools` (scripts/airflow.sh's and the compose file's) with the
    project's airflow.cfg and `env` over it."""
    base = {k: v for k, v in os.environ.items() if "DELAYWHEEL" not in k}
    return subprocess.run(
        [sys.executable, "-m", "delaywheel.dev.local_airflow", "pools"],
        env={**base, "AIRFLOW_CONFIG": str(ROOT / "airflow.cfg"), **env},
        capture_output=True,
        text=True,
    )


def test_the_deliver_pool_has_a_slot_per_lane_and_the_hand_over_slots() -> None:
    """One slot per lane for the running deliver run, and `deliver_handover_slots` (airflow.cfg: 3) for the next run's
    lane tasks, which start that many at a time (DESIGN.md, "A rolling hand-over"); per store with several."""
    assert pools({}).stdout == "delaywheel_deliver 22\n"
    assert pools({"DELAYWHEEL_LEVELS": "1s 5s", "AIRFLOW__DELAYWHEEL__DELIVER_HANDOVER_SLOTS": "1"}).stdout == (
        "delaywheel_deliver 4\n"
    )
    stores = {"DELAYWHEEL_STORES": "a=postgresql://h/a,b=postgresql://h/b", "DELAYWHEEL_DELIVER_HANDOVER_SLOTS": "19"}
    assert pools(stores).stdout == "delaywheel_deliver_a 38\ndelaywheel_deliver_b 38\n"


def test_a_hand_over_slots_value_the_pool_cannot_have_is_refused_with_a_reason() -> None:
    for value, reason in [
        ("three", "deliver_handover_slots: 'three' is not an integer"),
        ("0", "deliver_handover_slots: 0 is not between 1 and the lanes' number (19)"),
        ("20", "deliver_handover_slots: 20 is not between 1 and the lanes' number (19)"),
    ]:
        done = pools({"AIRFLOW__DELAYWHEEL__DELIVER_HANDOVER_SLOTS": value})
        assert (done.returncode, done.stdout, done.stderr) == (1, "", f"delaywheel: {reason}\n"), value
