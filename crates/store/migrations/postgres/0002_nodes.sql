-- Nodes announce themselves with a lease; each sandbox names the node that runs it.
ALTER TABLE sandboxes ADD COLUMN node_id TEXT NOT NULL DEFAULT '';
CREATE INDEX sandboxes_by_node ON sandboxes(node_id);

CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    started_at TIMESTAMPTZ NOT NULL,
    lease_until TIMESTAMPTZ NOT NULL,
    report TEXT NOT NULL DEFAULT '{}'
);
