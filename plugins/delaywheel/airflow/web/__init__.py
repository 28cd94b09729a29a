"""The delaywheel dashboard: a FastAPI app the Airflow API server mounts (see `delaywheel.airflow.plugin`)."""

URL_PREFIX = "/delaywheel"  # where the API server mounts the app
