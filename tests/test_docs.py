"""The documents say what the code does: the README's library example runs against the real PostgreSQL, every
relative link and every repository path the documents name exists, and each benchmark history file is dated and
carries the fields bench/RESULTS.md promises."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = ROOT / "plugins" / "delaywheel"
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "DESIGN.md",
    ROOT / "bench" / "RESULTS.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path in backquotes that starts at a top-level folder of the repository, at the package (`delaywheel/...`, which
# lives under plugins/) or at one of its subpackages (`deliver/levels.py`, as DESIGN writes them); placeholders
# (`<job>`, `NNN_*`) are not paths.
TOP = ("plugins", "dags", "tests", "bench", "scripts", "examples", "docker", "docs")
PACKAGE = ("produce", "deliver", "consume", "ops", "batch", "spark", "airflow", "dev", "migrations")
PATH = re.compile(r"`((?:" + "|".join((*TOP, "delaywheel", *PACKAGE)) + r")/[\w./-]*)`")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_library_example_runs(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's first python block, as written, against a fresh migrated database: it sends, cancels, delivers,
    pulls and acks, and asserts what each returns (a block that drifts from the API fails here)."""
    [example] = python_blocks((ROOT / "README.md").read_text())[:1]
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip() == str(list(range(100, 200)))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        unknown_anchor = anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text())
        if not resolved.exists() or unknown_anchor:
            broken.append(target)
    assert not broken, f"{document.name}: links to nothing: {broken}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(document: Path) -> None:
    """A module, test or script the documents name by path is where they say (they follow the code's layout)."""
    missing = []
    for named in PATH.findall(document.read_text()):
        if "<" in named or "*" in named or "NNN" in named:
            continue
        first = named.split("/", 1)[0]
        path = (
            ROOT / named
            if first in TOP
            else ROOT / "plugins" / named
            if first == "delaywheel"
            else PACKAGE_ROOT / named
        )
        by_number = re.fullmatch(r"\d{3}", path.name) and any(path.parent.glob(f"{path.name}_*.sql"))
        if not path.exists() and not by_number:  # `migrations/017` names 017_roles.sql
            missing.append(named)
    assert not missing, f"{document.name}: names paths that do not exist: {missing}"


def test_benchmark_history_files() -> None:
    """Each file under bench/results/ is one dated record with the fields RESULTS.md names (`target` and `verdict`
    where the run was judged against a target)."""
    files = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert files
    for file in files:
        record = json.loads(file.read_text())
        assert {"date", "command", "figures", "notes"} <= record.keys(), file.name
        assert file.name.startswith(f"{record['date']}-"), file.name
        assert record["command"] or not record.get("target"), (
            f"{file.name}: a run judged against a target names its command"
        )
        assert record["notes"], file.name
