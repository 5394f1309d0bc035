//! The sandbox host: builds template root filesystems, and starts, adopts and stops sandboxes
//! with Linux namespaces, cgroups, an overlay root and a private routed network.

pub mod build;
pub mod checkpoint;
pub mod cluster;
pub mod net;
pub mod resources;
mod runtime;
pub mod storage;
mod tied_children;

pub use build::builder::NodeBuilder;
pub use runtime::{LinuxRuntime, NodeConfig, NodeError, protect_server_from_oom_killer};
pub use runtime::{agent_log, warm};

#[cfg(test)]
pub(crate) mod few_descriptors;
