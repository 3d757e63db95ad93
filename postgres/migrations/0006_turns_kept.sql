-- Turns kept (see `reserve.lua` of the Redis store, Turns, which this follows call for call):
-- the account's virtual time is the lowest start served last among the processes that asked
-- within their grace, so that an admission out of turn no longer pushes the others' starts up
-- to it; a clock leads it by at most 200 ms plus the request; the first in line keeps its
-- need until its grace ends, also when it comes back late; an admitted process keeps its
-- place for 10 ms, expected back; stamps are no longer rounded to the millisecond. A refusal's
-- commit no longer waits for the disk.

ALTER TABLE llm_quota.line ALTER COLUMN score TYPE double precision,
    ALTER COLUMN since TYPE double precision,
    ADD COLUMN kept boolean NOT NULL DEFAULT false;
-- `at`: where the process's last admission started on the virtual clock (the account's
-- virtual time for '~'); `vc`: its clock, that admission's stamp; `seen`: when it last asked.
ALTER TABLE llm_quota.clocks ADD COLUMN vc double precision NOT NULL DEFAULT 0,
    ADD COLUMN seen bigint NOT NULL DEFAULT 0;
CREATE INDEX clocks_expiry ON llm_quota.clocks (expires);

-- Deletes the rows of `p_tag` that read as absent (expired), and the leases on slots that
-- ended a minute ago with the slots taken under them; and the expired clocks of every
-- account (a clock is no tag's: read as absent, it is nobody's to keep).
CREATE OR REPLACE FUNCTION llm_quota.sweep(p_tag text, nodes_root text, now bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    DELETE FROM llm_quota.buckets WHERE tag = p_tag AND expires <= now;
    DELETE FROM llm_quota.holds WHERE tag = p_tag AND until_ms <= now;
    DELETE FROM llm_quota.plans WHERE tag = p_tag AND expires <= now;
    DELETE FROM llm_quota.records WHERE tag = p_tag AND expires <= now;
    DELETE FROM llm_quota.line WHERE tag = p_tag AND expires <= now;
    DELETE FROM llm_quota.days WHERE tag = p_tag AND expires <= now;
    DELETE FROM llm_quota.slots s WHERE s.tag = p_tag AND NOT EXISTS (
        SELECT 1 FROM llm_quota.alive a WHERE a.root = nodes_root
        AND a.process = split_part(s.id, '-', 1) AND a.ends >= now - 60000);
    DELETE FROM llm_quota.alive WHERE root = nodes_root AND ends < now - 60000;
    DELETE FROM llm_quota.clocks WHERE expires <= now;
END $$;

DROP FUNCTION llm_quota.line_up(text, text, text, integer, bigint, double precision, bigint,
    text[], bigint[], bigint);

-- Joins the line (or moves within it), to come back in `wait` ms needing `needs`; with
-- `next_stamp`, an admitted process keeping its place for `kept_ms`, expected back with a
-- request like its last (ranked at `next_stamp`). Back after such an admission, a request's
-- own stamp replaces the estimate; else the first stamp in line stays.
CREATE FUNCTION llm_quota.line_up(p_tag text, p_root text, me text, rank integer, now bigint,
    wait double precision, grace bigint, needs_keys text[], needs bigint[],
    stamp double precision, next_stamp double precision, kept_ms bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    came double precision;
    was_kept boolean;
    back bigint := now + wait::bigint;
BEGIN
    DELETE FROM llm_quota.line WHERE root = p_root AND process = me AND expires <= now;
    SELECT since, kept INTO came, was_kept FROM llm_quota.line
    WHERE root = p_root AND process = me;
    IF next_stamp IS NOT NULL THEN
        came := next_stamp;
    ELSIF was_kept THEN
        came := stamp;
    END IF;
    came := coalesce(came, stamp);
    INSERT INTO llm_quota.line AS l (root, process, tag, score, since, ready, until_ms,
        needs_keys, needs, expires, kept)
    VALUES (p_root, me, p_tag, rank::double precision * 17592186044416 + came, came, back,
        CASE WHEN next_stamp IS NOT NULL THEN now + kept_ms
             ELSE back + floor(wait / 25)::bigint + grace END,
        needs_keys, needs, now + wait::bigint + grace + 60000, next_stamp IS NOT NULL)
    ON CONFLICT (root, process) DO UPDATE SET score = excluded.score, since = excluded.since,
        ready = excluded.ready, until_ms = excluded.until_ms,
        needs_keys = excluded.needs_keys, needs = excluded.needs, expires = excluded.expires,
        kept = excluded.kept;
    UPDATE llm_quota.clocks c SET seen = now WHERE c.root = p_root AND c.process = me;
END $$;

-- A refusal writes only the line, which a crash may forget (the process asks again and lines
-- up anew): its commit does not wait for the log to reach the disk, so that the questions of
-- processes waiting their turn hold the account's lock for less than a disk's flush. An
-- admission's commit still waits (synchronous_commit is set for this transaction only).
CREATE FUNCTION llm_quota.refusal_commits_lazily() RETURNS void
LANGUAGE sql VOLATILE AS $$
    SELECT set_config('synchronous_commit', 'off', true);
$$;

CREATE OR REPLACE FUNCTION llm_quota.reserve(clock_override bigint, tag text, lease_ms bigint, me text,
    rank integer, accounts integer, grace bigint, bucket_keys text[], nums bigint[],
    dens bigint[], caps bigint[], costs bigint[], floors bigint[], record_key text,
    line_root text, nodes_root text, path text[], ctl_kinds text[], ctl_keys text[],
    ctl_fields text[], ctl_caps bigint[], ctl_amounts bigint[], part_ppm bigint DEFAULT 1000000,
    OUT decision text,
    OUT wait_ms bigint, OUT bucket_index integer, OUT by_hold boolean, OUT floor_only boolean,
    OUT first_in_line boolean, OUT control_index integer, OUT used_so_far bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    -- How far (virtual ms) a clock may lead the virtual time beyond its request, and how
    -- long (ms) an admitted process keeps its place in line.
    lead constant double precision := 200;
    kept_ms constant bigint := 10;
    v double precision := 0;
    now bigint := llm_quota.enter(tag, clock_override);
    n integer := coalesce(array_length(bucket_keys, 1), 0);
    takes_turns boolean := me <> '' AND accounts > 0;
    rec record;
    first_ record;
    used bigint;
    counted integer[] := '{}';
    toks double precision[] := '{}';
    tss bigint[] := '{}';
    helds double precision[] := '{}';
    loaded record;
    mine double precision;
    came double precision;
    ready bigint;
    enough boolean;
    need double precision;
    later double precision;
    wait double precision := 0;
    w double precision;
    hold double precision;
    held_at bigint;
    limiting integer := 0;
    holding boolean := false;
    short boolean := false;
    head text;
    tok double precision;
    needs bigint[] := '{}';
    c_ integer;
    -- The process's part of the account (a thousandth at least), the request's start and
    -- stamp on the processes' virtual clocks, and the milliseconds the account takes to
    -- refill its cost.
    part double precision := greatest(coalesce(part_ppm, 1000000), 1000) / 1e6;
    start_ double precision := 0;
    stamp double precision := 0;
    ms double precision := 0;
BEGIN
    SELECT r.settled INTO rec FROM llm_quota.records r
    WHERE r.key = record_key AND r.expires > now;
    IF FOUND THEN
        -- Settled already: it admits nothing again. Else a retried call whose first attempt
        -- was admitted: the decision stands.
        decision := CASE WHEN rec.settled THEN 'settled' ELSE 'admitted' END;
        RETURN;
    END IF;

    -- A paused node of the path refuses, whatever the buckets hold.
    FOR depth IN 1 .. coalesce(array_length(path, 1), 0) LOOP
        IF EXISTS (SELECT 1 FROM llm_quota.paused p
                   WHERE p.root = nodes_root AND p.node = path[depth]) THEN
            decision := 'paused';
            control_index := depth;
            RETURN;
        END IF;
    END LOOP;

    -- A spent cap refuses; a cap on calls in flight whose every slot is held waits.
    FOR c IN 1 .. coalesce(array_length(ctl_kinds, 1), 0) LOOP
        IF ctl_kinds[c] = 's' THEN
            IF llm_quota.slots_held(ctl_keys[c], nodes_root, now, ctl_caps[c]) >= ctl_caps[c] THEN
                decision := 'no_slot';
                control_index := c;
                RETURN;
            END IF;
            counted := counted || c;
        ELSIF ctl_amounts[c] > 0 THEN
            used := llm_quota.day_used(ctl_keys[c], ctl_fields[c], now);
            IF used + ctl_amounts[c] > ctl_caps[c] THEN
                decision := 'capped';
                control_index := c;
                used_so_far := used;
                RETURN;
            END IF;
            counted := counted || c;
        END IF;
    END LOOP;

    -- Every bucket's level now.
    FOR i IN 1 .. n LOOP
        IF costs[i] + floors[i] > caps[i] THEN
            decision := 'too_large';
            bucket_index := i;
            RETURN;
        END IF;
        SELECT * INTO loaded FROM llm_quota.load(bucket_keys[i], now, nums[i], dens[i],
            caps[i]::double precision * dens[i]);
        toks := toks || loaded.tok;
        tss := tss || loaded.ts;
        helds := helds || loaded.held;
    END LOOP;
    FOR i IN 1 .. least(accounts, n) LOOP
        needs := needs || (costs[i] + floors[i]);
    END LOOP;
    IF takes_turns THEN
        FOR i IN 1 .. least(accounts, n) LOOP
            ms := greatest(ms, costs[i]::double precision * dens[i] / nums[i]);
        END LOOP;
        v := coalesce((SELECT c.at FROM llm_quota.clocks c
                       WHERE c.root = line_root AND c.process = '~' AND c.expires > now), 0);
        -- A clock leads the virtual time by at most `lead` and this request.
        start_ := least(greatest(v,
            coalesce((SELECT c.vc FROM llm_quota.clocks c
                      WHERE c.root = line_root AND c.process = me AND c.expires > now), 0)),
            v + lead + ms / part);
        stamp := start_ + ms / part;
    END IF;

    -- Whose turn it is: the first process in line still expected back, unless this one would
    -- rank before it. Another's turn refuses this request unless the first keeps its need.
    IF takes_turns THEN
        SELECT CASE WHEN l.kept THEN NULL ELSE l.since END INTO came FROM llm_quota.line l
        WHERE l.root = line_root AND l.process = me AND l.expires > now;
        mine := rank::double precision * 17592186044416 + coalesce(came, stamp);
        LOOP
            SELECT l.process, l.score, l.ready, l.until_ms, l.needs_keys, l.needs INTO first_
            FROM llm_quota.line l WHERE l.root = line_root AND l.expires > now
            ORDER BY l.score, l.process LIMIT 1;
            EXIT WHEN NOT FOUND OR first_.process = me OR first_.score > mine;
            ready := first_.ready;
            IF first_.until_ms >= now THEN
                -- Expected back (also late: its process may be busy), it keeps its place and
                -- its need.
                -- Whether taking this cost now leaves, in every account bucket the first
                -- needs, its need by the instant it comes back (refill counted, capped).
                enough := true;
                FOR i IN 1 .. least(accounts, n) LOOP
                    need := NULL;
                    FOR j IN 1 .. coalesce(array_length(first_.needs_keys, 1), 0) LOOP
                        IF first_.needs_keys[j] = bucket_keys[i] THEN
                            need := first_.needs[j];
                        END IF;
                    END LOOP;
                    IF need IS NOT NULL THEN
                        later := toks[i] - costs[i]::double precision * dens[i]
                            + greatest(ready - now, 0) * nums[i]::double precision;
                        IF least(later, (caps[i] - helds[i]) * dens[i]) < need * dens[i] THEN
                            enough := false;
                        END IF;
                    END IF;
                END LOOP;
                EXIT WHEN enough;
                w := greatest(ready - now, 1);
                PERFORM llm_quota.line_up(tag, line_root, me, rank, now, w, grace,
                    bucket_keys[1:accounts], needs, stamp, NULL, kept_ms);
                PERFORM llm_quota.refusal_commits_lazily();
                decision := 'denied';
                wait_ms := w::bigint;
                bucket_index := 1;
                by_hold := false;
                floor_only := false;
                first_in_line := false;
                RETURN;
            END IF;
            -- It did not come back: it left the line (its requests ended, or it died).
            DELETE FROM llm_quota.line l WHERE l.root = line_root AND l.process = first_.process;
        END LOOP;
    END IF;

    FOR i IN 1 .. n LOOP
        tok := toks[i];
        need := (costs[i] + floors[i])::double precision * dens[i];
        IF tok < costs[i]::double precision * dens[i] THEN
            short := true;
        END IF;
        w := 0;
        IF tok < need THEN
            w := greatest(tss[i] - now, 0) + ceil((need - tok) / nums[i]);
        END IF;
        hold := 0;
        held_at := llm_quota.held_until(bucket_keys[i], now);
        IF held_at IS NOT NULL THEN
            -- A day at most, as written.
            hold := least(held_at - now, 86400000);
            short := true;
        END IF;
        IF greatest(w, hold) > wait THEN
            wait := greatest(w, hold);
            limiting := i;
            holding := hold >= w;
        END IF;
    END LOOP;
    IF limiting > 0 THEN
        -- Short of the account's capacity (not of a tenant node's, nor only of a floor, nor
        -- held by a provider's pause, which holds every process alike): in line.
        PERFORM llm_quota.refusal_commits_lazily();
        decision := 'denied';
        wait_ms := wait::bigint;
        bucket_index := limiting;
        by_hold := holding;
        floor_only := NOT short;
        first_in_line := false;
        IF takes_turns AND limiting <= accounts AND short AND NOT holding THEN
            PERFORM llm_quota.line_up(tag, line_root, me, rank, now, wait, grace,
                bucket_keys[1:accounts], needs, stamp, NULL, kept_ms);
            SELECT l.process INTO head FROM llm_quota.line l
            WHERE l.root = line_root AND l.expires > now ORDER BY l.score, l.process LIMIT 1;
            first_in_line := head = me;
        END IF;
        RETURN;
    END IF;

    FOR i IN 1 .. n LOOP
        tok := toks[i] - costs[i]::double precision * dens[i];
        PERFORM llm_quota.store(tag, bucket_keys[i], tok, tss[i], now, nums[i], dens[i],
            caps[i]::double precision * dens[i], helds[i], NULL);
    END LOOP;
    INSERT INTO llm_quota.records AS r (key, tag, settled, buckets, costs, expires)
    VALUES (record_key, tag, false, coalesce(bucket_keys, '{}'), coalesce(costs, '{}'),
            now + lease_ms)
    ON CONFLICT (key) DO UPDATE SET tag = excluded.tag, settled = false,
        buckets = excluded.buckets, costs = excluded.costs, expires = excluded.expires;
    -- The path's controls count the call: its period's use, its slot under its process's lease.
    FOREACH c_ IN ARRAY counted LOOP
        IF ctl_kinds[c_] = 's' THEN
            INSERT INTO llm_quota.slots (key, id, tag, taken)
            VALUES (ctl_keys[c_], ctl_fields[c_], tag, llm_quota.renew(nodes_root,
                split_part(ctl_fields[c_], '-', 1), now, ctl_amounts[c_]))
            ON CONFLICT (key, id) DO UPDATE SET taken = excluded.taken;
        ELSE
            PERFORM llm_quota.day_add(tag, ctl_keys[c_], ctl_fields[c_], ctl_amounts[c_], now);
        END IF;
    END LOOP;
    IF takes_turns THEN
        -- It keeps its place for `kept_ms`, expected back with a request like this one.
        PERFORM llm_quota.line_up(tag, line_root, me, rank, now, 0, grace,
            bucket_keys[1:accounts], needs, stamp, stamp + (stamp - start_), kept_ms);
        -- Its clock moves to the stamp; the account's virtual time to the lowest start served
        -- last among the processes that asked within their grace (the others are dropped).
        -- Forgotten a minute after the last question.
        INSERT INTO llm_quota.clocks AS c (root, process, at, vc, seen, expires)
        VALUES (line_root, me, start_, stamp, now, now + 65000)
        ON CONFLICT (root, process) DO UPDATE SET at = excluded.at, vc = excluded.vc,
            seen = excluded.seen, expires = excluded.expires;
        SELECT c.at, c.process INTO first_ FROM llm_quota.clocks c
        WHERE c.root = line_root AND c.process <> '~' AND c.expires > now
            AND c.seen + grace >= now
        ORDER BY c.at, c.process LIMIT 1;
        DELETE FROM llm_quota.clocks c WHERE c.root = line_root AND c.process <> '~'
            AND (c.expires <= now OR ((c.at, c.process) < (first_.at, first_.process)));
        v := greatest(v, first_.at);
        INSERT INTO llm_quota.clocks AS c (root, process, at, vc, seen, expires)
        VALUES (line_root, '~', v, 0, now, now + 65000)
        ON CONFLICT (root, process) DO UPDATE SET at = excluded.at, expires = excluded.expires;
    END IF;
    decision := 'admitted';
END $$;
