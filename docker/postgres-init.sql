-- The store and Airflow's metadata live in separate databases of one PostgreSQL server.
CREATE DATABASE airflow OWNER delaywheel;
