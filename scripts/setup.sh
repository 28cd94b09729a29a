#!/usr/bin/env bash
# Installs what delaywheel needs on a fresh Debian/Ubuntu machine, then the pinned Python environment.
#   scripts/setup.sh          runtime: PostgreSQL server binaries, Java 17 + JDBC driver (Spark), .venv
#   scripts/setup.sh --test   also Chromium + ChromeDriver for the browser tests
# Safe to run again: every step checks first and does nothing when it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

missing=()
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
[ -f /usr/share/java/postgresql.jar ] || missing+=(libpostgresql-jdbc-java)
if [ "$want_test" = 1 ]; then
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  # tests/test_poolers.py: PgBouncer in transaction mode in front of the cluster
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
  # tests/airflow/test_celery.py: Redis as the Celery broker
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
sum=$(sha256sum requirements.lock pyproject.toml examples/shop/pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$sum" ]; then
  echo "setup: installing the pinned Python environment (requirements.lock; about 2 minutes the first time)"
  .venv/bin/pip install -q --upgrade "pip==26.3"
  .venv/bin/pip install -q -r requirements.lock
  # The Spark provider pulls in pyspark-client (a subset of pyspark in the same folder, one release
  # behind): reinstall pyspark last so its files are the ones that stay.
  .venv/bin/pip install -q --no-deps --force-reinstall "$(grep '^pyspark==' requirements.lock)"
  .venv/bin/pip install -q --no-deps -e .
  # The example application beside the library (examples/shop: `make demo`, the shop's DAGs), a package of its own.
  .venv/bin/pip install -q --no-deps -e ./examples/shop
  want=$(grep '^pyspark==' requirements.lock | cut -d= -f3)
  have=$(.venv/bin/python -c 'import pyspark; print(pyspark.__version__)')
  [ "$want" = "$have" ] || { echo "setup: pyspark is $have, the lock says $want" >&2; exit 1; }
  # The editable build leaves a delaywheel.egg-info behind (in plugins/, or in the checkout's root when the package
  # has two source folders); Airflow puts plugins/ on sys.path and a process started in the checkout has it on
  # sys.path too: either would read that copy's entry point as well and report the delaywheel plugin as a duplicate.
  rm -rf plugins/delaywheel.egg-info delaywheel.egg-info examples/shop/delaywheel.egg-info examples/shop/*.egg-info
  echo "$sum" > "$stamp"
fi
if [ "$want_test" = 1 ]; then
  # Test-only tools, pinned, kept out of the runtime lock: import-linter (the layer contracts `make test` checks)
  # and the Celery provider (tests/airflow/test_celery.py; its pins are docker/Dockerfile.celery's, written once).
  test_pins="import-linter==2.17 grimp==3.20 $(grep -o '[A-Za-z0-9_.-]*==[0-9][^ \\]*' docker/Dockerfile.celery | tr '\n' ' ')"
  test_sum=$(echo "$sum $test_pins" | sha256sum | cut -c1-16)
  if [ "$(cat .venv/.test-requirements.sha 2>/dev/null)" != "$test_sum" ]; then
    echo "setup: installing the pinned test tools"
    # shellcheck disable=SC2086
    .venv/bin/pip install -q -c requirements.lock $test_pins
    echo "$test_sum" > .venv/.test-requirements.sha
  fi
fi
echo "setup: done (.venv ready; PostgreSQL, Java and JDBC driver present)"
