"""Bulk work the Spark jobs drive: bulk enqueue from files, catch-up, replay and reconcile."""
