-- Requests per minute allowed to a team's API keys; 0 means no limit.
ALTER TABLE teams ADD COLUMN requests_per_minute INTEGER NOT NULL DEFAULT 0;
