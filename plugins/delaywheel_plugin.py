"""Loads the delaywheel plugin from the plugins folder when the package is not installed.

Airflow imports every top-level file here; `.airflowignore` hides the library folder from that per-file loader.
When the package is installed, its `airflow.plugins` entry point registers the plugin instead, and defining it
here too would make Airflow report a duplicate-plugin import error.
"""

from importlib.metadata import entry_points

if not entry_points(group="airflow.plugins", name="delaywheel"):
    from delaywheel.airflow.plugin import DelayWheelPlugin

    __all__ = ["DelayWheelPlugin"]
