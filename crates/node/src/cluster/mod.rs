//! A node among others: its lease, template layers and checkpoints shared through the layer store, what the store no longer needs let go, and layers fetched ahead of demand.

pub mod lease;
pub mod prefetch;
pub mod shared_collector;
pub mod shared_layers;
