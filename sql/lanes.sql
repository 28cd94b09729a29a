-- The lane lock: one pass at a time per lane (a level, the wheel), with turns so that a stream of cancels never
-- starves deliveries. Called by the passes and by cancel.

-- The lane's lock, then a turn: both tried; if either is held, waited for up to p_wait (lock_timeout, for these waits
-- only): the lane's lock, then the first turn (a turn tried again first, as the other may be free by then). 'free',
-- 'waited' or 'busy'. The locks are the transaction's (released at its commit); on 'busy' the subtransaction is undone,
-- the locks it took and lock_timeout with it, so a busy pass holds nothing.
CREATE OR REPLACE FUNCTION delaywheel.take_lane(p_class integer, p_key integer, p_wait text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    BEGIN
        IF pg_try_advisory_xact_lock(p_class, p_key) THEN
            IF pg_try_advisory_xact_lock(p_class + 1, p_key) OR pg_try_advisory_xact_lock(p_class + 2, p_key) THEN
                RETURN 'free';
            END IF;
        END IF;
        PERFORM set_config('lock_timeout', p_wait, true);
        PERFORM pg_advisory_xact_lock(p_class, p_key);
        IF NOT (pg_try_advisory_xact_lock(p_class + 1, p_key) OR pg_try_advisory_xact_lock(p_class + 2, p_key)) THEN
            PERFORM pg_advisory_xact_lock(p_class + 1, p_key);
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        RETURN 'busy';
    END;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN 'waited';
END
$$;
