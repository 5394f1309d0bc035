-- How a paused sandbox is kept: 'memory' (frozen in place), 'files' (its processes ended,
-- only its files kept), 'checkpointing' or 'checkpoint' (written to disk with CRIU). NULL
-- while running, and for sandboxes paused before this column,
-- which were all paused with their memory.
ALTER TABLE sandboxes ADD COLUMN paused_as TEXT;
-- Whether a pause on timeout keeps the memory (autoPauseMemory).
ALTER TABLE sandboxes ADD COLUMN auto_pause_memory INTEGER NOT NULL DEFAULT 1;
-- The image (layers, environment, user, start command) the sandbox booted from, as JSON, so
-- that a sandbox paused without memory boots again on what it started from.
ALTER TABLE sandboxes ADD COLUMN image TEXT;
