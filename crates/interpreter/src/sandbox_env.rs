//! The sandbox's environment as its agent publishes it: what the server reads and what each
//! kernel remembers having set.

use std::collections::BTreeMap;

/// The sandbox's environment and when its agent wrote it: a new write is a new sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxEnv {
    pub(crate) written: std::time::SystemTime,
    pub(crate) vars: BTreeMap<String, String>,
}
