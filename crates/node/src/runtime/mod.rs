//! [`LinuxRuntime`]: the core's [`Runtime`] on a Linux host.
//!
//! A sandbox is the agent binary started with `boot`: it joins the sandbox's cgroups, unshares
//! its namespaces and forks the sandbox's PID 1, then the node wires the network namespace to
//! the host. The sandbox is not a child of the server, so it outlives a server restart; its
//! [`RuntimeHandle`] in the store is how a restarted server finds it again.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{
    AdoptedCheckpoint, AgentLogChunk, EgressRules, Endpoint, LaunchSpec, Runtime, RuntimeError,
    RuntimeHandle, SnapshotParts,
};

use crate::net::network::NetworkError;
use crate::resources::cgroups::CgroupError;
use crate::storage::disks::DiskError;

/// Declares one part of the node's work on sandboxes: a handle on the node's state, made
/// `of` it, so that each part is cheap to make wherever it is needed.
macro_rules! node_part {
    ($(#[$meta:meta])* $vis:vis struct $name:ident;) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        $vis struct $name {
            pub(super) node: std::sync::Arc<$crate::runtime::state::NodeState>,
        }

        impl $name {
            pub(super) fn of(node: &std::sync::Arc<$crate::runtime::state::NodeState>) -> Self {
                Self {
                    node: std::sync::Arc::clone(node),
                }
            }
        }
    };
}

mod admission;
mod adopt;
pub(crate) mod agent_client;
mod agent_copies;
pub mod agent_log;
mod carried;
mod criu_runs;
mod handle;
mod holdings;
mod host;
#[cfg(test)]
mod host_fake;
mod host_ops;
mod in_flight;
mod jailed;
mod launch;
mod layers;
mod ledger;
mod pausing;
mod places;
mod restore;
mod sampling_memo;
mod sequence;
mod snapshot;
mod state;
mod stats;
pub mod warm;
mod warm_boot;

pub(crate) use in_flight::InFlightGuard;
pub use layers::LayerKeeper;

use adopt::Adopter;
use handle::{is_alive, launched};
use launch::Launcher;
use pausing::Pauser;
use restore::Restorer;
use snapshot::Snapshotter;
use state::NodeState;
use stats::NodeReports;
use warm_boot::WarmKeeper;

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// The agent binary started in every sandbox.
    pub agent_bin: PathBuf,
    pub network_base: Ipv4Addr,
    pub network_prefix_len: u8,
    pub pids_max: u32,
    /// Upstream resolvers the sandboxes' resolver forwards to (address or address:port).
    pub nameservers: Vec<String>,
    /// Private ranges sandboxes with internet access may reach (refused by default).
    pub allowed_private: Vec<String>,
    /// Enforce `diskSizeMB` with a btrfs pool under the data directory.
    pub disk_quotas: bool,
    /// Size of the disk pool image: made this size, or grown to it; `None`: a share of the
    /// free space when it is made (see `disks::PoolConfig`).
    pub disk_pool_bytes: Option<u64>,
    /// Disk size of the default template's sandboxes: the pool must hold one.
    pub default_disk_mb: u32,
    /// Bytes of the disk pool new sandbox disks may not count on (see [`PoolConfig`]).
    pub disk_pool_reserve_bytes: u64,
    /// How many times the pool the quotas of all sandbox disks may add up to.
    pub disk_overcommit: u32,
    /// Bytes of the data directory's filesystem kept free: work that writes there is refused
    /// below it.
    pub data_reserve_bytes: u64,
    /// Host uid/gid of the first sandbox id range; slot N gets
    /// `id_base + N * SANDBOX_IDS` onwards.
    pub id_base: u32,
    /// Pseudo-terminals one sandbox may hold at once.
    pub pty_max: u32,
    /// Memory kept for the host and the server, in MiB: no sandbox starts when less than
    /// this (and a start's cost) is available.
    pub memory_reserve_mb: u64,
    /// How many times the host's memory (less the reserve) the memory limits of all
    /// sandboxes may add up to.
    pub memory_overcommit: u32,
    /// What all sandboxes together may use, in MiB (their parent cgroup's limit); `None`:
    /// the host's memory less `memory_reserve_mb`.
    pub sandboxes_memory_limit_mb: Option<u64>,
    /// Memory pressure (PSI `full avg10`, percent) at which new sandboxes are refused.
    pub memory_pressure_limit_percent: f64,
    /// The CRIU binary for checkpoints of paused sandboxes; `None` keeps them in memory.
    pub criu: Option<PathBuf>,
    /// How often, at most, a node whose CRIU failed its probe probes it again when a
    /// checkpoint, snapshot or fork needs it.
    pub criu_reprobe: std::time::Duration,
    /// Network namespaces kept wired and waiting for new sandboxes.
    pub netns_pool: usize,
    /// Sandboxes kept booted and waiting for creates of the image last asked for.
    pub warm_pool: usize,
    /// Size at which a sandbox's agent log on the host is rotated (see `agent_log`).
    pub agent_log_rotate_bytes: u64,
    /// What the warm pool keeps at most, all images together, when creates ask for more.
    pub warm_pool_max: usize,
    /// How long a template's ready command may take to succeed.
    pub ready_timeout: Duration,
    /// Bandwidth of each sandbox in each direction, in Mbit/s; 0 for no limit.
    pub sandbox_bandwidth_mbit: u32,
    /// Disk rates of each sandbox on the devices under its files.
    pub sandbox_io: crate::resources::io::IoRates,
}

/// Ids a sandbox has (uids and gids 0..65535 inside, as in an ordinary system).
pub const SANDBOX_IDS: u32 = 65536;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Network(#[from] NetworkError),
    #[error("agent binary {path} is missing: {source}")]
    AgentMissing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    Dns(#[from] crate::net::dns::DnsError),
    #[error("the sandbox id ranges from {base} do not fit in 32 bits for {slots} slots")]
    IdRange { base: u32, slots: u32 },
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How long a stop waits for build sandboxes still being launched or removed.
const BUILD_SANDBOXES_PATIENCE: Duration = Duration::from_secs(30);

fn sandbox_err(id: &str, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: id.to_owned(),
        message: message.to_string(),
    }
}

/// Runs `work` for sandbox `id` off the async threads, as file and mount work must; its
/// failure, or the thread's, is the sandbox's error.
async fn run_blocking<T, E>(
    id: &str,
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, RuntimeError>
where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, e))
}

/// A kill's cgroup error: processes that outlived it are the client's to retry, anything
/// else is the node's failure.
fn kill_err(id: &str, err: crate::resources::cgroups::CgroupError) -> RuntimeError {
    match err {
        crate::resources::cgroups::CgroupError::Lingering { processes, .. } => {
            RuntimeError::StillRunning {
                sandbox_id: id.to_owned(),
                processes,
            }
        }
        other => sandbox_err(id, other),
    }
}

/// The server's own `oom_score_adj`: when the host runs out of memory, the kernel kills
/// sandbox processes and host services before the process that manages them.
pub const SERVER_OOM_SCORE_ADJ: &str = "-900";

/// Lowers the server's `oom_score_adj` to [`SERVER_OOM_SCORE_ADJ`]; the sandboxes it starts
/// are set back to 0. Needs `CAP_SYS_RESOURCE`, which some container hosts withhold; the
/// server then keeps the host's 0, still far below the 800 sandbox processes run at.
pub fn protect_server_from_oom_killer() -> std::io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", SERVER_OOM_SCORE_ADJ)
}

/// The node's runtime: the core's [`Runtime`] over the parts that each look after one concern,
/// all sharing the node's [`NodeState`].
#[derive(Debug)]
pub struct LinuxRuntime {
    node: Arc<NodeState>,
    launcher: Launcher,
    pauser: Pauser,
    restorer: Restorer,
    snapshots: Snapshotter,
    adopter: Adopter,
    warm: WarmKeeper,
    layers: LayerKeeper,
    reports: NodeReports,
}

impl LinuxRuntime {
    /// Checks the host and prepares the node's directories and firewall.
    pub async fn new(config: NodeConfig) -> Result<Self, NodeError> {
        let node = Arc::new(NodeState::open(config).await?);
        Ok(Self {
            launcher: Launcher::of(&node),
            pauser: Pauser::of(&node),
            restorer: Restorer::of(&node),
            snapshots: Snapshotter::of(&node),
            adopter: Adopter::of(&node),
            warm: WarmKeeper::of(&node),
            layers: LayerKeeper::of(&node),
            reports: NodeReports::of(&node),
            node,
        })
    }

    /// The node's layers: its store, the cluster's where one is configured, and the builds
    /// that add to them.
    pub fn layers(&self) -> &LayerKeeper {
        &self.layers
    }

    /// Keeps sandboxes booted for the image creates last asked for, in the background, from
    /// now on (see [`WarmKeeper::start_warm_pool`]).
    pub fn start_warm_pool(&self) {
        self.warm.start_warm_pool();
    }

    /// Unmounts what the node keeps mounted for sandboxes when none is left (clean shutdown).
    pub async fn release(&self) {
        for warm in self.node.warm.close().await {
            self.warm.retire_warm(&warm).await;
        }
        if !self
            .node
            .build_sandboxes_settling
            .settle(BUILD_SANDBOXES_PATIENCE)
            .await
        {
            tracing::warn!(
                "build sandboxes were still being launched or removed at the stop; the next start removes them"
            );
        }
        self.node.cgroups.remove_spare_memory_groups();
        self.node.cgroups.release_freezer_checks();
        self.node.disks.release_if_empty().await;
    }
}

#[async_trait::async_trait]
impl Runtime for LinuxRuntime {
    async fn launch(&self, spec: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        self.launcher.launch_sandbox(spec).await
    }

    async fn destroy(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let handle = launched(sandbox_id, handle).ok();
        self.node.teardown(sandbox_id, handle).await
    }

    fn is_alive(&self, _sandbox_id: &str, handle: &RuntimeHandle) -> bool {
        is_alive(handle)
    }

    async fn sweep(&self, recorded: &[String]) -> Result<usize, RuntimeError> {
        self.adopter.sweep(recorded).await
    }

    async fn update_network(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        self.node.update_network(sandbox_id, handle, rules).await
    }

    fn agent_log(&self, sandbox_id: &str, offset: u64, max: usize) -> Option<AgentLogChunk> {
        self.reports.agent_log(sandbox_id, offset, max)
    }

    fn prepare_sampling_thread(&self) {
        stats::run_sampling_in_background();
    }

    async fn pause(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        self.pauser.pause(sandbox_id, handle).await
    }

    async fn resume(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        self.pauser.resume(sandbox_id, handle).await
    }

    async fn release(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        self.pauser.release(sandbox_id, handle).await
    }

    fn can_checkpoint(&self) -> bool {
        self.node.criu.get().is_some()
    }

    async fn checkpoints_ready(&self) -> bool {
        self.node.criu.get_or_probe().await.is_some()
    }

    async fn snapshot(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
        agent_token: &str,
        memory: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        self.snapshots
            .snapshot(sandbox_id, handle, agent_token, memory)
            .await
    }

    fn snapshot_recorded(&self, parts: &SnapshotParts) {
        self.snapshots.snapshot_recorded(parts)
    }

    async fn discard_snapshot(&self, parts: &SnapshotParts) {
        self.snapshots.discard_snapshot(parts).await
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        self.pauser.checkpoint_sandbox(sandbox_id, handle).await
    }

    async fn restore(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        self.restorer.restore_sandbox(sandbox_id, handle).await
    }

    async fn adopt_checkpointed(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        self.adopter
            .adopt_checkpointed_sandbox(sandbox_id, handle)
            .await
    }

    async fn discard_checkpoint(&self, sandbox_id: &str) {
        self.pauser.discard_checkpoint(sandbox_id).await
    }

    async fn share_files(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        self.adopter.share_files(sandbox_id, handle).await
    }

    async fn share_checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        self.adopter.share_checkpoint(sandbox_id, handle).await
    }

    async fn take_over_files(
        &self,
        sandbox: &sandbar_core::Sandbox,
        files: &sandbar_core::LayerBlob,
        checkpoint: Option<&sandbar_core::LayerBlob>,
    ) -> Result<sandbar_core::TakenOver, RuntimeError> {
        self.adopter
            .take_over_files(sandbox, files, checkpoint)
            .await
    }

    async fn adopt_released(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        self.adopter.adopt_released(sandbox_id, handle).await
    }

    fn stats(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Option<sandbar_core::runtime::RuntimeStats> {
        self.reports.stats(sandbox_id)
    }

    fn is_paused(&self, sandbox_id: &str, _handle: &RuntimeHandle) -> bool {
        self.reports.is_paused(sandbox_id)
    }

    fn disk_io(&self) -> Option<sandbar_core::DiskIoReport> {
        self.reports.disk_io()
    }

    fn memory(&self) -> Option<sandbar_core::MemoryReport> {
        self.reports.memory()
    }

    fn warm_pool(&self) -> Option<sandbar_core::WarmPoolReport> {
        self.reports.warm_pool()
    }

    fn data_disk(&self) -> Option<sandbar_core::DiskSpace> {
        self.reports.data_disk()
    }

    fn disks(&self) -> sandbar_core::DiskReport {
        self.reports.disks()
    }

    fn oom_kills(&self) -> u64 {
        self.reports.oom_kills()
    }

    async fn adopt(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<Endpoint>, RuntimeError> {
        self.adopter.adopt(sandbox_id, handle).await
    }
}

/// Inode of a namespace file (`/proc/PID/ns/net` or a bind mount of one).
fn ns_inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// Whether `path` is a namespace (a bind mount of one): after a reboot only the empty file
/// it was mounted on is left.
fn is_nsfs(path: &Path) -> bool {
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain old data; all-zero is a valid value for it to fill in.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid nul-terminated path and `st` a statfs the call may write.
    let found = unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0;
    found && st.f_type as i64 == NSFS_MAGIC
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::agent_copies::collect_agent_copies;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn agent_copies_are_kept_while_something_uses_them() {
        let data = tempfile::tempdir().unwrap();
        let agents = data.path().join("agents");
        std::fs::create_dir_all(&agents).unwrap();
        let [current, named, unused, busy] = ["a", "b", "c", "d"].map(|c| c.repeat(64));
        for name in [&current, &named, &unused, &busy] {
            std::fs::write(agents.join(name), b"agent").unwrap();
        }
        let checkpoint = data.path().join("snapshots/k");
        std::fs::create_dir_all(&checkpoint).unwrap();
        crate::checkpoint::write_header(
            &checkpoint,
            &crate::checkpoint::Header {
                criu_version: crate::checkpoint::CRIU_VERSION.into(),
                agent_digest: named.clone(),
                listener_inode: 1,
                externals: Vec::new(),
                images: Vec::new(),
                images_crc32: 0,
            },
        )
        .unwrap();
        // A live process maps `busy` (this test, standing in for a sandbox's agent).
        let mapped = std::fs::File::open(agents.join(&busy)).unwrap();
        // SAFETY: a private read-only mapping of a 5-byte file that outlives the call.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                5,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                mapped.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let removed = collect_agent_copies(data.path(), &current);
        assert_eq!(removed, vec![agents.join(&unused)]);
        for kept in [&current, &named, &busy] {
            assert!(agents.join(kept).exists(), "{kept}");
        }
        // SAFETY: the mapping made above, unmapped once.
        unsafe { libc::munmap(at, 5) };
    }
}
