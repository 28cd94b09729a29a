-- The roll in slices (issue 21, item 4; docs/capacity.md, "The roll").
--
-- The daily roll moved a whole far day block into the near wheel in one transaction holding the wheel's lane lock and
-- ACCESS EXCLUSIVE on both wheel parents: at a billion pending timers, minutes a day with no wheel delivery and every
-- timer send waiting. It now moves the block a slice at a time (wheel.roll), each slice deleting the segments it
-- moved in the same statement, so the last step, which still locks the parents to drop the block, has only the
-- segments sent since. That is the one row-by-row delete of a hot table: the runtime may delete far segments, through
-- the parent (whose grants are the ones checked); the dead rows go when the roll drops their block.

GRANT DELETE ON delaywheel.wheel_far_segments TO delaywheel_runtime;
