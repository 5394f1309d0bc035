//! The one seam between the node's sequences and the host: every call that creates, changes
//! or removes something of a sandbox on the machine (cgroups, disks, egress rules, network
//! slots, the jailed agent, the freezer) goes through [`HostOps`]. The sequences built on it
//! (`sequence.rs`) decide the order and what is undone when a step fails; they are
//! unit-tested against a recording fake (`host_fake.rs`) without root.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{EgressRules, Endpoint, LaunchSpec, RuntimeError};
use sandbar_jail::IdMap;

use super::handle::{Handle, is_alive};
use super::launch::BootSpec;
use super::launch::Launcher;
use super::pausing::Pauser;
use super::restore::Restorer;
use super::restore::SlotRestore;
use super::state::NodeState;
use super::{kill_err, sandbox_err};
use crate::checkpoint::HostSocket;
use crate::net::netns::PreparedNetns;
use crate::resources::cgroups::{CgroupError, Limits};

/// Where a booting sandbox's files come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DiskSource {
    /// A new empty writable layer of this size.
    Fresh { size_mb: u32 },
    /// The files it kept, owned by the ids starting at `id_base` until now.
    Kept { id_base: u32 },
}

/// One CRIU dump of a frozen sandbox: its init, the CRIU that runs it, the sandbox's freezer,
/// where its images go and what its plan told CRIU about the host.
pub(super) struct CriuDump<'a> {
    pub(super) init: &'a Handle,
    pub(super) criu: &'a crate::checkpoint::Criu,
    pub(super) freezer: &'a Path,
    pub(super) images: &'a Path,
    pub(super) plan: &'a crate::checkpoint::DumpPlan,
    /// A snapshot's dump leaves the processes running; a checkpoint's ends them.
    pub(super) leave_running: bool,
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
        init: Option<&Handle>,
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

/// [`HostOps`] on this host: its cgroups, disk pool, nftables, network namespaces and
/// `/proc`.
pub(super) struct LinuxHost<'a>(pub(super) &'a Arc<NodeState>);

/// How long a killed sandbox's PID 1 is waited for.
const INIT_EXIT_PATIENCE: Duration = Duration::from_millis(2500);

impl HostOps for LinuxHost<'_> {
    type Netns = PreparedNetns;

    fn netns_slot(netns: &PreparedNetns) -> u32 {
        netns.slot
    }

    async fn freeze(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        self.0.cgroups.freeze(sandbox_id).await
    }

    fn thaw(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        self.0.cgroups.thaw(sandbox_id)
    }

    fn host_sockets(&self, sandbox_id: &str) -> Vec<HostSocket> {
        crate::checkpoint::host_unix_sockets(&self.0.cgroups.members(sandbox_id))
    }

    fn create_cgroups(&self, sandbox_id: &str, limits: Limits) -> Result<(), RuntimeError> {
        self.0
            .cgroups
            .create(sandbox_id, limits)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    async fn make_disk(
        &self,
        sandbox_id: &str,
        source: DiskSource,
        id_base: u32,
    ) -> Result<PathBuf, RuntimeError> {
        match source {
            DiskSource::Fresh { size_mb } => self
                .0
                .disks
                .create(sandbox_id, size_mb, id_base)
                .map_err(|e| sandbox_err(sandbox_id, e)),
            DiskSource::Kept { id_base: from } => {
                self.0.reuse_disk(sandbox_id, from, id_base).await
            }
        }
    }

    async fn apply_egress(
        &self,
        sandbox_id: &str,
        slot: u32,
        allow_internet: bool,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        self.0
            .apply_egress(sandbox_id, slot, allow_internet, rules)
            .await
    }

    async fn spawn_agent(
        &self,
        boot: &BootSpec<'_>,
        dir: &Path,
        netns: &PreparedNetns,
        id_map: IdMap,
    ) -> Result<i32, RuntimeError> {
        Launcher::of(self.0)
            .spawn_jailed(boot, dir, netns, id_map)
            .await
    }

    async fn restore_processes(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        id_map: IdMap,
        restore: SlotRestore,
    ) -> Result<i32, RuntimeError> {
        Restorer::of(self.0)
            .restore_processes(spec, netns, id_map, restore)
            .await
    }

    async fn wait_agent(&self, sandbox_id: &str, slot: u32) -> Result<Endpoint, RuntimeError> {
        let endpoint = self.0.endpoint(sandbox_id, slot)?;
        super::agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(15))
            .await
            .map_err(|e| {
                let log =
                    std::fs::read_to_string(self.0.places.log_path(sandbox_id)).unwrap_or_default();
                sandbox_err(sandbox_id, format!("{e}; agent log: {}", log.trim()))
            })?;
        Ok(endpoint)
    }

    async fn start_and_ready(
        &self,
        spec: &LaunchSpec,
        endpoint: &Endpoint,
    ) -> Result<(), RuntimeError> {
        Launcher::of(self.0)
            .start_and_wait_ready(spec, endpoint)
            .await
    }

    async fn kill_processes(
        &self,
        sandbox_id: &str,
        init: Option<&Handle>,
    ) -> Result<(), RuntimeError> {
        let init = init.filter(|h| is_alive(h));
        if let Some(h) = init {
            // SAFETY: the PID was checked against its start time just above; killing a PID
            // namespace's init kills every process in it.
            unsafe { libc::kill(h.pid, libc::SIGKILL) };
        }
        self.0
            .cgroups
            .kill_all(sandbox_id)
            .await
            .map_err(|e| kill_err(sandbox_id, e))?;
        if let Some(h) = init {
            let deadline = std::time::Instant::now() + INIT_EXIT_PATIENCE;
            while is_alive(h) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Ok(())
    }

    async fn dump(&self, sandbox_id: &str, dump: &CriuDump<'_>) -> Result<(), RuntimeError> {
        Pauser::of(self.0).run_dump(sandbox_id, dump).await
    }

    async fn kill_leftovers(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        self.0.cgroups.kill_all(sandbox_id).await
    }

    fn empty_memory(&self, sandbox_id: &str) {
        self.0.cgroups.empty_memory(sandbox_id);
    }

    async fn remove_egress(&self, slot: u32) {
        if let Ok(addrs) = self.0.network.addrs(slot) {
            self.0.egress.remove(addrs.sandbox).await;
        }
    }

    async fn release_slot(&self, slot: u32) {
        self.0.network.release(slot).await;
    }

    fn oom_kills(&self, sandbox_id: &str) -> Option<u64> {
        self.0.cgroups.oom_kills(sandbox_id)
    }

    async fn remove_cgroups(&self, sandbox_id: &str) -> Result<(), RuntimeError> {
        self.0
            .cgroups
            .remove(sandbox_id)
            .await
            .map_err(|e| kill_err(sandbox_id, e))
    }

    fn remove_agent_socket(&self, sandbox_id: &str) {
        let _ = std::fs::remove_file(self.0.places.socket_path(sandbox_id));
    }

    fn remove_records(&self, sandbox_id: &str) {
        self.0.forget_checkpoint(sandbox_id);
        self.0.remove_log(sandbox_id);
    }

    async fn remove_disk(&self, sandbox_id: &str) -> Result<(), RuntimeError> {
        let disks = self.0.disks.clone();
        let owned_id = sandbox_id.to_owned();
        tokio::task::spawn_blocking(move || disks.remove(&owned_id))
            .await
            .map_err(|e| sandbox_err(sandbox_id, e))?
            .map_err(|e| sandbox_err(sandbox_id, e))
    }
}
