-- Nodes announce themselves with a lease; each sandbox names the node that runs it. Rows
-- from before nodes had names keep an empty one, which the next server on this data adopts.
ALTER TABLE sandboxes ADD COLUMN node_id TEXT NOT NULL DEFAULT '';
CREATE INDEX sandboxes_by_node ON sandboxes(node_id);

CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    report TEXT NOT NULL DEFAULT '{}'
);
