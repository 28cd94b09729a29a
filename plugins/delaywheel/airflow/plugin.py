"""Placeholder until the UI plugin lands."""

from airflow.plugins_manager import AirflowPlugin


class DelayWheelPlugin(AirflowPlugin):
    name = "delaywheel"
