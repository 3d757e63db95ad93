-- Tenants divide a leased account by tenant first, whatever the processes their requests
-- reach (the crate's `budget::store::fleet::allocate`): each waiting flow gets its weighted
-- part of the account, a flow with a guarantee of its own lifted to it when that part is less
-- (the others sharing the rest by weight); its part is spread evenly over the processes where
-- it waits, and a process weighs what its flows' parts add up to, times the flows' total
-- weight. Only a guarantee of a node above the flows is still owed by the processes where it
-- waits. Each renewal tells, per flow, its weight in the process (`spreads.n` of a flow now
-- holds it, 0 when unknown), and per guarantee its spread, as before.

CREATE OR REPLACE FUNCTION llm_quota.divide(p_root text, me text, now bigint, l_keys text[],
    my_credit double precision[], INOUT helds double precision[],
    OUT credits double precision[])
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    nl integer := coalesce(array_length(l_keys, 1), 0);
    who text[] := '{}';
    wants double precision[] := '{}';
    weights double precision[] := '{}';
    owed double precision[] := '{}';
    parts double precision[] := '{}';
    lifted boolean[] := '{}';
    e record;
    h record;
    n integer;
    weight double precision;
    owes double precision;
    owed_total double precision := 0;
    left_ double precision;
    total double precision;
    per_weight double precision;
    wanting integer[];
    still integer[];
    satisfied boolean;
    short boolean;
    need double precision;
    p integer;
    -- By flow: its key, weight, guarantee of its own, whether lifted to it, and its part.
    fkeys text[] := '{}';
    fws double precision[] := '{}';
    ffloors double precision[] := '{}';
    flifted boolean[] := '{}';
    fparts double precision[] := '{}';
    ftotal double precision := 0;
    fweight double precision;
    floors double precision := 0;
    pos integer;
BEGIN
    credits := array_fill(0::double precision, ARRAY[nl]);
    DELETE FROM llm_quota.spreads x WHERE x.root = p_root;
    DELETE FROM llm_quota.shares x WHERE x.root = p_root AND x.ends <= now;
    FOR e IN SELECT * FROM llm_quota.shares x WHERE x.root = p_root ORDER BY x.process LOOP
        FOR i IN 1 .. coalesce(array_length(e.flow_keys, 1), 0) LOOP
            INSERT INTO llm_quota.spreads (root, flow, n) VALUES (p_root, e.flow_keys[i], 1)
            ON CONFLICT (root, flow) DO UPDATE SET n = llm_quota.spreads.n + 1;
        END LOOP;
    END LOOP;
    FOR h IN SELECT x.process, x.bucket, x.held, x.credit FROM llm_quota.holdings x
             WHERE x.root = p_root LOOP
        n := array_position(l_keys, h.bucket);
        IF NOT EXISTS (SELECT 1 FROM llm_quota.shares x
                       WHERE x.root = p_root AND x.process = h.process) THEN
            DELETE FROM llm_quota.holdings x
            WHERE x.root = p_root AND x.process = h.process AND x.bucket = h.bucket;
            IF n IS NOT NULL AND h.process <> me THEN
                helds[n] := greatest(helds[n] - h.held, 0);
            END IF;
        ELSIF n IS NOT NULL AND h.process <> me THEN
            credits[n] := credits[n] + h.credit;
        END IF;
    END LOOP;
    FOR i IN 1 .. nl LOOP
        credits[i] := credits[i] + my_credit[i];
    END LOOP;

    -- By tenant first: each flow's weighted part of the account, a flow with a guarantee of
    -- its own lifted to it when that part is less, the others sharing the rest by weight.
    FOR e IN SELECT * FROM llm_quota.shares x WHERE x.root = p_root ORDER BY x.process LOOP
        FOR i IN 1 .. coalesce(array_length(e.flow_keys, 1), 0) LOOP
            IF left(e.flow_keys[i], 1) <> 'g' THEN
                pos := array_position(fkeys, e.flow_keys[i]);
                IF pos IS NULL THEN
                    fkeys := fkeys || e.flow_keys[i];
                    fws := fws || greatest(e.flow_weights[i], 1);
                    ffloors := ffloors || 0::double precision;
                    flifted := flifted || false;
                    fparts := fparts || 0::double precision;
                ELSE
                    fws[pos] := greatest(fws[pos], greatest(e.flow_weights[i], 1));
                END IF;
            END IF;
        END LOOP;
    END LOOP;
    FOR e IN SELECT * FROM llm_quota.shares x WHERE x.root = p_root ORDER BY x.process LOOP
        FOR i IN 1 .. coalesce(array_length(e.flow_keys, 1), 0) LOOP
            IF left(e.flow_keys[i], 1) = 'g' THEN
                pos := array_position(fkeys, substr(e.flow_keys[i], 2));
                IF pos IS NOT NULL THEN
                    ffloors[pos] := greatest(ffloors[pos], greatest(e.flow_weights[i], 0) / 1e6);
                END IF;
            END IF;
        END LOOP;
    END LOOP;
    FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
        ftotal := ftotal + fws[f];
        floors := floors + ffloors[f];
    END LOOP;
    IF floors > 1 THEN
        FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
            ffloors[f] := ffloors[f] / floors;
        END LOOP;
    END IF;
    LOOP
        left_ := 1;
        fweight := 0;
        FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
            IF flifted[f] THEN
                left_ := left_ - ffloors[f];
            ELSE
                fweight := fweight + fws[f];
            END IF;
        END LOOP;
        FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
            IF flifted[f] THEN
                fparts[f] := ffloors[f];
            ELSE
                fparts[f] := greatest(left_, 0) * fws[f] / fweight;
            END IF;
        END LOOP;
        short := false;
        FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
            IF NOT flifted[f] AND fparts[f] + 1e-12 < ffloors[f] THEN
                flifted[f] := true;
                short := true;
            END IF;
        END LOOP;
        EXIT WHEN NOT short;
    END LOOP;

    FOR e IN SELECT * FROM llm_quota.shares x WHERE x.root = p_root ORDER BY x.process LOOP
        weight := 0;
        owes := 0;
        n := 0;
        FOR i IN 1 .. coalesce(array_length(e.flow_keys, 1), 0) LOOP
            IF left(e.flow_keys[i], 1) = 'g' THEN
                -- A guarantee above the flows (no flow's own): owed where it waits.
                IF array_position(fkeys, substr(e.flow_keys[i], 2)) IS NULL THEN
                    owes := owes + greatest(e.flow_weights[i], 0) / 1e6 / (SELECT x.n FROM
                        llm_quota.spreads x WHERE x.root = p_root AND x.flow = e.flow_keys[i]);
                END IF;
            ELSE
                n := n + 1;
                weight := weight + fparts[array_position(fkeys, e.flow_keys[i])] * ftotal
                    / (SELECT x.n FROM llm_quota.spreads x
                       WHERE x.root = p_root AND x.flow = e.flow_keys[i]);
            END IF;
        END LOOP;
        who := who || e.process;
        wants := wants || e.want;
        -- A millionth at least: its flows may get nothing (guarantees took all).
        weights := weights || CASE WHEN n > 0 THEN greatest(weight, 1e-6) ELSE 1 END;
        owed := owed || least(owes, e.want);
        owed_total := owed_total + least(owes, e.want);
        parts := parts || 0::double precision;
        lifted := lifted || false;
    END LOOP;
    n := coalesce(array_length(who, 1), 0);
    IF owed_total > 1 THEN
        FOR p IN 1 .. n LOOP
            owed[p] := owed[p] / owed_total;
        END LOOP;
    END IF;
    LOOP
        left_ := 1;
        FOR p IN 1 .. n LOOP
            IF lifted[p] THEN
                parts[p] := owed[p];
                left_ := left_ - owed[p];
            END IF;
        END LOOP;
        -- Weighted max-min fairness of what is left over the processes not lifted.
        wanting := '{}';
        FOR p IN 1 .. n LOOP
            IF NOT lifted[p] THEN
                parts[p] := 0;
                IF wants[p] > 0 THEN
                    wanting := wanting || p;
                END IF;
            END IF;
        END LOOP;
        WHILE coalesce(array_length(wanting, 1), 0) > 0 AND left_ > 1e-9 LOOP
            total := 0;
            FOREACH p IN ARRAY wanting LOOP
                total := total + weights[p];
            END LOOP;
            per_weight := left_ / total;
            still := '{}';
            satisfied := false;
            FOREACH p IN ARRAY wanting LOOP
                need := wants[p] - parts[p];
                IF need <= per_weight * weights[p] THEN
                    parts[p] := wants[p];
                    left_ := left_ - need;
                    satisfied := true;
                ELSE
                    still := still || p;
                END IF;
            END LOOP;
            IF NOT satisfied THEN
                FOREACH p IN ARRAY still LOOP
                    parts[p] := parts[p] + per_weight * weights[p];
                END LOOP;
                left_ := 0;
                still := '{}';
            END IF;
            wanting := still;
        END LOOP;
        left_ := greatest(left_, 0);
        -- Those whose part falls short of what they are owed are lifted to it.
        short := false;
        FOR p IN 1 .. n LOOP
            IF NOT lifted[p] AND parts[p] + 1e-12 < owed[p] THEN
                lifted[p] := true;
                short := true;
            END IF;
        END LOOP;
        EXIT WHEN NOT short;
    END LOOP;
    total := 0;
    FOR p IN 1 .. n LOOP
        total := total + weights[p];
    END LOOP;
    FOR p IN 1 .. n LOOP
        IF left_ > 1e-9 THEN
            parts[p] := parts[p] + left_ * weights[p] / total;
        END IF;
        UPDATE llm_quota.shares x SET part = parts[p] WHERE x.root = p_root AND x.process = who[p];
    END LOOP;
    -- Told with every renewal: each flow's weight in the processes where it waits (its part
    -- over its spread, in units of the flows' total weight times 840).
    FOR f IN 1 .. coalesce(array_length(fkeys, 1), 0) LOOP
        UPDATE llm_quota.spreads x
        SET n = greatest(floor(fparts[f] * ftotal * 840 / x.n + 0.5), 1)::integer
        WHERE x.root = p_root AND x.flow = fkeys[f];
    END LOOP;
    INSERT INTO llm_quota.share_roots (root, divided, expires) VALUES (p_root, now, now)
    ON CONFLICT (root) DO UPDATE SET divided = excluded.divided;
END $$;

CREATE OR REPLACE FUNCTION llm_quota.lease(clock_override bigint, tag text, root text, me text,
    lease_ms bigint, want double precision, every bigint, seq bigint, l_keys text[],
    l_incs double precision[], l_periods double precision[], l_nums bigint[], l_dens bigint[],
    l_caps bigint[], l_keeps bigint[], l_backs bigint[], l_needs bigint[], l_asks bigint[],
    flow_keys text[], flow_weights double precision[], OUT renewal text, OUT lasts_ms bigint,
    OUT part_ppm bigint, OUT hold_ms bigint[], OUT plan_ppm bigint[], OUT granted_units bigint[],
    OUT ready_ms bigint, OUT spread bigint[])
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.enter(tag, clock_override);
    nl integer := coalesce(array_length(l_keys, 1), 0);
    keep_ms bigint := lease_ms * 4;
    meta record;
    me_row record;
    known boolean;
    divided bigint;
    -- Per limit: the bucket's level, refill instant and what leases hold; this process's
    -- holding and credit, the sum of every credit; what it keeps, and may take.
    toks double precision[] := '{}';
    tss bigint[] := '{}';
    helds double precision[] := '{}';
    mines double precision[] := '{}';
    credit double precision[] := '{}';
    credits double precision[] := '{}';
    keeps bigint[] := l_keeps;
    may double precision[] := '{}';
    loaded record;
    h record;
    kept double precision;
    full_ double precision;
    entry_part double precision := 0;
    entry_at bigint := now;
    part double precision;
    since double precision;
    whole boolean := true;
    before double precision;
    grown double precision;
    pool double precision;
    unclaimed double precision;
    granted double precision;
    ready double precision := 0;
    filled double precision;
    per_ms double precision;
    owed double precision;
BEGIN
    -- An account whose leases nobody renewed for four leases forgets them.
    SELECT * INTO meta FROM llm_quota.share_roots s WHERE s.root = lease.root;
    IF FOUND AND meta.expires <= now THEN
        DELETE FROM llm_quota.shares s WHERE s.root = lease.root;
        DELETE FROM llm_quota.holdings s WHERE s.root = lease.root;
        DELETE FROM llm_quota.share_sums s WHERE s.root = lease.root;
        DELETE FROM llm_quota.spreads s WHERE s.root = lease.root;
        DELETE FROM llm_quota.share_roots s WHERE s.root = lease.root;
    ELSIF FOUND THEN
        divided := meta.divided;
    END IF;
    SELECT * INTO me_row FROM llm_quota.shares s WHERE s.root = lease.root AND s.process = me;
    known := FOUND;
    IF known AND seq <= me_row.seq THEN
        renewal := 'stale';
        RETURN;
    END IF;

    -- Every limit's bucket, and what this process held of it; its report applied.
    FOR i IN 1 .. nl LOOP
        IF want < 0 THEN
            -- Leaving, it keeps nothing (but a debt).
            keeps[i] := least(keeps[i], 0);
        END IF;
        full_ := l_caps[i]::double precision * l_dens[i];
        SELECT * INTO loaded FROM llm_quota.load(l_keys[i], now, l_nums[i], l_dens[i], full_);
        SELECT x.held, x.credit INTO h FROM llm_quota.holdings x
        WHERE x.root = lease.root AND x.process = me AND x.bucket = l_keys[i];
        mines := mines || coalesce(h.held, 0);
        credit := credit || coalesce(h.credit, 0);
        credits := credits || coalesce((SELECT x.credits FROM llm_quota.share_sums x
            WHERE x.root = lease.root AND x.bucket = l_keys[i]), 0);
        IF NOT known THEN
            -- A process the store does not know holds nothing it can tell (what a row left
            -- behind still holds stays counted, the safe side).
            mines[i] := 0;
            credit[i] := 0;
        END IF;
        toks := toks || loaded.tok;
        tss := tss || loaded.ts;
        helds := helds || loaded.held;
        -- A debt is charged to the bucket (one capacity at most), what it keeps stays held,
        -- what it gives back comes back, never above what the leases leave.
        IF keeps[i] < 0 THEN
            toks[i] := greatest(toks[i] + keeps[i]::double precision * l_dens[i],
                least(toks[i], -full_));
        END IF;
        kept := greatest(keeps[i], 0);
        helds[i] := greatest(helds[i] - mines[i] + kept, 0);
        mines[i] := kept;
        toks[i] := least(toks[i] + l_backs[i]::double precision * l_dens[i],
            full_ - helds[i] * l_dens[i]);
    END LOOP;

    IF want < 0 THEN
        FOR i IN 1 .. nl LOOP
            credits[i] := greatest(credits[i] - credit[i], 0);
            DELETE FROM llm_quota.holdings x
            WHERE x.root = lease.root AND x.process = me AND x.bucket = l_keys[i];
            INSERT INTO llm_quota.share_sums (root, bucket, credits)
            VALUES (lease.root, l_keys[i], credits[i])
            ON CONFLICT (root, bucket) DO UPDATE SET credits = excluded.credits;
            PERFORM llm_quota.store(tag, l_keys[i], toks[i], tss[i], now, l_nums[i], l_dens[i],
                l_caps[i]::double precision * l_dens[i], helds[i], keep_ms);
        END LOOP;
        DELETE FROM llm_quota.shares s WHERE s.root = lease.root AND s.process = me;
        INSERT INTO llm_quota.share_roots (root, divided, expires)
        VALUES (lease.root, divided, now + keep_ms)
        ON CONFLICT (root) DO UPDATE SET expires = excluded.expires;
        renewal := 'left';
        RETURN;
    END IF;
    want := least(want, 1);
    IF known THEN
        entry_part := me_row.part;
        entry_at := me_row.at;
        renewal := 'renewed';
    ELSE
        renewal := 'new';
    END IF;
    INSERT INTO llm_quota.shares (root, process, want, ends, part, seq, at, flow_keys,
        flow_weights)
    VALUES (lease.root, me, want, now + lease_ms, entry_part, seq, entry_at,
        coalesce(flow_keys, '{}'), coalesce(flow_weights, '{}'))
    ON CONFLICT (root, process) DO UPDATE SET want = excluded.want, ends = excluded.ends,
        seq = excluded.seq, flow_keys = excluded.flow_keys, flow_weights = excluded.flow_weights;

    IF divided IS NULL OR now - divided >= every OR now < divided THEN
        SELECT * INTO h FROM llm_quota.divide(lease.root, me, now, l_keys, credit, helds);
        helds := h.helds;
        credits := h.credits;
        SELECT s.part INTO entry_part FROM llm_quota.shares s
        WHERE s.root = lease.root AND s.process = me;
    END IF;

    -- Granting: the credits grow (in thousandths of a unit), then what each limit may give.
    part := floor(entry_part * 1e6 + 0.5) / 1e6;
    since := greatest(now - entry_at, 0);
    FOR i IN 1 .. nl LOOP
        before := credit[i];
        grown := credit[i] + l_backs[i]::double precision * 1000
            + floor(part * l_nums[i] / l_dens[i] * since * 1000);
        credit[i] := least(grown, greatest(floor(part * l_caps[i] * 1000),
            l_needs[i]::double precision * 1000));
        credits[i] := greatest(credits[i] - before + credit[i], 0);
        pool := greatest(floor(toks[i] / l_dens[i]), 0);
        unclaimed := greatest(pool - floor((credits[i] - credit[i]) / 1000), 0);
        IF toks[i] + l_dens[i] > l_caps[i]::double precision * l_dens[i] - helds[i] * l_dens[i] THEN
            -- The bucket is full: its refill is lost while the credits wait for it, so
            -- whoever asks may take it.
            unclaimed := pool;
        END IF;
        may := may || least(pool, floor(credit[i] / 1000) + unclaimed);
        IF l_needs[i] > may[i] THEN
            whole := false;
        END IF;
    END LOOP;
    UPDATE llm_quota.shares s SET at = now WHERE s.root = lease.root AND s.process = me;
    INSERT INTO llm_quota.share_roots (root, divided, expires)
    VALUES (lease.root, NULL, now + keep_ms)
    ON CONFLICT (root) DO UPDATE SET expires = excluded.expires;

    lasts_ms := lease_ms;
    part_ppm := floor(part * 1e6 + 0.5)::bigint;
    hold_ms := '{}';
    plan_ppm := '{}';
    granted_units := '{}';
    spread := '{}';
    FOR i IN 1 .. nl LOOP
        hold_ms := hold_ms
            || least(coalesce(llm_quota.held_until(l_keys[i], now) - now, 0), 86400000);
        plan_ppm := plan_ppm || floor(llm_quota.plan(l_keys[i], now, l_incs[i], l_periods[i])
            * 1e6 + 0.5)::bigint;
    END LOOP;
    FOR i IN 1 .. nl LOOP
        granted := 0;
        IF whole THEN
            granted := l_needs[i] + greatest(least(l_asks[i], may[i] - l_needs[i]), 0);
        END IF;
        before := credit[i];
        credit[i] := greatest(credit[i] - granted * 1000, 0);
        credits[i] := greatest(credits[i] - before + credit[i], 0);
        toks[i] := toks[i] - granted * l_dens[i];
        helds[i] := helds[i] + granted;
        mines[i] := mines[i] + granted;
        INSERT INTO llm_quota.holdings (root, process, bucket, held, credit)
        VALUES (lease.root, me, l_keys[i], mines[i], credit[i])
        ON CONFLICT (root, process, bucket) DO UPDATE SET held = excluded.held,
            credit = excluded.credit;
        INSERT INTO llm_quota.share_sums (root, bucket, credits)
        VALUES (lease.root, l_keys[i], credits[i])
        ON CONFLICT (root, bucket) DO UPDATE SET credits = excluded.credits;
        PERFORM llm_quota.store(tag, l_keys[i], toks[i], tss[i], now, l_nums[i], l_dens[i],
            l_caps[i]::double precision * l_dens[i], helds[i], keep_ms);
        granted_units := granted_units || granted::bigint;
    END LOOP;
    -- When the need was not granted: how soon the bucket, or this process's credit, should
    -- cover it, for every limit that lacked it.
    IF NOT whole THEN
        FOR i IN 1 .. nl LOOP
            IF l_needs[i] > may[i] THEN
                filled := ceil(greatest(l_needs[i]::double precision * l_dens[i] - toks[i], 0)
                    / l_nums[i]);
                per_ms := part * l_nums[i] / l_dens[i] * 1000;
                owed := filled;
                IF per_ms > 0 THEN
                    owed := ceil(greatest(l_needs[i]::double precision * 1000 - credit[i], 0)
                        / per_ms);
                END IF;
                ready := greatest(ready, least(filled, owed));
            END IF;
        END LOOP;
    END IF;
    ready_ms := ready::bigint;
    FOR i IN 1 .. coalesce(array_length(flow_keys, 1), 0) LOOP
        spread := spread || coalesce((SELECT x.n::bigint FROM llm_quota.spreads x
            WHERE x.root = lease.root AND x.flow = flow_keys[i]),
            CASE WHEN left(flow_keys[i], 1) = 'g' THEN 1 ELSE 0 END);
    END LOOP;
END $$;
