"""Bulk work the Spark jobs drive: bulk enqueue from files (which inputs a job may read: inputs), catch-up, replay,
reconcile, and the lateness contract (quality, with Great Expectations). Imports no Spark: the jobs in
spark/ do."""
