-- The quota store: buckets, holds, plans, reservation records, the line of processes, the
-- tenant nodes' controls, and the leases of a fleet; each operation one function, called in
-- one statement.
--
-- Every function takes the transaction-level advisory lock of its tag (an account, or the
-- tenant plane its accounts share) before it reads anything, so the calls on one tag run one
-- after another, like a Redis script on its slot: no lost update, no deadlock (one lock per
-- transaction), and nothing held past the statement (safe behind a transaction pooler).
-- Times are milliseconds of the database's clock (`clock_timestamp()`, read once the lock is
-- held), never a caller's; `clock_override` exists for the crate's tests alone.
--
-- A row whose `expires` is past reads as absent: a bucket then is full, a record unknown. The
-- heartbeat deletes such rows of its tag once a minute.
--
-- Levels are integers: a unit (a request, a token) is `den` ticks, a millisecond adds `num`
-- ticks. Arithmetic runs in double precision, as the Redis scripts' Lua does, on whole numbers
-- below 2^53 (the client picks `den` so), so that both stores compute the same levels and
-- the same divisions as the crate's reference model (`budget::store::fleet`).

CREATE SCHEMA IF NOT EXISTS llm_quota;

-- A bucket: `units` whole units (negative: a debt) and `ticks` of a unit, refilled up to `ts`;
-- `held` what leases hold of it (it refills to its capacity less that).
CREATE TABLE llm_quota.buckets (
    key text PRIMARY KEY,
    tag text NOT NULL,
    units bigint NOT NULL,
    ticks bigint NOT NULL,
    den bigint NOT NULL,
    ts bigint NOT NULL,
    held bigint NOT NULL,
    expires bigint NOT NULL
);
CREATE INDEX buckets_expiry ON llm_quota.buckets (tag, expires);

-- A provider's pause of a bucket: nothing is admitted in it before `until_ms`.
CREATE TABLE llm_quota.holds (
    key text PRIMARY KEY,
    tag text NOT NULL,
    until_ms bigint NOT NULL
);
CREATE INDEX holds_expiry ON llm_quota.holds (tag, until_ms);

-- The fleet's adaptive plan of a bucket: the share of its amount the leasing processes plan
-- for, set at `at` after a 429, climbing back.
CREATE TABLE llm_quota.plans (
    key text PRIMARY KEY,
    tag text NOT NULL,
    share double precision NOT NULL,
    at bigint NOT NULL,
    expires bigint NOT NULL
);
CREATE INDEX plans_expiry ON llm_quota.plans (tag, expires);

-- A reservation: what it took of each bucket, until it is settled; then a tombstone
-- (`settled`), so that a duplicate settlement is recognised.
CREATE TABLE llm_quota.records (
    key text PRIMARY KEY,
    tag text NOT NULL,
    settled boolean NOT NULL,
    buckets text[] NOT NULL,
    costs bigint[] NOT NULL,
    expires bigint NOT NULL
);
CREATE INDEX records_expiry ON llm_quota.records (tag, expires);

-- The processes refused for want of an account's capacity, in the order their heads get their
-- turn (`score`: the class's rank times 2^44, plus when it was first refused), with when each
-- must come back, when it loses its turn, and what it needs of each account bucket.
CREATE TABLE llm_quota.line (
    root text NOT NULL,
    process text NOT NULL,
    tag text NOT NULL,
    score bigint NOT NULL,
    since bigint NOT NULL,
    ready bigint NOT NULL,
    until_ms bigint NOT NULL,
    needs_keys text[] NOT NULL,
    needs bigint[] NOT NULL,
    expires bigint NOT NULL,
    PRIMARY KEY (root, process)
);
CREATE INDEX line_order ON llm_quota.line (root, score, process);
CREATE INDEX line_expiry ON llm_quota.line (tag, expires);

-- The tenant nodes paused for every process.
CREATE TABLE llm_quota.paused (
    root text NOT NULL,
    node text NOT NULL,
    PRIMARY KEY (root, node)
);

-- Each process's lease on the in-flight slots it holds: it ends at `ends`, and began at
-- `start` (a slot counts while the lease it was taken under lasts).
CREATE TABLE llm_quota.alive (
    root text NOT NULL,
    process text NOT NULL,
    ends bigint NOT NULL,
    start bigint NOT NULL,
    PRIMARY KEY (root, process)
);

-- A tenant node's cap over a period: `period` (days or months since the epoch) and what it
-- used, or for a rolling day, what each quarter hour used (oldest first).
CREATE TABLE llm_quota.days (
    key text NOT NULL,
    field text NOT NULL,
    tag text NOT NULL,
    period bigint NOT NULL,
    used bigint NOT NULL,
    quarters bigint[] NOT NULL,
    amounts bigint[] NOT NULL,
    expires bigint NOT NULL,
    PRIMARY KEY (key, field)
);
CREATE INDEX days_expiry ON llm_quota.days (tag, expires);

-- A tenant node's calls in flight: a slot per reservation, taken under its process's lease.
CREATE TABLE llm_quota.slots (
    key text NOT NULL,
    id text NOT NULL,
    tag text NOT NULL,
    taken bigint NOT NULL,
    PRIMARY KEY (key, id)
);

-- The leases of a fleet: per process its claim and part; per process and bucket what it
-- holds and its credit (thousandths of a unit); per bucket the sum of the credits; per
-- account when it was last divided and each flow's spread then. An account's leases are
-- forgotten four leases after its last renewal (`share_roots.expires`).
CREATE TABLE llm_quota.shares (
    root text NOT NULL,
    process text NOT NULL,
    want double precision NOT NULL,
    ends bigint NOT NULL,
    part double precision NOT NULL,
    seq bigint NOT NULL,
    at bigint NOT NULL,
    flow_keys text[] NOT NULL,
    flow_weights double precision[] NOT NULL,
    PRIMARY KEY (root, process)
);
CREATE TABLE llm_quota.holdings (
    root text NOT NULL,
    process text NOT NULL,
    bucket text NOT NULL,
    held double precision NOT NULL,
    credit double precision NOT NULL,
    PRIMARY KEY (root, process, bucket)
);
CREATE TABLE llm_quota.share_sums (
    root text NOT NULL,
    bucket text NOT NULL,
    credits double precision NOT NULL,
    PRIMARY KEY (root, bucket)
);
CREATE TABLE llm_quota.share_roots (
    root text PRIMARY KEY,
    divided bigint,
    expires bigint NOT NULL
);
CREATE TABLE llm_quota.spreads (
    root text NOT NULL,
    flow text NOT NULL,
    n integer NOT NULL,
    PRIMARY KEY (root, flow)
);

-- When each tag's expired rows were last deleted.
CREATE TABLE llm_quota.sweeps (
    tag text PRIMARY KEY,
    at bigint NOT NULL
);

-- The database's clock in milliseconds (the override is for tests).
CREATE FUNCTION llm_quota.clock(clock_override bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(clock_override, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
$$;

-- Serialises the calls on `tag`, then reads the clock.
CREATE FUNCTION llm_quota.enter(tag text, clock_override bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('llm_quota:' || tag, 0));
    RETURN llm_quota.clock(clock_override);
END $$;

-- The bucket `p_key` in ticks of `den`, refilled up to `now`, and what leases hold of it
-- (units). Absent (or expired): full. Time going backwards adds nothing (`ts` only moves on).
CREATE FUNCTION llm_quota.load(p_key text, now bigint, num double precision,
    den double precision, full_ double precision,
    OUT tok double precision, OUT ts bigint, OUT held double precision)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    r record;
    top double precision;
    deficit double precision;
BEGIN
    SELECT b.units, b.ticks, b.den AS stored, b.ts, b.held INTO r
    FROM llm_quota.buckets b WHERE b.key = p_key AND b.expires > now;
    IF NOT FOUND OR r.stored = 0 THEN
        tok := full_; ts := now; held := 0;
        RETURN;
    END IF;
    held := r.held;
    tok := r.ticks;
    IF r.stored <> den THEN
        tok := floor(r.ticks * den / r.stored);
    END IF;
    top := full_ - held * den;
    tok := least(top, r.units * den + tok);
    ts := r.ts;
    IF now > ts THEN
        deficit := top - tok;
        IF deficit > 0 THEN
            IF (now - ts) > deficit / num THEN
                tok := top;
            ELSE
                tok := least(top, tok + (now - ts) * num);
            END IF;
        END IF;
        ts := now;
    END IF;
END $$;

-- Writes the bucket, to expire at its time to full (an absent bucket is a full one): the time
-- its level takes to refill to the whole capacity, the units leases hold counted as refilling
-- (taken when granted, they come back by refill once their holders are gone; expiring sooner
-- would hand them out again). While leases hold some of it, it is also kept at least `keep`
-- ms, and never less than it already was.
CREATE FUNCTION llm_quota.store(p_tag text, p_key text, tok double precision, ts bigint,
    now bigint, num double precision, den double precision, full_ double precision,
    held double precision, keep double precision) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    units double precision;
    ticks double precision;
    ttl double precision;
    kept bigint;
BEGIN
    held := coalesce(held, 0);
    IF tok >= full_ AND ts <= now AND held <= 0 THEN
        DELETE FROM llm_quota.buckets WHERE key = p_key;
        RETURN;
    END IF;
    units := floor(tok / den);
    ticks := tok - units * den;
    IF ticks < 0 THEN
        units := units - 1; ticks := ticks + den;
    ELSIF ticks >= den THEN
        units := units + 1; ticks := ticks - den;
    END IF;
    ttl := ceil(greatest(full_ - tok, 0) / num) + greatest(ts - now, 0) + 1000;
    IF held > 0 THEN
        SELECT b.expires - now INTO kept FROM llm_quota.buckets b
        WHERE b.key = p_key AND b.expires > now;
        ttl := greatest(ttl, coalesce(keep, 0), coalesce(kept, 0));
    END IF;
    INSERT INTO llm_quota.buckets AS b (key, tag, units, ticks, den, ts, held, expires)
    VALUES (p_key, p_tag, units::bigint, ticks::bigint, den::bigint, ts, held::bigint,
            now + ceil(ttl)::bigint)
    ON CONFLICT (key) DO UPDATE SET tag = excluded.tag, units = excluded.units,
        ticks = excluded.ticks, den = excluded.den, ts = excluded.ts, held = excluded.held,
        expires = excluded.expires;
END $$;

-- The fleet's adaptive plan of the bucket `p_key` at `now`: the share of its amount the
-- processes plan for, climbing back by `increase` a period of `period_ms`; 1 when none is set.
CREATE FUNCTION llm_quota.plan(p_key text, now bigint, increase double precision,
    period_ms double precision) RETURNS double precision
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    p record;
BEGIN
    SELECT share, at INTO p FROM llm_quota.plans WHERE key = p_key AND expires > now;
    IF NOT FOUND THEN
        RETURN 1;
    END IF;
    RETURN least(1, p.share + increase * greatest(now - p.at, 0) / period_ms);
END $$;

-- Where a provider's pause of the bucket `p_key` ends, if it holds at `now` (else NULL).
CREATE FUNCTION llm_quota.held_until(p_key text, now bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT until_ms FROM llm_quota.holds WHERE key = p_key AND until_ms > now
$$;

-- Controls of tenant nodes (see the crate's `controls` documentation): caps over a period
-- and calls in flight.

-- The calendar period holding `now` of a cap of kind `kind` ('c' a day, 'm' a month): days
-- since the epoch, or months (H. Hinnant's civil_from_days, on whole numbers).
CREATE FUNCTION llm_quota.period(kind text, now bigint) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE AS $$
#variable_conflict use_column
DECLARE
    days bigint := floor(now / 86400000.0);
    z bigint; era bigint; doe bigint; yoe bigint; doy bigint; mp bigint;
    month bigint; year bigint;
BEGIN
    IF kind = 'c' THEN
        RETURN days;
    END IF;
    z := days + 719468;
    era := floor(z / 146097.0);
    doe := z - era * 146097;
    yoe := (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    doy := doe - (365 * yoe + yoe / 4 - yoe / 100);
    mp := (5 * doy + 2) / 153;
    month := CASE WHEN mp < 10 THEN mp + 3 ELSE mp - 9 END;
    year := yoe + era * 400 + CASE WHEN month <= 2 THEN 1 ELSE 0 END;
    RETURN (year - 1970) * 12 + month - 1;
END $$;

-- What the cap `p_field` of the node days `p_key` has used at `now`.
CREATE FUNCTION llm_quota.day_used(p_key text, p_field text, now bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    d record;
    first bigint := floor(now / 900000.0) - 96 + 1;
    sum bigint := 0;
BEGIN
    SELECT * INTO d FROM llm_quota.days WHERE key = p_key AND field = p_field;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF left(p_field, 1) <> 'r' THEN
        IF d.period = llm_quota.period(left(p_field, 1), now) THEN
            RETURN d.used;
        END IF;
        RETURN 0;
    END IF;
    FOR i IN 1 .. coalesce(array_length(d.quarters, 1), 0) LOOP
        IF d.quarters[i] >= first AND d.amounts[i] > 0 THEN
            sum := sum + d.amounts[i];
        END IF;
    END LOOP;
    RETURN sum;
END $$;

-- Counts `delta` units at `now` in the cap `p_field` of the node days `p_key`; a negative
-- `delta` (a refund) is taken from the current period, or from the latest quarter hours,
-- never below zero.
CREATE FUNCTION llm_quota.day_add(p_tag text, p_key text, p_field text, delta bigint, now bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    kind text := left(p_field, 1);
    d record;
    first bigint := floor(now / 900000.0) - 96 + 1;
    q bigint := floor(now / 900000.0);
    qs bigint[] := '{}';
    amounts bigint[] := '{}';
    left_ bigint;
    taken bigint;
    n integer;
    kept_q bigint[] := '{}';
    kept_a bigint[] := '{}';
BEGIN
    IF delta = 0 THEN
        RETURN;
    END IF;
    IF kind <> 'r' THEN
        INSERT INTO llm_quota.days AS d (key, field, tag, period, used, quarters, amounts, expires)
        VALUES (p_key, p_field, p_tag, llm_quota.period(kind, now),
                greatest(llm_quota.day_used(p_key, p_field, now) + delta, 0), '{}', '{}',
                now + 62::bigint * 86400000)
        ON CONFLICT (key, field) DO UPDATE SET period = excluded.period, used = excluded.used,
            tag = excluded.tag, expires = excluded.expires;
        RETURN;
    END IF;
    SELECT * INTO d FROM llm_quota.days WHERE key = p_key AND field = p_field;
    IF FOUND THEN
        FOR i IN 1 .. coalesce(array_length(d.quarters, 1), 0) LOOP
            IF d.quarters[i] >= first AND d.amounts[i] > 0 THEN
                qs := qs || d.quarters[i];
                amounts := amounts || d.amounts[i];
            END IF;
        END LOOP;
    END IF;
    n := coalesce(array_length(qs, 1), 0);
    IF delta > 0 THEN
        IF n > 0 AND qs[n] = q THEN
            amounts[n] := amounts[n] + delta;
        ELSE
            qs := qs || q;
            amounts := amounts || delta;
        END IF;
    ELSE
        left_ := -delta;
        FOR i IN REVERSE n .. 1 LOOP
            taken := least(left_, amounts[i]);
            amounts[i] := amounts[i] - taken;
            left_ := left_ - taken;
        END LOOP;
    END IF;
    FOR i IN 1 .. coalesce(array_length(qs, 1), 0) LOOP
        IF amounts[i] > 0 THEN
            kept_q := kept_q || qs[i];
            kept_a := kept_a || amounts[i];
        END IF;
    END LOOP;
    INSERT INTO llm_quota.days AS d (key, field, tag, period, used, quarters, amounts, expires)
    VALUES (p_key, p_field, p_tag, 0, 0, kept_q, kept_a, now + 62::bigint * 86400000)
    ON CONFLICT (key, field) DO UPDATE SET quarters = excluded.quarters,
        amounts = excluded.amounts, tag = excluded.tag, expires = excluded.expires;
END $$;

-- Renews `p_process`'s lease in `p_root` until `now + lease`; returns the start of that lease
-- (`now` when it had ended, or was never taken).
CREATE FUNCTION llm_quota.renew(p_root text, p_process text, now bigint, lease bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    a record;
    begun bigint := now;
BEGIN
    SELECT ends, start INTO a FROM llm_quota.alive WHERE root = p_root AND process = p_process;
    IF FOUND AND a.ends > now THEN
        begun := a.start;
    END IF;
    INSERT INTO llm_quota.alive (root, process, ends, start)
    VALUES (p_root, p_process, now + lease, begun)
    ON CONFLICT (root, process) DO UPDATE SET ends = excluded.ends, start = excluded.start;
    RETURN begun;
END $$;

-- How many slots of `p_key` are held under leases that last, at most `max_` counted exactly:
-- below it, the count of rows is enough; at it, the slots whose lease ended are dropped.
CREATE FUNCTION llm_quota.slots_held(p_key text, p_root text, now bigint, max_ bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    held bigint;
    s record;
    counted bigint := 0;
BEGIN
    SELECT count(*) INTO held FROM llm_quota.slots WHERE key = p_key;
    IF held < max_ THEN
        RETURN held;
    END IF;
    FOR s IN
        SELECT sl.id, sl.taken, a.ends, a.start
        FROM llm_quota.slots sl
        LEFT JOIN llm_quota.alive a ON a.root = p_root AND a.process = split_part(sl.id, '-', 1)
        WHERE sl.key = p_key
    LOOP
        IF coalesce(s.ends, 0) > now AND coalesce(s.start, -1) = s.taken THEN
            counted := counted + 1;
        ELSE
            DELETE FROM llm_quota.slots WHERE key = p_key AND id = s.id;
        END IF;
    END LOOP;
    RETURN counted;
END $$;

-- Joins the line of `p_root` (or moves within it, by its request's class), to come back in
-- `wait` ms needing `needs` of each of the account buckets `needs_keys`.
CREATE FUNCTION llm_quota.line_up(p_tag text, p_root text, me text, rank integer, now bigint,
    wait double precision, grace bigint, needs_keys text[], needs bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    came bigint;
    back bigint := now + wait::bigint;
BEGIN
    DELETE FROM llm_quota.line WHERE root = p_root AND process = me AND expires <= now;
    SELECT since INTO came FROM llm_quota.line WHERE root = p_root AND process = me;
    came := coalesce(came, now);
    INSERT INTO llm_quota.line AS l (root, process, tag, score, since, ready, until_ms,
        needs_keys, needs, expires)
    VALUES (p_root, me, p_tag, rank::bigint * 17592186044416 + came, came, back,
        back + floor(wait / 25)::bigint + grace, needs_keys, needs,
        now + wait::bigint + grace + 60000)
    ON CONFLICT (root, process) DO UPDATE SET score = excluded.score, ready = excluded.ready,
        until_ms = excluded.until_ms, needs_keys = excluded.needs_keys,
        needs = excluded.needs, expires = excluded.expires;
END $$;

-- RESERVE: every touched bucket pays `costs` (leaving `floors` untouched), or none does; none
-- does while a bucket is held (a provider's pause), nor when it would delay the process whose
-- turn it is, nor while a node of the request's tenant path is paused, has spent its cap, or
-- has every slot of its in-flight cap taken.
--
-- Buckets: `bucket_keys` with their rates (`nums`, `dens`, `caps`), what the request takes
-- (`costs`) and leaves (`floors`); the first `accounts` are the account's. The path: its nodes
-- from the top (`path`). Controls: per control its kind ('s' slots, 'c' a calendar day, 'm' a
-- calendar month, 'r' a rolling day), key, field (for slots, the reservation id), cap, and the
-- amount it counts (the cost in the cap's dimension; for slots, the lease on them in ms).
--
-- Returns the `decision`: 'admitted'; 'denied' (not yet: it fits in `wait_ms`, `bucket_index`
-- the bucket that refills the longest, `by_hold` when its hold is what the wait is for,
-- `floor_only` when no bucket is held and every bucket holds the cost, `first_in_line` when
-- the process is first in line); 'too_large' (`bucket_index` can never hold the cost);
-- 'settled' (the id was settled already); 'paused' (the node at depth `control_index` of the
-- path); 'capped' (the cap `control_index` is spent, `used_so_far` of it used); 'no_slot'
-- (every slot of the cap `control_index` is held). Buckets, controls and depths count from 1.
--
-- Turns. A process refused for want of the account's capacity joins a line, ranked by its
-- request's class, then by when it was first refused, with what its request needs of each
-- account bucket. Until the instant it was told to come back (and 5 ms of slack), another
-- process is admitted only if the first would still find its need then; else it is refused,
-- told to come back then. A first that comes back late keeps its place but not what it waited
-- for; one that does not come back within its grace is dropped from the line.
CREATE FUNCTION llm_quota.reserve(clock_override bigint, tag text, lease_ms bigint, me text,
    rank integer, accounts integer, grace bigint, bucket_keys text[], nums bigint[],
    dens bigint[], caps bigint[], costs bigint[], floors bigint[], record_key text,
    line_root text, nodes_root text, path text[], ctl_kinds text[], ctl_keys text[],
    ctl_fields text[], ctl_caps bigint[], ctl_amounts bigint[], OUT decision text,
    OUT wait_ms bigint, OUT bucket_index integer, OUT by_hold boolean, OUT floor_only boolean,
    OUT first_in_line boolean, OUT control_index integer, OUT used_so_far bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    slack constant bigint := 5;
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
    mine bigint;
    came bigint;
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

    -- Whose turn it is: the first process in line still expected back, unless this one would
    -- rank before it. Another's turn refuses this request unless the first keeps its need.
    IF takes_turns THEN
        SELECT l.since INTO came FROM llm_quota.line l
        WHERE l.root = line_root AND l.process = me AND l.expires > now;
        mine := rank::bigint * 17592186044416 + coalesce(came, now);
        LOOP
            SELECT l.process, l.score, l.ready, l.until_ms, l.needs_keys, l.needs INTO first_
            FROM llm_quota.line l WHERE l.root = line_root AND l.expires > now
            ORDER BY l.score, l.process LIMIT 1;
            EXIT WHEN NOT FOUND OR first_.process = me OR first_.score > mine;
            ready := first_.ready;
            IF now <= ready + slack THEN
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
                    bucket_keys[1:accounts], needs);
                decision := 'denied';
                wait_ms := w::bigint;
                bucket_index := 1;
                by_hold := false;
                floor_only := false;
                first_in_line := false;
                RETURN;
            ELSIF first_.until_ms >= now THEN
                -- Late: it keeps its place in line, but what it waited for goes to whoever
                -- asks meanwhile.
                EXIT;
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
        decision := 'denied';
        wait_ms := wait::bigint;
        bucket_index := limiting;
        by_hold := holding;
        floor_only := NOT short;
        first_in_line := false;
        IF takes_turns AND limiting <= accounts AND short AND NOT holding THEN
            PERFORM llm_quota.line_up(tag, line_root, me, rank, now, wait, grace,
                bucket_keys[1:accounts], needs);
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
        DELETE FROM llm_quota.line l WHERE l.root = line_root AND l.process = me;
    END IF;
    decision := 'admitted';
END $$;

-- SETTLE: for each reservation, once, the actual cost replaces the reserved one. Unused
-- estimate is refunded, an overrun is charged as debt (down to one capacity below zero at
-- most; a deeper debt is kept and refills). Many reservations in one call; each bucket is read
-- and written once. The controls of its tenant path follow: its slots are given back (also
-- when its record expired, or was settled), its periods' counts take the difference.
--
-- Buckets: `b_keys` with their rates. Per reservation: its record `r_keys`, how many buckets
-- it touched (`r_touched`) and how many controls it has (`r_controls`); then, in one list for
-- every reservation in turn, each touched bucket's index (from 1), reserved and actual units,
-- and each control's kind, key, field and actual less reserved.
-- Returns per reservation: 1 settled, 0 already settled, 2 late (its record had expired: only
-- overruns are charged, nothing is refunded blind).
CREATE FUNCTION llm_quota.settle(clock_override bigint, tag text, tombstone_ms bigint,
    b_keys text[], b_nums bigint[], b_dens bigint[], b_caps bigint[], r_keys text[],
    r_touched integer[], r_controls integer[], t_buckets integer[], t_reserved bigint[],
    t_actual bigint[], c_kinds text[], c_keys text[], c_fields text[], c_deltas bigint[])
RETURNS integer[] LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.enter(tag, clock_override);
    nb integer := coalesce(array_length(b_keys, 1), 0);
    toks double precision[] := array_fill(NULL::double precision, ARRAY[nb]);
    tss bigint[] := array_fill(NULL::bigint, ARRAY[nb]);
    helds double precision[] := array_fill(NULL::double precision, ARRAY[nb]);
    loaded record;
    rec record;
    found_ boolean;
    late boolean;
    ti integer := 1;
    ci integer := 1;
    b integer;
    reserved bigint;
    delta bigint;
    full_ double precision;
    tok double precision;
    answers integer[] := '{}';
BEGIN
    FOR r IN 1 .. coalesce(array_length(r_keys, 1), 0) LOOP
        SELECT x.settled, x.buckets, x.costs INTO rec FROM llm_quota.records x
        WHERE x.key = r_keys[r] AND x.expires > now;
        found_ := FOUND;
        IF found_ AND rec.settled THEN
            answers := answers || 0;
            ti := ti + r_touched[r];
        ELSE
            late := NOT found_;
            FOR j IN 1 .. r_touched[r] LOOP
                b := t_buckets[ti];
                reserved := t_reserved[ti];
                IF NOT late THEN
                    -- What was taken from this bucket, as the record says.
                    reserved := 0;
                    FOR k IN 1 .. coalesce(array_length(rec.buckets, 1), 0) LOOP
                        IF rec.buckets[k] = b_keys[b] THEN
                            reserved := rec.costs[k];
                        END IF;
                    END LOOP;
                END IF;
                delta := t_actual[ti] - reserved;
                ti := ti + 1;
                IF delta > 0 OR (delta < 0 AND NOT late) THEN
                    full_ := b_caps[b]::double precision * b_dens[b];
                    IF toks[b] IS NULL THEN
                        SELECT * INTO loaded FROM llm_quota.load(b_keys[b], now, b_nums[b],
                            b_dens[b], full_);
                        toks[b] := loaded.tok;
                        tss[b] := loaded.ts;
                        helds[b] := loaded.held;
                    END IF;
                    tok := toks[b] - delta::double precision * b_dens[b];
                    IF delta > 0 THEN
                        -- An overrun's debt stops at one capacity; a deeper one is kept.
                        tok := greatest(tok, least(toks[b], -full_));
                    END IF;
                    toks[b] := least(full_ - helds[b] * b_dens[b], tok);
                END IF;
            END LOOP;
            -- A tombstone, so that a duplicate is recognised.
            INSERT INTO llm_quota.records AS x (key, tag, settled, buckets, costs, expires)
            VALUES (r_keys[r], tag, true, '{}', '{}', now + tombstone_ms)
            ON CONFLICT (key) DO UPDATE SET settled = true, buckets = '{}', costs = '{}',
                tag = excluded.tag, expires = excluded.expires;
            answers := answers || CASE WHEN late THEN 2 ELSE 1 END;
        END IF;
        FOR j IN 1 .. r_controls[r] LOOP
            IF c_kinds[ci] = 's' THEN
                DELETE FROM llm_quota.slots WHERE key = c_keys[ci] AND id = c_fields[ci];
            ELSIF NOT (found_ AND rec.settled)
                AND (c_deltas[ci] > 0 OR (c_deltas[ci] < 0 AND found_)) THEN
                PERFORM llm_quota.day_add(tag, c_keys[ci], c_fields[ci], c_deltas[ci], now);
            END IF;
            ci := ci + 1;
        END LOOP;
    END LOOP;
    FOR i IN 1 .. nb LOOP
        IF toks[i] IS NOT NULL THEN
            PERFORM llm_quota.store(tag, b_keys[i], toks[i], tss[i], now, b_nums[i], b_dens[i],
                b_caps[i]::double precision * b_dens[i], helds[i], NULL);
        END IF;
    END LOOP;
    RETURN answers;
END $$;

-- LOWER: what the provider reports. The level falls to `remaining` less what the leases hold
-- (never rises: other clients of the same account are invisible here). A pause (a 429) is a
-- hold: the instant before which no reservation touching this bucket is admitted. It leaves
-- the level alone, so the bucket keeps refilling. A later pause extends a hold; an earlier end
-- never shortens it. A pause that starts a hold also lowers the fleet's adaptive plan for the
-- limit (when `decrease` is given), once for every process: its share times `decrease`,
-- `min_share` at least; the leasing processes plan with it at their next renewal.
CREATE FUNCTION llm_quota.lower(clock_override bigint, tag text, bucket_key text, num bigint,
    den bigint, cap bigint, remaining bigint, pause_ms bigint, decrease double precision,
    min_share double precision, increase double precision, period_ms double precision)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.enter(tag, clock_override);
    full_ double precision := cap::double precision * den;
    loaded record;
    ends bigint;
    held bigint;
    share double precision;
    whole double precision;
BEGIN
    IF remaining IS NOT NULL THEN
        SELECT * INTO loaded FROM llm_quota.load(bucket_key, now, num, den, full_);
        PERFORM llm_quota.store(tag, bucket_key,
            least(loaded.tok, greatest(remaining - loaded.held, 0) * den), loaded.ts, now,
            num, den, full_, loaded.held, NULL);
    END IF;
    IF pause_ms > 0 THEN
        ends := now + pause_ms;
        held := llm_quota.held_until(bucket_key, now);
        IF decrease IS NOT NULL AND held IS NULL THEN
            share := greatest(min_share,
                llm_quota.plan(bucket_key, now, increase, period_ms) * decrease);
            -- Gone once the plan is whole again.
            whole := CASE WHEN increase > 0 THEN ceil((1 - share) / increase * period_ms) + 1
                          ELSE 86400000 END;
            INSERT INTO llm_quota.plans (key, tag, share, at, expires)
            VALUES (bucket_key, tag, share, now, now + whole::bigint)
            ON CONFLICT (key) DO UPDATE SET share = excluded.share, at = excluded.at,
                tag = excluded.tag, expires = excluded.expires;
        END IF;
        IF held IS NULL OR ends > held THEN
            INSERT INTO llm_quota.holds (key, tag, until_ms) VALUES (bucket_key, tag, ends)
            ON CONFLICT (key) DO UPDATE SET until_ms = excluded.until_ms, tag = excluded.tag;
        END IF;
    END IF;
END $$;

-- LIFT: ends the holds of `bucket_keys` now.
CREATE FUNCTION llm_quota.lift(tag text, bucket_keys text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM llm_quota.enter(tag, NULL);
    DELETE FROM llm_quota.holds WHERE key = ANY (bucket_keys);
END $$;

-- PAUSE: pauses (or resumes) the tenant node `node` for every process of `nodes_root`.
CREATE FUNCTION llm_quota.set_paused(tag text, nodes_root text, node text, paused boolean)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM llm_quota.enter(tag, NULL);
    IF paused THEN
        INSERT INTO llm_quota.paused (root, node) VALUES (nodes_root, node)
        ON CONFLICT DO NOTHING;
    ELSE
        DELETE FROM llm_quota.paused p WHERE p.root = nodes_root AND p.node = set_paused.node;
    END IF;
END $$;

-- DAYS: what tenant nodes' caps have used in their current period. Reads only.
CREATE FUNCTION llm_quota.days_used(clock_override bigint, keys text[], fields text[])
RETURNS bigint[] LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.clock(clock_override);
    used bigint[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        used := used || llm_quota.day_used(keys[i], fields[i], now);
    END LOOP;
    RETURN used;
END $$;

-- Deletes the rows of `p_tag` that read as absent (expired), and the leases on slots that
-- ended a minute ago with the slots taken under them.
CREATE FUNCTION llm_quota.sweep(p_tag text, nodes_root text, now bigint) RETURNS void
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
END $$;

-- HEARTBEAT: renews a process's lease on the slots it holds; once a minute, deletes what of
-- its tag expired.
CREATE FUNCTION llm_quota.heartbeat(clock_override bigint, tag text, nodes_root text,
    me text, lease bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now bigint := llm_quota.enter(tag, clock_override);
    swept bigint;
BEGIN
    PERFORM llm_quota.renew(nodes_root, me, now, lease);
    SELECT at INTO swept FROM llm_quota.sweeps WHERE sweeps.tag = heartbeat.tag;
    IF swept IS NULL OR now - swept > 60000 THEN
        PERFORM llm_quota.sweep(tag, nodes_root, now);
        INSERT INTO llm_quota.sweeps (tag, at) VALUES (tag, now)
        ON CONFLICT (tag) DO UPDATE SET at = excluded.at;
    END IF;
END $$;

-- Divides the account `p_root` anew between its live processes, by weighted max-min fairness
-- on what each wants: each flow (a tenant, or every request of a process without tenants)
-- weighs its weight spread evenly over the processes where it waits, a process the sum of its
-- flows' parts (1 when none waits); none gets more than it wants, those wanting more share
-- the rest by weight; a process is owed, of what it wants, the guarantees waiting in it, each
-- spread over the processes where it waits (scaled down together past the whole account), and
-- one whose part falls short of that is lifted to it, the others sharing the rest again; what
-- nobody wants is spread by weight over every process. Expired leases are dropped: what they
-- held leaves the buckets' `held` (`helds`, of the limits `l_keys` this call carries) without
-- coming back to their levels. Returns the limits' `held` and the sum of their credits
-- (`my_credit` being the caller's own).
CREATE FUNCTION llm_quota.divide(p_root text, me text, now bigint, l_keys text[],
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

    FOR e IN SELECT * FROM llm_quota.shares x WHERE x.root = p_root ORDER BY x.process LOOP
        weight := 0;
        owes := 0;
        n := 0;
        FOR i IN 1 .. coalesce(array_length(e.flow_keys, 1), 0) LOOP
            IF left(e.flow_keys[i], 1) = 'g' THEN
                owes := owes + greatest(e.flow_weights[i], 0) / 1e6 / (SELECT x.n FROM
                    llm_quota.spreads x WHERE x.root = p_root AND x.flow = e.flow_keys[i]);
            ELSE
                n := n + 1;
                weight := weight + greatest(e.flow_weights[i], 1) / (SELECT x.n FROM
                    llm_quota.spreads x WHERE x.root = p_root AND x.flow = e.flow_keys[i]);
            END IF;
        END LOOP;
        who := who || e.process;
        wants := wants || e.want;
        weights := weights || CASE WHEN n > 0 THEN weight ELSE 1 END;
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
    INSERT INTO llm_quota.share_roots (root, divided, expires) VALUES (p_root, now, now)
    ON CONFLICT (root) DO UPDATE SET divided = excluded.divided;
END $$;

-- LEASE: a process's grant of the account, for a while (the arithmetic of the crate's
-- `budget::store::fleet`, in the same order). A grant is a debit: the units granted leave the
-- account's bucket at once, and the process admits only units it holds. What it holds is
-- counted in the bucket (`held`) until the process says it spent or gave them back, or its
-- lease ends: the bucket refills to its capacity less what leases hold, so that the bucket and
-- the leases together never hold more than the capacity. Every failure errs toward less: a
-- process that dies, stalls past its lease or loses a reply takes what it held with it (lost
-- until the bucket refills it), and a renewal that arrives after a later one changes nothing.
--
-- `want`: the fraction of the account the process wants (0 to 1; negative: it leaves); `every`:
-- how often (ms) the account is divided again; `seq`: the renewal's number. Per limit: its
-- bucket, its plan's increase per period and its period, its rate, and the process's report
-- (`keep` the units it keeps of what it held, negative a debt charged to the bucket; `back` the
-- units it gives back; `need` the units its first waiting request lacks, granted in every limit
-- at once or in none; `ask` what it would like beyond). Its waiting flows (keys and weights)
-- and guarantees (keys starting with 'g', and their shares in millionths).
--
-- Returns the `renewal` ('renewed'; 'new' for a process the store did not know; 'left'; 'stale'
-- for a renewal older than one already seen, which changed nothing) and, renewed: how long the
-- lease lasts, the process's part in millionths, per limit its hold's remaining ms, the fleet's
-- plan in millionths and the units granted, how soon (ms) a need not granted should be covered
-- (0 when granted), and per flow and guarantee the number of processes where it waits.
CREATE FUNCTION llm_quota.lease(clock_override bigint, tag text, root text, me text,
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
            WHERE x.root = lease.root AND x.flow = flow_keys[i]), 1);
    END LOOP;
END $$;
