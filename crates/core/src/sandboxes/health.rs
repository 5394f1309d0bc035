//! What the node reports about itself: its memory and disks, its sandboxes by status, and
//! what ails it.

use std::sync::Arc;

use chrono::Utc;

use super::CHECKPOINT_ATTEMPTS;
use super::shared::Shared;
use crate::disks::{DiskFull, DiskReport};
use crate::lifecycle::SandboxStatus;
use crate::model::{NodeRecord, NodeReport};
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

    /// What this node measures of itself: memory, disk pool and the sandboxes it holds. The
    /// templates it holds and its build slots are the node's to add.
    pub fn report(&self) -> NodeReport {
        let memory = self.memory().unwrap_or_default();
        let disks = self.disks();
        let pool = disks.pool.as_ref();
        let measured_at = Utc::now();
        let held: usize = self.count_by_status().iter().map(|(_, n)| n).sum();
        NodeReport {
            memory_total_bytes: memory.total_bytes,
            memory_available_bytes: memory.available_bytes,
            memory_promised_bytes: memory.promised_bytes,
            memory_promise_limit_bytes: memory.promise_limit_bytes,
            disk_pool_bytes: pool.map_or(0, |p| p.size_bytes),
            disk_pool_free_bytes: pool.map_or(0, |p| p.free_bytes),
            disk_promised_bytes: disks.pool_promised_bytes,
            disk_promise_limit_bytes: disks.pool_promise_limit_bytes,
            sandboxes: u32::try_from(held).unwrap_or(u32::MAX),
            measured_at: Some(measured_at),
            ..NodeReport::default()
        }
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
