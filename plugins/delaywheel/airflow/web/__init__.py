"""The delaywheel dashboard: a FastAPI app the Airflow API server mounts (see `delaywheel.airflow.plugin`)."""
