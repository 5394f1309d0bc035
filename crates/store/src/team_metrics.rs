//! Team activity buckets.

use sandbar_core::store::TeamMetricRecords;
use sandbar_core::{StoreError, TeamMetricBucket};

use crate::backend::{Backend, Transact, Write};
use crate::err;
use crate::rows::BucketRow;

/// Team activity buckets, in either database.
#[derive(Debug, Clone)]
pub struct TeamMetrics<B> {
    pub(crate) db: B,
}

on_both! {
    #[async_trait::async_trait]
    impl TeamMetricRecords for TeamMetrics<B> {
        async fn add_team_metrics(&self, buckets: &[TeamMetricBucket]) -> Result<(), StoreError> {
            // Rows are locked in one order by every host, so two hosts adding the same
            // buckets wait for each other instead of deadlocking.
            let mut sorted: Vec<&TeamMetricBucket> = buckets.iter().collect();
            sorted.sort_by(|a, b| (&a.team_id, a.bucket).cmp(&(&b.team_id, b.bucket)));
            let upserts = sorted.into_iter().map(|b| {
                // A CASE, as SQLite has no GREATEST.
                sqlx::query(
                    "INSERT INTO team_metrics (team_id, bucket, concurrent, starts) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (team_id, bucket) DO UPDATE SET \
                     concurrent = CASE WHEN excluded.concurrent > team_metrics.concurrent \
                       THEN excluded.concurrent ELSE team_metrics.concurrent END, \
                     starts = team_metrics.starts + excluded.starts",
                )
                .bind(&b.team_id)
                .bind(b.bucket)
                .bind(i64::from(b.concurrent))
                .bind(i64::from(b.starts))
            });
            self.db.write_all(upserts.collect()).await
        }

        async fn team_metrics(
            &self,
            team_id: &str,
            start: i64,
            end: i64,
        ) -> Result<Vec<TeamMetricBucket>, StoreError> {
            sqlx::query_as::<_, BucketRow>(
                "SELECT bucket, concurrent, starts FROM team_metrics WHERE team_id = $1 AND bucket >= $2 AND bucket <= $3 ORDER BY bucket",
            )
            .bind(team_id)
            .bind(start)
            .bind(end)
            .fetch_all(self.db.reads())
            .await
            .map_err(err)?
            .into_iter()
            .map(|r| r.of_team(team_id))
            .collect()
        }

        async fn prune_team_metrics(&self, before: i64) -> Result<u64, StoreError> {
            sqlx::query("DELETE FROM team_metrics WHERE bucket < $1")
                .bind(before)
                .write(&self.db)
                .await
        }
    }
}
