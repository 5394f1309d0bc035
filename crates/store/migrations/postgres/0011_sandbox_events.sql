-- Sandbox lifecycle events, in the order they were recorded (`seq`). `at` is Unix
-- microseconds; `body` the event as served, JSON. A team reads its own, newest or oldest
-- first, and the retention period prunes them by time.
CREATE TABLE sandbox_events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    team_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    type TEXT NOT NULL,
    at BIGINT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX sandbox_events_by_team ON sandbox_events(team_id, seq);
CREATE INDEX sandbox_events_by_sandbox ON sandbox_events(team_id, sandbox_id, seq);
CREATE INDEX sandbox_events_by_time ON sandbox_events(at);
