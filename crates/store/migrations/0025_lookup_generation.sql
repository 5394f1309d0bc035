-- One number raised by every change that an answer cached by a server could depend on: a
-- team (its limits, its slug), an API key's secret or team, a template, its names, its builds
-- and their tags. Triggers raise it, so a change made by any process (another server, the
-- admin commands) is seen; a server compares this one row instead of reading the records.
-- Spawn counters and a key's last use are left out: they change with every create and no
-- cached answer depends on them.
CREATE TABLE lookup_generation (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    generation INTEGER NOT NULL
);
INSERT INTO lookup_generation (id, generation) VALUES (1, 0);

CREATE TRIGGER lookups_team_inserted AFTER INSERT ON teams
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_team_updated AFTER UPDATE ON teams
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_team_deleted AFTER DELETE ON teams
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;

CREATE TRIGGER lookups_api_key_inserted AFTER INSERT ON api_keys
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_api_key_updated AFTER UPDATE OF key_hash, team_id ON api_keys
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_api_key_deleted AFTER DELETE ON api_keys
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;

CREATE TRIGGER lookups_template_inserted AFTER INSERT ON templates
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_template_updated AFTER UPDATE OF id, team_id, public, build_id,
    build_status, build_error, cpu_count, memory_mb, disk_size_mb, envd_version, image,
    ready_build_id, created_at, updated_at, build_count ON templates
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_template_deleted AFTER DELETE ON templates
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;

CREATE TRIGGER lookups_alias_inserted AFTER INSERT ON template_aliases
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_alias_updated AFTER UPDATE ON template_aliases
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_alias_deleted AFTER DELETE ON template_aliases
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;

CREATE TRIGGER lookups_build_inserted AFTER INSERT ON template_builds
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_build_updated AFTER UPDATE OF id, template_id, status, image,
    finished_at ON template_builds
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_build_deleted AFTER DELETE ON template_builds
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;

CREATE TRIGGER lookups_build_tag_inserted AFTER INSERT ON build_tags
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_build_tag_updated AFTER UPDATE ON build_tags
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
CREATE TRIGGER lookups_build_tag_deleted AFTER DELETE ON build_tags
BEGIN UPDATE lookup_generation SET generation = generation + 1; END;
