-- Run once by the postgres image's entrypoint, as the cluster's superuser (POSTGRES_USER), in POSTGRES_DB
-- (`delaywheel`). The roles (README, "Roles"; sql/017_roles.sql):
--   delaywheel_owner    NOLOGIN  owns schema `delaywheel`; migrations run as it (login: delaywheel_migrator)
--   delaywheel_runtime  NOLOGIN  sends, delivers, consumes, cancels, maintains partitions through sql/017's
--                                functions; no DDL, no superuser, no file or program access (login: delaywheel_app)
--   airflow             LOGIN    owns Airflow's metadata database, nothing of the store
-- Passwords are the compose file's development defaults: change them (and the URLs) for anything shared.
CREATE ROLE delaywheel_owner NOLOGIN;
CREATE ROLE delaywheel_runtime NOLOGIN;
CREATE ROLE delaywheel_migrator LOGIN PASSWORD 'delaywheel_migrator' IN ROLE delaywheel_owner;
CREATE ROLE delaywheel_app LOGIN PASSWORD 'delaywheel_app' IN ROLE delaywheel_runtime;
GRANT CREATE, CONNECT ON DATABASE delaywheel TO delaywheel_owner;
GRANT CONNECT ON DATABASE delaywheel TO delaywheel_runtime;
-- Only the store's roles reach the store: any other login could take the lanes' advisory locks or hold the commit
-- horizon back with an idle transaction, stopping every lane and consumer.
REVOKE CONNECT, TEMPORARY ON DATABASE delaywheel FROM PUBLIC;

-- The store and Airflow's metadata live in separate databases of one PostgreSQL server.
CREATE ROLE airflow LOGIN PASSWORD 'airflow';
CREATE DATABASE airflow OWNER airflow;
