//! Sandbox networking: the routed network and its namespaces made ahead, egress rules, the resolver sandboxes use, and bandwidth shaping.

pub mod dns;
pub mod egress;
pub mod netns;
pub mod network;
pub mod shaping;
