-- A team's webhooks: `events` is a JSON array of event type names; `secret` signs the
-- deliveries, so it is kept as given. Times are Unix microseconds.
CREATE TABLE webhooks (
    id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    name TEXT NOT NULL,
    url TEXT NOT NULL,
    enabled INTEGER NOT NULL,
    events TEXT NOT NULL,
    secret TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX webhooks_by_team ON webhooks(team_id, created_at);

-- Every attempt to deliver an event to a webhook, in the order made (`seq`).
CREATE TABLE webhook_deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL,
    webhook_id TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    status_code INTEGER,
    error TEXT,
    at INTEGER NOT NULL
);
CREATE INDEX webhook_deliveries_by_webhook ON webhook_deliveries(webhook_id, seq);
