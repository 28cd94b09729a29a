"""The delaywheel Airflow plugin: the dashboard app on the API server and its entry in the UI's navigation.

Registered twice over, by design: by the `airflow.plugins` entry point when the package is installed, and by
`plugins/delaywheel_plugin.py` when only the plugins folder is deployed (that shim stands down when the entry
point exists, so Airflow never sees the same plugin twice).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from .web.app import URL_PREFIX, app


class DelayWheelPlugin(AirflowPlugin):
    """Mounts the dashboard under /delaywheel and links it from the Airflow navigation (Browse menu)."""

    name = "delaywheel"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "delaywheel dashboard"}]
    external_views = [
        {
            "name": "Delaywheel",
            "href": f"{URL_PREFIX.lstrip('/')}/",  # relative with a trailing slash: works behind a base_url
            "url_route": "delaywheel",  # shown inside the Airflow UI at /plugin/delaywheel
            "destination": "nav",
            "category": "browse",
        }
    ]
