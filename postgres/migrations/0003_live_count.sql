-- The heartbeat returns how many processes' leases on the account are current (this one's
-- included): what a process's local share divides the account by while the database is out
-- of reach (`FailurePolicy::LiveShare`).

DROP FUNCTION llm_quota.heartbeat(bigint, text, text, text, bigint);

CREATE FUNCTION llm_quota.heartbeat(clock_override bigint, tag text, nodes_root text,
    me text, lease bigint) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.enter(tag, clock_override);
    swept bigint;
    live integer;
BEGIN
    PERFORM llm_quota.renew(nodes_root, me, now, lease);
    SELECT at INTO swept FROM llm_quota.sweeps WHERE sweeps.tag = heartbeat.tag;
    IF swept IS NULL OR now - swept > 60000 THEN
        PERFORM llm_quota.sweep(tag, nodes_root, now);
        INSERT INTO llm_quota.sweeps (tag, at) VALUES (tag, now)
        ON CONFLICT (tag) DO UPDATE SET at = excluded.at;
    END IF;
    SELECT count(*) INTO live FROM llm_quota.alive a WHERE a.root = nodes_root AND a.ends > now;
    RETURN live;
END $$;
