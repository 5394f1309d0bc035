//! What the core needs from persistent storage: one trait per aggregate, and [`Store`], a
//! handle to each, which the services hold. A backend implements each trait; a service that
//! needs only part of the store can name only that part.

use std::sync::Arc;

mod builds;
mod layer_blobs;
mod lookups;
mod nodes;
mod request_counts;
mod sandbox_events;
mod sandbox_logs;
mod sandboxes;
mod team_metrics;
mod teams;
mod templates;
mod volumes;
mod webhooks;

pub use builds::BuildRecords;
pub use layer_blobs::LayerBlobRecords;
pub use lookups::LookupGenerations;
pub use nodes::NodeRecords;
pub use request_counts::RequestCountRecords;
pub use sandbox_events::SandboxEventRecords;
pub use sandbox_logs::SandboxLogRecords;
pub use sandboxes::SandboxRecords;
pub use team_metrics::TeamMetricRecords;
pub use teams::{StoredAccessToken, StoredApiKey, StoredSecret, TeamRecords};
pub use templates::TemplateRecords;
pub use volumes::VolumeRecords;
pub use webhooks::WebhookRecords;

/// Why a store operation failed. Lookups that may find nothing answer `Ok(None)` (or
/// `false`); `NotFound` is for a record an operation needed and did not find.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {what} '{id}' not found")]
    NotFound { what: &'static str, id: String },
    #[error("store: {what} '{id}' already exists")]
    Conflict { what: &'static str, id: String },
    /// The backend failed (I/O, a constraint, a row it cannot read); only reportable.
    #[error("store: {0}")]
    Backend(String),
}

/// A row whose reading cannot fail reads through the same path as one whose can.
impl From<std::convert::Infallible> for StoreError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

/// All of the store's aggregates, one handle each: what the services hold. A caller names
/// the aggregate that keeps the records it needs (`store.teams.team_by_slug(…)`), so each
/// backend implements a small trait for each and no type answers for all of them.
#[derive(Clone)]
pub struct Store {
    pub teams: Arc<dyn TeamRecords>,
    pub templates: Arc<dyn TemplateRecords>,
    pub builds: Arc<dyn BuildRecords>,
    pub sandboxes: Arc<dyn SandboxRecords>,
    pub volumes: Arc<dyn VolumeRecords>,
    pub sandbox_logs: Arc<dyn SandboxLogRecords>,
    pub sandbox_events: Arc<dyn SandboxEventRecords>,
    pub webhooks: Arc<dyn WebhookRecords>,
    pub team_metrics: Arc<dyn TeamMetricRecords>,
    pub nodes: Arc<dyn NodeRecords>,
    pub layer_blobs: Arc<dyn LayerBlobRecords>,
    pub request_counts: Arc<dyn RequestCountRecords>,
    pub lookups: Arc<dyn LookupGenerations>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}
