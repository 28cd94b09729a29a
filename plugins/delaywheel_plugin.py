"""Loads the delaywheel plugin from the plugins folder when the package is not installed.

Airflow imports every top-level file here; `.airflowignore` hides the library folder from that per-file loader.
When the package is installed, its `airflow.plugins` entry point registers the plugin instead, and defining it
here too would make Airflow report a duplicate-plugin import error.

Airflow imports this file in every task process and every DAG parse, so it reads one distribution's metadata:
`entry_points(group=...)` reads every installed distribution's, about 17 ms of CPU each time here.
"""

from importlib.metadata import PackageNotFoundError, distribution


def _installed() -> bool:
    """Whether an installed delaywheel registers the plugin through its entry point."""
    try:
        entries = distribution("delaywheel").entry_points
    except PackageNotFoundError:
        return False
    return any(e.group == "airflow.plugins" and e.name == "delaywheel" for e in entries)


if not _installed():
    from delaywheel.airflow.plugin import DelayWheelPlugin

    __all__ = ["DelayWheelPlugin"]
