# delaywheel — the README names these targets.
PY := .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: setup setup-test demo check test lint airflow db-start db-stop bench lock

setup:            ## system packages + pinned .venv (idempotent)
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test

demo: setup       ## the main job on the embedded default (README's first command)
	$(PY) -m delaywheel.cli db start
	$(PY) -m delaywheel.cli migrate
	$(PY) -m delaywheel_shop demo $(DEMO_ARGS)  # the example application's own entry point (examples/shop)

test: setup-test lint  ## the gates, then the test suite (README's second command)
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick tier: the gates and the store's own tests, without Airflow, Spark, the browser or the tests marked slow
# (tests/conftest.py marks each test's tier by where it lives and what it uses). Needs `make setup` once.
CHECK_TESTS := not airflow and not spark and not browser and not slow

check: lint       ## the gates, then the store's quick tests (minutes; `make test` runs everything)
	$(PY) -m pytest -m "$(CHECK_TESTS)" $(PYTEST_ARGS)

lint:             ## ruff (lint and format), mypy and the layer contracts (pyproject.toml's [tool.importlinter])
	$(PY) -m ruff check plugins spark examples dags tests bench  # spark/: ruff does not follow plugins/delaywheel/spark's link
	$(PY) -m ruff format --check plugins spark examples dags tests bench
	$(PY) -m mypy
	$(PY) -m mypy dags  # the DAG files too (users copy them): mypy takes packages or files, not both
	.venv/bin/lint-imports

airflow: setup    ## Airflow on the embedded PostgreSQL, UI on http://127.0.0.1:8080 (README, "Airflow")
	scripts/airflow.sh

db-start:
	$(PY) -m delaywheel.cli db start

db-stop:
	$(PY) -m delaywheel.cli db stop

bench: setup      ## the contract benchmarks in sequence (BENCH_ARGS="--scale 0.1" for a quick run; docs/benchmarks.md)
	$(PY) -m bench contract $(BENCH_ARGS)

lock:             ## re-resolve requirements.in into requirements.lock
	python3 -m venv /tmp/delaywheel-lock && /tmp/delaywheel-lock/bin/pip install -q -r requirements.in \
	  && /tmp/delaywheel-lock/bin/pip freeze --exclude-editable > requirements.lock
