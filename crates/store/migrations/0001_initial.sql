CREATE TABLE teams (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    max_concurrent_sandboxes INTEGER NOT NULL,
    max_sandbox_timeout_secs INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    mask_prefix TEXT NOT NULL,
    mask_suffix TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    last_used INTEGER
);

CREATE TABLE access_tokens (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    token_hash TEXT NOT NULL UNIQUE,
    mask_prefix TEXT NOT NULL,
    mask_suffix TEXT NOT NULL,
    created_at INTEGER NOT NULL
);

CREATE TABLE templates (
    id TEXT PRIMARY KEY,
    team_id TEXT REFERENCES teams(id) ON DELETE CASCADE,
    public INTEGER NOT NULL,
    build_id TEXT NOT NULL,
    build_status TEXT NOT NULL,
    build_error TEXT,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    envd_version TEXT NOT NULL,
    rootfs TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    last_spawned_at INTEGER,
    spawn_count INTEGER NOT NULL DEFAULT 0,
    build_count INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE template_aliases (
    alias TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE
);

CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    template_id TEXT NOT NULL,
    alias TEXT,
    started_at INTEGER NOT NULL,
    end_at INTEGER NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    allow_internet_access INTEGER NOT NULL,
    envd_access_token TEXT NOT NULL,
    envd_version TEXT NOT NULL,
    state TEXT NOT NULL,
    handle TEXT NOT NULL
);

CREATE INDEX sandboxes_by_team ON sandboxes(team_id, started_at DESC, id DESC);
