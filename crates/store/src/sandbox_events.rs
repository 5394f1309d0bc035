//! Sandbox lifecycle events.

use chrono::{DateTime, Utc};
use sandbar_core::store::SandboxEventRecords;
use sandbar_core::{SandboxEvent, SandboxEventQuery, StoreError};

use crate::backend::{Backend, Transact, Write};
use crate::rows::{bind_event, event_of, events_page};
use crate::{err, micros};

/// Sandbox lifecycle events, in either database. Both keep their times as microseconds.
#[derive(Debug, Clone)]
pub struct SandboxEvents<B> {
    pub(crate) db: B,
}

on_both! {
    #[async_trait::async_trait]
    impl SandboxEventRecords for SandboxEvents<B> {
        async fn add_sandbox_events(&self, events: &[SandboxEvent]) -> Result<(), StoreError> {
            let inserts = events
                .iter()
                .map(|event| {
                    bind_event(
                        sqlx::query(
                            "INSERT INTO sandbox_events (id, team_id, sandbox_id, type, at, body) VALUES ($1, $2, $3, $4, $5, $6)",
                        ),
                        event,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            self.db.write_all(inserts).await
        }

        async fn sandbox_events(
            &self,
            team_id: &str,
            query: &SandboxEventQuery,
        ) -> Result<Vec<SandboxEvent>, StoreError> {
            let mut sql = events_page::<<B as Backend>::Db>(team_id, query);
            let bodies: Vec<(String,)> = sql
                .build_query_as()
                .fetch_all(self.db.reads())
                .await
                .map_err(err)?;
            bodies.iter().map(|(body,)| event_of(body)).collect()
        }

        async fn prune_sandbox_events(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
            sqlx::query("DELETE FROM sandbox_events WHERE at < $1")
                .bind(micros(before))
                .write(&self.db)
                .await
        }
    }
}
