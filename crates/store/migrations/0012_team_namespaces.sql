-- Template and snapshot names are unique within a team's namespace (its slug), not across
-- the server. `scope` is the owning team's id, '' for built-in templates.
ALTER TABLE teams ADD COLUMN slug TEXT;
CREATE UNIQUE INDEX teams_by_slug ON teams(slug);

CREATE TABLE template_names (
    scope TEXT NOT NULL,
    alias TEXT NOT NULL,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
    PRIMARY KEY (scope, alias)
);
INSERT OR IGNORE INTO template_names (scope, alias, template_id)
    SELECT COALESCE(t.team_id, ''), a.alias, a.template_id
    FROM template_aliases a JOIN templates t ON t.id = a.template_id;
DROP TABLE template_aliases;
ALTER TABLE template_names RENAME TO template_aliases;
CREATE INDEX template_aliases_by_template ON template_aliases(template_id);
