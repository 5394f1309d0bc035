//! What the node asks its ledger and disk pool before a sandbox starts, and how a sandbox
//! found running at a restart is counted again: the node-wide side of [`super::ledger`],
//! kept apart so the ledger itself knows nothing of the node.

use sandbar_core::{HandlePhase, RuntimeError, RuntimeHandle};

use crate::resources::memory::HostMemory;
use crate::resources::tasks::HostTasks;
use crate::storage::disks::{DiskError, DiskPromise};

use super::holdings::{NodeSandbox, SlotHold};
use super::ledger::MemoryGrant;
use super::sandbox_err;
use super::state::NodeState;

impl NodeState {
    /// Counts `memory_mb` (the sandbox's ceiling) for sandbox `id`, or says why the node
    /// cannot start it now: what is short is the memory the host really has, the ceilings
    /// promised in all (see [`crate::resources::memory`]), or the host's tasks ([`crate::resources::tasks`]).
    pub(super) fn grant_memory(
        &self,
        id: &str,
        memory_mb: u32,
    ) -> Result<MemoryGrant, RuntimeError> {
        let oom_now = self.cgroups.oom_kills(id).unwrap_or(0);
        self.ledger
            .grant(
                id,
                memory_mb,
                self.memory_view().as_ref(),
                self.host_tasks(),
                oom_now,
            )
            .map_err(|refusal| refusal.of_sandbox(id))
    }

    /// Whether the host can start sandbox `id` (a warm boot, which is granted no memory of its
    /// own) beside what is promised: its memory and its tasks.
    pub(super) fn admit_start(&self, id: &str) -> Result<(), RuntimeError> {
        self.ledger
            .admit_beside_promised(self.memory_view().as_ref(), self.host_tasks(), 0)
            .map_err(|refusal| refusal.of_sandbox(id))
    }

    /// The host's memory as sandboxes may have it: within their common cgroup's limit.
    pub(super) fn memory_view(&self) -> Option<HostMemory> {
        let host = HostMemory::read()?;
        Some(match self.cgroups.sandboxes_memory() {
            Some(together) => host.within(together, self.ledger.memory_rule().reserve_mb),
            None => host,
        })
    }

    fn host_tasks(&self) -> Option<HostTasks> {
        self.ledger.task_limit.and_then(HostTasks::read)
    }

    /// Records the grant of a sandbox an earlier server started or restored.
    pub(super) fn regrant_memory(&self, id: &str, memory_mb: u32) -> MemoryGrant {
        let oom_now = self.cgroups.oom_kills(id).unwrap_or(0);
        self.ledger.regrant(id, memory_mb, oom_now)
    }

    /// Gives sandbox `id` what an earlier server left it in `phase`, with no admission: its
    /// disk and the layers `h` names always, its slot unless released, its memory while its
    /// processes run.
    pub(super) fn adopt_holdings(&self, id: &str, h: &RuntimeHandle, phase: HandlePhase) {
        self.holdings.adopt(
            id,
            NodeSandbox {
                slot: (phase != HandlePhase::Released)
                    .then(|| SlotHold::retaken(&self.slots, h.slot)),
                memory: (phase == HandlePhase::Running)
                    .then(|| self.regrant_memory(id, h.memory_mb)),
                disk: self.disks.adopt(id),
                layers: h.layers.clone(),
            },
        );
    }

    /// Counts sandbox `id`'s disk against the pool, mounting a failed (read-only) pool
    /// afresh first when nothing holds it.
    pub(super) async fn admit_disk(
        &self,
        id: &str,
        size_mb: u32,
    ) -> Result<DiskPromise, RuntimeError> {
        let no_room = |err: DiskError| match err {
            DiskError::NoRoom {
                sandbox_id,
                message,
            } => RuntimeError::NoCapacity {
                sandbox_id,
                message,
            },
            other => sandbox_err(id, other),
        };
        match self.disks.admit(id, size_mb) {
            Ok(promise) => Ok(promise),
            Err(err) if self.disks.report().is_some_and(|r| r.space.read_only) => {
                if let Err(e) = self.disks.recover().await {
                    return Err(RuntimeError::NoCapacity {
                        sandbox_id: id.to_owned(),
                        message: format!("{}: {e}", no_room(err)),
                    });
                }
                self.disks.admit(id, size_mb).map_err(no_room)
            }
            Err(err) => Err(no_room(err)),
        }
    }
}
