-- Operation records of the idempotency layer: a key in flight (claimed by an owner until its
-- lease ends) or completed (its answer kept until `expires`). Each operation on one key takes
-- the key's transaction-level advisory lock first, so claims of one key run one after another.
-- A completion or a release notifies the channel `llm_quota_operations` with the key, so that
-- the processes waiting for it look again.

CREATE TABLE llm_quota.operations (
    key text PRIMARY KEY,
    completed boolean NOT NULL,
    owner text NOT NULL,
    meta bytea,
    body bytea,
    expires bigint NOT NULL
);
CREATE INDEX operations_expiry ON llm_quota.operations (expires);

CREATE FUNCTION llm_quota.operation_lock(p_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('llm_quota:operation:' || p_key, 0));
    RETURN llm_quota.clock(NULL);
END $$;

-- CLAIM: `p_owner` claims `p_key` for `lease_ms`, or learns who has it: 'claimed',
-- 'in_flight', or 'completed' with the record's metadata and body.
CREATE FUNCTION llm_quota.claim(p_key text, p_owner text, lease_ms bigint,
    OUT state text, OUT meta bytea, OUT body bytea)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.operation_lock(p_key);
    r record;
BEGIN
    SELECT o.completed, o.meta, o.body INTO r FROM llm_quota.operations o
    WHERE o.key = p_key AND o.expires > now;
    IF FOUND THEN
        IF r.completed THEN
            state := 'completed';
            meta := r.meta;
            body := r.body;
        ELSE
            state := 'in_flight';
        END IF;
        RETURN;
    END IF;
    INSERT INTO llm_quota.operations (key, completed, owner, meta, body, expires)
    VALUES (p_key, false, p_owner, NULL, NULL, now + lease_ms)
    ON CONFLICT (key) DO UPDATE SET completed = false, owner = excluded.owner, meta = NULL,
        body = NULL, expires = excluded.expires;
    state := 'claimed';
END $$;

-- RENEW: extends `p_owner`'s claim on `p_key` to `lease_ms` from now; whether it still held it.
CREATE FUNCTION llm_quota.renew_claim(p_key text, p_owner text, lease_ms bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.operation_lock(p_key);
BEGIN
    UPDATE llm_quota.operations o SET expires = now + lease_ms
    WHERE o.key = p_key AND o.owner = p_owner AND NOT o.completed AND o.expires > now;
    RETURN FOUND;
END $$;

-- FINISH: completes (`ttl_ms` above zero, with the record) or releases `p_owner`'s claim on
-- `p_key`, and notifies the key's waiters. A claim whose lease lapsed with nobody else claiming
-- is still completed: the operation did complete. Whether anything was written.
CREATE FUNCTION llm_quota.finish_claim(p_key text, p_owner text, ttl_ms bigint, p_meta bytea,
    p_body bytea) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.operation_lock(p_key);
    r record;
    held boolean;
BEGIN
    SELECT o.completed, o.owner INTO r FROM llm_quota.operations o
    WHERE o.key = p_key AND o.expires > now;
    held := FOUND AND NOT r.completed AND r.owner = p_owner;
    IF NOT held AND NOT (NOT FOUND AND ttl_ms > 0) THEN
        RETURN false;
    END IF;
    DELETE FROM llm_quota.operations o WHERE o.key = p_key;
    IF ttl_ms > 0 THEN
        INSERT INTO llm_quota.operations (key, completed, owner, meta, body, expires)
        VALUES (p_key, true, p_owner, p_meta, p_body, now + ttl_ms);
    END IF;
    PERFORM pg_notify('llm_quota_operations', p_key);
    RETURN true;
END $$;

-- LOOK: whether `p_key` is in flight, and for how much longer (ms).
CREATE FUNCTION llm_quota.claim_state(p_key text, OUT in_flight boolean, OUT lasts_ms bigint)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.clock(NULL);
BEGIN
    SELECT NOT o.completed, o.expires - now INTO in_flight, lasts_ms
    FROM llm_quota.operations o WHERE o.key = p_key AND o.expires > now;
    in_flight := coalesce(in_flight, false);
    lasts_ms := coalesce(lasts_ms, 0);
END $$;

-- Deletes the records that lapsed.
CREATE FUNCTION llm_quota.sweep_operations() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    gone bigint;
BEGIN
    DELETE FROM llm_quota.operations WHERE expires <= llm_quota.clock(NULL);
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END $$;
