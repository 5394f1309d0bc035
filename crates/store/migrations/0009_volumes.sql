-- Team-owned persistent volumes. Only a hash of each volume's content token is kept.
CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (team_id, name)
);

-- Which volumes a recorded sandbox mounts. A volume a sandbox still mounts cannot be deleted
-- (RESTRICT); the rows go with their sandbox.
CREATE TABLE sandbox_volumes (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    volume_id TEXT NOT NULL REFERENCES volumes(id) ON DELETE RESTRICT,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);

CREATE INDEX sandbox_volumes_volume ON sandbox_volumes(volume_id);
