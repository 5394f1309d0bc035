//! Volumes as recorded, and a sandbox's mounts of them.

use chrono::{DateTime, Utc};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub id: String,
    pub team_id: String,
    pub name: String,
    /// SHA-256 (hex) of the volume's content token.
    pub token_hash: String,
    pub created_at: DateTime<Utc>,
}

/// A volume a sandbox mounts, as recorded with the sandbox and handed to the runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMount {
    pub volume_id: String,
    pub team_id: String,
    pub name: String,
    /// Absolute, normalised path inside the sandbox.
    pub path: String,
}
