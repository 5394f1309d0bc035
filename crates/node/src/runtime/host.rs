//! [`HostOps`] on this machine, and the node's stop and teardown of a sandbox run on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{EgressRules, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

use super::criu_runs::{CriuDump, run_dump};
use super::handle::is_alive;
use super::host_ops::{DiskSource, HostOps};
use super::jailed::{BootSpec, Jailer};
use super::restore::{Restorer, SlotRestore};
use super::state::NodeState;
use super::{kill_err, run_blocking, sandbox_err, sequence};
use crate::checkpoint::HostSocket;
use crate::net::netns::PreparedNetns;
use crate::resources::cgroups::{CgroupError, Limits};

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
        Jailer::of(self.0)
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
        Jailer::of(self.0)
            .start_and_wait_ready(spec, endpoint)
            .await
    }

    async fn kill_processes(
        &self,
        sandbox_id: &str,
        init: Option<&RuntimeHandle>,
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
        run_dump(&self.0.cgroups, sandbox_id, dump).await
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
        run_blocking(sandbox_id, move || disks.remove(&owned_id)).await
    }
}

impl NodeState {
    /// Ends sandbox `id` on this node: its processes, its files and log, and everything its
    /// owner holds.
    pub(super) async fn teardown(
        self: &Arc<Self>,
        id: &str,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), RuntimeError> {
        sequence::teardown(&LinuxHost(self), &self.holdings, &self.slots, id, handle).await
    }

    /// Ends the processes of sandbox `id` and gives back what they held (its slot and
    /// memory); its disk, layers and agent log stay.
    pub(super) async fn stop(
        self: &Arc<Self>,
        id: &str,
        handle: Option<&RuntimeHandle>,
    ) -> Result<(), RuntimeError> {
        sequence::stop(&LinuxHost(self), &self.holdings, &self.slots, id, handle).await
    }
}
