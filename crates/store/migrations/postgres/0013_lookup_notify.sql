-- Every change that an answer cached by an API host could depend on (a team, an API key's
-- secret or team, a template, its names, its builds and their tags) notifies channel
-- `sandbar_lookups` when it commits; each host listens and drops what it cached. Spawn
-- counters and a key's last use are left out: they change with every create and no cached
-- answer depends on them. Notifications of one transaction are folded into one.
CREATE FUNCTION sandbar_lookups_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sandbar_lookups', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER lookups_teams AFTER INSERT OR UPDATE OR DELETE ON teams
    FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
CREATE TRIGGER lookups_api_keys AFTER INSERT OR DELETE OR UPDATE OF key_hash, team_id
    ON api_keys FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
CREATE TRIGGER lookups_templates AFTER INSERT OR DELETE OR UPDATE OF id, team_id, public,
    build_id, build_status, build_error, cpu_count, memory_mb, disk_size_mb, envd_version,
    image, ready_build_id, created_at, updated_at, build_count
    ON templates FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
CREATE TRIGGER lookups_template_aliases AFTER INSERT OR UPDATE OR DELETE ON template_aliases
    FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
CREATE TRIGGER lookups_template_builds AFTER INSERT OR DELETE
    OR UPDATE OF id, template_id, status, image, finished_at
    ON template_builds FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
CREATE TRIGGER lookups_build_tags AFTER INSERT OR UPDATE OR DELETE ON build_tags
    FOR EACH STATEMENT EXECUTE FUNCTION sandbar_lookups_changed();
