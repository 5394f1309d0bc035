//! Sandbox lifecycle events.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxEventRecords;
use sandbar_core::{SandboxEvent, SandboxEventQuery, StoreError};

use crate::SqliteDb;
use crate::err;

/// Sandbox lifecycle events, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteSandboxEvents {
    pub(crate) db: SqliteDb,
}

/// The stored form of an event: its columns, then its body as served.
pub(crate) fn event_columns(event: &SandboxEvent) -> Result<(i64, String), StoreError> {
    let body = serde_json::to_string(event).map_err(err)?;
    Ok((event.timestamp.timestamp_micros(), body))
}

pub(crate) fn event_of(body: &str) -> Result<SandboxEvent, StoreError> {
    serde_json::from_str(body).map_err(|e| err(format!("unreadable sandbox event: {e}")))
}

/// How a page of events is ordered: by when each was added.
pub(crate) fn order_of(query: &SandboxEventQuery) -> &'static str {
    if query.ascending {
        " ORDER BY seq ASC"
    } else {
        " ORDER BY seq DESC"
    }
}

#[async_trait::async_trait]
impl SandboxEventRecords for SqliteSandboxEvents {
    async fn add_sandbox_events(&self, events: &[SandboxEvent]) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        for event in events {
            let (at, body) = event_columns(event)?;
            sqlx::query(
                "INSERT INTO sandbox_events (id, team_id, sandbox_id, type, at, body) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(&event.id)
            .bind(&event.sandbox_team_id)
            .bind(&event.sandbox_id)
            .bind(event.event_type.as_str())
            .bind(at)
            .bind(body)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    async fn sandbox_events(
        &self,
        query: &SandboxEventQuery,
    ) -> Result<Vec<SandboxEvent>, StoreError> {
        let mut sql = sqlx::QueryBuilder::new("SELECT body FROM sandbox_events WHERE team_id = ");
        sql.push_bind(&query.team_id);
        if let Some(sandbox_id) = &query.sandbox_id {
            sql.push(" AND sandbox_id = ").push_bind(sandbox_id);
        }
        if !query.types.is_empty() {
            sql.push(" AND type IN (");
            let mut types = sql.separated(", ");
            for t in &query.types {
                types.push_bind(t.as_str());
            }
            sql.push(")");
        }
        sql.push(order_of(query))
            .push(" LIMIT ")
            .push_bind(i64::from(query.limit))
            .push(" OFFSET ")
            .push_bind(i64::from(query.offset));
        let bodies: Vec<(String,)> = sql
            .build_query_as()
            .fetch_all(&self.db.reads)
            .await
            .map_err(err)?;
        bodies.iter().map(|(body,)| event_of(body)).collect()
    }

    async fn prune_sandbox_events(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM sandbox_events WHERE at < ?")
            .bind(before.timestamp_micros())
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }
}
