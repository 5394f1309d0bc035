-- Whether traffic through the edge resumes the sandbox when it is paused.
ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
