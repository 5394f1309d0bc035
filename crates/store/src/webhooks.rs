//! Webhooks and their delivery log.

use sandbar_core::StoreError;
use sandbar_core::store::WebhookRecords;
use sandbar_core::webhooks::{Webhook, WebhookDelivery};
use sqlx::{PgConnection, PgPool, SqliteConnection};

use crate::backend::{Backend, Read, Transact, Write};
use crate::rows::{DeliveryRow, WebhookRow, bind_delivery, bind_webhook_settings};
use crate::{SqliteDb, err, micros};

/// Webhooks, in either database. Both keep their times as microseconds.
#[derive(Debug, Clone)]
pub struct Webhooks<B> {
    pub(crate) db: B,
}

/// A webhook query: every column of `webhooks` as `WebhookRow` reads them, then `$rest`. A
/// literal, so the SQL stays static.
macro_rules! webhook_query {
    ($rest:literal) => {
        concat!(
            "SELECT id, team_id, name, url, enabled, events, secret, created_at FROM webhooks ",
            $rest
        )
    };
}

// SQLite's one writer already counts a team's webhooks one add after another.
impl Webhooks<SqliteDb> {
    async fn lock_team(_: &mut SqliteConnection, _: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

impl Webhooks<PgPool> {
    /// Two hosts adding a team's webhooks at once count one after the other.
    async fn lock_team(tx: &mut PgConnection, team_id: &str) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('webhooks:' || $1))")
            .bind(team_id)
            .execute(tx)
            .await
            .map_err(err)?;
        Ok(())
    }
}

on_both! {
    #[async_trait::async_trait]
    impl WebhookRecords for Webhooks<B> {
        async fn add_webhook(
            &self,
            webhook: &Webhook,
            max_per_team: usize,
        ) -> Result<bool, StoreError> {
            let mut tx = self.db.writes().begin().await.map_err(err)?;
            Self::lock_team(&mut tx, &webhook.team_id).await?;
            let (count,): (i64,) =
                sqlx::query_as("SELECT COUNT(*) FROM webhooks WHERE team_id = $1")
                    .bind(&webhook.team_id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(err)?;
            if usize::try_from(count).unwrap_or(usize::MAX) >= max_per_team {
                return Ok(false);
            }
            let insert = sqlx::query(
                "INSERT INTO webhooks (id, team_id, name, url, enabled, events, secret, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(&webhook.id)
            .bind(&webhook.team_id);
            bind_webhook_settings(insert, webhook)?
                .bind(micros(webhook.created_at))
                .execute(&mut *tx)
                .await
                .map_err(err)?;
            tx.commit().await.map_err(err)?;
            Ok(true)
        }

        async fn webhooks(&self, team_id: &str) -> Result<Vec<Webhook>, StoreError> {
            sqlx::query_as::<_, WebhookRow>(webhook_query!(
                "WHERE team_id = $1 ORDER BY created_at, id"
            ))
            .bind(team_id)
            .all(&self.db)
            .await
        }

        async fn webhook(&self, team_id: &str, id: &str) -> Result<Option<Webhook>, StoreError> {
            sqlx::query_as::<_, WebhookRow>(webhook_query!("WHERE team_id = $1 AND id = $2"))
                .bind(team_id)
                .bind(id)
                .one(&self.db)
                .await
        }

        async fn update_webhook(&self, webhook: &Webhook) -> Result<bool, StoreError> {
            let update = sqlx::query(
                "UPDATE webhooks SET name = $1, url = $2, enabled = $3, events = $4, secret = $5 \
                 WHERE team_id = $6 AND id = $7",
            );
            let result = bind_webhook_settings(update, webhook)?
                .bind(&webhook.team_id)
                .bind(&webhook.id)
                .write(&self.db)
                .await?;
            Ok(result > 0)
        }

        async fn delete_webhook(&self, team_id: &str, id: &str) -> Result<bool, StoreError> {
            let result = sqlx::query("DELETE FROM webhooks WHERE team_id = $1 AND id = $2")
                .bind(team_id)
                .bind(id)
                .write(&self.db)
                .await?;
            Ok(result > 0)
        }

        async fn add_webhook_delivery(
            &self,
            delivery: &WebhookDelivery,
            keep: u32,
        ) -> Result<(), StoreError> {
            let insert = bind_delivery(
                sqlx::query(
                    "INSERT INTO webhook_deliveries (id, webhook_id, event_id, event_type, attempt, status_code, error, at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                ),
                delivery,
            );
            let prune = sqlx::query(
                "DELETE FROM webhook_deliveries WHERE webhook_id = $1 AND seq <= \
                 (SELECT seq FROM webhook_deliveries WHERE webhook_id = $2 ORDER BY seq DESC LIMIT 1 OFFSET $3)",
            )
            .bind(&delivery.webhook_id)
            .bind(&delivery.webhook_id)
            .bind(i64::from(keep));
            self.db.write_all(vec![insert, prune]).await
        }

        async fn webhook_deliveries(
            &self,
            webhook_id: &str,
            limit: u32,
        ) -> Result<Vec<WebhookDelivery>, StoreError> {
            sqlx::query_as::<_, DeliveryRow>(
                "SELECT id, webhook_id, event_id, event_type, attempt, status_code, error, at \
                 FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY seq DESC LIMIT $2",
            )
            .bind(webhook_id)
            .bind(i64::from(limit))
            .all(&self.db)
            .await
        }
    }
}
