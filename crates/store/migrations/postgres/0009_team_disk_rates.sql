-- The rates a team's sandboxes' disk I/O is held to, MiB/s and operations/s by direction;
-- 0 leaves the node's own rate, which is what every team had before.
ALTER TABLE teams
    ADD COLUMN disk_read_mbps BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN disk_write_mbps BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN disk_read_iops BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN disk_write_iops BIGINT NOT NULL DEFAULT 0;
