-- The cluster node a build runs on, so that a node's restart or stop fails only its own
-- unfinished builds, and a lost node's are failed by another.
ALTER TABLE template_builds ADD COLUMN node_id TEXT;
