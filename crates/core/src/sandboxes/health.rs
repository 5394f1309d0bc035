//! What the node reports about itself: its memory and disks, its sandboxes by status, and
//! what ails it.

use std::sync::Arc;

use super::CHECKPOINT_ATTEMPTS;
use super::shared::Shared;
use crate::disks::{DiskFull, DiskReport};
use crate::lifecycle::SandboxStatus;
use crate::model::NodeRecord;
use crate::runtime::{DiskIoReport, MemoryReport, WarmPoolReport};

/// The node's own state, as the health check, the metrics and the dashboard show it.
#[derive(Clone, Debug)]
pub struct NodeHealth {
    shared: Arc<Shared>,
}

impl NodeHealth {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Processes killed for reaching their sandbox's memory limit (see [`crate::runtime::Runtime::oom_kills`]).
    pub fn oom_kills(&self) -> u64 {
        self.shared.runtime.oom_kills()
    }

    /// The cluster's nodes as this host last read them from the store, or `None` on a single
    /// host.
    pub fn cluster_nodes(&self) -> Option<Vec<NodeRecord>> {
        self.shared.nodes.get().map(|nodes| nodes.all())
    }

    /// The node's memory as measured now.
    pub fn memory(&self) -> Option<MemoryReport> {
        self.shared.runtime.memory()
    }

    /// Sandboxes the node keeps booted ahead of demand.
    pub fn warm_pool(&self) -> Option<WarmPoolReport> {
        self.shared.runtime.warm_pool()
    }

    /// The sandboxes' disk rates and what they read and wrote.
    pub fn disk_io(&self) -> Option<DiskIoReport> {
        self.shared.runtime.disk_io()
    }

    /// The node's disks as measured now.
    pub fn disks(&self) -> DiskReport {
        self.shared.runtime.disks()
    }

    /// What ails this node, one sentence each: its disks, and paused sandboxes that stay in
    /// memory because their checkpoint was refused or abandoned (counted, not named: the
    /// answer is public, and each sandbox's log says why).
    pub fn health_problems(&self) -> Vec<String> {
        let mut problems = self.disks().problems();
        let kept = self
            .shared
            .live()
            .values()
            .filter(|l| {
                l.status == SandboxStatus::Paused && l.checkpoint_failures >= CHECKPOINT_ATTEMPTS
            })
            .count();
        if kept > 0 {
            problems.push(format!(
                "{kept} paused sandbox{} stay{} in memory: {} checkpoint to disk was refused or did not finish; each sandbox's log says why",
                if kept == 1 { "" } else { "es" },
                if kept == 1 { "s" } else { "" },
                if kept == 1 { "its" } else { "their" },
            ));
        }
        problems
    }

    /// Refuses, naming the disk, work that would write to a data disk without room for it.
    pub fn room_to_write(&self) -> Result<(), DiskFull> {
        self.shared.data_disk().write_refusal().map_or(Ok(()), Err)
    }

    pub fn count_by_status(&self) -> Vec<(SandboxStatus, usize)> {
        let live = self.shared.live();
        SandboxStatus::ALL
            .iter()
            .map(|&status| (status, live.values().filter(|l| l.status == status).count()))
            .collect()
    }
}
