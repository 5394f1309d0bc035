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
    AdoptedCheckpoint, EgressRules, Endpoint, LaunchSpec, Runtime, RuntimeError, RuntimeHandle,
    SnapshotParts,
};
use sandbar_jail::{AgentConfig, IdMap, JailSpec, LISTENER_FD, NETNS_FD, OOM_EVENTS_FD};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::agent_client;
use crate::cgroups::{CgroupDriver, CgroupError, Limits};
use crate::disks::{DiskError, DiskPool, PoolConfig};
use crate::netns::{NetnsPool, PreparedNetns, SlotSet};
use crate::network::{Network, NetworkError};

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// The statically linked agent binary started in every sandbox.
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
    /// Size of the disk pool image when it is first made; `None`: half the free space.
    pub disk_pool_bytes: Option<u64>,
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
    /// Bandwidth of each sandbox in each direction, in Mbit/s; 0 for no limit.
    pub sandbox_bandwidth_mbit: u32,
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
    Dns(#[from] crate::dns::DnsError),
    #[error("the sandbox id ranges from {base} do not fit in 32 bits for {slots} slots")]
    IdRange { base: u32, slots: u32 },
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What the store keeps about a running sandbox for this runtime.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Handle {
    /// Host PID of the sandbox's PID 1 (the agent).
    pid: i32,
    /// Its start time in clock ticks since boot, to tell it from a later process with a
    /// recycled PID.
    start_ticks: u64,
    slot: u32,
    /// Host uid and gid of the sandbox's root; absent in handles from before user
    /// namespaces, whose sandboxes ran as host root.
    #[serde(default)]
    id_base: Option<u32>,
    /// Memory limit granted to the sandbox, counted against the node's capacity.
    #[serde(default)]
    memory_mb: u32,
    /// Template layers the sandbox runs on: kept while it lives, whatever happens to its
    /// template.
    #[serde(default)]
    layers: Vec<String>,
    /// The sandbox's processes ended and its slot and memory went back to the node; only its
    /// files are kept (`pid` and `slot` are from its last life).
    #[serde(default)]
    released: bool,
    /// The sandbox's processes were checkpointed to disk and ended; it keeps its slot (its
    /// network namespace) and cgroups, and `pid` is from before the checkpoint.
    #[serde(default)]
    checkpointed: bool,
    /// Volumes bound into the sandbox, which a checkpoint names and a restore binds again.
    #[serde(default)]
    volumes: Vec<HandleVolume>,
    /// The id of the sandbox's current boot, shown at the kernel's boot id: new at every
    /// boot, the same after a restore of its checkpoint. Absent in handles of sandboxes
    /// booted before it existed, which see the host's.
    #[serde(default)]
    boot_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct HandleVolume {
    team_id: String,
    volume_id: String,
    /// Mount point inside the sandbox.
    path: String,
}

#[derive(Debug)]
pub struct LinuxRuntime {
    config: NodeConfig,
    cgroups: CgroupDriver,
    network: std::sync::Arc<Network>,
    netns_pool: std::sync::Arc<NetnsPool>,
    egress: std::sync::Arc<crate::egress::Egress>,
    disks: DiskPool,
    /// Memory limits granted to live sandboxes, by sandbox id.
    granted_memory: Mutex<std::collections::BTreeMap<String, u32>>,
    /// Out-of-memory kills: each live sandbox's cgroup count when it was granted memory (a
    /// restored or adopted sandbox's cgroup may have counted some before), and the kills of
    /// sandboxes that let their memory go since this server started.
    oom_baselines: Mutex<std::collections::BTreeMap<String, u64>>,
    oom_kills_ended: std::sync::atomic::AtomicU64,
    /// How memory is admitted.
    memory_rule: crate::memory::MemoryRule,
    /// How many tasks the kernel allows (`crate::tasks`), read once at start.
    task_limit: Option<u64>,
    slots: SlotSet,
    layers: crate::layers::LayerStore,
    /// Layers of live sandboxes, by sandbox id (the garbage collector keeps them).
    layers_in_use: Mutex<std::collections::BTreeMap<String, Vec<String>>>,
    /// CRIU, once it passed its probe (at start, or later when installed meanwhile).
    criu: crate::criu_cell::CriuCell,
    /// Sandboxes booted ahead of demand.
    warm: crate::warm::WarmPool,
    /// The content-addressed copy of the agent binary sandboxes run, and its SHA-256: a
    /// checkpoint can only be restored with the exact binary its processes mapped.
    agent_exec: PathBuf,
    agent_digest: String,
    /// Mount points a restore needs that the sandbox's host uid must reach (outside the
    /// data directory, which only root may traverse).
    mount_dir: PathBuf,
    /// Snapshot parts not yet kept by a template: the core records the template just after
    /// making them (and says so), and the collector must not take them in between. Entries
    /// older than [`FRESH_SNAPSHOT`] are dropped whatever happened.
    fresh_snapshots: Mutex<Vec<(String, std::time::Instant)>>,
    /// Checkpoint and snapshot directories whose images this process wrote or already
    /// checked against their checksum: nothing changes them afterwards, so a restore, a fork
    /// of many or a second create does not read them all again. Checkpoints a previous server
    /// left are checked once before their first restore.
    verified_images: Mutex<BTreeSet<PathBuf>>,
}

fn promised_mb(granted: &std::collections::BTreeMap<String, u32>) -> u64 {
    granted.values().map(|mb| u64::from(*mb)).sum()
}

fn sandbox_err(id: &str, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: id.to_owned(),
        message: message.to_string(),
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

/// State letter and start time (field 22, clock ticks since boot) of `/proc/PID/stat`.
fn stat_of(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let mut fields = stat[stat.rfind(')')? + 2..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

fn start_ticks(pid: i32) -> Option<u64> {
    stat_of(pid).map(|(_, ticks)| ticks)
}

/// Whether the handle's process still runs. A zombie counts as gone: it has already left its
/// namespaces and cgroups, and only waits for the host's init to reap it.
fn is_alive(handle: &Handle) -> bool {
    stat_of(handle.pid).is_some_and(|(state, ticks)| ticks == handle.start_ticks && state != 'Z')
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
        let cgroups = CgroupDriver::detect()?;
        let shaping = crate::shaping::Shaping::from_mbit(config.sandbox_bandwidth_mbit);
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
            .map(|range| crate::network::parse_range(range))
            .collect::<Result<Vec<_>, _>>()?;
        let upstreams = crate::dns::parse_upstreams(&config.nameservers)?;
        let egress = crate::egress::Egress::new();
        let resolver = crate::dns::Resolver::start(upstreams, egress.clone()).await?;
        network
            .init(&crate::network::FirewallConfig {
                resolver_port: resolver.port,
                allowed_private,
            })
            .await?;
        let disks = DiskPool::open(&PoolConfig {
            dir: config.data_dir.join("sandboxes"),
            image: config.data_dir.join("sandboxes.img"),
            size_bytes: config.disk_pool_bytes,
            quotas: config.disk_quotas,
            reserve_bytes: config.disk_pool_reserve_bytes,
            overcommit: config.disk_overcommit,
        })
        .await?;
        if !disks.enforces_quotas() {
            tracing::warn!("disk quotas are off: diskSizeMB is not enforced");
        }
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
        let memory_rule = crate::memory::MemoryRule {
            reserve_mb: config.memory_reserve_mb,
            overcommit: config.memory_overcommit,
            pressure_limit_percent: config.memory_pressure_limit_percent,
        };
        if let Some(host) = crate::memory::HostMemory::read() {
            tracing::info!(
                memory_limits_mb = memory_rule.promise_limit_mb(&host),
                overcommit = memory_rule.overcommit,
                "the memory limits of all sandboxes may add up to this; each start needs the host's reserve free"
            );
        }
        // Image layers live on the pool, whose accounting then sees them; a dot name keeps
        // them out of the sweep of unknown sandboxes.
        let layers = crate::layers::LayerStore::new(
            config.data_dir.join("templates"),
            config.data_dir.join("sandboxes").join(".images"),
            config.data_dir.join("sandboxes").join(".layers"),
        )
        .with_legacy_images_dir(config.data_dir.join("images").join("layers"));
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
        for removed in collect_agent_copies(&config.data_dir, &agent_digest) {
            tracing::info!(agent = %removed.display(), "removed an agent copy nothing uses");
        }
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
        let criu = crate::criu_cell::CriuCell::at_start(
            config.criu.clone(),
            kdat_dir.clone(),
            config.criu_reprobe,
        )
        .await;
        Ok(Self {
            criu,
            warm: crate::warm::WarmPool::new(config.warm_pool),
            agent_exec,
            agent_digest,
            mount_dir,
            fresh_snapshots: Mutex::new(Vec::new()),
            verified_images: Mutex::new(BTreeSet::new()),
            layers,
            layers_in_use: Mutex::new(std::collections::BTreeMap::new()),
            config,
            cgroups,
            network,
            netns_pool,
            egress,
            disks,
            granted_memory: Mutex::new(std::collections::BTreeMap::new()),
            oom_baselines: Mutex::new(std::collections::BTreeMap::new()),
            oom_kills_ended: std::sync::atomic::AtomicU64::new(0),
            memory_rule,
            task_limit: crate::tasks::task_limit(),
            slots,
        })
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("logs").join(format!("{id}.log"))
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
            crate::disks::remove_tree(&work)?;
            std::fs::create_dir(&work)?;
            std::os::unix::fs::chown(&work, Some(to), Some(to))?;
            if from != to {
                crate::layers::move_owners(
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

    fn socket_path(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("run").join(format!("{id}.sock"))
    }

    /// Records the template layers sandbox `id` runs on, so the collector keeps them.
    fn keep_layers(&self, id: impl Into<String>, layers: Vec<String>) {
        self.layers_in_use
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.into(), layers);
    }

    fn free_slot(&self, slot: u32) {
        crate::netns::free_slot(&self.slots, slot);
    }

    /// Counts `memory_mb` (the sandbox's ceiling) for sandbox `id`, or says why the node
    /// cannot start it now: what is short is the memory the host really has, the ceilings
    /// promised in all (see [`crate::memory`]), or the host's tasks ([`crate::tasks`]).
    fn grant_memory(&self, id: &str, memory_mb: u32) -> Result<(), RuntimeError> {
        let mut granted = self
            .granted_memory
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.admit_start(id, promised_mb(&granted), memory_mb)?;
        granted.insert(id.to_owned(), memory_mb);
        drop(granted);
        self.count_oom_kills_from_now(id);
        Ok(())
    }

    /// Whether the host can start sandbox `id` with a memory limit of `memory_mb` now that
    /// `promised` MiB are promised: its memory and its tasks.
    fn admit_start(&self, id: &str, promised: u64, memory_mb: u32) -> Result<(), RuntimeError> {
        let no_capacity = |message| RuntimeError::NoCapacity {
            sandbox_id: id.to_owned(),
            message,
        };
        if let Some(host) = crate::memory::HostMemory::read() {
            self.memory_rule
                .admit(&host, promised, memory_mb)
                .map_err(no_capacity)?;
        }
        if let Some(tasks) = self.task_limit.and_then(crate::tasks::HostTasks::read) {
            tasks.admit().map_err(no_capacity)?;
        }
        Ok(())
    }

    /// The memory limits granted to live sandboxes together, in MiB.
    fn promised_memory_mb(&self) -> u64 {
        promised_mb(
            &self
                .granted_memory
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Counts sandbox `id`'s disk against the pool, mounting a failed (read-only) pool
    /// afresh first when nothing holds it.
    async fn admit_disk(&self, id: &str, size_mb: u32) -> Result<(), RuntimeError> {
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
            Ok(()) => Ok(()),
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

    fn release_memory(&self, id: &str) {
        self.granted_memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let baseline = self
            .oom_baselines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let (Some(baseline), Some(now)) = (baseline, self.cgroups.oom_kills(id)) {
            self.oom_kills_ended.fetch_add(
                now.saturating_sub(baseline),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }

    /// Counts sandbox `id`'s out-of-memory kills from here on (see [`Self::oom_kills`]).
    fn count_oom_kills_from_now(&self, id: &str) {
        let now = self.cgroups.oom_kills(id).unwrap_or(0);
        self.oom_baselines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), now);
    }

    fn endpoint(&self, id: &str, slot: u32) -> Result<Endpoint, RuntimeError> {
        let addrs = self.network.addrs(slot).map_err(|e| sandbox_err(id, e))?;
        Ok(Endpoint {
            agent_socket: self.socket_path(id),
            address: IpAddr::V4(addrs.sandbox),
        })
    }

    /// Starts the agent in fresh namespaces and returns the host PID of the sandbox's init.
    async fn spawn_jailed(
        &self,
        boot: &BootSpec<'_>,
        dir: &Path,
        netns: &PreparedNetns,
        id_map: IdMap,
    ) -> Result<i32, RuntimeError> {
        let id = boot.id;
        let slot = netns.slot;
        let template_layers =
            self.layers
                .stack(boot.layers)
                .map_err(|message| RuntimeError::TemplateMissing {
                    template_id: format!("{} ({message})", boot.template_id),
                })?;
        let jail = JailSpec {
            template_layers,
            sandbox_dir: dir.to_owned(),
            hostname: "e2b.local".into(),
            cgroup_join: self.cgroups.join_files(id),
            // The gateway: the firewall redirects DNS sent there to the server's resolver.
            nameservers: vec![
                self.network
                    .addrs(slot)
                    .map_err(|e| sandbox_err(id, e))?
                    .host
                    .to_string(),
            ],
            id_map,
            pty_max: self.config.pty_max,
            volumes: boot
                .volumes
                .iter()
                .map(|m| {
                    Ok(sandbar_jail::VolumeBind {
                        source: crate::volumes::volume_dir(
                            &self.config.data_dir,
                            &m.team_id,
                            &m.volume_id,
                        )
                        .map_err(|e| sandbox_err(id, e))?,
                        target: m.path.clone().into(),
                    })
                })
                .collect::<Result<_, RuntimeError>>()?,
            agent: boot.agent.clone(),
            boot_id: Some(boot.boot_id.to_owned()),
            // A new writable layer makes a new machine; kept files keep the one they hold.
            machine_id: (!boot.kept).then(sandbar_core::ids::new_machine_id),
        };

        let socket = self.socket_path(id);
        let _ = std::fs::remove_file(&socket);
        let listener = netns
            .listen_at(&socket)
            .map_err(|e| sandbox_err(id, format!("bind {}: {e}", socket.display())))?;
        let log_path = self.log_path(id);
        // A sandbox booted again on its kept files goes on with its log: the lines read so
        // far are counted by offset. Appending, so a warm sandbox's log can be emptied when
        // it is taken while its agent writes on.
        if !boot.kept {
            let _ = std::fs::remove_file(&log_path);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", log_path.display())))?;

        let listener_fd = listener.as_raw_fd();
        let netns_fd = netns.netns.as_raw_fd();
        // Without it the sandbox runs as well; its out-of-memory kills are only not named in
        // the ended process's error.
        let oom_events = self.cgroups.oom_notifier(id).unwrap_or_else(|e| {
            tracing::warn!(sandbox_id = id, error = %e, "out-of-memory kills will not be named");
            None
        });
        let oom_fd = oom_events.as_ref().map(|fd| fd.as_raw_fd());
        // The restored root task reopens the log through its descriptor with its own rights.
        std::os::unix::fs::fchown(&log, Some(id_map.host_base), Some(id_map.host_base))
            .map_err(|e| sandbox_err(id, format!("chown {}: {e}", log_path.display())))?;
        let mut command = tokio::process::Command::new(&self.agent_exec);
        command
            // Sandboxes read PID 1's command line: it must not name a host path.
            .arg0("sandbar-agent")
            .arg("boot")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .env_clear()
            .env("RUST_LOG", "info");
        // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
        // functions (setsid, dup2, close_range) on descriptors that exist in the child.
        unsafe {
            command.pre_exec(move || {
                // A new session keeps terminal signals aimed at the server off the sandbox.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The server protects itself from the OOM killer; a sandbox must not inherit
                // that. Written with privilege, 0 is also the floor no process of the sandbox
                // can go below.
                reset_oom_score_adj();
                // Out of the way first: the eventfd may sit where the others go.
                let oom_high = match oom_fd {
                    Some(fd) => {
                        let high = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, OOM_EVENTS_FD + 1);
                        if high < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Some(high)
                    }
                    None => None,
                };
                if libc::dup2(listener_fd, LISTENER_FD) < 0 || libc::dup2(netns_fd, NETNS_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = oom_high
                    && libc::dup2(fd, OOM_EVENTS_FD) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // Descriptors the server inherited without close-on-exec (from whoever
                // started it) must not reach the sandbox, where they would be host files a
                // checkpoint cannot carry. Marked rather than closed: the spawner's own
                // error-reporting pipe must stay open until exec.
                libc::syscall(
                    libc::SYS_close_range,
                    (if oom_fd.is_some() {
                        OOM_EVENTS_FD + 1
                    } else {
                        NETNS_FD + 1
                    }) as libc::c_uint,
                    libc::c_uint::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|e| {
            sandbox_err(
                id,
                format!("start agent {}: {e}", self.agent_exec.display()),
            )
        })?;
        // The agent holds its own copy now; ours would keep the socket accepting after the
        // sandbox died and hang clients instead of refusing them. The namespace, likewise, must
        // end with the sandbox's processes.
        drop(listener);
        drop(oom_events);

        let payload = serde_json::to_vec(&jail).map_err(|e| sandbox_err(id, e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(&payload)
                .await
                .map_err(|e| sandbox_err(id, format!("send jail spec: {e}")))?;
        }
        let mut line = String::new();
        if let Some(stdout) = child.stdout.take() {
            BufReader::new(stdout)
                .read_line(&mut line)
                .await
                .map_err(|e| sandbox_err(id, format!("read sandbox pid: {e}")))?;
        }
        let status = child
            .wait()
            .await
            .map_err(|e| sandbox_err(id, format!("wait for boot: {e}")))?;
        let pid: i32 = line.trim().parse().map_err(|_| {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            sandbox_err(
                id,
                format!(
                    "boot exited with {status} before starting the sandbox: {}",
                    log.trim()
                ),
            )
        })?;
        Ok(pid)
    }

    async fn teardown(&self, id: &str, handle: Option<&Handle>) -> Result<(), RuntimeError> {
        self.stop(id, handle).await?;
        self.forget_checkpoint(id);
        let _ = std::fs::remove_file(self.log_path(id));
        let disks = self.disks.clone();
        let owned_id = id.to_owned();
        tokio::task::spawn_blocking(move || disks.remove(&owned_id))
            .await
            .map_err(|e| sandbox_err(id, e))?
            .map_err(|e| sandbox_err(id, e))?;
        Ok(())
    }

    /// Ends the sandbox's processes and frees everything but its disk and its agent log.
    async fn stop(&self, id: &str, handle: Option<&Handle>) -> Result<(), RuntimeError> {
        self.layers_in_use
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        // A released sandbox's slot went back to the node and may be another sandbox's now.
        let handle = handle.filter(|h| !h.released);
        if let Some(h) = handle
            && is_alive(h)
        {
            // SAFETY: the PID was checked against its start time just above; killing a PID
            // namespace's init kills every process in it.
            unsafe { libc::kill(h.pid, libc::SIGKILL) };
        }
        self.cgroups
            .kill_all(id)
            .await
            .map_err(|e| sandbox_err(id, e))?;
        if let Some(h) = handle {
            for _ in 0..250 {
                if !is_alive(h) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if let Ok(addrs) = self.network.addrs(h.slot) {
                self.egress.remove(addrs.sandbox).await;
            }
            self.network.release(h.slot).await;
            self.free_slot(h.slot);
        }
        self.cgroups
            .remove(id)
            .await
            .map_err(|e| sandbox_err(id, e))?;
        let _ = std::fs::remove_file(self.socket_path(id));
        Ok(())
    }

    async fn launch_in(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
    ) -> Result<(Handle, Endpoint), (Option<Handle>, RuntimeError)> {
        let id = &spec.sandbox_id;
        let slot = netns.slot;
        let started = std::time::Instant::now();
        let id_map = self.id_map(slot);
        self.cgroups
            .create(
                id,
                Limits {
                    cpu_count: spec.cpu_count,
                    memory_mb: spec.memory_mb,
                    pids_max: self.config.pids_max,
                },
            )
            .map_err(|e| (None, sandbox_err(id, e)))?;
        let cgroups_done = started.elapsed();
        let dir = match &spec.kept {
            None => self
                .disks
                .create(id, spec.disk_size_mb, id_map.host_base)
                .map_err(|e| (None, sandbox_err(id, e)))?,
            Some(kept) => {
                let kept = parse_handle(id, kept).map_err(|e| (None, e))?;
                self.reuse_disk(id, kept.id_base.unwrap_or(0), id_map.host_base)
                    .await
                    .map_err(|e| (None, e))?
            }
        };
        let disk_done = started.elapsed();
        // Before PID 1 joins the namespace: the sandbox never has a moment without its rules.
        self.apply_egress(id, slot, spec.allow_internet_access, &spec.egress)
            .await
            .map_err(|e| (None, e))?;
        let boot_id = sandbar_core::ids::new_uuid();
        let pid = self
            .spawn_jailed(&BootSpec::of(spec, &boot_id), &dir, &netns, id_map)
            .await
            .map_err(|e| (None, e))?;
        drop(netns);
        let spawned = started.elapsed();
        let handle = Handle::running(pid, slot, id_map, spec, Some(boot_id));
        let fail = |e: RuntimeError| (Some(handle.clone()), e);
        let endpoint = self.endpoint(id, slot).map_err(fail)?;
        agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(15))
            .await
            .map_err(|e| {
                let log = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
                fail(sandbox_err(id, format!("{e}; agent log: {}", log.trim())))
            })?;
        if spec.image.start_cmd.is_some() || spec.image.ready_cmd.is_some() {
            self.start_and_wait_ready(spec, &endpoint)
                .await
                .map_err(fail)?;
        }
        tracing::debug!(
            sandbox_id = %id,
            cgroups_us = cgroups_done.as_micros() as u64,
            disk_us = disk_done.as_micros() as u64,
            spawned_us = spawned.as_micros() as u64,
            healthy_us = started.elapsed().as_micros() as u64,
            "sandbox launch timings"
        );
        Ok((handle, endpoint))
    }
}

/// How long a pause waits for the agent to close its ends of connections from the host.
const HOST_SOCKETS_PATIENCE: Duration = Duration::from_secs(2);
/// How long a warm sandbox's agent may take to answer after its boot.
const WARM_AGENT_PATIENCE: Duration = Duration::from_secs(15);

impl LinuxRuntime {
    /// Keeps sandboxes booted for the image creates last asked for, in the background, from
    /// now on. Called once the sandboxes recorded before a restart are recovered: the
    /// recovery sweeps every unrecorded sandbox, and warm ones are never recorded.
    pub fn start_warm_pool(self: &std::sync::Arc<Self>) {
        if self.warm.target() == 0 {
            return;
        }
        let runtime = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(node) = runtime.upgrade() else {
                    return;
                };
                if let Some(wait) = node.warm.hold_off(std::time::Instant::now()) {
                    drop(node);
                    tokio::time::sleep(wait).await;
                    continue;
                }
                let Some(working) = node.warm.work().await else {
                    return;
                };
                match node.warm.next_job() {
                    crate::warm::Job::Wait => {
                        drop(working);
                        // Also the retry pace after a failed boot.
                        let pool = &node.warm;
                        pool.wait(Duration::from_secs(1)).await;
                    }
                    crate::warm::Job::Retire(warm) => node.retire_warm(&warm).await,
                    crate::warm::Job::Boot(key) => {
                        if let Err(err) = node.boot_warm(&key).await {
                            drop(working);
                            tracing::warn!(error = %err, "cannot boot a warm sandbox");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            }
        });
    }

    /// Boots a sandbox for `key` under a name of its own and puts it in the pool. It counts
    /// against no memory grant (an idle sandbox uses about a MiB) but against the disk pool,
    /// like any disk.
    async fn boot_warm(&self, key: &crate::warm::WarmKey) -> Result<(), RuntimeError> {
        let name = format!(
            "{}{}",
            crate::warm::NAME_PREFIX,
            &sandbar_core::ids::new_secret("")[..16]
        );
        self.admit_start(&name, self.promised_memory_mb(), 0)?;
        self.admit_disk(&name, crate::warm::BOOT_DISK_MB).await?;
        let netns = match self.netns_pool.claim(true).await {
            Some(Ok(netns)) => netns,
            Some(Err(err)) => {
                self.disks.forget(&name);
                return Err(sandbox_err(&name, err));
            }
            None => {
                self.disks.forget(&name);
                return Err(RuntimeError::NoCapacity {
                    sandbox_id: name,
                    message: "no free network slot on this node".into(),
                });
            }
        };
        let slot = netns.slot;
        let id_map = self.id_map(slot);
        let token = sandbar_core::ids::new_secret("");
        let boot_id = sandbar_core::ids::new_uuid();
        self.keep_layers(name.clone(), key.layers.clone());
        let booted = async {
            self.cgroups
                .create(
                    &name,
                    Limits {
                        cpu_count: 1,
                        memory_mb: crate::warm::BOOT_MEMORY_MB,
                        pids_max: self.config.pids_max,
                    },
                )
                .map_err(|e| sandbox_err(&name, e))?;
            let dir = self
                .disks
                .create(&name, crate::warm::BOOT_DISK_MB, id_map.host_base)
                .map_err(|e| sandbox_err(&name, e))?;
            let boot = BootSpec {
                id: &name,
                template_id: "(warm)",
                layers: &key.layers,
                volumes: &[],
                agent: AgentConfig {
                    access_token: Some(token.clone()),
                    default_user: key.user.clone(),
                    env_vars: Default::default(),
                    default_workdir: default_workdir(&key.user, &key.workdir).map(str::to_owned),
                    memory_limit_mb: None,
                },
                kept: false,
                boot_id: &boot_id,
            };
            let pid = self.spawn_jailed(&boot, &dir, &netns, id_map).await?;
            let warm = crate::warm::WarmSandbox {
                name: name.clone(),
                key: key.clone(),
                pid,
                start_ticks: start_ticks(pid).unwrap_or_default(),
                slot,
                id_map,
                token: token.clone(),
                boot_id: boot_id.clone(),
            };
            agent_client::wait_healthy(&self.socket_path(&name), WARM_AGENT_PATIENCE)
                .await
                .map_err(|e| sandbox_err(&name, e))?;
            Ok::<_, RuntimeError>(warm)
        }
        .await;
        drop(netns);
        match booted {
            Ok(warm) => {
                tracing::debug!(warm = %warm.name, slot, "warm sandbox booted");
                self.warm.put(warm);
                Ok(())
            }
            Err(err) => {
                let handle = Handle::warm(slot, id_map, 0, 0);
                if let Err(cleanup) = self.teardown(&name, Some(&handle)).await {
                    tracing::error!(warm = %name, error = %cleanup, "cannot clean up a warm sandbox");
                }
                Err(err)
            }
        }
    }

    async fn retire_warm(&self, warm: &crate::warm::WarmSandbox) {
        let handle = Handle::warm(warm.slot, warm.id_map, warm.pid, warm.start_ticks);
        if let Err(err) = self.teardown(&warm.name, Some(&handle)).await {
            tracing::error!(warm = %warm.name, error = %err, "cannot tear down a warm sandbox");
        }
    }

    /// Makes warm sandbox `warm` sandbox `spec`: its cgroups, disk, socket and log take the
    /// sandbox's id, its limits become the sandbox's and its agent gets the sandbox's token
    /// and environment. On failure the warm sandbox is gone, whatever name it had got.
    async fn take_warm(
        &self,
        spec: &LaunchSpec,
        warm: &crate::warm::WarmSandbox,
    ) -> Result<(Handle, Endpoint), RuntimeError> {
        let id = spec.sandbox_id.as_str();
        let started = std::time::Instant::now();
        let mut handle = Handle::warm(warm.slot, warm.id_map, warm.pid, warm.start_ticks);
        if !is_alive(&handle) {
            self.retire_warm(warm).await;
            return Err(sandbox_err(id, format!("warm sandbox {} died", warm.name)));
        }
        let mut name = warm.name.as_str();
        let taken = async {
            self.cgroups
                .rename(&warm.name, id)
                .map_err(|e| sandbox_err(id, e))?;
            name = id;
            self.cgroups
                .apply_limits(
                    id,
                    Limits {
                        cpu_count: spec.cpu_count,
                        memory_mb: spec.memory_mb,
                        pids_max: self.config.pids_max,
                    },
                )
                .map_err(|e| sandbox_err(id, e))?;
            let disks = &self.disks;
            disks
                .hand_over(&warm.name, id, spec.disk_size_mb)
                .map_err(|e| sandbox_err(id, e))?;
            for (from, to) in [
                (self.socket_path(&warm.name), self.socket_path(id)),
                (self.log_path(&warm.name), self.log_path(id)),
            ] {
                std::fs::rename(&from, &to)
                    .map_err(|e| sandbox_err(id, format!("rename {}: {e}", from.display())))?;
            }
            // What the agent logged while it waited is no part of this sandbox's life.
            let log = self.log_path(id);
            std::fs::OpenOptions::new()
                .write(true)
                .open(&log)
                .and_then(|f| f.set_len(0))
                .map_err(|e| sandbox_err(id, format!("empty {}: {e}", log.display())))?;
            self.layers_in_use
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&warm.name);
            self.keep_layers(id, spec.image.layers.clone());
            // Before the agent hands anything out: the sandbox never has a moment without
            // its rules.
            self.apply_egress(id, warm.slot, true, &spec.egress).await?;
            let endpoint = self.endpoint(id, warm.slot)?;
            agent_client::init(
                &endpoint.agent_socket,
                &warm.token,
                &agent_client::Init {
                    access_token: &spec.envd_access_token,
                    env_vars: &spec.env_vars,
                    default_user: &spec.image.user,
                    default_workdir: default_workdir(&spec.image.user, &spec.image.workdir),
                    memory_limit_mb: spec.memory_mb,
                },
            )
            .await
            .map_err(|e| sandbox_err(id, format!("cannot hand the agent its sandbox: {e}")))?;
            handle = Handle::running(
                warm.pid,
                warm.slot,
                warm.id_map,
                spec,
                Some(warm.boot_id.clone()),
            );
            handle.start_ticks = warm.start_ticks;
            if spec.image.start_cmd.is_some() || spec.image.ready_cmd.is_some() {
                self.start_and_wait_ready(spec, &endpoint).await?;
            }
            Ok::<_, RuntimeError>(endpoint)
        }
        .await;
        match taken {
            Ok(endpoint) => {
                tracing::debug!(
                    sandbox_id = %id,
                    warm = %warm.name,
                    taken_us = started.elapsed().as_micros() as u64,
                    "warm sandbox taken"
                );
                Ok((handle, endpoint))
            }
            Err(err) => {
                // Whatever was renamed already goes under the sandbox's id, the rest under
                // the warm name.
                let _ = self.teardown(name, Some(&handle)).await;
                for rest in [warm.name.as_str(), id] {
                    let _ = self.teardown(rest, None).await;
                }
                self.layers_in_use
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&warm.name);
                Err(err)
            }
        }
    }
}

/// How long the collector leaves a new snapshot's parts alone at most.
const FRESH_SNAPSHOT: Duration = Duration::from_secs(600);

/// How long a new sandbox's ready command may take to succeed.
const READY_PATIENCE: Duration = Duration::from_secs(60);

impl LinuxRuntime {
    pub fn layer_store(&self) -> &crate::layers::LayerStore {
        &self.layers
    }

    /// Layers live sandboxes run on.
    pub fn layers_of_live_sandboxes(&self) -> Vec<String> {
        self.layers_in_use
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .cloned()
            .collect()
    }

    /// Starts the template's start command in the background, then runs its ready command
    /// until it succeeds.
    async fn start_and_wait_ready(
        &self,
        spec: &LaunchSpec,
        endpoint: &Endpoint,
    ) -> Result<(), RuntimeError> {
        let id = &spec.sandbox_id;
        let exec = |command| agent_client::Exec {
            token: &spec.envd_access_token,
            user: &spec.image.user,
            command,
            envs: &spec.env_vars,
            cwd: Some(&spec.image.workdir),
        };
        if let Some(start) = &spec.image.start_cmd {
            agent_client::start_detached(&endpoint.agent_socket, &exec(start))
                .await
                .map_err(|e| RuntimeError::NotReady {
                    sandbox_id: id.clone(),
                    message: format!("cannot run the start command: {e}"),
                })?;
        }
        let Some(ready) = &spec.image.ready_cmd else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + READY_PATIENCE;
        let mut last;
        loop {
            let mut output = Vec::new();
            let code = agent_client::run(&endpoint.agent_socket, &exec(ready), |b| {
                if output.len() < 4096 {
                    output.extend_from_slice(b);
                }
            })
            .await
            .map_err(|e| RuntimeError::NotReady {
                sandbox_id: id.clone(),
                message: format!("cannot run the ready command: {e}"),
            })?;
            if code == 0 {
                return Ok(());
            }
            last = format!(
                "exit code {code}: {}",
                String::from_utf8_lossy(&output).trim()
            );
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(RuntimeError::NotReady {
            sandbox_id: id.clone(),
            message: format!(
                "the ready command '{ready}' did not succeed within {} s (last: {last})",
                READY_PATIENCE.as_secs()
            ),
        })
    }

    /// Stops a build sandbox and makes its writable layer the step layer `key`: owners
    /// shifted into the sandbox id range every sandbox maps, read-only from now on.
    pub async fn commit_layer(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        key: &str,
    ) -> Result<(), RuntimeError> {
        let h = parse_handle(id, handle)?;
        self.stop(id, Some(&h)).await?;
        let _ = std::fs::remove_file(self.log_path(id));
        self.release_memory(id);
        let base = h.id_base.unwrap_or(0);
        let dir = self.disks.path(id);
        let target = self.layers.steps_dir().join(key);
        let disks = self.disks.clone();
        let owned_id = id.to_owned();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            crate::layers::seal_layer(&dir, base, SANDBOX_IDS)?;
            if target.exists() {
                // Another build made the same layer meanwhile; keep theirs.
                return disks.remove(&owned_id).map_err(std::io::Error::other);
            }
            std::fs::rename(&dir, &target)
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot keep the layer {key}: {e}")))?;
        Ok(())
    }

    /// `keep` and the layers live sandboxes and new snapshots use.
    pub fn layers_to_keep(&self, keep: &[String]) -> BTreeSet<String> {
        let mut keep: BTreeSet<String> = keep.iter().cloned().collect();
        keep.extend(self.layers_of_live_sandboxes());
        let mut fresh = self
            .fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        fresh.retain(|(_, made)| made.elapsed() < FRESH_SNAPSHOT);
        keep.extend(fresh.iter().map(|(name, _)| name.clone()));
        keep
    }

    /// Removes step layers and checkpoints that `keep` (see [`Self::layers_to_keep`]) does
    /// not name. Image layers are a cache with a limit of its own (`image_layers`).
    pub fn collect_layers(&self, keep: &BTreeSet<String>) {
        let steps = self.layers.steps_dir().to_owned();
        let snapshots = self.snapshots_dir();
        for (dir, kind) in [
            (steps.as_path(), "layer"),
            (snapshots.as_path(), "checkpoint"),
        ] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') || keep.contains(&format!("{kind}/{name}")) {
                    continue;
                }
                let path = entry.path();
                let removed = if kind == "layer" {
                    self.disks.remove_at(&steps, &name)
                } else {
                    crate::disks::remove_tree(&path).map_err(|e| e.to_string())
                };
                match removed {
                    Ok(()) => {
                        tracing::info!(layer = %format!("{kind}/{name}"), "removed unused layer")
                    }
                    Err(e) => {
                        tracing::warn!(layer = %name, error = %e, "cannot remove unused layer")
                    }
                }
            }
        }
    }
}

impl LinuxRuntime {
    /// Installs `rules` for slot `slot`; an isolated sandbox needs none (its interface name
    /// already cuts it off).
    async fn apply_egress(
        &self,
        id: &str,
        slot: u32,
        egress: bool,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        let addrs = self.network.addrs(slot).map_err(|e| sandbox_err(id, e))?;
        let none = EgressRules::default();
        let wanted = if egress { rules } else { &none };
        self.egress
            .apply(
                slot,
                addrs.sandbox,
                &crate::network::iface_name(slot, egress),
                wanted,
            )
            .await
            .map_err(|e| sandbox_err(id, e))
    }
}

/// What booting a sandbox needs beyond its slot and directory.
struct BootSpec<'a> {
    id: &'a str,
    /// Named when a layer is missing.
    template_id: &'a str,
    layers: &'a [String],
    volumes: &'a [sandbar_core::VolumeMount],
    agent: AgentConfig,
    /// Booted again on kept files: its log goes on, and its machine id is the one they hold.
    kept: bool,
    /// What the sandbox reads as the kernel's boot id.
    boot_id: &'a str,
}

impl<'a> BootSpec<'a> {
    fn of(spec: &'a LaunchSpec, boot_id: &'a str) -> Self {
        BootSpec {
            id: &spec.sandbox_id,
            template_id: &spec.template.id,
            layers: &spec.image.layers,
            volumes: &spec.volumes,
            agent: AgentConfig {
                access_token: Some(spec.envd_access_token.clone()),
                default_user: spec.image.user.clone(),
                env_vars: spec.env_vars.clone(),
                default_workdir: default_workdir(&spec.image.user, &spec.image.workdir)
                    .map(str::to_owned),
                memory_limit_mb: Some(spec.memory_mb),
            },
            kept: spec.kept.is_some(),
            boot_id,
        }
    }
}

/// The agent's default working directory for an image: none when it is the user's home,
/// which leaves each user in their own.
fn default_workdir<'a>(user: &str, workdir: &'a str) -> Option<&'a str> {
    Some(workdir).filter(|w| *w != format!("/home/{user}"))
}

impl Handle {
    /// The handle of a warm sandbox (see [`crate::warm`]); `pid` 0 for one that never
    /// started.
    fn warm(slot: u32, id_map: IdMap, pid: i32, start_ticks: u64) -> Self {
        Handle {
            pid,
            start_ticks,
            slot,
            id_base: Some(id_map.host_base),
            memory_mb: 0,
            layers: Vec::new(),
            released: false,
            checkpointed: false,
            volumes: Vec::new(),
            boot_id: None,
        }
    }

    /// The handle of sandbox `spec` whose PID 1 is `pid`, just started in `slot` with the
    /// boot id `boot_id`.
    fn running(
        pid: i32,
        slot: u32,
        id_map: IdMap,
        spec: &LaunchSpec,
        boot_id: Option<String>,
    ) -> Self {
        Handle {
            pid,
            start_ticks: start_ticks(pid).unwrap_or_default(),
            slot,
            id_base: Some(id_map.host_base),
            memory_mb: spec.memory_mb,
            layers: spec.image.layers.clone(),
            released: false,
            checkpointed: false,
            volumes: spec
                .volumes
                .iter()
                .map(|v| HandleVolume {
                    team_id: v.team_id.clone(),
                    volume_id: v.volume_id.clone(),
                    path: v.path.clone(),
                })
                .collect(),
            boot_id,
        }
    }

    fn to_runtime(&self, id: &str) -> Result<RuntimeHandle, RuntimeError> {
        serde_json::to_value(self)
            .map(RuntimeHandle)
            .map_err(|e| sandbox_err(id, e))
    }
}

fn parse_handle(id: &str, handle: &RuntimeHandle) -> Result<Handle, RuntimeError> {
    serde_json::from_value(handle.0.clone()).map_err(|e| RuntimeError::BadHandle {
        sandbox_id: id.to_owned(),
        message: e.to_string(),
    })
}

#[async_trait::async_trait]
impl Runtime for LinuxRuntime {
    async fn launch(&self, spec: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let id = spec.sandbox_id.clone();
        let kept = spec
            .kept
            .as_ref()
            .map(|k| parse_handle(&id, k))
            .transpose()?;
        let _creating = self.warm.creating();
        self.grant_memory(&id, spec.memory_mb)?;
        if kept.is_none()
            && let Err(err) = self.admit_disk(&id, spec.disk_size_mb).await
        {
            self.release_memory(&id);
            return Err(err);
        }
        if let Some(warm) = crate::warm::WarmKey::of(&spec).and_then(|key| self.warm.take(&key)) {
            match self.take_warm(&spec, &warm).await {
                Ok((handle, endpoint)) => return Ok((handle.to_runtime(&id)?, endpoint)),
                // The sandbox is booted afresh instead.
                Err(err) => tracing::warn!(
                    sandbox_id = %id,
                    warm = %warm.name,
                    error = %err,
                    "cannot take a warm sandbox"
                ),
            }
        }
        let netns = match self.netns_pool.claim(spec.allow_internet_access).await {
            Some(Ok(netns)) => netns,
            Some(Err(err)) => {
                self.release_memory(&id);
                self.disks.forget(&id);
                return Err(sandbox_err(&id, err));
            }
            None => {
                self.release_memory(&id);
                self.disks.forget(&id);
                return Err(RuntimeError::NoCapacity {
                    sandbox_id: id,
                    message: "no free network slot on this node".into(),
                });
            }
        };
        let slot = netns.slot;
        self.keep_layers(id.clone(), spec.image.layers.clone());
        let checkpoint = spec
            .image
            .snapshot
            .as_ref()
            .and_then(|s| s.checkpoint.as_deref());
        let launched = match (checkpoint, &kept) {
            (Some(checkpoint), None) => self.launch_restored(&spec, netns, checkpoint).await,
            _ => self.launch_in(&spec, netns).await,
        };
        match launched {
            Ok((handle, endpoint)) => Ok((handle.to_runtime(&id)?, endpoint)),
            Err((handle, err)) => {
                let handle = handle.unwrap_or(Handle {
                    pid: 0,
                    start_ticks: 0,
                    slot,
                    id_base: None,
                    memory_mb: 0,
                    layers: Vec::new(),
                    released: false,
                    checkpointed: false,
                    volumes: Vec::new(),
                    boot_id: None,
                });
                // A sandbox booted on kept files keeps them for another try.
                let cleanup = match &kept {
                    None => self.teardown(&id, Some(&handle)).await,
                    Some(kept) => {
                        let stopped = self.stop(&id, Some(&handle)).await;
                        self.keep_layers(id.clone(), kept.layers.clone());
                        stopped
                    }
                };
                if let Err(cleanup) = cleanup {
                    tracing::error!(sandbox_id = %id, error = %cleanup, "cannot clean up failed sandbox");
                }
                self.free_slot(slot);
                self.release_memory(&id);
                Err(err)
            }
        }
    }

    async fn destroy(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let handle = parse_handle(sandbox_id, handle).ok();
        self.teardown(sandbox_id, handle.as_ref()).await?;
        self.release_memory(sandbox_id);
        Ok(())
    }

    fn is_alive(&self, sandbox_id: &str, handle: &RuntimeHandle) -> bool {
        parse_handle(sandbox_id, handle).is_ok_and(|h| is_alive(&h))
    }

    async fn sweep(&self, recorded: &[String]) -> Result<usize, RuntimeError> {
        let mut removed = 0;
        for id in self.disks.list() {
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

    fn agent_log(&self, sandbox_id: &str, offset: u64, max: usize) -> Option<Vec<u8>> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = std::fs::File::open(self.log_path(sandbox_id)).ok()?;
        // Most rounds find nothing new: a stat is all they cost.
        if file.metadata().ok()?.len() <= offset {
            return Some(Vec::new());
        }
        file.seek(SeekFrom::Start(offset)).ok()?;
        let mut bytes = Vec::new();
        file.take(max as u64).read_to_end(&mut bytes).ok()?;
        Some(bytes)
    }

    async fn pause(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if !is_alive(&h) {
            return Err(sandbox_err(sandbox_id, "the sandbox is not running"));
        }
        self.settle_host_sockets(sandbox_id).await;
        self.cgroups
            .freeze(sandbox_id)
            .await
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
        if h.released {
            return Ok(handle.clone());
        }
        self.stop(sandbox_id, Some(&h)).await?;
        // Namespaces kept by an earlier checkpoint would hold its old network alive.
        self.forget_checkpoint(sandbox_id);
        self.release_memory(sandbox_id);
        // Its layers stay in use: the kept writable layer only makes sense on top of them.
        self.keep_layers(sandbox_id.to_owned(), h.layers.clone());
        let released = Handle {
            pid: 0,
            start_ticks: 0,
            released: true,
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
    }

    async fn discard_snapshot(&self, parts: &SnapshotParts) {
        self.snapshot_recorded(parts);
        if let Some(key) = parts
            .checkpoint
            .as_deref()
            .and_then(|c| c.strip_prefix("checkpoint/"))
            && is_snapshot_key(key)
        {
            let dir = self.snapshots_dir().join(key);
            self.set_verified(&dir, false);
            let _ = tokio::task::spawn_blocking(move || crate::disks::remove_tree(&dir)).await;
        }
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if h.checkpointed {
            return Ok(handle.clone());
        }
        let started = std::time::Instant::now();
        if let Err(err) = self.dump(sandbox_id, &h).await {
            if crate::checkpoint::host_unix_sockets(&self.cgroups.members(sandbox_id)).is_empty() {
                return Err(err);
            }
            // The agent was frozen before it closed a connection from the host: let it run
            // for the moment that takes, then try once more.
            tracing::info!(sandbox_id, error = %err, "thawing the paused sandbox briefly to let connections from the host close");
            self.cgroups
                .thaw(sandbox_id)
                .map_err(|e| sandbox_err(sandbox_id, e))?;
            self.settle_host_sockets(sandbox_id).await;
            self.cgroups
                .freeze(sandbox_id)
                .await
                .map_err(|e| sandbox_err(sandbox_id, e))?;
            self.dump(sandbox_id, &h).await?;
        }
        let dumped_in = started.elapsed();
        sandbar_core::faults::crash_point("checkpoint.dumped");
        // CRIU ended the tree after the dump; anything that escaped it would run on.
        for _ in 0..250 {
            if !is_alive(&h) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.end_dumped(sandbox_id).await;
        tracing::debug!(
            sandbox_id,
            dump_us = dumped_in.as_micros() as u64,
            release_us = (started.elapsed() - dumped_in).as_micros() as u64,
            "checkpoint timings"
        );
        let checkpointed = Handle {
            pid: 0,
            start_ticks: 0,
            checkpointed: true,
            ..h
        };
        checkpointed.to_runtime(sandbox_id)
    }

    async fn restore(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if !h.checkpointed {
            return Err(sandbox_err(sandbox_id, "the sandbox is not checkpointed"));
        }
        self.grant_memory(sandbox_id, h.memory_mb)?;
        let started = std::time::Instant::now();
        // Joining a frozen cgroup would freeze CRIU itself.
        let restored = match self.cgroups.thaw(sandbox_id) {
            Ok(()) => self.undump(sandbox_id, &h).await,
            Err(e) => Err(sandbox_err(sandbox_id, e)),
        };
        let pid = match restored {
            Ok(pid) => pid,
            Err(err) => {
                self.release_memory(sandbox_id);
                return Err(err);
            }
        };
        let running = Handle {
            pid,
            start_ticks: start_ticks(pid).unwrap_or_default(),
            checkpointed: false,
            ..h
        };
        let endpoint = self.endpoint(sandbox_id, h.slot)?;
        if let Err(e) =
            agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(10)).await
        {
            let _ = self.cgroups.kill_all(sandbox_id).await;
            self.release_memory(sandbox_id);
            return Err(sandbox_err(
                sandbox_id,
                format!("the restored agent does not answer: {e}"),
            ));
        }
        tracing::debug!(
            sandbox_id,
            healthy_us = started.elapsed().as_micros() as u64,
            "restored agent answers"
        );
        sandbar_core::faults::crash_point("restore.restored");
        // The images stay until the sandbox is recorded running (`discard_checkpoint`): a
        // restart before that finds the finished restore beside them.
        Ok((running.to_runtime(sandbox_id)?, endpoint))
    }

    async fn adopt_checkpointed(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        let dir = self.checkpoint_dir(sandbox_id);
        if h.checkpointed {
            // The server may have died during a restore (CRIU was waited for at start): its
            // host-side mounts are left over, and the restore finished or not.
            self.unmount_restore(sandbox_id, h.layers.len());
            if let Some(restored) = self.finished_restore(sandbox_id, &h) {
                return Ok(restored);
            }
            if let Err(e) = self.cgroups.kill_all(sandbox_id).await {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("cannot end what an unfinished restore started: {e}"),
                ));
            }
            crate::checkpoint::clear_restore(&dir);
            let _ = std::fs::remove_file(self.socket_path(sandbox_id));
        } else {
            if is_alive(&h) {
                return Err(sandbox_err(sandbox_id, "its processes still run"));
            }
            // The dump ended the processes: if the server died before sealing it, it is
            // sealed now, and what `checkpoint` does after a dump is done here.
            if !dir.join(crate::checkpoint::HEADER_FILE).exists() {
                let criu = self
                    .criu
                    .get_or_probe()
                    .await
                    .ok_or_else(|| sandbox_err(sandbox_id, "this node cannot checkpoint"))?;
                let (version, digest) = (criu.version.clone(), self.agent_digest.clone());
                let sealed_dir = dir.clone();
                tokio::task::spawn_blocking(move || {
                    crate::checkpoint::seal_finished_dump(&sealed_dir, version, digest)
                })
                .await
                .map_err(|e| sandbox_err(sandbox_id, e))?
                .map_err(|e| sandbox_err(sandbox_id, e))?;
                tracing::info!(
                    sandbox_id,
                    "sealed a checkpoint whose dump outlived the server"
                );
            }
            self.end_dumped(sandbox_id).await;
        }
        let header_dir = dir.clone();
        tokio::task::spawn_blocking(move || crate::checkpoint::read_header(&header_dir, false))
            .await
            .map_err(|e| sandbox_err(sandbox_id, e))?
            .map_err(|e| sandbox_err(sandbox_id, e))?;
        for kind in ["net", "user"] {
            let kept = self.kept_ns(sandbox_id, kind);
            if !is_nsfs(&kept) {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("its kept namespace {} is gone", kept.display()),
                ));
            }
        }
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h.slot);
        self.keep_layers(sandbox_id.to_owned(), h.layers.clone());
        let checkpointed = Handle {
            pid: 0,
            start_ticks: 0,
            checkpointed: true,
            ..h
        };
        Ok(AdoptedCheckpoint::Checkpointed(
            checkpointed.to_runtime(sandbox_id)?,
        ))
    }

    async fn discard_checkpoint(&self, sandbox_id: &str) {
        let dir = self.checkpoint_dir(sandbox_id);
        self.set_verified(&dir, false);
        // Deleting the images of a large sandbox takes a while (a tenth of a second per GiB)
        // and nothing needs to wait for it: they are moved aside at once and removed behind.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let spent = dir.with_file_name(format!("{SPENT_PREFIX}{sandbox_id}-{nanos}"));
        match std::fs::rename(&dir, &spent) {
            Ok(()) => {
                tokio::task::spawn_blocking(move || crate::disks::remove_tree(&spent));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => {
                let _ = crate::disks::remove_tree(&dir);
            }
        }
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
        if !h.released || !upper.is_dir() {
            return Err(sandbox_err(
                sandbox_id,
                format!("no kept files at {}", upper.display()),
            ));
        }
        self.keep_layers(sandbox_id.to_owned(), h.layers);
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

    fn memory(&self) -> Option<sandbar_core::MemoryReport> {
        let host = crate::memory::HostMemory::read()?;
        let promised = self.promised_memory_mb();
        Some(sandbar_core::MemoryReport {
            total_bytes: host.total_mb << 20,
            available_bytes: host.available_mb << 20,
            promised_bytes: promised << 20,
            promise_limit_bytes: self.memory_rule.promise_limit_mb(&host) << 20,
            overcommit: self.memory_rule.overcommit,
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
        let space = crate::disks::Space::of(data_dir).ok()?;
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
        }
    }

    fn oom_kills(&self) -> u64 {
        let baselines = self
            .oom_baselines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let live: u64 = baselines
            .iter()
            .filter_map(|(id, baseline)| {
                Some(self.cgroups.oom_kills(id)?.saturating_sub(*baseline))
            })
            .sum();
        self.oom_kills_ended
            .load(std::sync::atomic::Ordering::Relaxed)
            + live
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
        let _ = crate::disks::remove_tree(&self.checkpoint_dir(sandbox_id));
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle.slot);
        self.granted_memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sandbox_id.to_owned(), handle.memory_mb);
        self.count_oom_kills_from_now(sandbox_id);
        self.keep_layers(sandbox_id.to_owned(), handle.layers.clone());
        Ok(Some(self.endpoint(sandbox_id, handle.slot)?))
    }
}

/// Copies the agent binary to `<data>/agents/<sha256>` (once) and returns that path and the
/// digest: sandboxes run the copy, so a checkpoint's processes map a file that stays as it was
/// when the server's own binary is replaced.
fn keep_agent(agent_bin: &Path, data_dir: &Path) -> Result<(PathBuf, String), NodeError> {
    use sha2::Digest;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| NodeError::Io { path, source }
    };
    let bytes = std::fs::read(agent_bin).map_err(io(agent_bin))?;
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let dir = data_dir.join("agents");
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let kept = dir.join(&digest);
    if !kept.exists() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = dir.join(format!(".{digest}.tmp"));
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &kept).map_err(io(&kept))?;
    }
    Ok((kept, digest))
}

/// Removes the agent copies under `<data>/agents/` that neither this server runs (`current`),
/// nor a checkpoint or snapshot names, nor a live process maps (a sandbox started by an
/// earlier build, which a later checkpoint would name); returns what it removed.
fn collect_agent_copies(data_dir: &Path, current: &str) -> Vec<PathBuf> {
    let agents = data_dir.join("agents");
    let Ok(entries) = std::fs::read_dir(&agents) else {
        return Vec::new();
    };
    let copies: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.len() == 64 && name.bytes().all(|c| c.is_ascii_hexdigit()))
        .filter(|name| name != current)
        .collect();
    if copies.is_empty() {
        return Vec::new();
    }
    let mut used = BTreeSet::new();
    for kind in ["checkpoints", "snapshots"] {
        let Ok(dirs) = std::fs::read_dir(data_dir.join(kind)) else {
            continue;
        };
        for dir in dirs
            .flatten()
            .filter(|d| d.file_type().is_ok_and(|t| t.is_dir()))
        {
            // Incomplete ones too: a dump under way names the copy it is dumping.
            match crate::checkpoint::read_header(&dir.path(), false) {
                Ok(header) => {
                    used.insert(header.agent_digest);
                }
                Err(_) => {
                    used.extend(copies.iter().cloned());
                }
            }
        }
    }
    let prefix = agents.to_string_lossy().into_owned();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for process in procs.flatten() {
            let Ok(maps) = std::fs::read_to_string(process.path().join("maps")) else {
                continue;
            };
            for line in maps.lines().filter(|l| l.contains(&prefix)) {
                if let Some(name) = line.rsplit('/').next() {
                    used.insert(name.trim_end_matches(" (deleted)").to_owned());
                }
            }
        }
    }
    copies
        .into_iter()
        .filter(|name| !used.contains(name))
        .map(|name| agents.join(name))
        .filter(|path| std::fs::remove_file(path).is_ok())
        .collect()
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

/// Where a restored sandbox's inherited descriptors start: above anything CRIU itself opens
/// early.
const INHERITED_FD_BASE: i32 = 200;

impl LinuxRuntime {
    fn checkpoint_dir(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("checkpoints").join(id)
    }

    /// A namespace of the sandbox kept (bind-mounted) while its processes are checkpointed.
    fn kept_ns(&self, id: &str, kind: &str) -> PathBuf {
        self.config
            .data_dir
            .join("checkpoints")
            .join(format!("{id}.{kind}"))
    }

    /// The network namespace a checkpointed sandbox's processes are restored into; the one
    /// its PID 1 joined at boot, kept alive by a bind mount.
    fn keep_netns(&self, id: &str, pid: i32) -> std::io::Result<PathBuf> {
        for kind in ["net", "user"] {
            let target = self.kept_ns(id, kind);
            let source = PathBuf::from(format!("/proc/{pid}/ns/{kind}"));
            if ns_inode(&target).is_some() && ns_inode(&target) == ns_inode(&source) {
                continue;
            }
            let _ = sandbar_jail::host::unmount(&target);
            sandbar_jail::host::bind_file(&source, &target)?;
        }
        Ok(self.kept_ns(id, "net"))
    }

    /// Removes a sandbox's checkpoint and the namespaces kept for it; nothing if it has none.
    fn forget_checkpoint(&self, id: &str) {
        self.unmount_restore_aids(id);
        self.set_verified(&self.checkpoint_dir(id), false);
        for kind in ["net", "user"] {
            let kept = self.kept_ns(id, kind);
            while sandbar_jail::host::unmount(&kept).is_ok() {}
            let _ = std::fs::remove_file(&kept);
        }
        let _ = std::fs::remove_dir_all(self.checkpoint_dir(id));
    }

    /// Dumps the frozen sandbox `id` with CRIU, which ends its processes.
    async fn dump(&self, id: &str, h: &Handle) -> Result<crate::checkpoint::Header, RuntimeError> {
        let criu = self
            .criu
            .get()
            .ok_or_else(|| sandbox_err(id, "this node cannot checkpoint sandboxes"))?;
        if !is_alive(h) {
            return Err(sandbox_err(id, "the sandbox's processes are gone"));
        }
        if !self.cgroups.is_frozen(id) {
            return Err(sandbox_err(id, "the sandbox is not frozen"));
        }
        let freezer = self
            .cgroups
            .freezer_dir(id)
            .ok_or_else(|| sandbox_err(id, "the freezer controller is not mounted"))?;
        let netns = self
            .keep_netns(id, h.pid)
            .map_err(|e| sandbox_err(id, format!("cannot keep its network namespace: {e}")))?;
        let netns_inode =
            ns_inode(&netns).ok_or_else(|| sandbox_err(id, "its network namespace is gone"))?;
        let dir = self.checkpoint_dir(id);
        self.set_verified(&dir, false);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", dir.display())))?;
        let plan = match self
            .dump_into(id, h, &criu, &freezer, &dir, netns_inode, false)
            .await
        {
            Ok(plan) => plan,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let (version, digest) = (criu.version.clone(), self.agent_digest.clone());
        let sealing = std::time::Instant::now();
        let sealed_dir = dir.clone();
        let sealed = tokio::task::spawn_blocking(move || {
            crate::checkpoint::seal(&sealed_dir, version, digest, plan)
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot write the checkpoint header: {e}")))?;
        self.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, seal_us = sealing.elapsed().as_micros() as u64, "checkpoint sealed");
        Ok(sealed)
    }

    /// Gives the agent a moment to close its ends of connections from the host before the
    /// sandbox is frozen: frozen with one, it could not be checkpointed until resumed.
    async fn settle_host_sockets(&self, sandbox_id: &str) {
        let deadline = std::time::Instant::now() + HOST_SOCKETS_PATIENCE;
        loop {
            let held = crate::checkpoint::host_unix_sockets(&self.cgroups.members(sandbox_id));
            if held.is_empty() {
                return;
            }
            if std::time::Instant::now() >= deadline {
                let held: Vec<String> = held.iter().map(ToString::to_string).collect();
                tracing::warn!(sandbox_id, held = %held.join("; "), "frozen with connections from the host still open; a checkpoint may fail");
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Runs `criu dump` of the frozen sandbox `id` (whose network namespace is
    /// `netns_inode`) into `images`, leaving its processes running or ending them; returns
    /// what the dump was told about the host.
    #[allow(clippy::too_many_arguments)]
    async fn dump_into(
        &self,
        id: &str,
        h: &Handle,
        criu: &crate::checkpoint::Criu,
        freezer: &Path,
        images: &Path,
        netns_inode: u64,
        leave_running: bool,
    ) -> Result<crate::checkpoint::DumpPlan, RuntimeError> {
        let tasks = self.cgroups.members(id);
        let pid = h.pid;
        let volumes = h
            .volumes
            .iter()
            .map(|v| {
                crate::volumes::volume_dir(&self.config.data_dir, &v.team_id, &v.volume_id)
                    .map(|source| (PathBuf::from(&v.path), source))
                    .map_err(|e| sandbox_err(id, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let plan = tokio::task::spawn_blocking(move || {
            crate::checkpoint::plan_dump(pid, &tasks, netns_inode, LISTENER_FD, &volumes)
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot list what it uses of the host: {e}")))?;
        crate::checkpoint::write_plan(images, &plan)
            .map_err(|e| sandbox_err(id, format!("cannot write {}: {e}", images.display())))?;
        let mut command = criu.command();
        command
            .arg("dump")
            .arg("--tree")
            .arg(h.pid.to_string())
            .arg("--images-dir")
            .arg(images)
            .arg("--log-file")
            .arg(crate::checkpoint::DUMP_LOG)
            .arg("-v2")
            .arg("--freeze-cgroup")
            .arg(freezer)
            .args(NO_NETWORK_LOCK)
            .arg(TCP_CLOSE)
            .args(&plan.args)
            // PID 1 is non-dumpable; the ownership check CRIU would run from inside its user
            // namespace cannot open its namespaces (patch 0001).
            .env("CRIU_SKIP_USERNS_CHECK", "1")
            // Nothing to a pipe: CRIU must be able to finish the dump if the server dies.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if leave_running {
            command.arg("--leave-running");
        }
        let mut child = command
            .spawn()
            .map_err(|e| sandbox_err(id, format!("run {}: {e}", criu.path.display())))?;
        sandbar_core::faults::crash_point(if leave_running {
            "snapshot.dumping"
        } else {
            "checkpoint.dumping"
        });
        let status = child
            .wait()
            .await
            .map_err(|e| sandbox_err(id, format!("wait for {}: {e}", criu.path.display())))?;
        if !status.success() {
            let mut errors =
                crate::checkpoint::log_errors(&images.join(crate::checkpoint::DUMP_LOG));
            let held = crate::checkpoint::host_unix_sockets(&self.cgroups.members(id));
            if !held.is_empty() {
                let held: Vec<String> = held.iter().map(ToString::to_string).collect();
                errors = format!("{errors}; from the host: {}", held.join(", "));
            }
            let what = if leave_running {
                "snapshot"
            } else {
                "checkpoint"
            };
            return Err(sandbox_err(
                id,
                format!("{what} failed ({status}): {errors}"),
            ));
        }
        Ok(plan)
    }

    /// Waits for the dumps and restores a server that died left running, so that what they
    /// leave (a sealed or abandoned checkpoint, a restored or killed sandbox) can be judged
    /// once they are done. One still running after a long wait is killed.
    async fn wait_for_orphaned_criu(criu: &Path, data_dir: &Path) {
        let mut waited = Duration::ZERO;
        loop {
            let pids = crate::checkpoint::criu_in_flight(criu, data_dir);
            if pids.is_empty() {
                return;
            }
            if waited.is_zero() {
                tracing::warn!(
                    ?pids,
                    "waiting for checkpoint work a previous server left running"
                );
            }
            if waited >= ORPHANED_CRIU_WAIT {
                tracing::error!(
                    ?pids,
                    "checkpoint work a previous server left does not end; killing it"
                );
                for pid in pids {
                    // SAFETY: kill(2) on a PID just read from /proc; at worst it is gone.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            waited += Duration::from_millis(20);
        }
    }

    /// What is left of sandbox `id` once a dump ended its processes: anything that escaped
    /// the dump, the memory its cgroup still holds, its memory grant and its agent socket.
    async fn end_dumped(&self, id: &str) {
        if let Err(err) = self.cgroups.kill_all(id).await {
            tracing::warn!(sandbox_id = %id, error = %err, "processes left after the checkpoint");
        }
        self.cgroups.empty_memory(id);
        self.release_memory(id);
        let _ = std::fs::remove_file(self.socket_path(id));
    }

    fn is_verified(&self, images: &Path) -> bool {
        self.verified_images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(images)
    }

    fn set_verified(&self, images: &Path, verified: bool) {
        let mut set = self
            .verified_images
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if verified {
            set.insert(images.to_owned());
        } else {
            set.remove(images);
        }
    }

    /// The host-side mounts a restore of sandbox `id` makes (its root over `layers` layers,
    /// a sysfs of its network namespace, its volumes), gone.
    fn unmount_restore(&self, id: &str, layers: usize) {
        sandbar_jail::host::unmount_root(&self.disks.path(id), layers);
        self.unmount_restore_aids(id);
    }

    /// The mounts outside the sandbox's directory that a restore of sandbox `id` makes for
    /// CRIU (its sysfs, its boot id, its volumes), gone with their mount points.
    fn unmount_restore_aids(&self, id: &str) {
        for dir in [self.restored_sysfs(id), self.restored_boot_id_dir(id)] {
            let _ = sandbar_jail::host::unmount(&dir);
            let _ = std::fs::remove_dir(&dir);
        }
        let volumes = self.restored_volumes_dir(id);
        if let Ok(entries) = std::fs::read_dir(&volumes) {
            for entry in entries.flatten() {
                let _ = sandbar_jail::host::unmount(&entry.path());
                let _ = std::fs::remove_dir(entry.path());
            }
            let _ = std::fs::remove_dir(&volumes);
        }
    }

    /// Where a restore of sandbox `id` mounts a sysfs of its network namespace on the host.
    fn restored_sysfs(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.sys"))
    }

    /// Where a restore of sandbox `id` mounts the filesystem of its boot id on the host, for
    /// CRIU to bind the file back.
    fn restored_boot_id_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.boot"))
    }

    /// Where a restore of sandbox `id` mounts its volumes on the host, for CRIU to bind back.
    fn restored_volumes_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.volumes"))
    }

    /// The checkpointed sandbox `id` (handle `h`) running, if a restore the server died
    /// during ran to its end: CRIU wrote its statistics, and the PID 1 it wrote lives in the
    /// sandbox's cgroup.
    fn finished_restore(&self, id: &str, h: &Handle) -> Option<AdoptedCheckpoint> {
        let pid = crate::checkpoint::finished_restore(&self.checkpoint_dir(id))?;
        if !self.cgroups.members(id).contains(&pid) {
            return None;
        }
        let running = Handle {
            pid,
            start_ticks: start_ticks(pid)?,
            checkpointed: false,
            ..h.clone()
        };
        let endpoint = self.endpoint(id, h.slot).ok()?;
        let runtime_handle = running.to_runtime(id).ok()?;
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h.slot);
        self.granted_memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), h.memory_mb);
        self.count_oom_kills_from_now(id);
        self.keep_layers(id.to_owned(), h.layers.clone());
        tracing::info!(sandbox_id = %id, pid, "a restore finished while the server was down");
        Some(AdoptedCheckpoint::Restored(runtime_handle, endpoint))
    }

    /// Restores the checkpointed sandbox `id` into its kept network namespace and cgroups;
    /// returns its new PID 1.
    async fn undump(&self, id: &str, h: &Handle) -> Result<i32, RuntimeError> {
        let criu = self.criu_for_restore(id).await?;
        let dir = self.checkpoint_dir(id);
        let read_dir = dir.clone();
        let started = std::time::Instant::now();
        let verify = !self.is_verified(&dir);
        let header =
            tokio::task::spawn_blocking(move || crate::checkpoint::read_header(&read_dir, verify))
                .await
                .map_err(|e| sandbox_err(id, e))?
                .map_err(|e| sandbox_err(id, e))?;
        self.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, verify_us = started.elapsed().as_micros() as u64, "checkpoint verified");
        check_criu_version(id, &criu, &header)?;
        let layers = self
            .layers
            .stack(&h.layers)
            .map_err(|e| sandbox_err(id, e))?;
        let netns_path = self.kept_ns(id, "net");
        let userns_path = self.kept_ns(id, "user");
        let slot = h.slot;
        let opened = tokio::task::spawn_blocking(move || -> Result<_, String> {
            let netns: std::os::fd::OwnedFd = std::fs::File::open(&netns_path)
                .map_err(|e| format!("open {}: {e}", netns_path.display()))?
                .into();
            let userns: std::os::fd::OwnedFd = std::fs::File::open(&userns_path)
                .map_err(|e| format!("open {}: {e}", userns_path.display()))?
                .into();
            let agent_socket = crate::netns::socket_in(&netns)
                .map_err(|e| format!("cannot make the agent's socket: {e}"))?;
            Ok((
                PreparedNetns {
                    slot,
                    netns,
                    agent_socket,
                },
                userns,
            ))
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, e))?;
        let (prepared, userns) = opened;
        self.run_restore(
            id,
            RestoreFrom {
                images: dir,
                header,
                layers,
                userns,
                netns: prepared,
                new_log: None,
                etc: None,
                boot_id: h.boot_id.clone(),
            },
        )
        .await
    }

    /// A checkpoint made before a restart may find CRIU installed only since: probed again.
    async fn criu_for_restore(
        &self,
        id: &str,
    ) -> Result<std::sync::Arc<crate::checkpoint::Criu>, RuntimeError> {
        self.criu
            .get_or_probe()
            .await
            .ok_or_else(|| sandbox_err(id, "this node cannot restore checkpoints"))
    }

    /// Mounts what the restore of sandbox `id` needs on the host (its root, a sysfs of its
    /// network namespace, its agent's listener), runs `criu restore` from its cgroups and
    /// returns the restored PID 1; the host-side mounts are gone afterwards either way.
    async fn run_restore(&self, id: &str, from: RestoreFrom) -> Result<i32, RuntimeError> {
        let criu = self.criu_for_restore(id).await?;
        let RestoreFrom {
            images: dir,
            header,
            layers,
            userns,
            netns: prepared,
            new_log,
            etc,
            boot_id,
        } = from;
        let sandbox_dir = self.disks.path(id);
        let images_bytes: u64 = header.images.iter().map(|i| i.size).sum();
        let sysfs = self.restored_sysfs(id);
        let volumes_dir = self.restored_volumes_dir(id);
        let socket = self.socket_path(id);
        let started = std::time::Instant::now();
        let mounted = {
            let sandbox_dir = sandbox_dir.clone();
            let layers = layers.clone();
            let sysfs = sysfs.clone();
            let socket = socket.clone();
            let volumes: Vec<(PathBuf, PathBuf)> = header
                .externals
                .iter()
                .filter_map(|e| match e {
                    crate::checkpoint::External::Volume { key, source } => {
                        Some((source.clone(), volumes_dir.join(key)))
                    }
                    _ => None,
                })
                .collect();
            let volumes_dir = volumes_dir.clone();
            // A checkpoint that binds a boot id but whose handle names none cannot be made
            // by this node; it would get a new one, as a boot does.
            let boot_id = header
                .externals
                .iter()
                .any(|e| matches!(e, crate::checkpoint::External::BootId { .. }))
                .then(|| boot_id.unwrap_or_else(sandbar_core::ids::new_uuid));
            let boot_id_dir = self.restored_boot_id_dir(id);
            tokio::task::spawn_blocking(move || -> Result<_, String> {
                sandbar_jail::host::mount_root_mapped(&sandbox_dir, &layers, &userns)
                    .map_err(|e| format!("cannot mount its root again: {e}"))?;
                if !volumes.is_empty() {
                    std::fs::create_dir_all(&volumes_dir)
                        .map_err(|e| format!("create {}: {e}", volumes_dir.display()))?;
                }
                for (source, target) in &volumes {
                    sandbar_jail::host::mount_volume_mapped(source, &userns, target).map_err(
                        |e| format!("cannot mount the volume {} again: {e}", source.display()),
                    )?;
                }
                if let Some((owner, etc)) = &etc {
                    let root = sandbox_dir.join(sandbar_jail::layout::ROOT);
                    for (name, content, mode) in etc {
                        sandbar_jail::host::replace_file_beneath(
                            &root,
                            &Path::new("etc").join(name),
                            content.as_bytes(),
                            *mode,
                            *owner,
                        )
                        .map_err(|e| format!("cannot write /etc/{name}: {e}"))?;
                    }
                }
                if let Err(e) = std::fs::create_dir(&sysfs)
                    && e.kind() != std::io::ErrorKind::AlreadyExists
                {
                    return Err(format!("create {}: {e}", sysfs.display()));
                }
                let netns_path =
                    PathBuf::from(format!("/proc/self/fd/{}", prepared.netns.as_raw_fd()));
                sandbar_jail::host::mount_sysfs_of(&netns_path, &sysfs)
                    .map_err(|e| format!("cannot mount its sysfs: {e}"))?;
                let boot_id_file = boot_id
                    .map(|boot_id| sandbar_jail::host::mount_boot_id(&boot_id_dir, &boot_id))
                    .transpose()
                    .map_err(|e| format!("cannot make its boot id: {e}"))?;
                let _ = std::fs::remove_file(&socket);
                let listener = prepared
                    .listen_at(&socket)
                    .map_err(|e| format!("bind {}: {e}", socket.display()))?;
                Ok((prepared, listener, boot_id_file))
            })
            .await
            .map_err(|e| sandbox_err(id, e))?
        };
        let undo_mounts = || self.unmount_restore(id, layers.len());
        let (prepared, listener, boot_id_file) = match mounted {
            Ok(ok) => ok,
            Err(e) => {
                undo_mounts();
                return Err(sandbox_err(id, e));
            }
        };
        let files = match crate::checkpoint::open_externals(&header, new_log.as_ref()) {
            Ok(files) => files,
            Err(e) => {
                undo_mounts();
                return Err(sandbox_err(id, e));
            }
        };
        let mut args: Vec<String> = Vec::new();
        for external in &header.externals {
            match external {
                crate::checkpoint::External::Device { key, source } => {
                    args.push(format!("--external=mnt[{key}]:{}", source.display()));
                }
                crate::checkpoint::External::Sysfs { key } => {
                    args.push(format!("--external=mnt[{key}]:{}", sysfs.display()));
                }
                crate::checkpoint::External::Volume { key, .. } => {
                    args.push(format!(
                        "--external=mnt[{key}]:{}",
                        volumes_dir.join(key).display()
                    ));
                }
                crate::checkpoint::External::BootId { key } => {
                    if let Some(file) = &boot_id_file {
                        args.push(format!("--external=mnt[{key}]:{}", file.display()));
                    }
                }
                crate::checkpoint::External::File { .. } => {}
            }
        }
        // Descriptors handed to CRIU at fixed numbers: the host files, the new listener and
        // the network namespace.
        let mut inherited: Vec<(i32, i32)> = Vec::new();
        let mut owned = Vec::new();
        let mut next = INHERITED_FD_BASE;
        for (key, fd) in files {
            args.push(format!("--inherit-fd=fd[{next}]:{key}"));
            inherited.push((fd.as_raw_fd(), next));
            owned.push(fd);
            next += 1;
        }
        args.push(format!(
            "--inherit-fd=fd[{next}]:socket:[{}]",
            header.listener_inode
        ));
        inherited.push((listener.as_raw_fd(), next));
        next += 1;
        args.push(format!("--inherit-fd=fd[{next}]:extnet"));
        inherited.push((prepared.netns.as_raw_fd(), next));

        let pidfile = dir.join(crate::checkpoint::RESTORE_PIDFILE);
        crate::checkpoint::clear_restore(&dir);
        let joins: Vec<std::ffi::CString> = self
            .cgroups
            .join_files(id)
            .iter()
            .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok())
            .collect();
        let mut command = criu.command();
        command
            .arg("restore")
            .arg("--images-dir")
            .arg(&dir)
            .arg("--log-file")
            .arg(crate::checkpoint::RESTORE_LOG)
            .arg("-v2")
            .arg("--root")
            .arg(sandbox_dir.join(sandbar_jail::layout::ROOT))
            .arg("--restore-detached")
            .arg(TCP_CLOSE)
            .arg("--manage-cgroups=ignore")
            .arg("--pidfile")
            .arg(&pidfile)
            .args(&args)
            // Nothing to a pipe: CRIU must be able to finish the restore if the server dies.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
        // functions (open, write, close, dup2) on data prepared before the fork.
        unsafe {
            command.pre_exec(move || {
                // CRIU leaves restored tasks in its own cgroups (--manage-cgroups=ignore): it
                // joins the sandbox's first.
                for file in &joins {
                    let fd = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let written = libc::write(fd, c"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for (from, to) in &inherited {
                    if libc::dup2(*from, *to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let prepared_in = started.elapsed();
        let deadline = restore_deadline(images_bytes);
        let mut tries = 0;
        let status = loop {
            tries += 1;
            let outcome = run_criu(&mut command, deadline).await;
            let failed = match &outcome {
                Ok(status) => !status.success(),
                Err(e) => e.kind() == std::io::ErrorKind::TimedOut,
            };
            if !failed || tries == RESTORE_TRIES {
                break outcome;
            }
            // Seen rarely: a thread of the restored tree gone before CRIU let it go, and
            // CRIU then stuck on its own kill of the tree. The images are intact; what the
            // failed attempt started has not run any of the sandbox's code yet.
            let errors = crate::checkpoint::log_errors(&dir.join(crate::checkpoint::RESTORE_LOG));
            tracing::warn!(sandbox_id = %id, error = %errors, ?outcome, "restore failed; trying again");
            let _ = self.cgroups.kill_all(id).await;
            crate::checkpoint::clear_restore(&dir);
        };
        let criu_in = started.elapsed() - prepared_in;
        drop(owned);
        drop(listener);
        drop(prepared);
        undo_mounts();
        tracing::debug!(
            sandbox_id = %id,
            prepare_us = prepared_in.as_micros() as u64,
            criu_us = criu_in.as_micros() as u64,
            "restore timings"
        );
        let status =
            status.map_err(|e| sandbox_err(id, format!("run {}: {e}", criu.path.display())))?;
        if !status.success() {
            let errors = crate::checkpoint::log_errors(&dir.join(crate::checkpoint::RESTORE_LOG));
            // Whatever CRIU had started is in the sandbox's cgroups.
            let _ = self.cgroups.kill_all(id).await;
            return Err(sandbox_err(
                id,
                format!("restore failed ({status}): {errors}"),
            ));
        }
        let pid = crate::checkpoint::restored_pid(&dir)
            .ok_or_else(|| sandbox_err(id, "the restore wrote no PID"))?;
        Ok(pid)
    }
}

/// Established TCP connections are not kept: their sockets come back shut down, as after a
/// network outage, and the programs holding them see the connection end. Keeping them
/// (`--tcp-established`) would freeze their peers outside the sandbox for as long as it is
/// paused and fail when the peer has moved on; without either, a sandbox with any open
/// connection could not be checkpointed at all. Given at the dump and again at the restore.
const TCP_CLOSE: &str = "--tcp-close";

/// How many times a restore is attempted before it is given up.
const RESTORE_TRIES: u32 = 2;

/// How long one restore may take: restores run at hundreds of MiB a second, so this is only
/// ever reached by a CRIU that is stuck.
fn restore_deadline(images_bytes: u64) -> Duration {
    Duration::from_secs(20 + 20 * images_bytes.div_ceil(1 << 30))
}

/// Runs `criu restore` to its end, or kills it (and so lets go of the tasks it holds) once
/// `deadline` has passed.
async fn run_criu(
    command: &mut tokio::process::Command,
    deadline: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    let mut child = command.spawn()?;
    sandbar_core::faults::crash_point("restore.restoring");
    match tokio::time::timeout(deadline, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            let _ = child.kill().await;
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("criu did not finish within {} s", deadline.as_secs()),
            ))
        }
    }
}

/// What a snapshot's checkpoint directory holds besides the images: what a restore into
/// another sandbox must change.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotOrigin {
    /// Host id of the snapshotted sandbox's root: its user namespace image names that range.
    id_base: u32,
    /// The token its agent held, which the restored agent answers to until it is given its
    /// own.
    access_token: String,
    /// Its agent log, which the checkpoint's agent holds open.
    log: PathBuf,
}

const SNAPSHOT_ORIGIN: &str = "origin.json";

/// CRIU would otherwise lock the sandbox's network namespace with `iptables-restore` around
/// a dump and a restore (two processes each time, about 50 ms of a restore; the restore
/// follows what the dump recorded). The lock keeps established TCP connections from being
/// reset meanwhile; a sandbox's are not kept anyway ([`TCP_CLOSE`]), and nothing routes to
/// it while it is dumped or restored.
const NO_NETWORK_LOCK: [&str; 2] = ["--network-lock", "skip"];

/// Names a checkpoint directory gets when it is spent and is being removed.
const SPENT_PREFIX: &str = ".spent-";

/// Removes spent checkpoints whose removal a stopped server did not finish.
fn remove_spent_checkpoints(checkpoints: &Path) {
    let Ok(entries) = std::fs::read_dir(checkpoints) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(SPENT_PREFIX)
        {
            let _ = crate::disks::remove_tree(&entry.path());
        }
    }
}

/// How long a restart waits for a dump or restore the previous server left running: far
/// longer than one of a sandbox of the largest size takes.
const ORPHANED_CRIU_WAIT: Duration = Duration::from_secs(120);

fn is_snapshot_key(key: &str) -> bool {
    key.len() == 32 && key.bytes().all(|c| c.is_ascii_hexdigit())
}

impl LinuxRuntime {
    fn snapshots_dir(&self) -> PathBuf {
        self.config.data_dir.join("snapshots")
    }

    /// Copies sandbox `id` into a snapshot: frozen, its processes dumped (left running) and
    /// its writable layer snapshotted, then thawed; the copies are made into a layer and a
    /// checkpoint after it runs again.
    async fn take_snapshot(
        &self,
        id: &str,
        h: &Handle,
        agent_token: &str,
        memory: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        let criu = self.criu.get();
        let criu = match (criu.as_deref(), memory) {
            (Some(criu), true) => Some(criu),
            (None, true) => {
                return Err(sandbox_err(
                    id,
                    "this node cannot snapshot memory (no usable CRIU); a snapshot with memory: false copies the files only",
                ));
            }
            (_, false) => None,
        };
        if !is_alive(h) {
            return Err(sandbox_err(id, "the sandbox's processes are gone"));
        }
        let base = h
            .id_base
            .ok_or_else(|| sandbox_err(id, "the sandbox runs without its own user namespace"))?;
        let key = {
            use sha2::Digest;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            hex::encode(sha2::Sha256::digest(format!(
                "{id}/{nanos}/{}",
                std::process::id()
            )))[..32]
                .to_owned()
        };
        let parts = SnapshotParts {
            layer: crate::layers::LayerStore::step_layer_name(&key),
            checkpoint: memory.then(|| format!("checkpoint/{key}")),
        };
        self.fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(
                std::iter::once(parts.layer.clone())
                    .chain(parts.checkpoint.clone())
                    .map(|name| (name, std::time::Instant::now())),
            );
        let images = self.snapshots_dir().join(&key);
        let layer_dir = self.layers.steps_dir().join(&key);
        let discard = || {
            let _ = crate::disks::remove_tree(&images);
            let _ = self.disks.remove_at(self.layers.steps_dir(), &key);
        };
        if memory {
            std::fs::create_dir_all(&images)
                .map_err(|e| sandbox_err(id, format!("create {}: {e}", images.display())))?;
        }
        let freezer = self
            .cgroups
            .freezer_dir(id)
            .ok_or_else(|| sandbox_err(id, "the freezer controller is not mounted"))?;
        let was_frozen = self.cgroups.is_frozen(id);
        if !was_frozen {
            self.cgroups
                .freeze(id)
                .await
                .map_err(|e| sandbox_err(id, e))?;
        }
        let held_since = std::time::Instant::now();
        let copied = self.copy_frozen(id, h, criu, &freezer, &images, &key).await;
        if !was_frozen && let Err(e) = self.cgroups.thaw(id) {
            tracing::error!(sandbox_id = %id, error = %e, "cannot thaw after a snapshot");
        }
        let held = held_since.elapsed();
        sandbar_core::faults::crash_point("snapshot.copied");
        let plan = match copied {
            Ok(plan) => plan,
            Err(e) => {
                discard();
                return Err(e);
            }
        };
        let with_memory = plan.zip(criu.map(|c| c.version.clone()));
        let origin = SnapshotOrigin {
            id_base: base,
            access_token: agent_token.to_owned(),
            log: self.log_path(id),
        };
        let agent_digest = self.agent_digest.clone();
        let finish_images = images.clone();
        let finished = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            crate::layers::seal_layer(&layer_dir, base, SANDBOX_IDS)?;
            let Some((plan, criu_version)) = with_memory else {
                return Ok(());
            };
            std::fs::write(
                finish_images.join(SNAPSHOT_ORIGIN),
                serde_json::to_vec(&origin).map_err(std::io::Error::other)?,
            )?;
            crate::checkpoint::seal(&finish_images, criu_version, agent_digest, plan).map(|_| ())
        })
        .await
        .map_err(|e| sandbox_err(id, e));
        if let Err(e) = finished.and_then(|r| {
            r.map_err(|e| sandbox_err(id, format!("cannot finish the snapshot: {e}")))
        }) {
            discard();
            return Err(e);
        }
        if memory {
            self.set_verified(&images, true);
        }
        tracing::info!(
            sandbox_id = %id,
            held_ms = held.as_millis() as u64,
            layer = %parts.layer,
            "sandbox snapshotted"
        );
        Ok(parts)
    }

    /// The frozen part of a snapshot: CRIU dumps the processes and leaves them running, and
    /// the sandbox's directory is snapshotted at the same moment.
    async fn copy_frozen(
        &self,
        id: &str,
        h: &Handle,
        criu: Option<&crate::checkpoint::Criu>,
        freezer: &Path,
        images: &Path,
        key: &str,
    ) -> Result<Option<crate::checkpoint::DumpPlan>, RuntimeError> {
        let plan = match criu {
            Some(criu) => {
                let netns_inode = ns_inode(Path::new(&format!("/proc/{}/ns/net", h.pid)))
                    .ok_or_else(|| sandbox_err(id, "its network namespace is gone"))?;
                Some(
                    self.dump_into(id, h, criu, freezer, images, netns_inode, true)
                        .await?,
                )
            }
            None => None,
        };
        let disks = self.disks.clone();
        let (owned_id, steps, owned_key) = (
            id.to_owned(),
            self.layers.steps_dir().to_owned(),
            key.to_owned(),
        );
        tokio::task::spawn_blocking(move || disks.snapshot(&owned_id, &steps, &owned_key))
            .await
            .map_err(|e| sandbox_err(id, e))?
            .map_err(|e| sandbox_err(id, format!("cannot copy its files: {e}")))?;
        Ok(plan)
    }

    /// Starts sandbox `spec` from the snapshot `snapshot`: a fresh writable layer on the
    /// snapshot's layers, and the snapshot's processes restored into it with the new
    /// sandbox's id range, network, cgroups, token and environment.
    async fn launch_restored(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        checkpoint: &str,
    ) -> Result<(Handle, Endpoint), (Option<Handle>, RuntimeError)> {
        let id = &spec.sandbox_id;
        let slot = netns.slot;
        let started = std::time::Instant::now();
        let id_map = self.id_map(slot);
        let bare = |e: RuntimeError| (None, e);
        let criu = self.criu_for_restore(id).await.map_err(bare)?;
        let key = checkpoint
            .strip_prefix("checkpoint/")
            .filter(|k| is_snapshot_key(k))
            .ok_or_else(|| {
                bare(sandbox_err(
                    id,
                    format!("'{checkpoint}' names no snapshot checkpoint"),
                ))
            })?
            .to_owned();
        let source = self.snapshots_dir().join(&key);
        let work = self.checkpoint_dir(id);
        let verify = !self.is_verified(&source);
        let prepared = {
            let (source, work) = (source.clone(), work.clone());
            let to = id_map.host_base;
            tokio::task::spawn_blocking(move || -> Result<_, String> {
                let header = crate::checkpoint::read_header(&source, verify)
                    .map_err(|e| format!("the snapshot is not usable: {e}"))?;
                let origin: SnapshotOrigin = serde_json::from_slice(
                    &std::fs::read(source.join(SNAPSHOT_ORIGIN))
                        .map_err(|e| format!("the snapshot has no origin: {e}"))?,
                )
                .map_err(|e| format!("the snapshot's origin is unreadable: {e}"))?;
                // The images are shared by every sandbox made from the snapshot: each restore
                // gets links to them in a directory of its own, with its own id range.
                let _ = crate::disks::remove_tree(&work);
                std::fs::create_dir_all(&work)
                    .map_err(|e| format!("create {}: {e}", work.display()))?;
                // Restored with the snapshotted sandbox's ids, a copy could touch its files.
                let user_namespaces = header
                    .images
                    .iter()
                    .filter(|i| crate::checkpoint::is_userns_image(&i.name))
                    .count();
                if user_namespaces != 1 {
                    return Err(format!(
                        "the snapshot has {user_namespaces} user namespace images, not one"
                    ));
                }
                for image in &header.images {
                    if crate::checkpoint::is_userns_image(&image.name) {
                        let bytes = std::fs::read(source.join(&image.name))
                            .map_err(|e| format!("read {}: {e}", image.name))?;
                        let moved = crate::checkpoint::remap_userns_image(
                            &bytes,
                            origin.id_base,
                            to,
                            SANDBOX_IDS,
                        )
                        .ok_or("the snapshot's user namespace image is not one this node reads")?;
                        std::fs::write(work.join(&image.name), moved)
                            .map_err(|e| format!("write {}: {e}", image.name))?;
                    } else {
                        std::fs::hard_link(source.join(&image.name), work.join(&image.name))
                            .map_err(|e| format!("link {}: {e}", image.name))?;
                    }
                }
                Ok((header, origin))
            })
            .await
            .map_err(|e| bare(sandbox_err(id, e)))?
            .map_err(|e| bare(sandbox_err(id, e)))?
        };
        let (header, origin) = prepared;
        self.set_verified(&source, true);
        // Its restore is the new sandbox's first boot.
        let boot_id = header
            .externals
            .iter()
            .any(|e| matches!(e, crate::checkpoint::External::BootId { .. }))
            .then(sandbar_core::ids::new_uuid);
        check_criu_version(id, &criu, &header).map_err(bare)?;
        if header.agent_digest != self.agent_digest {
            tracing::debug!(sandbox_id = %id, "the snapshot runs an older agent build");
        }
        self.cgroups
            .create(
                id,
                Limits {
                    cpu_count: spec.cpu_count,
                    memory_mb: spec.memory_mb,
                    pids_max: self.config.pids_max,
                },
            )
            .map_err(|e| bare(sandbox_err(id, e)))?;
        self.disks
            .create(id, spec.disk_size_mb, id_map.host_base)
            .map_err(|e| bare(sandbox_err(id, e)))?;
        self.apply_egress(id, slot, spec.allow_internet_access, &spec.egress)
            .await
            .map_err(bare)?;
        // CRIU checks that a file the processes held open has the size it had at the dump: the
        // new log starts out as long as the snapshotted one was (a hole) and is emptied once
        // the restore is done; the agent appends, so its next line lands at the start.
        let held_log_size = header
            .externals
            .iter()
            .find_map(|e| match e {
                crate::checkpoint::External::File { path, size, .. } if *path == origin.log => {
                    Some(*size)
                }
                _ => None,
            })
            .unwrap_or(0);
        let log_path = self.log_path(id);
        let log = std::fs::File::create(&log_path)
            .and_then(|log| {
                std::os::unix::fs::fchown(&log, Some(id_map.host_base), Some(id_map.host_base))?;
                log.set_len(held_log_size)?;
                Ok(log)
            })
            .map_err(|e| {
                bare(sandbox_err(
                    id,
                    format!("create {}: {e}", log_path.display()),
                ))
            })?;
        let layers = self.layers.stack(&spec.image.layers).map_err(|message| {
            bare(RuntimeError::TemplateMissing {
                template_id: format!("{} ({message})", spec.template.id),
            })
        })?;
        let userns = sandbar_jail::host::new_user_namespace(id_map).map_err(|e| {
            bare(sandbox_err(
                id,
                format!("cannot make its user namespace: {e}"),
            ))
        })?;
        let gateway = self
            .network
            .addrs(slot)
            .map_err(|e| bare(sandbox_err(id, e)))?
            .host;
        let pid = self
            .run_restore(
                id,
                RestoreFrom {
                    images: work.clone(),
                    header,
                    layers,
                    userns,
                    netns,
                    new_log: Some((origin.log.clone(), log_path.clone())),
                    // A new sandbox is a new machine; what its restored processes read before
                    // stays in their memory.
                    etc: Some((
                        id_map.host_base,
                        vec![
                            ("resolv.conf", format!("nameserver {gateway}\n"), 0o644),
                            (
                                "machine-id",
                                format!("{}\n", sandbar_core::ids::new_machine_id()),
                                0o444,
                            ),
                        ],
                    )),
                    boot_id: boot_id.clone(),
                },
            )
            .await
            .map_err(bare)?;
        let _ = log.set_len(0);
        drop(log);
        let _ = crate::disks::remove_tree(&work);
        let restored = started.elapsed();
        let handle = Handle::running(pid, slot, id_map, spec, boot_id);
        let fail = |e: RuntimeError| (Some(handle.clone()), e);
        let endpoint = self.endpoint(id, slot).map_err(fail)?;
        agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(10))
            .await
            .map_err(|e| fail(sandbox_err(id, format!("the restored agent: {e}"))))?;
        let workdir = default_workdir(&spec.image.user, &spec.image.workdir);
        agent_client::init(
            &endpoint.agent_socket,
            &origin.access_token,
            &agent_client::Init {
                access_token: &spec.envd_access_token,
                env_vars: &spec.env_vars,
                default_user: &spec.image.user,
                default_workdir: workdir,
                memory_limit_mb: spec.memory_mb,
            },
        )
        .await
        .map_err(|e| {
            fail(sandbox_err(
                id,
                format!("cannot hand the agent its sandbox: {e}"),
            ))
        })?;
        tracing::debug!(
            sandbox_id = %id,
            restored_us = restored.as_micros() as u64,
            ready_us = started.elapsed().as_micros() as u64,
            "sandbox restored from a snapshot"
        );
        Ok((handle, endpoint))
    }
}

/// What [`LinuxRuntime::run_restore`] restores, and into what.
/// A file of `/etc` written into a restored sandbox's root: name, content, mode.
type EtcFile = (&'static str, String, u32);

struct RestoreFrom {
    /// The images, where CRIU also writes its log and the PID file.
    images: PathBuf,
    header: crate::checkpoint::Header,
    /// The sandbox's layers, topmost first.
    layers: Vec<PathBuf>,
    /// A user namespace with the sandbox's id range, to id-map the layers.
    userns: std::os::fd::OwnedFd,
    netns: PreparedNetns,
    /// The agent log the checkpoint's processes held (the snapshotted sandbox's) and the one
    /// the restored sandbox writes instead.
    new_log: Option<(PathBuf, PathBuf)>,
    /// Files of `/etc` written into the root before the restore, and their owner.
    etc: Option<(u32, Vec<EtcFile>)>,
    /// The boot id the restored sandbox shows, when its checkpoint binds one.
    boot_id: Option<String>,
}

fn check_criu_version(
    id: &str,
    criu: &crate::checkpoint::Criu,
    header: &crate::checkpoint::Header,
) -> Result<(), RuntimeError> {
    if header.criu_version != criu.version {
        return Err(sandbox_err(
            id,
            format!(
                "the checkpoint was made by CRIU {}, this node has {}",
                header.criu_version, criu.version
            ),
        ));
    }
    Ok(())
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
            slot: 0,
            id_base: None,
            memory_mb: 0,
            layers: Vec::new(),
            released: false,
            checkpointed: false,
            volumes: Vec::new(),
            boot_id: None,
        }));
        assert!(!is_alive(&Handle {
            pid,
            start_ticks: first + 1,
            slot: 0,
            id_base: None,
            memory_mb: 0,
            layers: Vec::new(),
            released: false,
            checkpointed: false,
            volumes: Vec::new(),
            boot_id: None,
        }));
    }
}
