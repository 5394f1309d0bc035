-- Handles written before their layout carried a version said where a sandbox's processes
-- were with two flags; they become the current layout: a phase and `v` 2. A sandbox
-- recorded before its launch kept a JSON null, which becomes a handle of nothing launched.
UPDATE sandboxes
SET handle = '{"v":2,"pid":0,"start_ticks":0,"slot":0,"phase":"unlaunched"}'
WHERE CASE WHEN json_valid(handle) THEN json_type(handle) <> 'object' ELSE 1 END;

UPDATE sandboxes
SET handle = json_set(
    json_remove(handle, '$.released', '$.checkpointed'),
    '$.phase',
    COALESCE(
        json_extract(handle, '$.phase'),
        CASE
            WHEN json_extract(handle, '$.released') = 1 THEN 'released'
            WHEN json_extract(handle, '$.checkpointed') = 1 THEN 'checkpointed'
            ELSE 'running'
        END
    ),
    '$.v',
    2
)
WHERE json_extract(handle, '$.v') IS NULL;
