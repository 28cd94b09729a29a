"""Airflow integration: hook, triggers, sensors, operators and the UI plugin (the only place that imports Airflow)."""
