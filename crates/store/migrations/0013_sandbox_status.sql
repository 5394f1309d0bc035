-- A sandbox's status as the core's lifecycle names it (running, paused, shelved,
-- checkpointing, checkpointed, or pausing while a pause without memory ends its processes),
-- in place of a running/paused state and a separate pause kind.
ALTER TABLE sandboxes ADD COLUMN status TEXT NOT NULL DEFAULT 'running';
UPDATE sandboxes SET status = CASE
    WHEN state = 'running' THEN 'running'
    -- Paused before the kind was recorded: only pauses with memory existed then.
    WHEN paused_as IS NULL OR paused_as = 'memory' THEN 'paused'
    WHEN paused_as = 'files' THEN 'shelved'
    WHEN paused_as = 'checkpointing' THEN 'checkpointing'
    WHEN paused_as = 'checkpoint' THEN 'checkpointed'
    WHEN paused_as = 'releasing' THEN 'pausing'
    -- Unknown kinds stay unreadable, as they were.
    ELSE paused_as
END;
ALTER TABLE sandboxes DROP COLUMN state;
ALTER TABLE sandboxes DROP COLUMN paused_as;
