-- Ceilings on what a team keeps: snapshots and the MiB of their memory images, templates,
-- volumes and the MiB of their files, tags per template and API keys; 0 means no cap.
-- Teams made before get the defaults a new team gets.
ALTER TABLE teams ADD COLUMN max_snapshots INTEGER NOT NULL DEFAULT 100;
ALTER TABLE teams ADD COLUMN max_snapshot_mb INTEGER NOT NULL DEFAULT 20480;
ALTER TABLE teams ADD COLUMN max_templates INTEGER NOT NULL DEFAULT 100;
ALTER TABLE teams ADD COLUMN max_volumes INTEGER NOT NULL DEFAULT 100;
ALTER TABLE teams ADD COLUMN max_volume_mb INTEGER NOT NULL DEFAULT 51200;
ALTER TABLE teams ADD COLUMN max_tags_per_template INTEGER NOT NULL DEFAULT 100;
ALTER TABLE teams ADD COLUMN max_api_keys INTEGER NOT NULL DEFAULT 100;
