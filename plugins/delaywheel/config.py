"""Settings for delaywheel, read from the environment and the `[delaywheel]` section of airflow.cfg.

The store must not import Airflow (DESIGN.md: the import contracts), so airflow.cfg is read with configparser.
Precedence, highest first: `DELAYWHEEL_<NAME>`, `AIRFLOW__DELAYWHEEL__<NAME>`, airflow.cfg, default.
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path


def _project_root() -> Path:
    """The folder of the project's own files (the embedded cluster, reports, input folders, airflow.cfg): nothing the
    library needs to migrate, send, deliver or consume. `DELAYWHEEL_HOME`; else the checkout this module sits in
    (`plugins/delaywheel/config.py`); else, installed as a package, the working directory, as for any project's."""
    if os.environ.get("DELAYWHEEL_HOME"):
        return Path(os.environ["DELAYWHEEL_HOME"])
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "pyproject.toml").is_file() and (checkout / "plugins").is_dir() else Path.cwd()


PROJECT_ROOT = _project_root()

DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_TOKEN = re.compile(r"^(\d+)(ms|s|m|h|d)$")


class ConfigError(ValueError):
    """A setting has a value delaywheel cannot use; the message names the setting and the value."""


def parse_levels(text: str) -> tuple[timedelta, ...]:
    """Parse RocketMQ's `messageDelayLevel` format; level n is element n-1 of the result."""
    tokens = text.split()
    if not tokens:
        raise ConfigError("delay levels: empty string; expected e.g. '1s 5s 10s 30s 1m'")
    levels = []
    for position, token in enumerate(tokens, start=1):
        match = _TOKEN.match(token)
        if not match or int(match.group(1)) == 0:
            raise ConfigError(
                f"delay levels: bad token {token!r} at position {position}; "
                "expected a positive integer followed by one of ms, s, m, h, d (e.g. '30s')"
            )
        levels.append(timedelta(milliseconds=int(match.group(1)) * _UNIT_MS[match.group(2)]))
    return tuple(levels)


def parse_duration(text: str, setting: str) -> timedelta:
    """One duration in the same unit syntax as the levels ('500ms', '3d')."""
    match = _TOKEN.match(text.strip())
    if not match:
        raise ConfigError(f"{setting}: bad duration {text!r}; expected e.g. '500ms', '30s', '3d'")
    try:
        return timedelta(milliseconds=int(match.group(1)) * _UNIT_MS[match.group(2)])
    except OverflowError:
        raise ConfigError(f"{setting}: duration {text!r} is too large") from None


def format_duration(duration: timedelta) -> str:
    """A whole number of milliseconds as `parse_duration` reads it, in the largest unit that divides it ('90m',
    '2h', '1500ms'); a part below a millisecond is dropped."""
    ms = duration // timedelta(milliseconds=1)
    for unit in ("d", "h", "m", "s"):
        if ms and ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


# Several stores (docs/stores.md). A store's name becomes part of Airflow connection ids and DAG ids
# (`delaywheel_<name>`), so it is a lower-case identifier. Entries are `NAME=URL`, separated by commas; a comma splits
# only where the next entry begins, because a libpq URL may list several hosts with commas (`postgresql://h1,h2/db`).
STORE_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_STORE_ENTRY = re.compile(r",\s*(?=[^,=/:@?]+=\s*postgres(?:ql)?://)")  # any would-be name: checked below
# A route: `TOPIC=STORE`, or `TOPIC=OLD>NEW` while a topic moves (new sends go to NEW; consumers still read OLD).
# Neither '=' nor '>' nor ',' may appear in a topic (validation.TOPIC_PATTERN), so the split is unambiguous.
_ROUTE_TOPIC = re.compile(r"[%|A-Za-z0-9_.-]{1,127}")


def parse_stores(text: str) -> tuple[tuple[str, str], ...]:
    """`a=postgresql://…,b=postgresql://…` as ((name, url), …) in the order given. Refused, with the reason: an entry
    that is not NAME=URL, a name that is not a lower-case identifier, a URL that is not a postgresql:// one (a
    key=value conninfo could not be told apart from the next entry), a name given twice."""
    stores: dict[str, str] = {}
    for position, entry in enumerate(_STORE_ENTRY.split(text.strip()), start=1):
        name, sep, url = (part.strip() for part in entry.partition("="))
        if not sep or not name or not url:
            raise ConfigError(f"stores: entry {position} ({entry.strip()[:40]!r}) is not NAME=postgresql://…")
        if not STORE_NAME.fullmatch(name):
            raise ConfigError(
                f"stores: entry {position}: name {name[:40]!r} is not a lower-case identifier"
                " (a-z, then a-z 0-9 _, at most 40 characters)"
            )
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(
                f"stores: store {name!r}: its URL must start with postgresql:// (key=value conninfo"
                " strings cannot be listed here)"
            )
        if name in stores:
            raise ConfigError(f"stores: store {name!r} is named twice")
        stores[name] = url
    return tuple(stores.items())


def parse_routes(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`orders=b,audit=a>c` as ((topic, stores), …): a topic's stores are its current one last and, while it moves,
    the ones it moves from before it (routing.py). Refused, with the reason: an entry that is not TOPIC=STORE, a
    malformed topic or store name, a topic given twice, a store named twice in one route. Whether the stores are
    configured is checked where both settings meet (routing.Stores)."""
    routes: dict[str, tuple[str, ...]] = {}
    for position, entry in enumerate((e.strip() for e in text.split(",")), start=1):
        if not entry:
            continue
        topic, sep, target = (part.strip() for part in entry.partition("="))
        if not sep or not _ROUTE_TOPIC.fullmatch(topic):
            raise ConfigError(f"routes: entry {position} ({entry[:60]!r}) is not TOPIC=STORE with a well-formed topic")
        names = tuple(name.strip() for name in target.split(">"))
        if not all(STORE_NAME.fullmatch(name) for name in names):
            raise ConfigError(f"routes: topic {topic!r}: {target[:60]!r} is not STORE or OLD>NEW (store names)")
        if len(set(names)) != len(names):
            raise ConfigError(f"routes: topic {topic!r}: {target!r} names a store twice")
        if topic in routes:
            raise ConfigError(f"routes: topic {topic!r} is routed twice")
        routes[topic] = names
    return tuple(routes.items())


TEST_CLOCK_ENV = "DELAYWHEEL_TEST_CLOCK"


def _test_clock() -> bool:
    """`Settings.test_clock`'s default: DELAYWHEEL_TEST_CLOCK in the environment (tests/conftest.py sets it). Read from
    the environment only, never airflow.cfg: it is a test run's opt-in, not a deployment's setting."""
    raw = os.environ.get(TEST_CLOCK_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{TEST_CLOCK_ENV}: {raw!r} is not a boolean (1 or 0)")


@dataclass(frozen=True)
class Settings:
    """Everything tunable; `load_settings()` builds it, tests build it directly."""

    database_url: str | None = None
    owner_url: str | None = None  # the owner role's URL, for `migrate` (README, "Roles"); None: database_url's
    levels: tuple[timedelta, ...] = field(default_factory=lambda: parse_levels(DEFAULT_LEVELS))
    max_body_bytes: int = 4 * 1024 * 1024
    max_reconsume_times: int = 16
    wheel_precision: timedelta = timedelta(seconds=1)
    wheel_near_window: timedelta = timedelta(days=3)
    wheel_max_delay: timedelta = timedelta(days=365)
    past_tolerance: timedelta = timedelta(days=1)
    topic_retention: timedelta = timedelta(days=7)
    batch_size: int = 5000
    # The most messages one slice of the wheel's daily roll moves (wheel.roll): a slice holds the wheel's lane, so
    # this bounds how long the roll holds up a pass (the default keeps a slice under the default wheel_precision).
    wheel_roll_slice: int = 10_000
    # Caller-supplied text (DESIGN.md, "Caller-supplied text"): how long a checked predicate or bulk query may read
    # (read-only, with this statement_timeout); which databases a bulk query may read besides the store (Airflow
    # connection ids or URLs; empty: the store only); and the folders bulk enqueue may read files from (symlinks and ..
    # resolved first).
    match_timeout: timedelta = timedelta(minutes=5)
    allowed_sources: tuple[str, ...] = ()
    input_roots: tuple[str, ...] = (str(PROJECT_ROOT / "data"), str(PROJECT_ROOT / ".delaywheel" / "input"))
    # Several stores (docs/stores.md): (name, url) pairs, empty for one store (database_url); and the routing table,
    # (topic, stores) pairs that win over the hash (routing.py).
    stores: tuple[tuple[str, str], ...] = ()
    routes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A test's injected clock: `now=` may then be any aware instant. Otherwise it must lie within
    # validation.NOW_AHEAD / NOW_BEHIND of the database's clock, because it changes shared state (a lane's FIFO
    # order, partitions, the wheel's cursor).
    test_clock: bool = field(default_factory=_test_clock)

    def __post_init__(self) -> None:
        if not timedelta(milliseconds=100) <= self.wheel_precision <= timedelta(minutes=1):
            raise ConfigError(f"wheel_precision: {self.wheel_precision} is outside 100ms..1m")
        if self.max_body_bytes <= 0 or self.batch_size <= 0 or self.wheel_roll_slice <= 0:
            raise ConfigError("max_body_bytes, batch_size and wheel_roll_slice must be positive")

    @property
    def max_level(self) -> int:
        return len(self.levels)

    def level_delay(self, level: int) -> timedelta:
        return self.levels[level - 1]


def _airflow_cfg_path() -> Path:
    if "AIRFLOW_CONFIG" in os.environ:
        return Path(os.environ["AIRFLOW_CONFIG"])
    if "AIRFLOW_HOME" in os.environ:
        return Path(os.environ["AIRFLOW_HOME"]) / "airflow.cfg"
    return PROJECT_ROOT / "airflow.cfg"


def _raw(name: str, cfg: configparser.ConfigParser) -> str | None:
    for env in (f"DELAYWHEEL_{name.upper()}", f"AIRFLOW__DELAYWHEEL__{name.upper()}"):
        if os.environ.get(env):
            return os.environ[env]
    if cfg.has_option("delaywheel", name):
        return cfg.get("delaywheel", name, raw=True)
    return None


def _airflow_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(_airflow_cfg_path())
    return cfg


def option(name: str) -> str | None:
    """One `[delaywheel]` option as the environment or airflow.cfg sets it (None if unset), for the options that are
    not the store's `Settings` but the Airflow side's (the deliver pool's hand-over slots)."""
    return _raw(name, _airflow_cfg())


def load_settings() -> Settings:
    """Settings from the environment and airflow.cfg; unset values keep their defaults."""
    cfg = _airflow_cfg()
    values: dict[str, object] = {}
    if (url := _raw("database_url", cfg)) is not None:
        values["database_url"] = url
    if (url := _raw("owner_url", cfg)) is not None:
        values["owner_url"] = url
    if (levels := _raw("levels", cfg)) is not None:
        values["levels"] = parse_levels(levels)
    for name in ("max_body_bytes", "max_reconsume_times", "batch_size", "wheel_roll_slice"):
        if (raw := _raw(name, cfg)) is not None:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(f"{name}: {raw!r} is not an integer") from None
    for name in (
        "wheel_precision",
        "wheel_near_window",
        "wheel_max_delay",
        "past_tolerance",
        "topic_retention",
        "match_timeout",
    ):
        if (raw := _raw(name, cfg)) is not None:
            values[name] = parse_duration(raw, name)
    if (raw := _raw("stores", cfg)) is not None:
        values["stores"] = parse_stores(raw)
    if (raw := _raw("routes", cfg)) is not None:  # the table itself, or `@PATH`: a file of it, one or more a line
        values["routes"] = parse_routes(_routes_text(raw))
    for name in ("allowed_sources", "input_roots"):  # comma-separated lists
        if (raw := _raw(name, cfg)) is not None:
            values[name] = tuple(item.strip() for item in raw.split(",") if item.strip())
    return Settings(**values)  # type: ignore[arg-type]


def _routes_text(raw: str) -> str:
    """The routing table's text: `raw`, or with `@PATH` the file's lines (a long table is kept in a file; `#` starts
    a comment) joined as entries."""
    if not raw.startswith("@"):
        return raw
    try:
        lines = Path(raw[1:]).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"routes: cannot read {raw[1:]!r}: {exc}") from None
    return ",".join(line.partition("#")[0] for line in lines)
