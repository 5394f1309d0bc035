//! Webhooks and their delivery log.

use sandbar_core::StoreError;
use sandbar_core::store::WebhookRecords;
use sandbar_core::webhooks::{Webhook, WebhookDelivery};

use crate::rows::{DeliveryRow, WebhookRow, bind_delivery, bind_webhook_settings};
use crate::{SqliteDb, err, micros};

/// Webhooks, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteWebhooks {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl WebhookRecords for SqliteWebhooks {
    async fn add_webhook(
        &self,
        webhook: &Webhook,
        max_per_team: usize,
    ) -> Result<bool, StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM webhooks WHERE team_id = ?")
            .bind(&webhook.team_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(err)?;
        if usize::try_from(count).unwrap_or(usize::MAX) >= max_per_team {
            return Ok(false);
        }
        let insert = sqlx::query(
            "INSERT INTO webhooks (id, team_id, name, url, enabled, events, secret, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
        sqlx::query_as::<_, WebhookRow>(webhook_query!("WHERE team_id = ? ORDER BY created_at, id"))
            .bind(team_id)
            .fetch_all(&self.db.reads)
            .await
            .map_err(err)?
            .into_iter()
            .map(WebhookRow::webhook)
            .collect()
    }

    async fn webhook(&self, team_id: &str, id: &str) -> Result<Option<Webhook>, StoreError> {
        sqlx::query_as::<_, WebhookRow>(webhook_query!("WHERE team_id = ? AND id = ?"))
            .bind(team_id)
            .bind(id)
            .fetch_optional(&self.db.reads)
            .await
            .map_err(err)?
            .map(WebhookRow::webhook)
            .transpose()
    }

    async fn update_webhook(&self, webhook: &Webhook) -> Result<bool, StoreError> {
        let update = sqlx::query(
            "UPDATE webhooks SET name = ?, url = ?, enabled = ?, events = ?, secret = ? \
             WHERE team_id = ? AND id = ?",
        );
        let result = bind_webhook_settings(update, webhook)?
            .bind(&webhook.team_id)
            .bind(&webhook.id)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(result.rows_affected() > 0)
    }

    async fn delete_webhook(&self, team_id: &str, id: &str) -> Result<bool, StoreError> {
        let result = sqlx::query("DELETE FROM webhooks WHERE team_id = ? AND id = ?")
            .bind(team_id)
            .bind(id)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(result.rows_affected() > 0)
    }

    async fn add_webhook_delivery(
        &self,
        delivery: &WebhookDelivery,
        keep: u32,
    ) -> Result<(), StoreError> {
        let mut tx = self.db.writes.begin().await.map_err(err)?;
        bind_delivery(
            sqlx::query(
                "INSERT INTO webhook_deliveries (id, webhook_id, event_id, event_type, attempt, status_code, error, at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            ),
            delivery,
        )
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        sqlx::query(
            "DELETE FROM webhook_deliveries WHERE webhook_id = ? AND seq <= \
             (SELECT seq FROM webhook_deliveries WHERE webhook_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
        )
        .bind(&delivery.webhook_id)
        .bind(&delivery.webhook_id)
        .bind(i64::from(keep))
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)
    }

    async fn webhook_deliveries(
        &self,
        webhook_id: &str,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>, StoreError> {
        sqlx::query_as::<_, DeliveryRow>(
            "SELECT id, webhook_id, event_id, event_type, attempt, status_code, error, at \
             FROM webhook_deliveries WHERE webhook_id = ? ORDER BY seq DESC LIMIT ?",
        )
        .bind(webhook_id)
        .bind(i64::from(limit))
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?
        .into_iter()
        .map(DeliveryRow::delivery)
        .collect()
    }
}
