//! Webhooks and their delivery log.

use super::StoreError;
use crate::webhooks::{Webhook, WebhookDelivery};

#[async_trait::async_trait]
pub trait WebhookRecords: Send + Sync {
    /// Adds `webhook` unless its team already has `max_per_team`; says whether it was added.
    async fn add_webhook(&self, webhook: &Webhook, max_per_team: usize)
    -> Result<bool, StoreError>;
    /// The team's webhooks, oldest first.
    async fn webhooks(&self, team_id: &str) -> Result<Vec<Webhook>, StoreError>;
    async fn webhook(&self, team_id: &str, id: &str) -> Result<Option<Webhook>, StoreError>;
    /// Writes every field but the team and creation time; says whether it was there.
    async fn update_webhook(&self, webhook: &Webhook) -> Result<bool, StoreError>;
    /// Removes the webhook and its delivery log; says whether it was there.
    async fn delete_webhook(&self, team_id: &str, id: &str) -> Result<bool, StoreError>;
    /// Logs an attempt, keeping the newest `keep` of the webhook's.
    async fn add_webhook_delivery(
        &self,
        delivery: &WebhookDelivery,
        keep: u32,
    ) -> Result<(), StoreError>;
    /// The webhook's latest attempts, newest first.
    async fn webhook_deliveries(
        &self,
        webhook_id: &str,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>, StoreError>;
}
