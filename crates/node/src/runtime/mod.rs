//! [`LinuxRuntime`]: the core's [`Runtime`] on a Linux host.
//!
//! A sandbox is the agent binary started with `boot`: it joins the sandbox's cgroups, unshares
//! its namespaces and forks the sandbox's PID 1, then the node wires the network namespace to
//! the host. The sandbox is not a child of the server, so it outlives a server restart; its
//! [`Handle`] in the store is how a restarted server finds it again.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use sandbar_core::{
    AdoptedCheckpoint, AgentLogChunk, EgressRules, Endpoint, LaunchSpec, Runtime, RuntimeError,
    RuntimeHandle, SnapshotParts,
};
use sandbar_jail::{AgentConfig, IdMap, JailSpec, LISTENER_FD, NETNS_FD, OOM_EVENTS_FD};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::net::netns::{NetnsPool, PreparedNetns, SlotSet};
use crate::net::network::{Network, NetworkError};
use crate::resources::cgroups::{CgroupDriver, CgroupError, Limits};
use crate::storage::disks::{DiskError, DiskPool, PoolConfig};

pub(crate) mod agent_client;
mod agent_copies;
pub mod agent_log;
mod carried;
mod handle;
mod holdings;
mod host;
#[cfg(test)]
mod host_fake;
mod in_flight;
mod launch;
mod layers;
mod ledger;
mod pausing;
mod places;
mod restore;
mod sequence;
mod snapshot;
pub mod warm;
mod warm_boot;

pub(crate) use in_flight::{InFlight, InFlightGuard};

use agent_copies::*;
use carried::*;
use handle::*;
use holdings::{Holdings, NodeSandbox, SlotHold};
use host::LinuxHost;
use launch::*;
use pausing::*;
use restore::*;
use snapshot::*;

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

#[derive(Debug)]
pub struct LinuxRuntime {
    config: NodeConfig,
    cgroups: CgroupDriver,
    network: std::sync::Arc<Network>,
    netns_pool: std::sync::Arc<NetnsPool>,
    egress: std::sync::Arc<crate::net::egress::Egress>,
    disks: DiskPool,
    /// Memory granted to sandboxes and the rule for granting more.
    ledger: std::sync::Arc<ledger::ResourceLedger>,
    /// What each sandbox on this node holds: its slot, memory grant, disk promise and layers.
    holdings: Holdings,
    slots: SlotSet,
    layers: crate::storage::layers::LayerStore,
    /// CRIU, once it passed its probe (at start, or later when installed meanwhile).
    criu: crate::checkpoint::criu_cell::CriuCell,
    /// Sandboxes booted ahead of demand.
    warm: crate::runtime::warm::WarmPool,
    /// The content-addressed copy of the agent binary sandboxes run, and its SHA-256: a
    /// checkpoint can only be restored with the exact binary its processes mapped.
    agent_exec: PathBuf,
    agent_digest: String,
    /// Where the kernel keeps objects without a path, which a dump plan leaves to CRIU.
    kernel_filesystems: crate::checkpoint::KernelFilesystems,
    /// The host's shared libraries the agent maps.
    agent_libraries: Vec<AgentLibrary>,
    /// Every agent copy kept at start, by identity and digest: sandboxes started by an
    /// earlier build run an earlier one, and no copy is made after start.
    agent_copies: Vec<(crate::checkpoint::FileIdentity, String)>,
    /// Where each sandbox's files sit on the host.
    places: places::NodePlaces,
    /// Snapshot parts not yet kept by a template: the core records the template just after
    /// making them (and says so), and the collector must not take them in between. Entries
    /// older than [`FRESH_SNAPSHOT`] are dropped whatever happened.
    fresh_snapshots: Mutex<Vec<(String, std::time::Instant)>>,
    /// Captures of templates whose restore failed here: their sandboxes boot and run the
    /// start command instead, until the process restarts.
    unrestorable_captures: Mutex<BTreeSet<String>>,
    /// Checkpoint and snapshot directories whose images this process wrote or already
    /// checked against their checksum: nothing changes them afterwards, so a restore, a fork
    /// of many or a second create does not read them all again. Checkpoints a previous server
    /// left are checked once before their first restore.
    verified_images: Mutex<BTreeSet<PathBuf>>,
    /// The cluster's layer store, where one is configured: layers this node lacks are
    /// fetched from it before a sandbox boots on them.
    shared_layers: std::sync::OnceLock<std::sync::Arc<crate::cluster::shared_layers::SharedLayers>>,
    /// Build sandboxes being launched or removed in tasks of their own (a build dropped
    /// where it stands leaves them to finish): the server's stop waits for them.
    build_sandboxes_settling: std::sync::Arc<InFlight>,
}

/// How long a stop waits for build sandboxes still being launched or removed.
const BUILD_SANDBOXES_PATIENCE: Duration = Duration::from_secs(30);

fn sandbox_err(id: &str, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: id.to_owned(),
        message: message.to_string(),
    }
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

/// Sets the calling process's `oom_score_adj` (and, for a privileged caller, its floor) to 0.
/// Async-signal-safe: called between fork and exec.
fn reset_oom_score_adj() {
    // SAFETY: open, write and close on a static path and buffer.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            let _ = libc::write(fd, c"0".as_ptr().cast(), 1);
            libc::close(fd);
        }
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

impl LinuxRuntime {
    /// Checks the host and prepares the node's directories and firewall.
    pub async fn new(config: NodeConfig) -> Result<Self, NodeError> {
        std::fs::metadata(&config.agent_bin).map_err(|source| NodeError::AgentMissing {
            path: config.agent_bin.clone(),
            source,
        })?;
        // Before anything looks at sandboxes, checkpoints or agent copies.
        if let Some(criu) = &config.criu {
            Self::wait_for_orphaned_criu(criu, &config.data_dir).await;
        }
        let mut cgroups = CgroupDriver::detect()?;
        let shaping = crate::net::shaping::Shaping::from_mbit(config.sandbox_bandwidth_mbit);
        match shaping {
            Some(_) => tracing::info!(
                mbit = config.sandbox_bandwidth_mbit,
                "each sandbox's network is limited to this rate in each direction"
            ),
            None => tracing::warn!("sandbox bandwidth is not limited"),
        }
        let network = std::sync::Arc::new(
            Network::new(config.network_base, config.network_prefix_len).with_shaping(shaping),
        );
        let last_id =
            u64::from(config.id_base) + u64::from(network.capacity()) * u64::from(SANDBOX_IDS);
        if last_id > u64::from(u32::MAX - 1) {
            return Err(NodeError::IdRange {
                base: config.id_base,
                slots: network.capacity(),
            });
        }
        let allowed_private = config
            .allowed_private
            .iter()
            .map(|range| crate::net::network::parse_range(range))
            .collect::<Result<Vec<_>, _>>()?;
        let upstreams = crate::net::dns::parse_upstreams(&config.nameservers)?;
        let egress = crate::net::egress::Egress::new();
        let resolver = crate::net::dns::Resolver::start(upstreams, egress.clone()).await?;
        network
            .init(&crate::net::network::FirewallConfig {
                resolver_port: resolver.port,
                allowed_private,
            })
            .await?;
        let disks = DiskPool::open(&PoolConfig {
            dir: config.data_dir.join("sandboxes"),
            image: config.data_dir.join("sandboxes.img"),
            size_bytes: config.disk_pool_bytes,
            smallest_disk_bytes: u64::from(config.default_disk_mb) << 20,
            quotas: config.disk_quotas,
            reserve_bytes: config.disk_pool_reserve_bytes,
            overcommit: config.disk_overcommit,
        })
        .await?;
        if !disks.enforces_quotas() {
            tracing::warn!("disk quotas are off: diskSizeMB is not enforced");
        }
        crate::resources::io::hold_sandboxes_to(
            &mut cgroups,
            config.sandbox_io,
            &[disks.dir(), &config.data_dir],
        );
        for dir in [config.data_dir.join("run"), config.data_dir.join("logs")] {
            std::fs::create_dir_all(&dir).map_err(|source| NodeError::Io {
                path: dir.clone(),
                source,
            })?;
            // Agent sockets and sandbox layers are the host's business only.
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        tracing::info!(cgroup_version = cgroups.version(), "node ready");
        let memory_rule = crate::resources::memory::MemoryRule {
            reserve_mb: config.memory_reserve_mb,
            overcommit: config.memory_overcommit,
            pressure_limit_percent: config.memory_pressure_limit_percent,
        };
        if let Some(host) = crate::resources::memory::HostMemory::read() {
            let together_mb = config
                .sandboxes_memory_limit_mb
                .unwrap_or_else(|| host.total_mb.saturating_sub(config.memory_reserve_mb));
            match cgroups.limit_sandboxes_memory(together_mb << 20) {
                Ok(()) => tracing::info!(
                    limit_mb = together_mb,
                    "all sandboxes together may use this much memory; beyond it the kernel reclaims and kills among their processes only"
                ),
                Err(e) => tracing::warn!(
                    limit_mb = together_mb,
                    error = %e,
                    "cannot limit the memory of all sandboxes together; pressure may reach the server"
                ),
            }
            let host = cgroups.sandboxes_memory().map_or(host, |together| {
                host.within(together, memory_rule.reserve_mb)
            });
            tracing::info!(
                memory_limits_mb = memory_rule.promise_limit_mb(&host),
                overcommit = memory_rule.overcommit,
                "the memory limits of all sandboxes may add up to this; each start needs the host's reserve free"
            );
        }
        // Image layers live on the pool, whose accounting then sees them; a dot name keeps
        // them out of the sweep of unknown sandboxes.
        let layers = crate::storage::layers::LayerStore::new(
            config.data_dir.join("templates"),
            config.data_dir.join("sandboxes").join(".images"),
            config.data_dir.join("sandboxes").join(".layers"),
        )
        .with_legacy_images_dir(config.data_dir.join("images").join("layers"))
        .with_checkpoints_dir(config.data_dir.join("snapshots"));
        for dir in [layers.steps_dir(), layers.images_dir()] {
            std::fs::create_dir_all(dir).map_err(|source| NodeError::Io {
                path: dir.to_owned(),
                source,
            })?;
        }
        let slots = SlotSet::default();
        let netns_pool = NetnsPool::new(network.clone(), slots.clone(), config.netns_pool);
        netns_pool.refill();
        let (agent_exec, agent_digest) = keep_agent(&config.agent_bin, &config.data_dir)?;
        let agent_libraries = agent_libraries(&agent_exec);
        for removed in collect_agent_copies(&config.data_dir, &agent_digest) {
            tracing::info!(agent = %removed.display(), "removed an agent copy nothing uses");
        }
        let agent_copies = kept_agent_copies(&config.data_dir);
        let mount_dir = PathBuf::from(format!(
            "/run/sandbar-{}",
            &hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
                config.data_dir.as_os_str().as_encoded_bytes()
            ))[..12]
        ));
        for dir in [
            config.data_dir.join("checkpoints"),
            config.data_dir.join("snapshots"),
            mount_dir.clone(),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| NodeError::Io {
                path: dir.clone(),
                source,
            })?;
        }
        remove_spent_checkpoints(&config.data_dir.join("checkpoints"));
        {
            use std::os::unix::fs::PermissionsExt;
            for private in ["checkpoints", "snapshots"] {
                let _ = std::fs::set_permissions(
                    config.data_dir.join(private),
                    std::fs::Permissions::from_mode(0o700),
                );
            }
            // Traversable, not listable: a restored sandbox's root task opens its sysfs here.
            let _ = std::fs::set_permissions(&mount_dir, std::fs::Permissions::from_mode(0o711));
        }
        // CRIU's kernel probe is cached per boot: an earlier boot's cache may describe another
        // kernel.
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|id| id.trim().to_owned())
            .unwrap_or_default();
        let kdat_dir = mount_dir.join(format!("criu-{boot_id}"));
        if let Ok(entries) = std::fs::read_dir(&mount_dir) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with("criu-")
                    && entry.path() != kdat_dir
                {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new().mode(0o700).create(&kdat_dir);
        }
        let kernel_filesystems =
            crate::checkpoint::KernelFilesystems::probe().map_err(|source| NodeError::Io {
                path: PathBuf::from("/proc/self/fd"),
                source,
            })?;
        let criu = crate::checkpoint::criu_cell::CriuCell::at_start(
            config.criu.clone(),
            kdat_dir.clone(),
            config.criu_reprobe,
        )
        .await;
        Ok(Self {
            criu,
            warm: crate::runtime::warm::WarmPool::new(config.warm_pool, config.warm_pool_max),
            agent_exec,
            agent_digest,
            kernel_filesystems,
            agent_libraries,
            agent_copies,
            places: places::NodePlaces {
                data_dir: config.data_dir.clone(),
                mount_dir,
            },
            fresh_snapshots: Mutex::new(Vec::new()),
            unrestorable_captures: Mutex::new(BTreeSet::new()),
            verified_images: Mutex::new(BTreeSet::new()),
            shared_layers: std::sync::OnceLock::new(),
            build_sandboxes_settling: Default::default(),
            layers,
            config,
            cgroups,
            network,
            netns_pool,
            egress,
            disks,
            ledger: std::sync::Arc::new(ledger::ResourceLedger::new(
                memory_rule,
                crate::resources::tasks::task_limit(),
            )),
            holdings: Holdings::default(),
            slots,
        })
    }

    /// Counts a build sandbox's launch or removal running in a task of its own.
    pub(crate) fn build_sandbox_in_flight(&self) -> InFlightGuard {
        self.build_sandboxes_settling.enter()
    }

    /// The node's files a sandbox's processes may hold from outside its mounts, as a dump
    /// plan recognises them: every agent copy (a sandbox started by an earlier build runs an
    /// earlier one), the agent's libraries and the sandbox's own log.
    fn placed_files(&self, id: &str) -> std::io::Result<crate::checkpoint::PlacedFiles> {
        Ok(crate::checkpoint::PlacedFiles {
            agents: self.agent_copies.clone(),
            log: crate::checkpoint::FileIdentity::of_path(&self.places.log_path(id))?,
            libraries: self
                .agent_libraries
                .iter()
                .map(|l| (l.identity, l.digest.clone()))
                .collect(),
        })
    }

    /// The agent's libraries as a restore finds them: digest and this node's path.
    fn library_sources(&self) -> Vec<(String, PathBuf)> {
        self.agent_libraries
            .iter()
            .map(|l| (l.digest.clone(), l.path.clone()))
            .collect()
    }

    /// Removes the sandbox's agent log with what its rotation kept.
    fn remove_log(&self, id: &str) {
        crate::runtime::agent_log::AgentLog::new(self.places.log_path(id)).remove();
    }

    fn id_map(&self, slot: u32) -> IdMap {
        IdMap {
            host_base: self.config.id_base + slot * SANDBOX_IDS,
            size: SANDBOX_IDS,
        }
    }

    /// Unmounts what the node keeps mounted for sandboxes when none is left (clean shutdown).
    pub async fn release(&self) {
        for warm in self.warm.close().await {
            self.retire_warm(&warm).await;
        }
        if !self
            .build_sandboxes_settling
            .settle(BUILD_SANDBOXES_PATIENCE)
            .await
        {
            tracing::warn!(
                "build sandboxes were still being launched or removed at the stop; the next start removes them"
            );
        }
        self.disks.release_if_empty().await;
    }

    /// The kept directory of a released sandbox, its files given to the id range of the
    /// slot it boots in now when that differs from its last one.
    async fn reuse_disk(&self, id: &str, from: u32, to: u32) -> Result<PathBuf, RuntimeError> {
        let dir = self.disks.path(id);
        if !dir.join(sandbar_jail::layout::UPPER).is_dir() {
            return Err(sandbox_err(
                id,
                format!("its kept files at {} are gone", dir.display()),
            ));
        }
        let moved = dir.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            // The overlay's scratch directory holds nothing to keep, and after a restore its
            // contents belong to host root (CRIU mounted the overlay again): made anew.
            let work = moved.join(sandbar_jail::layout::WORK);
            crate::storage::disks::remove_tree(&work)?;
            std::fs::create_dir(&work)?;
            std::os::unix::fs::chown(&work, Some(to), Some(to))?;
            if from != to {
                crate::storage::layers::move_owners(
                    &moved.join(sandbar_jail::layout::UPPER),
                    from,
                    to,
                    SANDBOX_IDS,
                )?;
                std::os::unix::fs::chown(&moved, Some(to), Some(to))?;
            }
            Ok(())
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| {
            sandbox_err(
                id,
                format!("cannot give its kept files to host ids from {to}: {e}"),
            )
        })?;
        Ok(dir)
    }

    fn endpoint(&self, id: &str, slot: u32) -> Result<Endpoint, RuntimeError> {
        let addrs = self.network.addrs(slot).map_err(|e| sandbox_err(id, e))?;
        Ok(Endpoint {
            agent_socket: self.places.socket_path(id),
            address: IpAddr::V4(addrs.sandbox),
        })
    }
}

#[async_trait::async_trait]
impl Runtime for LinuxRuntime {
    async fn launch(&self, spec: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        self.launch_sandbox(spec).await
    }

    async fn destroy(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let handle = parse_handle(sandbox_id, handle).ok();
        self.teardown(sandbox_id, handle.as_ref()).await
    }

    fn is_alive(&self, sandbox_id: &str, handle: &RuntimeHandle) -> bool {
        parse_handle(sandbox_id, handle).is_ok_and(|h| is_alive(&h))
    }

    async fn sweep(&self, recorded: &[String]) -> Result<usize, RuntimeError> {
        let mut removed = 0;
        let mut found: BTreeSet<String> = self.disks.list().into_iter().collect();
        found.extend(self.cgroups.names());
        for id in found {
            if recorded.contains(&id) {
                continue;
            }
            self.teardown(&id, None).await?;
            removed += 1;
        }
        Ok(removed)
    }

    async fn update_network(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        let handle = parse_handle(sandbox_id, handle)?;
        let open = !rules.is_isolated();
        // Rules first when opening, the name first when closing: never more open than either.
        if open {
            self.apply_egress(sandbox_id, handle.slot, true, rules)
                .await?;
        }
        self.network
            .set_egress(handle.slot, open)
            .await
            .map_err(|e| sandbox_err(sandbox_id, e))?;
        if !open {
            self.apply_egress(sandbox_id, handle.slot, false, rules)
                .await?;
        }
        Ok(())
    }

    fn agent_log(&self, sandbox_id: &str, offset: u64, max: usize) -> Option<AgentLogChunk> {
        let log = crate::runtime::agent_log::AgentLog::new(self.places.log_path(sandbox_id));
        // Checked where the server reads the log, every few seconds while the sandbox runs.
        // A frozen sandbox's log is left alone: a checkpoint may be recording its size.
        let rotated = log.rotate_if_over(self.config.agent_log_rotate_bytes, || {
            !self.cgroups.is_frozen(sandbox_id)
        });
        if let Err(e) = rotated {
            tracing::warn!(sandbox_id, error = %e, "cannot rotate the agent log");
        }
        log.read(offset, max)
    }

    async fn pause(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if !is_alive(&h) {
            return Err(sandbox_err(sandbox_id, "the sandbox is not running"));
        }
        sequence::settle_and_freeze(&LinuxHost(self), sandbox_id, HOST_SOCKETS_PATIENCE)
            .await
            .map(drop)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    async fn resume(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if !is_alive(&h) {
            return Err(sandbox_err(sandbox_id, "the sandbox's processes are gone"));
        }
        self.cgroups
            .thaw(sandbox_id)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    async fn release(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if h.phase == Phase::Released {
            return Ok(handle.clone());
        }
        // Its disk and layers stay held: the kept writable layer only makes sense on top of
        // them.
        self.stop(sandbox_id, Some(&h)).await?;
        // Namespaces kept by an earlier checkpoint would hold its old network alive.
        self.forget_checkpoint(sandbox_id);
        let released = Handle {
            pid: 0,
            start_ticks: 0,
            phase: Phase::Released,
            ..h
        };
        released.to_runtime(sandbox_id)
    }

    fn can_checkpoint(&self) -> bool {
        self.criu.get().is_some()
    }

    async fn checkpoints_ready(&self) -> bool {
        self.criu.get_or_probe().await.is_some()
    }

    async fn snapshot(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
        agent_token: &str,
        memory: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        self.take_snapshot(sandbox_id, &h, agent_token, memory)
            .await
    }

    fn snapshot_recorded(&self, parts: &SnapshotParts) {
        let names: Vec<&String> = std::iter::once(&parts.layer)
            .chain(parts.checkpoint.as_ref())
            .collect();
        self.fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(name, _)| !names.contains(&name));
        // Recorded: other nodes may start it once its parts are in the layer store. Until
        // then it starts only here.
        if let Some(shared) = self.shared_layers.get().cloned() {
            let names: Vec<String> = names.into_iter().cloned().collect();
            tokio::spawn(async move {
                if let Err(e) = shared.publish(&names).await {
                    tracing::warn!(error = %e, "cannot publish a snapshot to the layer store; it starts only on this node");
                }
            });
        }
    }

    async fn discard_snapshot(&self, parts: &SnapshotParts) {
        self.snapshot_recorded(parts);
        if let Some(key) = parts
            .checkpoint
            .as_deref()
            .and_then(|c| c.strip_prefix("checkpoint/"))
            && is_snapshot_key(key)
        {
            let dir = self.places.snapshots_dir().join(key);
            self.set_verified(&dir, false);
            let _ =
                tokio::task::spawn_blocking(move || crate::storage::disks::remove_tree(&dir)).await;
        }
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        self.checkpoint_sandbox(sandbox_id, handle).await
    }

    async fn restore(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        self.restore_sandbox(sandbox_id, handle).await
    }

    async fn adopt_checkpointed(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        self.adopt_checkpointed_sandbox(sandbox_id, handle).await
    }

    async fn discard_checkpoint(&self, sandbox_id: &str) {
        let dir = self.places.checkpoint_dir(sandbox_id);
        self.set_verified(&dir, false);
        // Deleting the images of a large sandbox takes a while (a tenth of a second per GiB)
        // and nothing needs to wait for it: they are moved aside at once and removed behind.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let spent = dir.with_file_name(format!("{SPENT_PREFIX}{sandbox_id}-{nanos}"));
        match std::fs::rename(&dir, &spent) {
            Ok(()) => {
                tokio::task::spawn_blocking(move || crate::storage::disks::remove_tree(&spent));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => {
                let _ = crate::storage::disks::remove_tree(&dir);
            }
        }
    }

    async fn share_files(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        let Some(shared) = self.shared_layers.get() else {
            return Ok(None);
        };
        let h = parse_handle(sandbox_id, handle)?;
        let upper = self
            .disks
            .path(sandbox_id)
            .join(sandbar_jail::layout::UPPER);
        shared
            .share_sandbox_files(sandbox_id, &upper, h.id_base.unwrap_or(0))
            .await
            .map(Some)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    async fn share_checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<sandbar_core::LayerBlob>, RuntimeError> {
        let Some(shared) = self.shared_layers.get() else {
            return Ok(None);
        };
        let h = parse_handle(sandbox_id, handle)?;
        if h.phase != Phase::Checkpointed {
            return Ok(None);
        }
        let images = self.places.checkpoint_dir(sandbox_id);
        let origin = SnapshotOrigin {
            id_base: h.id_base.unwrap_or(0),
            // The processes keep their token: a restore elsewhere hands over nothing.
            access_token: String::new(),
            log: self.places.log_path(sandbox_id),
        };
        serde_json::to_vec(&origin)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(images.join(crate::checkpoint::CARRY_ORIGIN), bytes))
            .map_err(|e| sandbox_err(sandbox_id, format!("cannot describe its checkpoint: {e}")))?;
        shared
            .share_sandbox_checkpoint(sandbox_id, &images)
            .await
            .map(Some)
            .map_err(|e| sandbox_err(sandbox_id, e))
    }

    async fn take_over_files(
        &self,
        sandbox: &sandbar_core::Sandbox,
        files: &sandbar_core::LayerBlob,
        checkpoint: Option<&sandbar_core::LayerBlob>,
    ) -> Result<sandbar_core::TakenOver, RuntimeError> {
        let id = sandbox.id.as_str();
        let Some(shared) = self.shared_layers.get() else {
            return Err(sandbox_err(id, "this node has no layer store"));
        };
        // What an earlier attempt left; the sandbox is not this node's yet.
        self.disks.remove(id).map_err(|e| sandbox_err(id, e))?;
        let _ = crate::storage::disks::remove_tree(&self.places.carried_checkpoint_dir(id));
        let mut opening = self.holdings.opening(id);
        opening.hold_disk(self.admit_disk(id, sandbox.disk_size_mb).await?);
        let laid_out = async {
            let dir = self
                .disks
                .create(id, sandbox.disk_size_mb, 0)
                .map_err(|e| sandbox_err(id, e))?;
            shared
                .fetch_sandbox_files(files, &dir.join(sandbar_jail::layout::UPPER))
                .await
                .map_err(|e| sandbox_err(id, e))
        }
        .await;
        if let Err(err) = laid_out {
            let _ = self.disks.remove(id);
            return Err(err);
        }
        let carried = match checkpoint {
            None => None,
            Some(blob) => match self.carry_checkpoint(id, blob).await {
                Ok(carried) => Some(carried),
                Err(e) => {
                    tracing::warn!(sandbox_id = %id, error = %e, "the lost node's checkpoint cannot be restored here; the sandbox will boot afresh on its files");
                    let _ =
                        crate::storage::disks::remove_tree(&self.places.carried_checkpoint_dir(id));
                    None
                }
            },
        };
        let origin = parse_handle(id, &sandbox.handle).ok();
        let handle = Handle {
            // The files carry the ids they have inside the sandbox: a boot on them moves
            // them to the range of the slot it gets.
            id_base: Some(0),
            memory_mb: sandbox.memory_mb,
            layers: sandbox
                .image
                .as_ref()
                .map(|image| image.layers.clone())
                .unwrap_or_default(),
            phase: Phase::Released,
            // A restored sandbox goes on with the boot it had.
            boot_id: carried.as_ref().and(origin.and_then(|h| h.boot_id)),
            carried,
            ..Handle::unstarted(0)
        };
        let runtime_handle = handle.to_runtime(id)?;
        opening.use_layers(handle.layers.clone());
        opening.commit();
        Ok(sandbar_core::TakenOver {
            with_memory: handle.carried.is_some(),
            handle: runtime_handle,
        })
    }

    async fn adopt_released(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        let upper = self
            .disks
            .path(sandbox_id)
            .join(sandbar_jail::layout::UPPER);
        if h.phase != Phase::Released || !upper.is_dir() {
            return Err(sandbox_err(
                sandbox_id,
                format!("no kept files at {}", upper.display()),
            ));
        }
        self.adopt_holdings(sandbox_id, &h, Phase::Released);
        Ok(())
    }

    fn stats(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Option<sandbar_core::runtime::RuntimeStats> {
        let cgroup = self.cgroups.stats(sandbox_id)?;
        let disk = self.disks.usage(sandbox_id);
        Some(sandbar_core::runtime::RuntimeStats {
            cpu_ns: cgroup.cpu_ns,
            memory_used: cgroup.memory_used,
            memory_cache: cgroup.memory_cache,
            disk_used: disk.map_or(0, |d| d.used),
            disk_total: disk.map_or(0, |d| d.total),
            oom_kills: self.cgroups.oom_kills(sandbox_id).unwrap_or(0),
        })
    }

    fn is_paused(&self, sandbox_id: &str, _handle: &RuntimeHandle) -> bool {
        self.cgroups.is_frozen(sandbox_id)
    }

    fn disk_io(&self) -> Option<sandbar_core::DiskIoReport> {
        let counts = self.cgroups.io_counts(None)?;
        let rates = self.cgroups.io_throttle().rates;
        Some(sandbar_core::DiskIoReport {
            read_bytes_limit: rates.read_bytes,
            write_bytes_limit: rates.write_bytes,
            read_ops_limit: rates.read_ops,
            write_ops_limit: rates.write_ops,
            read_bytes: counts.read_bytes,
            write_bytes: counts.write_bytes,
            read_ops: counts.read_ops,
            write_ops: counts.write_ops,
        })
    }

    fn memory(&self) -> Option<sandbar_core::MemoryReport> {
        let host = self.memory_view()?;
        let promised = self.ledger.promised_mb();
        Some(sandbar_core::MemoryReport {
            total_bytes: host.total_mb << 20,
            available_bytes: host.available_mb << 20,
            promised_bytes: promised << 20,
            promise_limit_bytes: self.ledger.memory_rule().promise_limit_mb(&host) << 20,
            overcommit: self.ledger.memory_rule().overcommit,
            stalled_percent: host.stalled_percent,
        })
    }

    fn warm_pool(&self) -> Option<sandbar_core::WarmPoolReport> {
        let report = self.warm.report();
        Some(sandbar_core::WarmPoolReport {
            target: report.target as u64,
            waiting: report.waiting as u64,
            taken: report.taken,
            missed: report.missed,
        })
    }

    fn data_disk(&self) -> Option<sandbar_core::DiskSpace> {
        let data_dir = &self.config.data_dir;
        let space = crate::storage::disks::Space::of(data_dir).ok()?;
        Some(sandbar_core::DiskSpace {
            path: data_dir.clone(),
            size_bytes: space.size,
            free_bytes: space.free,
            reserve_bytes: self.config.data_reserve_bytes,
            read_only: space.read_only,
        })
    }

    fn disks(&self) -> sandbar_core::DiskReport {
        let pool = self.disks.report();
        sandbar_core::DiskReport {
            data: self.data_disk(),
            pool: pool.map(|p| sandbar_core::DiskSpace {
                path: self.disks.dir().to_path_buf(),
                size_bytes: p.space.size,
                free_bytes: p.space.free,
                reserve_bytes: p.reserve,
                read_only: p.space.read_only,
            }),
            pool_promised_bytes: pool.map_or(0, |p| p.promised),
            pool_promise_limit_bytes: pool.map_or(0, |p| p.promise_limit),
            pool_holds: pool.map(|p| {
                let disk = u64::from(self.config.default_disk_mb) << 20;
                let holds = crate::storage::disks::PoolHolds::of(
                    p.space.size,
                    p.reserve,
                    p.overcommit,
                    disk,
                );
                sandbar_core::PoolHolds {
                    default_disk_bytes: disk,
                    filled: holds.filled,
                    admitted: holds.promised,
                }
            }),
        }
    }

    fn oom_kills(&self) -> u64 {
        self.ledger.oom_kills(|id| self.cgroups.oom_kills(id))
    }

    async fn adopt(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<Endpoint>, RuntimeError> {
        let handle = parse_handle(sandbox_id, handle)?;
        if !is_alive(&handle) {
            return Ok(None);
        }
        // A checkpoint it was restored from, if the server died before discarding it.
        let _ = crate::storage::disks::remove_tree(&self.places.checkpoint_dir(sandbox_id));
        self.adopt_holdings(sandbox_id, &handle, Phase::Running);
        Ok(Some(self.endpoint(sandbox_id, handle.slot)?))
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

    use super::*;

    #[test]
    fn own_start_time_is_readable_and_stable() {
        let pid = std::process::id() as i32;
        let first = start_ticks(pid).expect("own stat");
        assert_eq!(start_ticks(pid), Some(first));
        assert!(is_alive(&Handle {
            pid,
            start_ticks: first,
            ..Handle::unstarted(0)
        }));
        assert!(!is_alive(&Handle {
            pid,
            start_ticks: first + 1,
            ..Handle::unstarted(0)
        }));
    }
}
