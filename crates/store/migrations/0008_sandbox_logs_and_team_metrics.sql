-- Which team a sandbox's logs belong to, kept after the sandbox row is gone so a killed
-- sandbox's logs stay readable until `ended_at` is older than the retention period.
-- `agent_log_offset` is how far the agent's log file has been read; `next_seq` numbers the
-- sandbox's lines so the oldest can be dropped once there are too many.
CREATE TABLE sandbox_log_sources (
    sandbox_id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    ended_at INTEGER,
    agent_log_offset INTEGER NOT NULL DEFAULT 0,
    next_seq INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sandbox_log_sources_by_end ON sandbox_log_sources(ended_at);

-- `level` is 0 debug, 1 info, 2 warn, 3 error so a minimum level is one comparison.
CREATE TABLE sandbox_logs (
    sandbox_id TEXT NOT NULL REFERENCES sandbox_log_sources(sandbox_id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    at INTEGER NOT NULL,
    level INTEGER NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
);
CREATE INDEX sandbox_logs_by_time ON sandbox_logs(sandbox_id, at);

-- Per team and 5-second bucket (`bucket` in Unix seconds): the most sandboxes running at once
-- and how many started.
CREATE TABLE team_metrics (
    team_id TEXT NOT NULL,
    bucket INTEGER NOT NULL,
    concurrent INTEGER NOT NULL,
    starts INTEGER NOT NULL,
    PRIMARY KEY (team_id, bucket)
);
CREATE INDEX team_metrics_by_bucket ON team_metrics(bucket);
