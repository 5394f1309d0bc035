-- A team's slots are counted on every create in a cluster: by team, status and node from the
-- index alone, without reading each of the team's sandbox rows.
CREATE INDEX sandboxes_by_team_status ON sandboxes(team_id, status, node_id, id);
