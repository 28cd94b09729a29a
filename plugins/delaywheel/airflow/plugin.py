"""The delaywheel Airflow plugin: the dashboard app on the API server, its entry in the UI's navigation, and a listener
that preloads what our tasks run in the processes that fork them (`preload`).

Registered twice over, by design: by the `airflow.plugins` entry point when the package is installed, and by
`plugins/delaywheel_plugin.py` when only the plugins folder is deployed (that shim stands down when the entry
point exists, so Airflow never sees the same plugin twice).
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from . import preload
from .web import URL_PREFIX


class DashboardApp:
    """The dashboard's ASGI app (`web.app.app`), imported at its first request.

    Airflow loads every plugin wherever it may need one: in each task process (for macros, when it builds the task's
    context) and in each DAG file's parse (for timetables and operator links), not only in the API server. Importing
    the app there would import FastAPI, Airflow's API app and the store, seconds of CPU in a process that loads the
    plugins itself, for a page only the API server serves. The API server mounts this object like any ASGI app."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            from .web.app import app

            self._app = app
        await self._app(scope, receive, send)

    def __repr__(self) -> str:  # what /api/v2/plugins lists as the app
        return "delaywheel.airflow.web.app:app"


class DelayWheelPlugin(AirflowPlugin):
    """Mounts the dashboard under /delaywheel and links it from the Airflow navigation (Browse menu), and has Airflow's
    scheduler, triggerer and DAG processor import what our tasks run before they fork them (`preload`)."""

    name = "delaywheel"
    listeners = [preload]
    fastapi_apps = [{"app": DashboardApp(), "url_prefix": URL_PREFIX, "name": "delaywheel dashboard"}]
    external_views = [
        {
            "name": "Delaywheel",
            "href": f"{URL_PREFIX.lstrip('/')}/",  # relative with a trailing slash: works behind a base_url
            "url_route": "delaywheel",  # shown inside the Airflow UI at /plugin/delaywheel
            "destination": "nav",
            "category": "browse",
        }
    ]
