"""What Airflow pays to execute each of the project's DAG files and plugins-folder files, now and at another revision.

The DAG processor re-parses every DAG file every `[dag_processor] min_file_process_interval` (30 s) in a fresh child
process, having imported only the Airflow modules the file names. So each file's own imports (the library, psycopg,
providers) are paid at every parse, for as long as Airflow runs. Each figure is the median CPU time a fresh interpreter
spends executing the DAG file after it has imported `airflow.sdk` and the DAG processor's own modules (SQLAlchemy
among them), as a parse forked from the DAG processor finds them; the interpreter's start and those imports, ~3-4 s of
CPU here and varying by more than a file costs, are left out. What a parse does beyond executing the file (DagBag's
checks, serializing the DAGs, sending them to the DAG processor) is not in these figures;
`--before REV` measures the DAG files and library of a git revision the same way, interleaved run by run. Bytecode is
written and a first round is not counted, as the DAG processor's own runs find the library's `.pyc` files.

The plugins folder's top-level files (`plugins/delaywheel_plugin.py`) are measured the same way: Airflow executes them
in every task process and every parse when it loads plugins, even where the modules they import are loaded already.

    python -m bench.dag_parse [--runs 7] [--before REV]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench.common import Check, print_section
from bench.send_bench import ROOT, export_revision

PARSE = """
import importlib.util, sys, time
import airflow.dag_processing.manager, airflow.sdk  # what the DAG processor holds before it forks a parse
started = time.process_time()
spec = importlib.util.spec_from_file_location("dag_file", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(1000 * (time.process_time() - started))
"""
INTERVAL_S = 30.0  # Airflow's default min_file_process_interval, which airflow.cfg keeps


def parse_ms(dag_file: Path, env: dict[str, str]) -> float:
    """CPU milliseconds a fresh interpreter spends executing `dag_file` once it holds what the DAG processor holds."""
    done = subprocess.run(
        [sys.executable, "-c", PARSE, str(dag_file)], env=env, check=True, capture_output=True, text=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> list[Check]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--before", metavar="REV", help="also measure the DAG files and library of this revision")
    args = parser.parse_args()
    started = datetime.now(UTC)
    files = sorted(
        p.relative_to(ROOT).as_posix() for folder in ("dags", "plugins") for p in (ROOT / folder).glob("*.py")
    )
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"now": ROOT}
        if args.before:  # its library, DAG files and the shop the shop's DAGs import
            export_revision(args.before, Path(tmp), ("plugins", "dags", "examples"))
            roots[f"at {args.before}"] = Path(tmp)
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        envs = {
            label: {
                **inherited,
                "PYTHONPATH": f"{root / 'plugins'}:{root / 'examples' / 'shop'}",
                "DELAYWHEEL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nowhere",  # parsing connects to nothing
            }
            for label, root in roots.items()
        }
        samples: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs + 1):  # interleaved: a slow moment of the machine lands on both trees
            for label, root in roots.items():
                for name in files:
                    took = parse_ms(root / name, envs[label])
                    if run:  # the first round compiles and writes the bytecode
                        samples.setdefault((label, name), []).append(took)
    parse = {key: statistics.median(values) for key, values in samples.items()}
    total = {label: sum(parse[(label, name)] for name in files) for label in roots}
    notes = [
        f"median of {args.runs} interleaved runs per file: CPU to execute it once airflow.sdk and the DAG processor's"
        " modules are imported"
    ]
    for name in files:
        notes.append(f"{name}: " + "; ".join(f"{label} {parse[(label, name)]:,.0f} ms" for label in roots))
    for label in roots:
        notes.append(
            f"{label}: all {len(files)} files {total[label]:,.0f} ms a round, {total[label] / 10 / INTERVAL_S:.1f} % of"
            f" a core at one round every {INTERVAL_S:.0f} s, were every parse to pay it (one forked from a process"
            " that holds these modules already pays less)"
        )
    checks = []
    if args.before:
        before = total[f"at {args.before}"]
        checks.append(
            Check(
                "DAG and plugins-folder files' CPU, every file (ms)",
                total["now"],
                before,
                "ratio < 1.00",
                total["now"] < before,
            )
        )
    print_section(
        "DAG and plugins-folder files' execution cost",
        checks,
        notes,
        started,
        "python -m bench.dag_parse" + (f" --before {args.before}" if args.before else ""),
    )
    return checks


if __name__ == "__main__":
    main()
