-- The wheel's cursor as an insert-only log (issue 19, item 2; DESIGN.md, "The cursor is a log, not a row").
--
-- Every wheel pass used to UPDATE the single row of `wheel_state`, and read it 4-5 times. Dead versions of a row
-- can only be pruned once no snapshot can see them, and every snapshot's xmin is the oldest xid running anywhere in
-- the cluster: while any transaction was old (Airflow's metadata shares the cluster; an `idle in transaction`
-- session), the row kept every version, one per pass, and each read of it scanned them all (1,768 versions on 19
-- pages after 1,768 passes: ~1 ms a read, bench/RESULTS.md). A HOT chain is no better: a read walks it from its root.
--
-- Now a pass *inserts* its cursor as the next entry of `wheel_cursor` and reads the newest entry through the
-- primary key, newest first: the first index entry is the last pass's, visible, so the read costs the same few
-- buffers however long an old transaction has been open. Old entries are deleted a block at a time by the passes
-- themselves (wheel.TRIM_EVERY); an old transaction keeps them on disk until it ends, but nothing reads them.
-- `near_until` changes once a day (the roll) and producers lock its row FOR KEY SHARE: it stays a one-row table,
-- `wheel_roll`. The view `wheel_state` joins the two under the old name and columns, so every reader of the cursor
-- (pending.py, stats, cancel, producers' FOR KEY SHARE, which locks only `wheel_roll`'s row) is unchanged.

ALTER TABLE delaywheel.wheel_state RENAME TO wheel_roll;  -- keeps its row, its grants and its fillfactor

-- One entry per wheel pass. `pass` is the previous entry's + 1: two passes that read the same cursor (which the
-- wheel's advisory lock already prevents) cannot both commit; the second fails on the key instead of delivering
-- again. Invariant (TimerCheckpoint): every wheel row with (deliver_at, id) <= (cursor_at, cursor_id) and
-- xid < horizon_xid in the newest entry is delivered or cancelled.
CREATE TABLE delaywheel.wheel_cursor (
    pass         bigint      PRIMARY KEY,
    cursor_at    timestamptz NOT NULL,
    cursor_id    bigint      NOT NULL,
    horizon_xid  xid8        NOT NULL,
    delivered    bigint      NOT NULL,                          -- all passes' deliveries so far
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered, updated_at)
SELECT 0, cursor_at, cursor_id, horizon_xid, delivered, updated_at FROM delaywheel.wheel_roll;

ALTER TABLE delaywheel.wheel_roll DROP COLUMN cursor_at, DROP COLUMN cursor_id, DROP COLUMN horizon_xid,
    DROP COLUMN delivered, DROP COLUMN updated_at;

-- The old row under its old name. The cursor's columns are scalar subqueries (one bounded index read each, all
-- from the statement's one snapshot), not a join: a row lock taken through the view (producers' FOR KEY SHARE, a
-- test's FOR UPDATE) then locks `wheel_roll`'s row only, never a cursor entry.
CREATE VIEW delaywheel.wheel_state AS
SELECT r.singleton, (r.c).cursor_at, (r.c).cursor_id, (r.c).horizon_xid, r.near_until, (r.c).delivered,
       (r.c).updated_at
FROM (SELECT w.singleton, w.near_until,
             (SELECT c FROM delaywheel.wheel_cursor c ORDER BY c.pass DESC LIMIT 1) AS c
      FROM delaywheel.wheel_roll w) r;

-- The runtime appends entries, reads them, and deletes old ones (wheel.TRIM_EVERY); it never rewrites one. Unlike
-- the queues (sql/017: nothing is deleted row by row), it deletes here: an entry deleted is one no pass reads again,
-- and the runtime could already move the cursor anywhere by appending, as it could by updating the old row. The
-- view is read, and row-locked (FOR KEY SHARE needs UPDATE on it), by the runtime; rows go nowhere through it.
REVOKE ALL ON delaywheel.wheel_cursor FROM delaywheel_runtime;
GRANT SELECT, INSERT, DELETE ON delaywheel.wheel_cursor TO delaywheel_runtime;
REVOKE ALL ON delaywheel.wheel_state FROM delaywheel_runtime;
GRANT SELECT, UPDATE ON delaywheel.wheel_state TO delaywheel_runtime;
