//! Sandbox logs.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxLogRecords;
use sandbar_core::{SandboxLogEntry, SandboxLogQuery, StoreError};

use crate::rows::{SandboxLogRow, level_rank, log_cursor_micros};
use crate::{SqliteDb, err, micros, to_json};

/// Sandbox logs, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteSandboxLogs {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl SandboxLogRecords for SqliteSandboxLogs {
    async fn open_sandbox_log(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: &[SandboxLogEntry],
    ) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        let opened = sqlx::query(
            "INSERT INTO sandbox_log_sources (sandbox_id, team_id, created_at, next_seq) VALUES (?, ?, ?, ?) ON CONFLICT (sandbox_id) DO NOTHING",
        )
        .bind(sandbox_id)
        .bind(team_id)
        .bind(micros(at))
        .bind(entries.len() as i64)
        .execute(&mut *tx)
        .await
        .map_err(err)?
        .rows_affected();
        if opened > 0 {
            insert_log_lines(&mut tx, sandbox_id, 0, entries).await?;
        }
        tx.commit().await.map_err(err)
    }

    async fn sandbox_log_team(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        sqlx::query_scalar("SELECT team_id FROM sandbox_log_sources WHERE sandbox_id = ?")
            .bind(sandbox_id)
            .fetch_optional(&self.db.reads)
            .await
            .map_err(err)
    }

    async fn sandbox_log_offset(&self, sandbox_id: &str) -> Result<u64, StoreError> {
        let offset: Option<i64> = sqlx::query_scalar(
            "SELECT agent_log_offset FROM sandbox_log_sources WHERE sandbox_id = ?",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.db.reads)
        .await
        .map_err(err)?;
        Ok(offset.unwrap_or(0).max(0) as u64)
    }

    async fn append_sandbox_logs(
        &self,
        sandbox_id: &str,
        entries: &[SandboxLogEntry],
        agent_log_offset: Option<u64>,
        keep: u64,
    ) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        let next: Option<i64> = sqlx::query_scalar(
            "UPDATE sandbox_log_sources SET next_seq = next_seq + ?, agent_log_offset = COALESCE(?, agent_log_offset) WHERE sandbox_id = ? RETURNING next_seq",
        )
        .bind(entries.len() as i64)
        .bind(agent_log_offset.map(|o| o.min(i64::MAX as u64) as i64))
        .bind(sandbox_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(err)?;
        let Some(next) = next else {
            return Ok(());
        };
        insert_log_lines(&mut tx, sandbox_id, next - entries.len() as i64, entries).await?;
        let oldest_kept = next - keep.min(i64::MAX as u64) as i64;
        if oldest_kept > 0 && !entries.is_empty() {
            sqlx::query("DELETE FROM sandbox_logs WHERE sandbox_id = ? AND seq < ?")
                .bind(sandbox_id)
                .bind(oldest_kept)
                .execute(&mut *tx)
                .await
                .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn end_sandbox_log(&self, sandbox_id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sandbox_log_sources SET ended_at = ? WHERE sandbox_id = ? AND ended_at IS NULL",
        )
        .bind(micros(at))
        .bind(sandbox_id)
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn sandbox_logs(
        &self,
        sandbox_id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, StoreError> {
        // instr is case-sensitive, unlike LIKE.
        const FORWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
             WHERE sandbox_id = ? AND level >= ? AND (? IS NULL OR at >= ?) \
             AND (? IS NULL OR instr(message, ?) > 0) ORDER BY at, seq LIMIT ?";
        const BACKWARD: &str = "SELECT at, level, message, fields FROM sandbox_logs \
             WHERE sandbox_id = ? AND level >= ? AND (? IS NULL OR at <= ?) \
             AND (? IS NULL OR instr(message, ?) > 0) ORDER BY at DESC, seq DESC LIMIT ?";
        let cursor = log_cursor_micros(query);
        let q =
            sqlx::query_as::<_, SandboxLogRow<i64>>(if query.forward { FORWARD } else { BACKWARD })
                .bind(sandbox_id)
                .bind(query.min_level.map(level_rank).unwrap_or(0))
                .bind(cursor)
                .bind(cursor)
                .bind(&query.search)
                .bind(&query.search);
        let rows = q
            .bind(i64::from(query.limit))
            .fetch_all(&self.db.reads)
            .await
            .map_err(err)?;
        rows.into_iter().map(SandboxLogEntry::try_from).collect()
    }

    async fn prune_sandbox_logs(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM sandbox_log_sources WHERE ended_at < ?")
            .bind(micros(before))
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }
}

async fn insert_log_lines(
    tx: &mut sqlx::SqliteConnection,
    sandbox_id: &str,
    first_seq: i64,
    entries: &[SandboxLogEntry],
) -> Result<(), StoreError> {
    for (i, entry) in entries.iter().enumerate() {
        sqlx::query(
            "INSERT INTO sandbox_logs (sandbox_id, seq, at, level, message, fields) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(sandbox_id)
        .bind(first_seq + i as i64)
        .bind(micros(entry.at))
        .bind(level_rank(entry.level))
        .bind(&entry.message)
        .bind(to_json(&entry.fields)?)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    }
    Ok(())
}
