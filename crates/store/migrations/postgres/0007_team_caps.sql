-- Ceilings on what a team keeps: snapshots and the MiB of their memory images, templates,
-- volumes and the MiB of their files, tags per template and API keys; 0 means no cap.
-- Teams made before get the defaults a new team gets.
ALTER TABLE teams
    ADD COLUMN max_snapshots BIGINT NOT NULL DEFAULT 100,
    ADD COLUMN max_snapshot_mb BIGINT NOT NULL DEFAULT 20480,
    ADD COLUMN max_templates BIGINT NOT NULL DEFAULT 100,
    ADD COLUMN max_volumes BIGINT NOT NULL DEFAULT 100,
    ADD COLUMN max_volume_mb BIGINT NOT NULL DEFAULT 51200,
    ADD COLUMN max_tags_per_template BIGINT NOT NULL DEFAULT 100,
    ADD COLUMN max_api_keys BIGINT NOT NULL DEFAULT 100;
