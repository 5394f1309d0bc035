-- The PostgreSQL schema, equivalent to the SQLite one at its migration 0013. Several API hosts
-- may share this database, so every uniqueness the store relies on is a constraint here.
--
-- Counts and sizes are BIGINT: the records hold them as u32 or u64, which INTEGER cannot carry
-- whole. JSON documents (metadata, network, images, handles) are TEXT: the store only writes
-- and reads them whole, and TEXT gives back exactly the bytes written, as SQLite does.

CREATE TABLE teams (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    -- The team's namespace in template names; a race between two hosts making teams of the
    -- same name ends in a unique violation for one of them.
    slug TEXT NOT NULL UNIQUE,
    max_concurrent_sandboxes BIGINT NOT NULL,
    max_sandbox_timeout_secs BIGINT NOT NULL,
    -- 0 means no limit.
    requests_per_minute BIGINT NOT NULL DEFAULT 0,
    -- Per-sandbox ceilings; 0 means only the server's own limits apply.
    max_vcpu BIGINT NOT NULL DEFAULT 0,
    max_memory_mb BIGINT NOT NULL DEFAULT 0,
    max_disk_mb BIGINT NOT NULL DEFAULT 0,
    created_at TIMESTAMPTZ NOT NULL
);

CREATE TABLE users (
    id TEXT PRIMARY KEY,
    created_at TIMESTAMPTZ NOT NULL
);

CREATE TABLE team_members (
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    is_default BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (team_id, user_id)
);
CREATE INDEX team_members_by_user ON team_members(user_id);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    mask_prefix TEXT NOT NULL,
    mask_suffix TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    last_used TIMESTAMPTZ,
    -- No foreign key: a key outlives the user who made it.
    created_by TEXT
);
CREATE INDEX api_keys_by_team ON api_keys(team_id, created_at);

CREATE TABLE access_tokens (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    token_hash TEXT NOT NULL UNIQUE,
    mask_prefix TEXT NOT NULL,
    mask_suffix TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    user_id TEXT REFERENCES users(id) ON DELETE CASCADE
);

CREATE TABLE templates (
    id TEXT PRIMARY KEY,
    team_id TEXT REFERENCES teams(id) ON DELETE CASCADE,
    public BOOLEAN NOT NULL,
    build_id TEXT NOT NULL,
    build_status TEXT NOT NULL,
    build_error TEXT,
    cpu_count BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    disk_size_mb BIGINT NOT NULL,
    envd_version TEXT NOT NULL,
    image TEXT,
    ready_build_id TEXT,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    last_spawned_at TIMESTAMPTZ,
    spawn_count BIGINT NOT NULL DEFAULT 0,
    build_count BIGINT NOT NULL DEFAULT 0
);

-- Names are unique within a team's namespace: `scope` is the owning team's id, '' for the
-- built-in templates.
CREATE TABLE template_aliases (
    scope TEXT NOT NULL,
    alias TEXT NOT NULL,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    PRIMARY KEY (scope, alias)
);
CREATE INDEX template_aliases_by_template ON template_aliases(template_id);

CREATE TABLE template_builds (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    team_id TEXT,
    status TEXT NOT NULL,
    failure TEXT,
    spec TEXT,
    image TEXT,
    cpu_count BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    disk_size_mb BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    finished_at TIMESTAMPTZ
);
CREATE INDEX builds_by_template ON template_builds(template_id, created_at DESC);

CREATE TABLE build_logs (
    build_id TEXT NOT NULL REFERENCES template_builds(id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    at TIMESTAMPTZ NOT NULL,
    level TEXT NOT NULL,
    step TEXT,
    message TEXT NOT NULL,
    PRIMARY KEY (build_id, seq)
);

CREATE TABLE build_tags (
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    build_id TEXT NOT NULL REFERENCES template_builds(id) ON DELETE CASCADE,
    tag TEXT NOT NULL,
    PRIMARY KEY (build_id, tag)
);
CREATE INDEX build_tags_by_template ON build_tags(template_id, tag);

CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    template_id TEXT NOT NULL,
    alias TEXT,
    started_at TIMESTAMPTZ NOT NULL,
    end_at TIMESTAMPTZ NOT NULL,
    cpu_count BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    disk_size_mb BIGINT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    allow_internet_access BOOLEAN NOT NULL,
    envd_access_token TEXT NOT NULL,
    envd_version TEXT NOT NULL,
    -- As the core's lifecycle names it: running, paused, shelved, checkpointing,
    -- checkpointed or pausing.
    status TEXT NOT NULL DEFAULT 'running',
    handle TEXT NOT NULL,
    network TEXT NOT NULL DEFAULT '{}',
    traffic_access_token TEXT,
    auto_pause BOOLEAN NOT NULL DEFAULT FALSE,
    auto_resume BOOLEAN NOT NULL DEFAULT FALSE,
    auto_pause_memory BOOLEAN NOT NULL DEFAULT TRUE,
    image TEXT
);
CREATE INDEX sandboxes_by_team ON sandboxes(team_id, started_at DESC, id DESC);

CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    UNIQUE (team_id, name)
);

-- A volume a sandbox still mounts cannot be deleted (RESTRICT); the rows go with their sandbox.
CREATE TABLE sandbox_volumes (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position BIGINT NOT NULL,
    volume_id TEXT NOT NULL REFERENCES volumes(id) ON DELETE RESTRICT,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);
CREATE INDEX sandbox_volumes_volume ON sandbox_volumes(volume_id);

-- Kept after the sandbox row is gone so a killed sandbox's logs stay readable until `ended_at`
-- is older than the retention period. Appends lock the row (UPDATE … RETURNING next_seq), so
-- two writers never number lines alike.
CREATE TABLE sandbox_log_sources (
    sandbox_id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    ended_at TIMESTAMPTZ,
    agent_log_offset BIGINT NOT NULL DEFAULT 0,
    next_seq BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX sandbox_log_sources_by_end ON sandbox_log_sources(ended_at);

-- `level` is 0 debug, 1 info, 2 warn, 3 error so a minimum level is one comparison.
CREATE TABLE sandbox_logs (
    sandbox_id TEXT NOT NULL REFERENCES sandbox_log_sources(sandbox_id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    at TIMESTAMPTZ NOT NULL,
    level BIGINT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
);
CREATE INDEX sandbox_logs_by_time ON sandbox_logs(sandbox_id, at);

-- Per team and 5-second bucket (`bucket` in Unix seconds): the most sandboxes running at once
-- and how many started.
CREATE TABLE team_metrics (
    team_id TEXT NOT NULL,
    bucket BIGINT NOT NULL,
    concurrent BIGINT NOT NULL,
    starts BIGINT NOT NULL,
    PRIMARY KEY (team_id, bucket)
);
CREATE INDEX team_metrics_by_bucket ON team_metrics(bucket);
