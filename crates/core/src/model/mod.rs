//! The records the core reasons about, one module per aggregate. They depend on nothing but
//! each other and a few value types, so the services and the store traits can all use them
//! without depending on one another.

pub mod builds;
pub mod layer_blobs;
pub mod nodes;
pub mod sandbox_events;
pub mod sandbox_logs;
pub mod sandboxes;
pub mod team_metrics;
pub mod teams;
pub mod templates;
pub mod volumes;

pub use builds::{BuildFailure, BuildLogEntry, BuildRecord, LogLevel};
pub use layer_blobs::LayerBlob;
pub use nodes::{BuildSlotUse, NodeRecord, NodeReport, SlotClaim};
pub use sandbox_events::{
    SANDBOX_EVENT_VERSION, SandboxEvent, SandboxEventData, SandboxEventQuery, SandboxEventType,
    SandboxExecution,
};
pub use sandbox_logs::{SandboxLogEntry, SandboxLogQuery};
pub use sandboxes::{Sandbox, SandboxState};
pub use team_metrics::TeamMetricBucket;
pub use teams::{DiskRates, Team, TeamCaps, TeamLimits, slug_of};
pub use templates::{
    BUILT_IN_TEMPLATE_ALIASES, BuildStatus, DEFAULT_TEMPLATE_ALIAS, DESKTOP_TEMPLATE_ALIAS,
    INTERPRETER_TEMPLATE_ALIAS, SnapshotImage, StartedImage, Template, TemplateImage,
};
pub use volumes::{Volume, VolumeMount};
