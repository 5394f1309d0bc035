-- Handles written before their layout carried a version said where a sandbox's processes
-- were with two flags; they become the current layout: a phase and `v` 2. A sandbox
-- recorded before its launch kept a JSON null, which becomes a handle of nothing launched.
UPDATE sandboxes
SET handle = '{"v":2,"pid":0,"start_ticks":0,"slot":0,"phase":"unlaunched"}'
WHERE jsonb_typeof(handle::jsonb) <> 'object';

UPDATE sandboxes
SET handle = (
    (handle::jsonb - 'released' - 'checkpointed')
    || jsonb_build_object(
        'phase',
        COALESCE(
            handle::jsonb ->> 'phase',
            CASE
                WHEN handle::jsonb -> 'released' = 'true'::jsonb THEN 'released'
                WHEN handle::jsonb -> 'checkpointed' = 'true'::jsonb THEN 'checkpointed'
                ELSE 'running'
            END
        ),
        'v',
        2
    )
)::text
WHERE NOT (handle::jsonb ? 'v');
