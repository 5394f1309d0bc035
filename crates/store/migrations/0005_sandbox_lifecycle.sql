-- Whether the sandbox pauses instead of stopping when its timeout passes.
ALTER TABLE sandboxes ADD COLUMN auto_pause INTEGER NOT NULL DEFAULT 0;
