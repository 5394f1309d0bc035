//! Requests counted per team and minute across a cluster's processes.

use sandbar_core::StoreError;
use sandbar_core::store::RequestCountRecords;
use sqlx::PgPool;

use crate::err;

/// Requests counted per team and minute across a cluster's processes, in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgRequestCounts {
    pub(crate) pool: PgPool,
}

#[async_trait::async_trait]
impl RequestCountRecords for PgRequestCounts {
    async fn add_team_requests(
        &self,
        window: i64,
        counts: &[(String, u64)],
    ) -> Result<Vec<(String, u64)>, StoreError> {
        if counts.is_empty() {
            return Ok(Vec::new());
        }
        let teams: Vec<&str> = counts.iter().map(|(team, _)| team.as_str()).collect();
        let requests = counts
            .iter()
            .map(|(_, n)| i64::try_from(*n).map_err(err))
            .collect::<Result<Vec<i64>, _>>()?;
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "INSERT INTO team_request_windows (team_id, window_start, requests) \
             SELECT team, $2, n FROM UNNEST($1::text[], $3::bigint[]) AS counts(team, n) \
             ON CONFLICT (team_id, window_start) DO UPDATE \
             SET requests = team_request_windows.requests + excluded.requests \
             RETURNING team_id, requests",
        )
        .bind(&teams)
        .bind(window)
        .bind(&requests)
        .fetch_all(&self.pool)
        .await
        .map_err(err)?;
        rows.into_iter()
            .map(|(team, total)| Ok((team, u64::try_from(total).map_err(err)?)))
            .collect()
    }

    async fn prune_team_requests(&self, window: i64) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM team_request_windows WHERE window_start < $1")
            .bind(window)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(done.rows_affected())
    }
}
