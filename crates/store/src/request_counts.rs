//! Requests counted per team and minute across a cluster's processes.

use sandbar_core::StoreError;
use sandbar_core::store::RequestCountRecords;
use sqlx::PgPool;

use crate::backend::Write;
use crate::{SqliteDb, err};

/// Requests counted per team and minute across a cluster's processes, in either database.
#[derive(Debug, Clone)]
pub struct RequestCounts<B> {
    pub(crate) db: B,
}

// SQLite has no arrays: the counts go in as one JSON document.
impl RequestCounts<SqliteDb> {
    /// Adds `counts` to window `window`, giving back each team's total in it.
    async fn add(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, i64)>, StoreError> {
        // `WHERE true` tells SQLite's parser the upsert belongs to the INSERT, not the join.
        sqlx::query_as(
            "INSERT INTO team_request_windows (team_id, window_start, requests) \
             SELECT json_extract(value, '$[0]'), ?, json_extract(value, '$[1]') FROM json_each(?) WHERE true \
             ON CONFLICT (team_id, window_start) DO UPDATE SET requests = requests + excluded.requests \
             RETURNING team_id, requests",
        )
        .bind(window)
        .bind(serde_json::to_string(counts).map_err(err)?)
        .fetch_all(&self.db.writes)
        .await
        .map_err(err)
    }
}

impl RequestCounts<PgPool> {
    /// Adds `counts` to window `window`, giving back each team's total in it.
    async fn add(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let teams: Vec<&str> = counts.iter().map(|(team, _)| team.as_str()).collect();
        let requests = counts
            .iter()
            .map(|(_, n)| i64::try_from(*n).map_err(err))
            .collect::<Result<Vec<i64>, _>>()?;
        sqlx::query_as(
            "INSERT INTO team_request_windows (team_id, window_start, requests) \
             SELECT team, $2, n FROM UNNEST($1::text[], $3::bigint[]) AS counts(team, n) \
             ON CONFLICT (team_id, window_start) DO UPDATE \
             SET requests = team_request_windows.requests + excluded.requests \
             RETURNING team_id, requests",
        )
        .bind(&teams)
        .bind(window)
        .bind(&requests)
        .fetch_all(&self.db)
        .await
        .map_err(err)
    }
}

on_both! {
    #[async_trait::async_trait]
    impl RequestCountRecords for RequestCounts<B> {
        async fn add_team_requests(
            &self,
            window: i64,
            counts: &[(String, u64)],
        ) -> Result<Vec<(String, u64)>, StoreError> {
            if counts.is_empty() {
                return Ok(Vec::new());
            }
            self.add(window, counts)
                .await?
                .into_iter()
                .map(|(team, total)| Ok((team, u64::try_from(total).map_err(err)?)))
                .collect()
        }

        async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError> {
            sqlx::query("DELETE FROM team_request_windows WHERE window_start < $1")
                .bind(window)
                .write(&self.db)
                .await
        }
    }
}
