//! What the core needs from persistent storage: one trait per aggregate, and [`Store`], all
//! of them together, which the services hold as `Arc<dyn Store>`. A backend implements each
//! trait; a service that needs only part of the store can name only that part.

mod builds;
mod layer_blobs;
mod nodes;
mod request_counts;
mod sandbox_logs;
mod sandboxes;
mod team_metrics;
mod teams;
mod templates;
mod volumes;

pub use builds::BuildRecords;
pub use layer_blobs::LayerBlobRecords;
pub use nodes::NodeRecords;
pub use request_counts::RequestCountRecords;
pub use sandbox_logs::SandboxLogRecords;
pub use sandboxes::SandboxRecords;
pub use team_metrics::TeamMetricRecords;
pub use teams::{StoredAccessToken, StoredApiKey, StoredSecret, TeamRecords};
pub use templates::TemplateRecords;
pub use volumes::VolumeRecords;

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

/// All of the store's aggregates: what a backend implements and the services hold.
pub trait Store:
    TeamRecords
    + TemplateRecords
    + BuildRecords
    + SandboxRecords
    + VolumeRecords
    + SandboxLogRecords
    + TeamMetricRecords
    + NodeRecords
    + LayerBlobRecords
    + RequestCountRecords
    + 'static
{
}

impl<T> Store for T where
    T: TeamRecords
        + TemplateRecords
        + BuildRecords
        + SandboxRecords
        + VolumeRecords
        + SandboxLogRecords
        + TeamMetricRecords
        + NodeRecords
        + LayerBlobRecords
        + RequestCountRecords
        + 'static
{
}
