//! Webhooks and their delivery log.

use sandbar_core::SandboxEventType;
use sandbar_core::StoreError;
use sandbar_core::store::WebhookRecords;
use sandbar_core::webhooks::{Webhook, WebhookDelivery};

use crate::{SqliteDb, err, micros, time};

/// Webhooks, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteWebhooks {
    pub(crate) db: SqliteDb,
}

/// A webhook as both databases select it.
#[derive(sqlx::FromRow)]
pub(crate) struct WebhookRow {
    id: String,
    team_id: String,
    name: String,
    url: String,
    enabled: bool,
    events: String,
    secret: String,
    created_at: i64,
}

impl WebhookRow {
    pub(crate) fn webhook(self) -> Result<Webhook, StoreError> {
        let names: Vec<String> = serde_json::from_str(&self.events).map_err(err)?;
        let events = names
            .iter()
            .map(|n| {
                SandboxEventType::parse(n)
                    .ok_or_else(|| err(format!("webhook {}: unknown event type '{n}'", self.id)))
            })
            .collect::<Result<_, _>>()?;
        Ok(Webhook {
            id: self.id,
            team_id: self.team_id,
            name: self.name,
            url: self.url,
            enabled: self.enabled,
            events,
            secret: self.secret,
            created_at: time(self.created_at),
        })
    }
}

pub(crate) fn events_json(webhook: &Webhook) -> Result<String, StoreError> {
    let names: Vec<&str> = webhook.events.iter().map(|e| e.as_str()).collect();
    serde_json::to_string(&names).map_err(err)
}

/// An attempt as both databases select it.
#[derive(sqlx::FromRow)]
pub(crate) struct DeliveryRow {
    id: String,
    webhook_id: String,
    event_id: String,
    event_type: String,
    attempt: i64,
    status_code: Option<i64>,
    error: Option<String>,
    at: i64,
}

impl DeliveryRow {
    pub(crate) fn delivery(self) -> Result<WebhookDelivery, StoreError> {
        Ok(WebhookDelivery {
            event_type: SandboxEventType::parse(&self.event_type).ok_or_else(|| {
                err(format!(
                    "delivery {}: unknown event type '{}'",
                    self.id, self.event_type
                ))
            })?,
            id: self.id,
            webhook_id: self.webhook_id,
            event_id: self.event_id,
            attempt: u32::try_from(self.attempt).unwrap_or(u32::MAX),
            status_code: self.status_code.and_then(|c| u16::try_from(c).ok()),
            error: self.error,
            at: time(self.at),
        })
    }
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
        sqlx::query(
            "INSERT INTO webhooks (id, team_id, name, url, enabled, events, secret, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&webhook.id)
        .bind(&webhook.team_id)
        .bind(&webhook.name)
        .bind(&webhook.url)
        .bind(webhook.enabled)
        .bind(events_json(webhook)?)
        .bind(&webhook.secret)
        .bind(micros(webhook.created_at))
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(true)
    }

    async fn webhooks(&self, team_id: &str) -> Result<Vec<Webhook>, StoreError> {
        sqlx::query_as::<_, WebhookRow>("SELECT id, team_id, name, url, enabled, events, secret, created_at FROM webhooks WHERE team_id = ? ORDER BY created_at, id")
        .bind(team_id)
        .fetch_all(&self.db.reads)
        .await
        .map_err(err)?
        .into_iter()
        .map(WebhookRow::webhook)
        .collect()
    }

    async fn webhook(&self, team_id: &str, id: &str) -> Result<Option<Webhook>, StoreError> {
        sqlx::query_as::<_, WebhookRow>("SELECT id, team_id, name, url, enabled, events, secret, created_at FROM webhooks WHERE team_id = ? AND id = ?")
        .bind(team_id)
        .bind(id)
        .fetch_optional(&self.db.reads)
        .await
        .map_err(err)?
        .map(WebhookRow::webhook)
        .transpose()
    }

    async fn update_webhook(&self, webhook: &Webhook) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE webhooks SET name = ?, url = ?, enabled = ?, events = ?, secret = ? \
             WHERE team_id = ? AND id = ?",
        )
        .bind(&webhook.name)
        .bind(&webhook.url)
        .bind(webhook.enabled)
        .bind(events_json(webhook)?)
        .bind(&webhook.secret)
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
        sqlx::query(
            "INSERT INTO webhook_deliveries (id, webhook_id, event_id, event_type, attempt, status_code, error, at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&delivery.id)
        .bind(&delivery.webhook_id)
        .bind(&delivery.event_id)
        .bind(delivery.event_type.as_str())
        .bind(i64::from(delivery.attempt))
        .bind(delivery.status_code.map(i64::from))
        .bind(&delivery.error)
        .bind(micros(delivery.at))
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
        sqlx::query_as::<_, DeliveryRow>("SELECT id, webhook_id, event_id, event_type, attempt, status_code, error, at FROM webhook_deliveries WHERE webhook_id = ? ORDER BY seq DESC LIMIT ?")
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
