-- Templates made before builds were recorded (0004) have no build row, so their detail lists
-- no builds and their build status cannot be read. Give each ready one the build it was made by.
INSERT INTO template_builds (id, template_id, team_id, status, failure, spec, image, cpu_count, memory_mb, disk_size_mb, created_at, updated_at, finished_at)
SELECT t.build_id, t.id, t.team_id, t.build_status, NULL, NULL, t.image, t.cpu_count, t.memory_mb, t.disk_size_mb, t.created_at, t.updated_at, t.updated_at
FROM templates t
WHERE t.build_status = 'ready'
  AND NOT EXISTS (SELECT 1 FROM template_builds b WHERE b.template_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM template_builds b WHERE b.id = t.build_id);
