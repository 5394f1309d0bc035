//! Sandbox lifecycle events.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxEventRecords;
use sandbar_core::{SandboxEvent, SandboxEventQuery, StoreError};
use sqlx::PgPool;

use crate::err;
use crate::sandbox_events::{event_columns, event_of, order_of};

/// Sandbox lifecycle events, in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgSandboxEvents {
    pub(crate) pool: PgPool,
}

#[async_trait::async_trait]
impl SandboxEventRecords for PgSandboxEvents {
    async fn add_sandbox_events(&self, events: &[SandboxEvent]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(err)?;
        for event in events {
            let (at, body) = event_columns(event)?;
            sqlx::query(
                "INSERT INTO sandbox_events (id, team_id, sandbox_id, type, at, body) VALUES ($1, $2, $3, $4, $5, $6)",
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
            let types: Vec<&str> = query.types.iter().map(|t| t.as_str()).collect();
            sql.push(" AND type = ANY(").push_bind(types).push(")");
        }
        sql.push(order_of(query))
            .push(" LIMIT ")
            .push_bind(i64::from(query.limit))
            .push(" OFFSET ")
            .push_bind(i64::from(query.offset));
        let bodies: Vec<(String,)> = sql
            .build_query_as()
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
        bodies.iter().map(|(body,)| event_of(body)).collect()
    }

    async fn prune_sandbox_events(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let result = sqlx::query("DELETE FROM sandbox_events WHERE at < $1")
            .bind(before.timestamp_micros())
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(result.rows_affected())
    }
}
