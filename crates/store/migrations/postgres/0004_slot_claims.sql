-- Slots of a team's concurrency claimed by nodes for sandboxes they are starting, so the
-- team's limit holds across the nodes of a cluster.
CREATE TABLE slot_claims (
    sandbox_id TEXT PRIMARY KEY,
    team_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    claimed_until TIMESTAMPTZ NOT NULL
);
CREATE INDEX slot_claims_by_team ON slot_claims(team_id);
