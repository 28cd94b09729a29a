-- A consumer group's queues: who reads which queue of a topic (consume/topics.py).
--
-- A topic is read as 16 queues by key (topic_messages.qid). A group's member holds leases on its share of them,
-- ceil(16 / live members), renewed by its pulls, and reads only rows of the queues it holds: messages with one key
-- go to one member at a time, in order, and members share the rest. A lease ends when its holder gives it back (an
-- ack of a pull of its own, the end of a consume loop) or expires: a member that died (its server process gone: at
-- once), or whose handler outlived the lease, loses its queues to the others, and its late ack is refused (the ack checks the lease, FOR UPDATE).

-- Be seen as a member, then hold its share of the queues: renew those held (once past half their lease), give back
-- what exceeds the share (a member joined), take free or expired queues up to it. Returns the queues held, in order.
-- A queue another member holds and renews stays with it; its rows wait for that member, which keeps key order.
CREATE OR REPLACE FUNCTION delaywheel.take_queues(p_grp text, p_topic text, p_holder text, p_lease interval)
RETURNS smallint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_share integer;
    v_held smallint[];
    v_got smallint;
    v_live integer[] := ARRAY(SELECT a.pid FROM pg_stat_activity a WHERE a.pid IS NOT NULL);
BEGIN
    INSERT INTO delaywheel.consumer_members AS m (grp, topic, holder, pid, expires_at)
    VALUES (p_grp, p_topic, p_holder, pg_backend_pid(), v_now + p_lease)
    ON CONFLICT (grp, topic, holder) DO UPDATE SET expires_at = excluded.expires_at, pid = excluded.pid
        WHERE m.expires_at < excluded.expires_at - least(p_lease / 2, interval '1 second') OR m.pid <> excluded.pid;
    SELECT (16 + count(*) - 1) / count(*) INTO v_share
    FROM delaywheel.consumer_members m
    WHERE m.grp = p_grp AND m.topic = p_topic
      AND ((m.expires_at > v_now AND m.pid = ANY (v_live)) OR m.holder = p_holder);

    SELECT coalesce(array_agg(l.qid ORDER BY l.qid), '{}') INTO v_held
    FROM delaywheel.consumer_leases l WHERE l.grp = p_grp AND l.topic = p_topic AND l.holder = p_holder;
    IF cardinality(v_held) > v_share THEN
        UPDATE delaywheel.consumer_leases l SET holder = NULL, expires_at = '-infinity'
        WHERE l.grp = p_grp AND l.topic = p_topic AND l.holder = p_holder AND l.qid = ANY (v_held[v_share + 1:]);
        v_held := v_held[1:v_share];
    END IF;
    UPDATE delaywheel.consumer_leases l SET expires_at = v_now + p_lease, pid = pg_backend_pid()
    WHERE l.grp = p_grp AND l.topic = p_topic AND l.holder = p_holder
      AND (l.expires_at < v_now + p_lease / 2 OR l.pid <> pg_backend_pid());

    IF cardinality(v_held) < v_share THEN
        -- free queues (never held, given back, expired, or their holder's process gone), in one order for every
        -- member: two members taking at once lock the rows in the same order, so one waits for the other's commit and
        -- then skips what it took, where orders that differ by member would deadlock
        FOR v_got IN
            SELECT q.q::smallint FROM generate_series(0, 15) q(q)
            LEFT JOIN delaywheel.consumer_leases l ON l.grp = p_grp AND l.topic = p_topic AND l.qid = q.q
            WHERE l.qid IS NULL OR l.holder IS NULL OR l.expires_at <= v_now OR l.pid <> ALL (v_live)
            ORDER BY q.q
        LOOP
            INSERT INTO delaywheel.consumer_leases AS l (grp, topic, qid, holder, pid, expires_at, taken_at, taken)
            VALUES (p_grp, p_topic, v_got, p_holder, pg_backend_pid(), v_now + p_lease, v_now, 1)
            ON CONFLICT (grp, topic, qid) DO UPDATE
                SET holder = excluded.holder, pid = excluded.pid, expires_at = excluded.expires_at,
                    taken_at = excluded.taken_at, taken = l.taken + 1
                WHERE l.holder IS NULL OR l.expires_at <= v_now OR l.pid <> ALL (v_live)
            RETURNING l.qid INTO v_got;
            IF FOUND THEN
                v_held := v_held || v_got;
                EXIT WHEN cardinality(v_held) >= v_share;
            END IF;
        END LOOP;
    END IF;
    RETURN (SELECT array_agg(h ORDER BY h) FROM unnest(v_held) h);
END
$$;

-- Give back every queue p_holder holds on (p_grp, p_topic), and leave the group's members: its ack of its own pull,
-- or the end of its consume loop. Their rows go to the other members at their next pull.
CREATE OR REPLACE FUNCTION delaywheel.give_queues(p_grp text, p_topic text, p_holder text) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM delaywheel.consumer_members m WHERE m.grp = p_grp AND m.topic = p_topic AND m.holder = p_holder
    ), given AS (
        UPDATE delaywheel.consumer_leases l SET holder = NULL, expires_at = '-infinity'
        WHERE l.grp = p_grp AND l.topic = p_topic AND l.holder = p_holder
        RETURNING 1
    )
    SELECT count(*)::integer FROM given
$$;
