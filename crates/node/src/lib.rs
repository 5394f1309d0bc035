//! The sandbox host: builds template root filesystems, and starts, adopts and stops sandboxes
//! with Linux namespaces, cgroups, an overlay root and a private routed network.

mod agent_client;
pub mod agent_log;
mod build_output;
mod build_step;
pub mod builder;
pub mod cgroups;
pub mod checkpoint;
mod criu_cell;
pub mod disks;
pub mod dns;
pub mod egress;
pub mod image_layers;
pub mod interpreter;
pub mod layer_archive;
pub mod layers;
pub mod lease;
pub mod memory;
pub mod mounts;
pub mod netns;
pub mod network;
pub mod prefetch;
mod runtime;
pub mod shaping;
pub mod shared_collector;
pub mod shared_layers;
pub mod tasks;
pub mod templates;
mod tied_children;
pub mod uploads;
pub mod volumes;
pub mod warm;

pub use builder::NodeBuilder;
pub use runtime::{LinuxRuntime, NodeConfig, NodeError, protect_server_from_oom_killer};

#[cfg(test)]
pub(crate) mod few_descriptors;
