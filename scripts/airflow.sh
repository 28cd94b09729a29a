#!/usr/bin/env bash
# Start Airflow locally on the project's embedded PostgreSQL (the README's `make airflow`).
#
#   scripts/airflow.sh                 set up, then run the API server + UI (http://127.0.0.1:8080), and once it
#                                      answers, the triggerer, DAG processor and scheduler. Ctrl-C (or TERM) stops
#                                      them in order, leaving no process behind: the scheduler first (running tasks
#                                      are asked to stop, the operator's on_kill, and report their end to the API
#                                      server), then the triggerer and DAG processor, the API server last. Whatever
#                                      has not ended after DELAYWHEEL_AIRFLOW_STOP_SECONDS (60; 20 for the other
#                                      services) or at a second Ctrl-C is killed; so are LocalExecutor workers left
#                                      idle once no task is left (the scheduler would wait for ever for one that
#                                      never takes its stop message).
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
# To run a second, separate Airflow (the tests do): DELAYWHEEL_AIRFLOW_HOME (AIRFLOW_HOME),
# DELAYWHEEL_AIRFLOW_DB (the metadata database's name), AIRFLOW__API__PORT (8080) and Airflow's own
# AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT (8793) / AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT (8794).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$ROOT/.venv/bin:$PATH"
PY="$ROOT/.venv/bin/python"

export AIRFLOW_HOME="${DELAYWHEEL_AIRFLOW_HOME:-$ROOT/.delaywheel/airflow}"
AIRFLOW_DB="${DELAYWHEEL_AIRFLOW_DB:-airflow}"
export AIRFLOW_CONFIG="$ROOT/airflow.cfg"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$ROOT/dags}"  # a bench may give its own folder
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export DELAYWHEEL_HOME="$ROOT"
mkdir -p "$AIRFLOW_HOME"

# Start the embedded cluster if no external store is configured (idempotent), then derive both URLs: the store's
# (its runtime role, for connection `delaywheel_default`) and Airflow's metadata database $AIRFLOW_DB (`airflow`)
# beside it, created if missing, as the cluster's superuser on the embedded cluster (the store's roles may create
# nothing; the README's "Roles") and with the store URL's credentials on an external server. A metadata URL set in
# AIRFLOW__DATABASE__SQL_ALCHEMY_CONN is used as it is.
"$PY" -m delaywheel.cli db start >/dev/null
read -r STORE_URL AIRFLOW_DB_URL < <(AIRFLOW_DB="$AIRFLOW_DB" "$PY" - <<'PYEOF'
import os

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy.engine import URL
from delaywheel import load_settings
from delaywheel.dev import embedded
from delaywheel.dev.embedded import database_url

settings = load_settings()
store, name = database_url(settings), os.environ["AIRFLOW_DB"]
server = store if settings.database_url else embedded.default_cluster().admin_url("postgres")
if os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
    print(store, "-")
    raise SystemExit
with psycopg.connect(make_conninfo(server, dbname="postgres"), autocommit=True) as conn:
    if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
p = conninfo_to_dict(server)
meta = URL.create("postgresql+psycopg2", username=p.get("user"), password=p.get("password"), host=p.get("host"),
                  port=int(p.get("port", 5432)), database=name)
print(store, meta.render_as_string(hide_password=False))
PYEOF
)
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-$AIRFLOW_DB_URL}"
export AIRFLOW_CONN_DELAYWHEEL_DEFAULT="${AIRFLOW_CONN_DELAYWHEEL_DEFAULT:-$STORE_URL}"
# Several stores (DELAYWHEEL_STORES, docs/stores.md): connection delaywheel_<name> per store, from its URL; a
# variable already set wins (a store URL listing several hosts is no Airflow URI: set that one yourself).
CONNS="$("$PY" -m delaywheel.dev.local_airflow connections)"
while read -r line; do
  [[ -n "$line" ]] || continue
  name="${line%%=*}"
  [[ -n "${!name:-}" ]] || export "$line"
done <<<"$CONNS"
# Airflow 3 creates no default connections, and without one SparkSubmitOperator's `spark_default` means yarn:
# Spark local mode unless the user set the connection (README, "Spark").
[[ -n "${AIRFLOW_CONN_SPARK_DEFAULT:-}" ]] || AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type":"spark","host":"local[*]"}'
export AIRFLOW_CONN_SPARK_DEFAULT

# The URL every process reaches the API server by (tasks report to its Execution API there): airflow.cfg's
# (port 8080), or, given another port in AIRFLOW__API__PORT, the same on that port.
if [[ -n "${AIRFLOW__API__PORT:-}" ]]; then
  export AIRFLOW__API__BASE_URL="${AIRFLOW__API__BASE_URL:-http://127.0.0.1:$AIRFLOW__API__PORT}"
fi
UI="${AIRFLOW__API__BASE_URL:-http://127.0.0.1:8080}"

# Secrets every Airflow process must share, generated once per AIRFLOW_HOME (files of mode 0600, kept out of
# airflow.cfg and git; delaywheel.dev.local_airflow.SECRETS says what each is for): the Fernet key, the JWT secret
# (the scheduler signs task tokens the API server checks) and [api] secret_key (the API server signs its requests
# for a running task's log to the scheduler's log server). A variable already set wins.
SECRETS="$("$PY" -m delaywheel.dev.local_airflow secrets "$AIRFLOW_HOME")"
while read -r line; do
  name="${line%%=*}"  # (not IFS='=' read: that drops a Fernet key's trailing '=')
  [[ -n "${!name:-}" ]] || export "$line"
done <<<"$SECRETS"

if [[ $# -gt 0 && "$1" != "standalone" ]]; then
  exec airflow "$@"
fi

# The store's schema and the next hours' partitions, and the example shop's own line (its DAGs need it), on
# delaywheel_default's store (with several stores configured as well: DELAYWHEEL_STORES= reads database_url only).
DELAYWHEEL_STORES= "$PY" -m delaywheel.cli migrate
DELAYWHEEL_STORES= "$PY" -m delaywheel_shop migrate
[[ -z "$CONNS" ]] || "$PY" -m delaywheel.cli --all-stores migrate  # each configured store's
airflow db migrate                                   # Airflow's metadata schema, in database `airflow`
# The deliver DAGs' pools: delaywheel_deliver, or delaywheel_deliver_<name> per store (levels + 1 slots each, plus
# [delaywheel] deliver_handover_slots for the next run's lane tasks during a hand-over).
"$PY" -m delaywheel.dev.local_airflow pools | while read -r pool slots; do
  airflow pools set "$pool" "$slots" "$pool: a slot per lane, and a few for the next run during a hand-over" >/dev/null
done

PASSWORDS="$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
login() {
  echo "Airflow UI: $UI  user: admin  password: $(cat "$PASSWORDS" 2>/dev/null || echo "in $PASSWORDS")"
}
if [[ "${1:-}" == "standalone" ]]; then
  login
  exec airflow standalone
fi

# Each service runs in a session of its own (setsid), so Ctrl-C in the terminal reaches this script alone and
# `stop` decides the order. A session holds everything its service starts: the scheduler's LocalExecutor workers
# (which ignore INT and TERM) and their tasks (each leading a process group of its own), the log servers, the
# DAG processor's and triggerer's subprocesses. DELAYWHEEL_AIRFLOW_RUN marks the services' environment, so a
# program one of them runs that leaves its session is found too (Airflow's own processes rename themselves over
# what /proc shows of their environment; their sessions find those).
RUN="$$-$(date +%s%N)"
STOP_SECONDS="${DELAYWHEEL_AIRFLOW_STOP_SECONDS:-60}"
IDLE_SECONDS=10  # no task left in the scheduler's session for this long: its idle workers are ended (`stop`)
declare -A pid=()
# PYTHONFAULTHANDLER: a Python process of a service that has to be killed is sent SIGABRT first, and writes the
# stack of each of its threads to this script's output (`drain`), so a stop that hangs says where; with no core
# file left behind.
ulimit -c 0
service() { DELAYWHEEL_AIRFLOW_RUN="$RUN" PYTHONFAULTHANDLER=1 setsid airflow "$1" & pid[$1]=$!; }
note() { echo "scripts/airflow.sh: $* ($(date -u +%H:%M:%S))" >&2; }  # the time: how long each step of a stop took
# "pid pgid sid" of every live process (from /proc/<pid>/stat: after "pid (comm) ", state ppid pgrp session).
procs() {
  local f line
  for f in /proc/[0-9]*/stat; do
    { read -r line <"$f"; } 2>/dev/null || continue
    local -a a=(${line##*) })
    [[ ${a[0]} != Z ]] && echo "${f:6:-5} ${a[2]} ${a[3]}"
  done
  return 0
}
# The live processes of the sessions given (each service's session id is its pid).
in_sessions() {
  local p g s
  procs | while read -r p g s; do [[ " $* " != *" $s "* ]] || echo "$p"; done
}
# Processes carrying this run's mark, wherever they went.
marked() { grep -lzxF "DELAYWHEEL_AIRFLOW_RUN=$RUN" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true; }
# The task processes under the scheduler (session $1): each leads a process group of its own. With `ready`, only
# those whose SIGTERM handler is in place (the task runner's, which calls the operator's on_kill; before that,
# TERM would kill the task outright and it would fail).
task_groups() {
  local p g s k v
  procs | while read -r p g s; do
    [[ $s == "$1" && $p == "$g" && $p != "$s" ]] || continue
    if [[ "${2:-}" == ready ]]; then
      v=0
      while read -r k v; do [[ $k == SigCgt: ]] && break; done 2>/dev/null <"/proc/$p/status"
      (( 0x${v:-0} >> 14 & 1 )) || continue  # bit 14: SIGTERM caught
    fi
    echo "$p"
  done
}
# Each pid given, with what it is (its command line, as the process titles itself: a LocalExecutor worker says
# whether it is idle or which task it runs), so that a note about killing says what was killed.
# The command line of process $1, as it titles itself.
title() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline"; }
named() {
  local p t
  for p; do
    t="$(title "$p" | cut -c1-100)" || t=
    printf '%s (%s) ' "$p" "${t% }"
  done
}
# The scheduler's LocalExecutor workers in session $1 that wait for work: their title ends in `<idle>` (a worker
# running a task is titled with it).
idle_workers() {
  local p
  for p in $(in_sessions "$1"); do
    [[ "$(title "$p")" == *LocalExecutor*": <idle>"* ]] && echo "$p"
  done
  return 0
}
# Wait up to $1 seconds (less after a second Ctrl-C) for the sessions that follow to empty; kill what is left:
# SIGABRT first (each Python process writes its threads' stacks, PYTHONFAULTHANDLER), then SIGKILL.
drain() {
  local limit=$(($1 + SECONDS)); shift
  while [[ -n "$(in_sessions "$@")" ]] && ((SECONDS < limit && !hurry)); do sleep 0.5; done
  local left; left="$(in_sessions "$@")"
  [[ -n "$left" ]] || return 0
  note "killing what is left of ${*/#/session }: $(named $left)(their stacks follow)"
  kill -ABRT $left 2>/dev/null
  sleep 1
  kill -KILL $(in_sessions "$@") 2>/dev/null
}

# The order lets running tasks end cleanly: the scheduler first, while the API server is still up to receive
# their final state (in Airflow 3 a task reports to the API server; without it, it fails and is retried). On TERM
# the scheduler stops scheduling and waits for its LocalExecutor workers, which finish the task they run, so the
# tasks are asked to stop too (TERM: on_kill; a delaywheel lane stops after its current pass and succeeds),
# again each second, for any a worker starts from the queue meanwhile. Past the bound, the tasks and then the
# scheduler's session are killed (such a task stays `running` until the next scheduler finds it without a
# heartbeat and retries it). Then the triggerer and the DAG processor; the API server last; then anything still
# marked as ours.
stopping=0 hurry=0
stop() {
  ((stopping)) && return
  stopping=1
  set +e
  trap 'hurry=1; note "killing what is left"' INT TERM
  local s="${pid[scheduler]:-}" limit t
  if [[ -n "$s" ]]; then
    note "stopping: the scheduler first; running tasks are asked to stop (up to ${STOP_SECONDS}s; Ctrl-C again kills them)"
    kill -TERM "$s" 2>/dev/null
    limit=$((SECONDS + STOP_SECONDS)) idle=$SECONDS
    while [[ -n "$(in_sessions "$s")" ]] && ((SECONDS < limit && !hurry)); do
      t="$(task_groups "$s" ready)"
      [[ -z "$t" ]] || kill -TERM $t 2>/dev/null
      # Airflow's LocalExecutor.end() sends each live worker a stop message and then joins every one with no bound:
      # a worker that never takes its message keeps the scheduler waiting for ever (seen in CI: one titled <idle>,
      # every task already ended). Once no task has been left for IDLE_SECONDS, such workers run nothing, and
      # ending them loses nothing: each writes its stacks first (SIGABRT; they ignore TERM), then SIGKILL.
      if [[ -n "$t" || -n "$(task_groups "$s")" ]]; then
        idle=$SECONDS
      elif ((SECONDS - idle >= IDLE_SECONDS)); then
        t="$(idle_workers "$s")"
        if [[ -n "$t" ]]; then
          note "no task left, and the scheduler still waits for idle LocalExecutor workers: ending $(named $t)(their stacks follow)"
          kill -ABRT $t 2>/dev/null
          sleep 1
          kill -KILL $t 2>/dev/null
        fi
        idle=$SECONDS
      fi
      sleep 1
    done
    t="$(task_groups "$s")"
    if [[ -n "$t" ]]; then
      note "tasks still running, killed: $(named $t)"
      for g in $t; do kill -KILL -- "-$g" 2>/dev/null; done
    fi
    drain 0 "$s"
  fi
  local others=()
  for n in triggerer dag-processor; do
    [[ -z "${pid[$n]:-}" ]] || { others+=("${pid[$n]}"); kill -TERM "${pid[$n]}" 2>/dev/null; }
  done
  ((${#others[@]})) && drain 20 "${others[@]}"
  if [[ -n "${pid[api-server]:-}" ]]; then
    kill -TERM "${pid[api-server]}" 2>/dev/null
    drain 20 "${pid[api-server]}"
  fi
  t="$(marked)"
  [[ -z "$t" ]] || { note "killing processes that left their service: $(named $t)"; kill -KILL $t 2>/dev/null; }
  wait 2>/dev/null
  note "stopped"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap 'stop' EXIT

# The API server first: workers report to its Execution API, so a task started before it answers fails.
service api-server
for _ in $(seq 1 180); do
  curl -fs "$UI/api/v2/monitor/health" >/dev/null && break
  kill -0 "${pid[api-server]}" 2>/dev/null || { note "the API server exited"; exit 1; }
  sleep 1
done
login
service triggerer
service dag-processor
service scheduler
rc=0
wait -n || rc=$?
for n in "${!pid[@]}"; do kill -0 "${pid[$n]}" 2>/dev/null || note "$n exited (status $rc): stopping the others"; done
exit 1
