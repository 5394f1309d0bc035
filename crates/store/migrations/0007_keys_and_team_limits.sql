-- People behind access tokens. A user belongs to the teams it was made for; API keys remember
-- which user created them (none for keys made by the operator).
CREATE TABLE users (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL
);

CREATE TABLE team_members (
    team_id TEXT NOT NULL REFERENCES teams(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
    is_default INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (team_id, user_id)
);

CREATE INDEX team_members_by_user ON team_members(user_id);

ALTER TABLE access_tokens ADD COLUMN user_id TEXT REFERENCES users(id) ON DELETE CASCADE;

-- Tokens made before users existed each become their own user, a member of the token's team.
INSERT INTO users (id, created_at) SELECT id, created_at FROM access_tokens;
UPDATE access_tokens SET user_id = id;
INSERT INTO team_members (team_id, user_id, is_default) SELECT team_id, id, 1 FROM access_tokens;

-- No foreign key: a key outlives the user who made it.
ALTER TABLE api_keys ADD COLUMN created_by TEXT;

CREATE INDEX api_keys_by_team ON api_keys(team_id, created_at);

-- Per-sandbox resource ceilings of a team; 0 means only the server's own limits apply.
ALTER TABLE teams ADD COLUMN max_vcpu INTEGER NOT NULL DEFAULT 0;
ALTER TABLE teams ADD COLUMN max_memory_mb INTEGER NOT NULL DEFAULT 0;
ALTER TABLE teams ADD COLUMN max_disk_mb INTEGER NOT NULL DEFAULT 0;
