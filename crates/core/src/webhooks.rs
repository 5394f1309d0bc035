//! Webhooks: a team registers URLs that get its sandboxes' lifecycle events as they happen,
//! signed with a secret the team chose, retried when the receiver fails, with every attempt
//! kept in a delivery log.
//!
//! Events reach a webhook in the order they happened: each webhook has one queue and one
//! task that delivers an event (with its retries) before the next. The core knows no HTTP:
//! a [`WebhookTransport`] posts the body, and decides which addresses it may reach.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::ids;
use crate::lock;
use crate::model::{SandboxEvent, SandboxEventType, Team};
use crate::store::{Store, StoreError};

/// A team's registered receiver of lifecycle events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Webhook {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub events: Vec<SandboxEventType>,
    /// What deliveries are signed with; never shown again.
    pub secret: String,
    pub created_at: DateTime<Utc>,
}

/// One attempt to deliver one event to one webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookDelivery {
    /// Sent as `e2b-delivery-id`: the same for every attempt of one event.
    pub id: String,
    pub webhook_id: String,
    pub event_id: String,
    pub event_type: SandboxEventType,
    /// 1 for the first try.
    pub attempt: u32,
    /// The receiver's HTTP status, when it answered.
    pub status_code: Option<u16>,
    /// Why the attempt failed, when it did.
    pub error: Option<String>,
    pub at: DateTime<Utc>,
}

impl WebhookDelivery {
    pub fn delivered(&self) -> bool {
        self.status_code.is_some_and(|c| (200..300).contains(&c))
    }
}

/// What a team sets when it registers a webhook; `None` keeps the current value on an
/// update.
#[derive(Debug, Clone, Default)]
pub struct WebhookChange {
    pub name: Option<String>,
    pub url: Option<String>,
    pub enabled: Option<bool>,
    pub events: Option<Vec<SandboxEventType>>,
    pub secret: Option<String>,
}

/// Most webhooks a team may register.
pub const MAX_WEBHOOKS_PER_TEAM: usize = 10;
const MAX_NAME_LEN: usize = 100;
const MAX_URL_LEN: usize = 2048;
const SECRET_LEN: std::ops::RangeInclusive<usize> = 8..=256;
/// Events waiting for one webhook; beyond it the newest is dropped (and logged).
const QUEUE_LEN: usize = 1000;
/// Attempts kept in the log per webhook.
pub const DELIVERIES_KEPT: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("webhook '{0}' not found")]
    NotFound(String),
    #[error("invalid webhook: {0}")]
    Invalid(String),
    #[error("team {team_id} has reached its limit of {limit} webhooks")]
    TooMany { team_id: String, limit: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a delivery attempt did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum WebhookPostError {
    /// The URL names an address deliveries may not go to (the host itself, a private
    /// network), as it resolved at the time of the attempt.
    #[error("webhook address refused: {0}")]
    Refused(String),
    #[error("webhook not reached: {0}")]
    Unreachable(String),
}

/// Posts a delivery's body to a webhook's URL and says the receiver's HTTP status.
#[async_trait::async_trait]
pub trait WebhookTransport: Send + Sync + 'static {
    async fn post(
        &self,
        url: &str,
        headers: &[(&'static str, String)],
        body: Vec<u8>,
    ) -> Result<u16, WebhookPostError>;
}

/// How deliveries are retried.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Attempts after the first, for an error or a non-2xx answer.
    pub retries: u32,
    /// Wait before each retry (E2B waits 10 seconds).
    pub backoff: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            retries: 3,
            backoff: Duration::from_secs(10),
        }
    }
}

/// `e2b-signature`: the unpadded base64 of SHA-256 over the secret followed by the body, as
/// E2B signs, so a receiver written for E2B checks Sandbar's deliveries unchanged.
pub fn signature(secret: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(secret.as_bytes());
    hash.update(body);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(hash.finalize())
}

fn check_name(name: &str) -> Result<(), WebhookError> {
    if name.trim().is_empty() || name.chars().count() > MAX_NAME_LEN {
        return Err(WebhookError::Invalid(format!(
            "name must be 1 to {MAX_NAME_LEN} characters"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(WebhookError::Invalid(
            "name must not hold control characters".into(),
        ));
    }
    Ok(())
}

/// The URL's form only; where it leads is the transport's to check at each attempt.
fn check_url(url: &str) -> Result<(), WebhookError> {
    let shown: String = url.chars().take(100).collect();
    if url.len() > MAX_URL_LEN {
        return Err(WebhookError::Invalid(format!(
            "url must be at most {MAX_URL_LEN} characters, got '{shown}…'"
        )));
    }
    let parsed = url::Url::parse(url)
        .map_err(|e| WebhookError::Invalid(format!("invalid url '{shown}': {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(WebhookError::Invalid(format!(
            "url must be an http or https URL with a host, got '{shown}'"
        )));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(WebhookError::Invalid(
            "url must not carry credentials".into(),
        ));
    }
    Ok(())
}

fn check_events(events: &[SandboxEventType]) -> Result<(), WebhookError> {
    if events.is_empty() {
        return Err(WebhookError::Invalid(
            "events must name at least one event type".into(),
        ));
    }
    Ok(())
}

fn check_secret(secret: &str) -> Result<(), WebhookError> {
    if !SECRET_LEN.contains(&secret.len()) {
        return Err(WebhookError::Invalid(format!(
            "signatureSecret must be {} to {} bytes",
            SECRET_LEN.start(),
            SECRET_LEN.end()
        )));
    }
    Ok(())
}

/// The team's webhooks, and the deliveries of its events to them.
#[derive(Clone)]
pub struct Webhooks {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<Store>,
    transport: Arc<dyn WebhookTransport>,
    config: WebhookConfig,
    /// One queue per webhook with a task that empties it in order.
    queues: Mutex<HashMap<String, tokio::sync::mpsc::Sender<SandboxEvent>>>,
}

impl std::fmt::Debug for Webhooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Webhooks {
    pub fn new(
        store: Arc<Store>,
        transport: Arc<dyn WebhookTransport>,
        config: WebhookConfig,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                transport,
                config,
                queues: Mutex::default(),
            }),
        }
    }

    pub async fn create(
        &self,
        team: &Team,
        change: WebhookChange,
    ) -> Result<Webhook, WebhookError> {
        let (Some(name), Some(url), Some(events), Some(secret)) =
            (change.name, change.url, change.events, change.secret)
        else {
            return Err(WebhookError::Invalid(
                "name, url, events and signatureSecret are required".into(),
            ));
        };
        check_name(&name)?;
        check_url(&url)?;
        check_events(&events)?;
        check_secret(&secret)?;
        let webhook = Webhook {
            id: ids::new_uuid(),
            team_id: team.id.clone(),
            name,
            url,
            enabled: change.enabled.unwrap_or(true),
            events,
            secret,
            created_at: Utc::now(),
        };
        if !self
            .inner
            .store
            .webhooks
            .add_webhook(&webhook, MAX_WEBHOOKS_PER_TEAM)
            .await?
        {
            return Err(WebhookError::TooMany {
                team_id: team.id.clone(),
                limit: MAX_WEBHOOKS_PER_TEAM,
            });
        }
        Ok(webhook)
    }

    pub async fn list(&self, team: &Team) -> Result<Vec<Webhook>, WebhookError> {
        Ok(self.inner.store.webhooks.webhooks(&team.id).await?)
    }

    pub async fn get(&self, team: &Team, id: &str) -> Result<Webhook, WebhookError> {
        self.inner
            .store
            .webhooks
            .webhook(&team.id, id)
            .await?
            .ok_or_else(|| WebhookError::NotFound(id.to_owned()))
    }

    pub async fn update(
        &self,
        team: &Team,
        id: &str,
        change: WebhookChange,
    ) -> Result<Webhook, WebhookError> {
        let mut webhook = self.get(team, id).await?;
        if let Some(name) = change.name {
            check_name(&name)?;
            webhook.name = name;
        }
        if let Some(url) = change.url {
            check_url(&url)?;
            webhook.url = url;
        }
        if let Some(events) = change.events {
            check_events(&events)?;
            webhook.events = events;
        }
        if let Some(secret) = change.secret {
            check_secret(&secret)?;
            webhook.secret = secret;
        }
        if let Some(enabled) = change.enabled {
            webhook.enabled = enabled;
        }
        if !self.inner.store.webhooks.update_webhook(&webhook).await? {
            return Err(WebhookError::NotFound(id.to_owned()));
        }
        Ok(webhook)
    }

    pub async fn delete(&self, team: &Team, id: &str) -> Result<(), WebhookError> {
        if !self
            .inner
            .store
            .webhooks
            .delete_webhook(&team.id, id)
            .await?
        {
            return Err(WebhookError::NotFound(id.to_owned()));
        }
        // Its task ends once the queue is empty.
        self.queues().remove(id);
        Ok(())
    }

    /// The latest attempts to deliver to one of the team's webhooks, newest first.
    pub async fn deliveries(
        &self,
        team: &Team,
        id: &str,
        limit: u32,
    ) -> Result<Vec<WebhookDelivery>, WebhookError> {
        let webhook = self.get(team, id).await?;
        Ok(self
            .inner
            .store
            .webhooks
            .webhook_deliveries(&webhook.id, limit)
            .await?)
    }

    fn queues(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, tokio::sync::mpsc::Sender<SandboxEvent>>> {
        lock(&self.inner.queues)
    }

    /// Queues stored events for every enabled webhook of their team that asked for their
    /// type. Webhooks are read anew for each batch, so a change applies to the next event.
    pub async fn dispatch(&self, events: &[SandboxEvent]) {
        let mut by_team: HashMap<&str, Vec<Webhook>> = HashMap::new();
        for event in events {
            let team_id = event.sandbox_team_id.as_str();
            if !by_team.contains_key(team_id) {
                let hooks = match self.inner.store.webhooks.webhooks(team_id).await {
                    Ok(hooks) => hooks,
                    Err(err) => {
                        tracing::warn!(team_id, error = %err, "webhooks not read: events not delivered");
                        Vec::new()
                    }
                };
                by_team.insert(team_id, hooks);
            }
            for webhook in &by_team[team_id] {
                if webhook.enabled && webhook.events.contains(&event.event_type) {
                    self.enqueue(webhook, event.clone());
                }
            }
        }
    }

    fn enqueue(&self, webhook: &Webhook, event: SandboxEvent) {
        let mut queues = self.queues();
        // A queue whose task ended (it panicked) is replaced.
        if queues.get(&webhook.id).is_some_and(|q| q.is_closed()) {
            queues.remove(&webhook.id);
        }
        let queue = queues.entry(webhook.id.clone()).or_insert_with(|| {
            let (queue, waiting) = tokio::sync::mpsc::channel(QUEUE_LEN);
            tokio::spawn(self.clone().deliver_in_order(webhook.id.clone(), waiting));
            queue
        });
        if let Err(err) = queue.try_send(event) {
            tracing::warn!(webhook_id = %webhook.id, error = %err, "webhook event dropped: its queue is full");
        }
    }

    async fn deliver_in_order(
        self,
        webhook_id: String,
        mut waiting: tokio::sync::mpsc::Receiver<SandboxEvent>,
    ) {
        while let Some(event) = waiting.recv().await {
            self.deliver(&webhook_id, &event).await;
        }
    }

    /// Delivers one event, retrying after a wait; each attempt is logged. The
    /// webhook is read again before each attempt: a deleted or disabled one gets no more.
    async fn deliver(&self, webhook_id: &str, event: &SandboxEvent) {
        let body = match serde_json::to_vec(event) {
            Ok(body) => body,
            Err(err) => {
                tracing::error!(event_id = %event.id, error = %err, "cannot serialise an event");
                return;
            }
        };
        let delivery_id = ids::new_uuid();
        for attempt in 1..=self.inner.config.retries + 1 {
            let webhook = match self
                .inner
                .store
                .webhooks
                .webhook(&event.sandbox_team_id, webhook_id)
                .await
            {
                Ok(Some(webhook)) if webhook.enabled => webhook,
                Ok(_) => return,
                Err(err) => {
                    tracing::warn!(webhook_id, error = %err, "webhook not read: delivery stopped");
                    return;
                }
            };
            let headers = [
                ("content-type", "application/json".to_owned()),
                ("e2b-webhook-id", webhook.id.clone()),
                ("e2b-delivery-id", delivery_id.clone()),
                ("e2b-signature-version", "v1".to_owned()),
                ("e2b-signature", signature(&webhook.secret, &body)),
            ];
            let answer = self
                .inner
                .transport
                .post(&webhook.url, &headers, body.clone())
                .await;
            let record = WebhookDelivery {
                id: delivery_id.clone(),
                webhook_id: webhook.id.clone(),
                event_id: event.id.clone(),
                event_type: event.event_type,
                attempt,
                status_code: answer.as_ref().ok().copied(),
                error: answer.as_ref().err().map(ToString::to_string),
                at: Utc::now(),
            };
            if let Err(err) = self
                .inner
                .store
                .webhooks
                .add_webhook_delivery(&record, DELIVERIES_KEPT)
                .await
            {
                tracing::warn!(webhook_id, error = %err, "cannot log a webhook delivery");
            }
            // A refused address stays refused: no retry.
            if record.delivered() || matches!(answer, Err(WebhookPostError::Refused(_))) {
                return;
            }
            if attempt <= self.inner.config.retries {
                tokio::time::sleep(self.inner.config.backoff).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_e2bs_keyed_sha256() {
        // sha256("secret" + "{}") in unpadded base64, as E2B's receivers compute it.
        let mut hash = Sha256::new();
        hash.update(b"secret{}");
        let expected = base64::engine::general_purpose::STANDARD_NO_PAD.encode(hash.finalize());
        assert_eq!(signature("secret", b"{}"), expected);
        assert!(!expected.ends_with('='));
        assert_ne!(signature("secret", b"{}"), signature("secreT", b"{}"));
    }

    #[test]
    fn bad_inputs_are_refused_by_name() {
        assert!(
            matches!(check_url("ftp://x"), Err(WebhookError::Invalid(m)) if m.contains("http or https"))
        );
        assert!(matches!(
            check_url("http://a b"),
            Err(WebhookError::Invalid(_))
        ));
        assert!(check_url("https://receiver.example/hook").is_ok());
        assert!(
            matches!(check_url("not a url"), Err(WebhookError::Invalid(m)) if m.contains("invalid url"))
        );
        assert!(
            matches!(check_url("http://u:p@receiver.example/"), Err(WebhookError::Invalid(m)) if m.contains("credentials"))
        );
        assert!(
            matches!(check_secret("short"), Err(WebhookError::Invalid(m)) if m.contains("signatureSecret"))
        );
        assert!(matches!(check_events(&[]), Err(WebhookError::Invalid(m)) if m.contains("events")));
        assert!(matches!(check_name(""), Err(WebhookError::Invalid(m)) if m.contains("name")));
        assert!(
            matches!(check_name("a\u{7}"), Err(WebhookError::Invalid(m)) if m.contains("control"))
        );
    }
}
