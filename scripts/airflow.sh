#!/usr/bin/env bash
# Start Airflow locally on the project's embedded PostgreSQL (the README's `make airflow`).
#
#   scripts/airflow.sh                 set up, then run the API server + UI (http://127.0.0.1:8080), and once it
#                                      answers, the triggerer, DAG processor and scheduler; Ctrl-C stops them all
#   scripts/airflow.sh standalone      set up, then `airflow standalone` instead (same services; it starts the
#                                      scheduler before the API server, so the first task tries may fail and retry)
#   scripts/airflow.sh <command...>    any other airflow command in the same environment, e.g. `dags list`,
#                                      or one service per terminal: `api-server`, `scheduler`, `triggerer`, ...
#
# Login: user `admin`; the password is generated on first start into
# .delaywheel/airflow/simple_auth_manager_passwords.json.generated (printed below once it exists).
#
# Everything lives in the git-ignored .delaywheel/: the PostgreSQL cluster (.delaywheel/pg, holding the
# store in database `delaywheel` and Airflow's metadata in database `airflow`, never SQLite) and
# AIRFLOW_HOME (.delaywheel/airflow: logs, generated secrets). Configuration is the project's airflow.cfg.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$ROOT/.venv/bin:$PATH"
PY="$ROOT/.venv/bin/python"

export AIRFLOW_HOME="$ROOT/.delaywheel/airflow"
export AIRFLOW_CONFIG="$ROOT/airflow.cfg"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export DELAYWHEEL_HOME="$ROOT"
mkdir -p "$AIRFLOW_HOME"

# Start the embedded cluster if no external store is configured (idempotent), then derive both URLs from
# the store's: the store itself for connection `delaywheel_default`, database `airflow` beside it for
# Airflow's metadata (created if missing; the embedded cluster creates it at initdb).
"$PY" -m delaywheel.cli db start >/dev/null
read -r STORE_URL AIRFLOW_DB_URL < <("$PY" - <<'PYEOF'
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy.engine import URL
from delaywheel.db import database_url

store = database_url()
with psycopg.connect(make_conninfo(store, dbname="postgres"), autocommit=True) as conn:
    if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'airflow'").fetchone():
        conn.execute("CREATE DATABASE airflow")
p = conninfo_to_dict(store)
meta = URL.create("postgresql+psycopg2", username=p.get("user"), password=p.get("password"), host=p.get("host"),
                  port=int(p.get("port", 5432)), database="airflow")
print(store, meta.render_as_string(hide_password=False))
PYEOF
)
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-$AIRFLOW_DB_URL}"
export AIRFLOW_CONN_DELAYWHEEL_DEFAULT="${AIRFLOW_CONN_DELAYWHEEL_DEFAULT:-$STORE_URL}"
# Airflow 3 creates no default connections, and without one SparkSubmitOperator's `spark_default` means yarn:
# Spark local mode unless the user set the connection (README, "Spark").
[[ -n "${AIRFLOW_CONN_SPARK_DEFAULT:-}" ]] || AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type":"spark","host":"local[*]"}'
export AIRFLOW_CONN_SPARK_DEFAULT

# Secrets every Airflow process must share (the scheduler signs task tokens the API server checks):
# generated once, kept out of airflow.cfg and git.
secret() {
  local file="$AIRFLOW_HOME/$1"
  [[ -s "$file" ]] || (umask 077 && "$PY" -c "$2" >"$file")
  cat "$file"
}
export AIRFLOW__API_AUTH__JWT_SECRET="${AIRFLOW__API_AUTH__JWT_SECRET:-$(secret jwt_secret 'import secrets; print(secrets.token_urlsafe(32))')}"
export AIRFLOW__CORE__FERNET_KEY="${AIRFLOW__CORE__FERNET_KEY:-$(secret fernet_key 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')}"

if [[ $# -gt 0 && "$1" != "standalone" ]]; then
  exec airflow "$@"
fi

"$PY" -m delaywheel.cli migrate                      # the store's schema and the next hours' partitions
airflow db migrate                                   # Airflow's metadata schema, in database `airflow`
SLOTS="$("$PY" -c 'from delaywheel import load_settings; print(2 * (load_settings().max_level + 1))')"
airflow pools set delaywheel_deliver "$SLOTS" "delaywheel_deliver: per level and wheel, two runs during a hand-over" >/dev/null

PASSWORDS="$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
login() { echo "Airflow UI: http://127.0.0.1:8080  user: admin  password: $(cat "$PASSWORDS" 2>/dev/null || echo "in $PASSWORDS")"; }
if [[ "${1:-}" == "standalone" ]]; then
  login
  exec airflow standalone
fi

# The API server first: workers report to its Execution API, so a task started before it answers fails.
pids=()
trap 'trap - EXIT; kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
airflow api-server & pids+=($!)
for _ in $(seq 1 180); do
  curl -fs http://127.0.0.1:8080/api/v2/monitor/health >/dev/null && break
  sleep 1
done
login
airflow triggerer & pids+=($!)
airflow dag-processor & pids+=($!)
airflow scheduler & pids+=($!)
wait -n  # one service ended: stop the others (the EXIT trap)
