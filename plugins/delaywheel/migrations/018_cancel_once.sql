-- Cancels no longer take the lanes' advisory locks (DESIGN.md, "Cancellation"): a cancel commits its row, then
-- waits for a delivery pass of the message's lane that may have read the message before that commit, then reads
-- what happened. Two cancels of one message still meet: at this index. `INSERT … ON CONFLICT DO NOTHING` waits for
-- a concurrent cancel of the same message to end and then inserts nothing, so one of them says `cancelled` and the
-- other `already_cancelled`. A unique index of a partitioned table must hold the partition key (due_at); a message
-- has one due time, so (message_id, due_at) is the message. It also serves every lookup by message_id alone, so it
-- replaces cancellations_message: one index insert per cancel, as before.
--
-- The old locks kept duplicates out; a copy left by some other writer is dropped here (one row per message kept).
DELETE FROM delaywheel.cancellations a
USING delaywheel.cancellations b
WHERE a.message_id = b.message_id AND a.due_at = b.due_at AND a.tableoid = b.tableoid AND a.ctid > b.ctid;

CREATE UNIQUE INDEX cancellations_once ON delaywheel.cancellations (message_id, due_at);
DROP INDEX delaywheel.cancellations_message;
