"""Developer infrastructure: the embedded PostgreSQL cluster and a local Airflow on it. Not used by the store."""
