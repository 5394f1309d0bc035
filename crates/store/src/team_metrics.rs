//! Team activity buckets.

use sandbar_core::store::TeamMetricRecords;
use sandbar_core::{StoreError, TeamMetricBucket};

use crate::SqliteDb;
use crate::err;
use crate::rows::BucketRow;

/// Team activity buckets, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteTeamMetrics {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl TeamMetricRecords for SqliteTeamMetrics {
    async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        for b in buckets {
            sqlx::query(
                "INSERT INTO team_metrics (team_id, bucket, concurrent, starts) VALUES (?, ?, ?, ?) \
                 ON CONFLICT (team_id, bucket) DO UPDATE SET \
                 concurrent = MAX(concurrent, excluded.concurrent), starts = starts + excluded.starts",
            )
            .bind(&b.team_id)
            .bind(b.bucket)
            .bind(b.concurrent)
            .bind(b.starts)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn team_metrics(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, StoreError> {
        let rows = sqlx::query_as::<_, BucketRow>(
            "SELECT bucket, concurrent, starts FROM team_metrics WHERE team_id = ? AND bucket >= ? AND bucket <= ? ORDER BY bucket",
        )
        .bind(team_id)
        .bind(start)
        .bind(end)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?;
        rows.into_iter().map(|r| r.of_team(team_id)).collect()
    }

    async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM team_metrics WHERE bucket < ?")
            .bind(before)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }
}
