-- Requests of each team per minute, summed over the processes of a cluster, so a team's
-- rate limit holds across API hosts and nodes.
CREATE TABLE team_request_windows (
    team_id TEXT NOT NULL,
    window_start BIGINT NOT NULL,
    requests BIGINT NOT NULL,
    PRIMARY KEY (team_id, window_start)
);
