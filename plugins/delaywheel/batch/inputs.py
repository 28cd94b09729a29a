"""What a bulk-enqueue form may point at: files under the configured input roots, databases among the allowed sources.

The `delaywheel_bulk_enqueue` form takes an input path, a query and a query database from whoever may trigger it,
and the job runs with the store's credentials: without these checks a form could read any local file into messages
and quarantine rows, or send any query to any reachable server.

* `input` must lie under one of `Settings.input_roots` (default: the project's `data/` and `.delaywheel/input/`),
  checked after resolving symlinks and `..`, and so must every file a glob or a folder expands to (a symlink inside a
  root that leads out of it is refused too). Other file systems (`s3a://…`, `hdfs://…`) are accepted only under a
  root spelled with that scheme.
* `source_url` must be empty (the store itself) or one of `Settings.allowed_sources`: an Airflow connection id
  (resolved from `AIRFLOW_CONN_<ID>` or Airflow's connections) or a PostgreSQL URL. The job then connects with the
  configured entry, never with credentials from the form.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from delaywheel.config import Settings

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB = re.compile(r"[*?\[]")


class NotAllowed(ValueError):
    """An input path or a source the configuration does not allow; the message says which setting to change."""


def _root_paths(settings: Settings) -> list[str]:
    return [r for r in settings.input_roots if r.strip()]


def check_input(path: str, settings: Settings) -> str:
    """`path` (a file, folder or glob) if everything it names lies under an input root; else `NotAllowed`."""
    roots = _root_paths(settings)
    hint = f"input roots: {', '.join(roots) or '(none)'}; set DELAYWHEEL_INPUT_ROOTS to allow another folder"
    if not roots:
        raise NotAllowed(f"input {path!r} is not allowed: no input roots are configured ({hint})")
    if "{" in path or "}" in path:
        raise NotAllowed(f"input {path!r}: {{a,b}} alternatives are not supported; use * or ? or several runs")
    scheme = _SCHEME.match(path)
    if scheme and scheme.group(1).lower() != "file":
        if ".." in path.split("/"):
            raise NotAllowed(f"input {path!r} holds '..'")
        if not any(path.startswith(r.rstrip("/") + "/") for r in roots if _SCHEME.match(r)):
            raise NotAllowed(f"input {path!r} is not under an input root ({hint})")
        return path
    local = path.removeprefix("file://") if scheme else path
    resolved_roots = [
        Path(r.removeprefix("file://")).expanduser().resolve()
        for r in roots
        if not _SCHEME.match(r) or r.startswith("file://")
    ]
    base = Path(os.path.abspath(Path(local).expanduser()))  # relative: to the working folder, as Spark reads it
    matches = glob.glob(str(base)) if _GLOB.search(str(base)) else [str(base)] if os.path.lexists(base) else []
    if not matches:
        raise NotAllowed(f"input {path!r} matches no file")
    for match in matches:
        for name in _files(Path(match)):
            real = Path(os.path.realpath(name))
            if not any(real == root or real.is_relative_to(root) for root in resolved_roots):
                raise NotAllowed(f"input {path!r}: {name} is not under an input root ({hint})")
    return path


def _files(path: Path) -> list[str]:
    """The path itself and, for a folder, every file and folder below it (without following links out)."""
    names = [str(path)]
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):
            names += [os.path.join(folder, n) for n in (*dirs, *files)]
    return names


def _identity(url: str) -> tuple[str, str, str, str]:
    from psycopg.conninfo import conninfo_to_dict  # psycopg: not for the Airflow DAG files that import this module

    p = conninfo_to_dict(url)
    return (str(p.get("host", "")), str(p.get("port", "5432")), str(p.get("dbname", "")), str(p.get("user", "")))


def connection_ids(allowed: tuple[str, ...]) -> list[str]:
    """The entries of `Settings.allowed_sources` that name an Airflow connection (not a URL or a conninfo string)."""
    return [a.strip() for a in allowed if a.strip() and "://" not in a and "=" not in a]


def connection_variable(conn_id: str) -> str:
    """Airflow's environment variable for a connection: how an allowed connection reaches the job."""
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def _connection_uri(conn_id: str) -> str:
    """An allowed connection's URI, from the job's environment: the Airflow task that submits the job puts each
    allowed connection there (airflow/spark.py), and a job run by hand is given it the same way."""
    env = os.environ.get(connection_variable(conn_id))
    if env:
        return env
    raise NotAllowed(
        f"source {conn_id!r} is allowed but {connection_variable(conn_id)} is not set for this job "
        "(the Airflow task sets it from the connection; set it yourself when running the job by hand)"
    )


def check_source(source: str | None, settings: Settings, *, to_url: object = None) -> str | None:
    """The URL to read a bulk query from: None (the store) for an empty source; for an allowed source (a connection
    id or a URL listed in `Settings.allowed_sources`), the configured entry's URL; else `NotAllowed`.
    `to_url` turns a connection's URI into a libpq URL (the Spark job's `sparkjob.db_url`)."""
    if source is None or not source.strip():
        return None
    source = source.strip()
    allowed = [a for a in settings.allowed_sources if a.strip()]
    hint = "set DELAYWHEEL_ALLOWED_SOURCES (Airflow connection ids or URLs) to allow it; empty: the store only"
    convert = to_url if callable(to_url) else (lambda u: u)
    if source in allowed and "://" not in source and "=" not in source:
        return str(convert(_connection_uri(source)))
    if "://" in source or "=" in source:
        try:
            wanted = _identity(str(convert(source)))
        except Exception:  # not a URL at all
            raise NotAllowed(f"source {source!r} is not a PostgreSQL URL or an allowed connection id") from None
        for entry in allowed:
            try:
                url = str(convert(_connection_uri(entry) if "://" not in entry and "=" not in entry else entry))
            except NotAllowed:
                continue
            if _identity(url) == wanted:
                return url
    raise NotAllowed(f"source {_redact(source)!r} is not an allowed source ({hint})")


def _redact(source: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", source)
