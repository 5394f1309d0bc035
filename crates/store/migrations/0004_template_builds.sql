-- A template's image is the JSON of its last successful build's layers and defaults; the old
-- rootfs column stays unused.
ALTER TABLE templates ADD COLUMN image TEXT;
ALTER TABLE templates ADD COLUMN ready_build_id TEXT;

CREATE TABLE template_builds (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    team_id TEXT,
    status TEXT NOT NULL,
    failure TEXT,
    spec TEXT,
    image TEXT,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    finished_at INTEGER
);
CREATE INDEX builds_by_template ON template_builds(template_id, created_at DESC);

CREATE TABLE build_logs (
    build_id TEXT NOT NULL REFERENCES template_builds(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    at INTEGER NOT NULL,
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
