//! The one seam between the node's sequences and the host: every call that creates, changes
//! or removes something of a sandbox on the machine (cgroups, disks, egress rules, network
//! slots, the jailed agent, the freezer) goes through [`HostOps`]. The sequences built on it
//! (`sequence.rs`) decide the order and what is undone when a step fails; they are
//! unit-tested against a recording fake (`host_fake.rs`) without root.

use std::future::Future;
use std::path::{Path, PathBuf};

use sandbar_core::{EgressRules, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

use super::criu_runs::CriuDump;
use super::jailed::BootSpec;
use super::restore::SlotRestore;
use crate::checkpoint::HostSocket;
use crate::resources::cgroups::{CgroupError, Limits};

/// Where a booting sandbox's files come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DiskSource {
    /// A new empty writable layer of this size.
    Fresh { size_mb: u32 },
    /// The files it kept, owned by the ids starting at `id_base` until now.
    Kept { id_base: u32 },
}

/// What the node's sequences ask of the host for one sandbox. Each call that makes
/// something has the call that removes it: `create_cgroups` / `remove_cgroups`,
/// `make_disk` / `remove_disk`, `apply_egress` / `remove_egress`, `spawn_agent` or
/// `restore_processes` / `kill_processes`, and a claimed network slot / `release_slot`.
pub(super) trait HostOps: Sync {
    /// A network namespace prepared for one slot, given to the agent when it starts.
    type Netns: Send + Sync;

    fn netns_slot(netns: &Self::Netns) -> u32;

    fn freeze(&self, sandbox_id: &str) -> impl Future<Output = Result<(), CgroupError>> + Send;
    fn thaw(&self, sandbox_id: &str) -> Result<(), CgroupError>;
    /// Unix sockets of the host's network namespace that the sandbox's processes hold.
    fn host_sockets(&self, sandbox_id: &str) -> Vec<HostSocket>;

    fn create_cgroups(&self, sandbox_id: &str, limits: Limits) -> Result<(), RuntimeError>;
    /// The sandbox's writable layer, owned by the ids starting at `id_base`.
    fn make_disk(
        &self,
        sandbox_id: &str,
        source: DiskSource,
        id_base: u32,
    ) -> impl Future<Output = Result<PathBuf, RuntimeError>> + Send;
    fn apply_egress(
        &self,
        sandbox_id: &str,
        slot: u32,
        allow_internet: bool,
        rules: &EgressRules,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
    /// Starts the jailed agent as the sandbox's PID 1; returns its host PID.
    fn spawn_agent(
        &self,
        boot: &BootSpec<'_>,
        dir: &Path,
        netns: &Self::Netns,
        id_map: IdMap,
    ) -> impl Future<Output = Result<i32, RuntimeError>> + Send;
    /// Restores the processes of a staged checkpoint as sandbox `spec` in `netns`; returns
    /// the restored PID 1.
    fn restore_processes(
        &self,
        spec: &LaunchSpec,
        netns: Self::Netns,
        id_map: IdMap,
        restore: SlotRestore,
    ) -> impl Future<Output = Result<i32, RuntimeError>> + Send;
    /// Waits until the agent answers on its socket.
    fn wait_agent(
        &self,
        sandbox_id: &str,
        slot: u32,
    ) -> impl Future<Output = Result<Endpoint, RuntimeError>> + Send;
    /// The template's start command, then its ready command until it succeeds.
    fn start_and_ready(
        &self,
        spec: &LaunchSpec,
        endpoint: &Endpoint,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Kills every process of the sandbox (`init`, when known and still the same process,
    /// first) and waits a bounded time for them to go.
    fn kill_processes(
        &self,
        sandbox_id: &str,
        init: Option<&RuntimeHandle>,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
    /// Runs CRIU's dump of the frozen sandbox; when it fails, the processes stay frozen as
    /// they were.
    fn dump(
        &self,
        sandbox_id: &str,
        dump: &CriuDump<'_>,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
    /// Kills what a dump that ended the processes left in the sandbox's cgroup.
    fn kill_leftovers(
        &self,
        sandbox_id: &str,
    ) -> impl Future<Output = Result<(), CgroupError>> + Send;
    /// Drops the page cache the sandbox's cgroup still holds once its processes are gone.
    fn empty_memory(&self, sandbox_id: &str);
    fn remove_egress(&self, slot: u32) -> impl Future<Output = ()> + Send;
    /// Takes the slot's network down so the slot can be prepared for another sandbox.
    fn release_slot(&self, slot: u32) -> impl Future<Output = ()> + Send;
    /// Out-of-memory kills the sandbox's cgroup counted; read before it is removed.
    fn oom_kills(&self, sandbox_id: &str) -> Option<u64>;
    fn remove_cgroups(
        &self,
        sandbox_id: &str,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
    /// The agent's socket, which outlives nothing it served.
    fn remove_agent_socket(&self, sandbox_id: &str);
    /// Its checkpoint, if any, and its agent log.
    fn remove_records(&self, sandbox_id: &str);
    fn remove_disk(
        &self,
        sandbox_id: &str,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;
}
