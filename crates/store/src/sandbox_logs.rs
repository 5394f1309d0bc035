//! Sandbox logs.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxLogRecords;
use sandbar_core::{SandboxLogEntry, SandboxLogQuery, StoreError};
use sqlx::PgPool;

use crate::backend::{Backend, Read, Write};
use crate::rows::{SandboxLogRow, big, level_rank, log_cursor_micros};
use crate::{SqliteDb, err, time, to_json};

/// Sandbox logs, in either database.
#[derive(Debug, Clone)]
pub struct SandboxLogs<B> {
    pub(crate) db: B,
}

// SQLite searches with instr where PostgreSQL has strpos (both case-sensitive, unlike LIKE
// and ILIKE), and only PostgreSQL must be told the type of a parameter it may see as NULL.
impl SandboxLogs<SqliteDb> {
    const FORWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
         WHERE sandbox_id = $1 AND level >= $2 AND ($3 IS NULL OR at >= $3) \
         AND ($4 IS NULL OR instr(message, $4) > 0) ORDER BY at, seq LIMIT $5";
    const BACKWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
         WHERE sandbox_id = $1 AND level >= $2 AND ($3 IS NULL OR at <= $3) \
         AND ($4 IS NULL OR instr(message, $4) > 0) ORDER BY at DESC, seq DESC LIMIT $5";

    /// A page's cursor, in microseconds, as the `at` column holds it.
    fn cursor(us: i64) -> i64 {
        us
    }
}

impl SandboxLogs<PgPool> {
    const FORWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
         WHERE sandbox_id = $1 AND level >= $2 AND ($3::timestamptz IS NULL OR at >= $3) \
         AND ($4::text IS NULL OR strpos(message, $4) > 0) ORDER BY at, seq LIMIT $5";
    const BACKWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
         WHERE sandbox_id = $1 AND level >= $2 AND ($3::timestamptz IS NULL OR at <= $3) \
         AND ($4::text IS NULL OR strpos(message, $4) > 0) ORDER BY at DESC, seq DESC LIMIT $5";

    /// A page's cursor, in microseconds, as the `at` column holds it.
    fn cursor(us: i64) -> DateTime<Utc> {
        time(us)
    }
}

on_both! {
    type Connection = <<B as Backend>::Db as sqlx::Database>::Connection;

    impl SandboxLogs<B> {
        async fn insert_log_lines(
            tx: &mut Connection,
            sandbox_id: &str,
            first_seq: i64,
            entries: &[SandboxLogEntry],
        ) -> Result<(), StoreError> {
            for (seq, entry) in (first_seq..).zip(entries) {
                sqlx::query(
                    "INSERT INTO sandbox_logs (sandbox_id, seq, at, level, message, fields) VALUES ($1, $2, $3, $4, $5, $6)",
                )
                .bind(sandbox_id)
                .bind(seq)
                .bind(B::time(entry.at))
                .bind(level_rank(entry.level))
                .bind(&entry.message)
                .bind(to_json(&entry.fields)?)
                .execute(&mut *tx)
                .await
                .map_err(err)?;
            }
            Ok(())
        }
    }

    #[async_trait::async_trait]
    impl SandboxLogRecords for SandboxLogs<B> {
        async fn open_sandbox_log(
            &self,
            sandbox_id: &str,
            team_id: &str,
            at: DateTime<Utc>,
            entries: &[SandboxLogEntry],
        ) -> Result<(), StoreError> {
            let mut tx = self.db.writes().begin().await.map_err(err)?;
            let opened = sqlx::query(
                "INSERT INTO sandbox_log_sources (sandbox_id, team_id, created_at, next_seq) VALUES ($1, $2, $3, $4) ON CONFLICT (sandbox_id) DO NOTHING",
            )
            .bind(sandbox_id)
            .bind(team_id)
            .bind(B::time(at))
            .bind(i64::try_from(entries.len()).map_err(err)?)
            .execute(&mut *tx)
            .await
            .map_err(err)?
            .rows_affected();
            if opened > 0 {
                Self::insert_log_lines(&mut tx, sandbox_id, 0, entries).await?;
            }
            tx.commit().await.map_err(err)
        }

        async fn sandbox_log_team(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
            sqlx::query_scalar("SELECT team_id FROM sandbox_log_sources WHERE sandbox_id = $1")
                .bind(sandbox_id)
                .fetch_optional(self.db.reads())
                .await
                .map_err(err)
        }

        async fn sandbox_log_offset(&self, sandbox_id: &str) -> Result<u64, StoreError> {
            let offset: Option<i64> = sqlx::query_scalar(
                "SELECT agent_log_offset FROM sandbox_log_sources WHERE sandbox_id = $1",
            )
            .bind(sandbox_id)
            .fetch_optional(self.db.reads())
            .await
            .map_err(err)?;
            Ok(offset.unwrap_or(0).max(0).unsigned_abs())
        }

        async fn append_sandbox_logs(
            &self,
            sandbox_id: &str,
            entries: &[SandboxLogEntry],
            agent_log_offset: Option<u64>,
            keep: u64,
        ) -> Result<(), StoreError> {
            let count = i64::try_from(entries.len()).map_err(err)?;
            let mut tx = self.db.writes().begin().await.map_err(err)?;
            // The update locks the source row until commit: appends from two hosts number
            // their lines one after the other.
            let next: Option<i64> = sqlx::query_scalar(
                "UPDATE sandbox_log_sources SET next_seq = next_seq + $1, agent_log_offset = COALESCE($2, agent_log_offset) WHERE sandbox_id = $3 RETURNING next_seq",
            )
            .bind(count)
            .bind(agent_log_offset.map(big))
            .bind(sandbox_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(err)?;
            let Some(next) = next else {
                return Ok(());
            };
            Self::insert_log_lines(&mut tx, sandbox_id, next - count, entries).await?;
            let oldest_kept = next - big(keep);
            if oldest_kept > 0 && !entries.is_empty() {
                sqlx::query("DELETE FROM sandbox_logs WHERE sandbox_id = $1 AND seq < $2")
                    .bind(sandbox_id)
                    .bind(oldest_kept)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
            }
            tx.commit().await.map_err(err)
        }

        async fn end_sandbox_log(
            &self,
            sandbox_id: &str,
            at: DateTime<Utc>,
        ) -> Result<(), StoreError> {
            sqlx::query(
                "UPDATE sandbox_log_sources SET ended_at = $1 WHERE sandbox_id = $2 AND ended_at IS NULL",
            )
            .bind(B::time(at))
            .bind(sandbox_id)
            .run(&self.db).await
        }

        async fn sandbox_logs(
            &self,
            sandbox_id: &str,
            query: &SandboxLogQuery,
        ) -> Result<Vec<SandboxLogEntry>, StoreError> {
            let sql = if query.forward {
                Self::FORWARD
            } else {
                Self::BACKWARD
            };
            sqlx::query_as::<_, SandboxLogRow<Time>>(sql)
                .bind(sandbox_id)
                .bind(query.min_level.map(level_rank).unwrap_or(0))
                .bind(log_cursor_micros(query).map(Self::cursor))
                .bind(&query.search)
                .bind(i64::from(query.limit))
                .all(&self.db)
                .await
        }

        async fn prune_sandbox_logs(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
            sqlx::query("DELETE FROM sandbox_log_sources WHERE ended_at < $1")
                .bind(B::time(before))
                .write(&self.db)
                .await
        }
    }
}
