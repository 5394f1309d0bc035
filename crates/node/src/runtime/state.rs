//! What every part of the node shares: its configuration, host resources and records of the
//! sandboxes it holds.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbar_core::{EgressRules, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

use crate::net::netns::{NetnsPool, SlotSet};
use crate::net::network::Network;
use crate::resources::cgroups::{CgroupDriver, Limits};
use crate::storage::disks::{DiskPool, PoolConfig};

use super::agent_copies::{
    AgentLibrary, agent_libraries, collect_agent_copies, keep_agent, kept_agent_copies,
};
use super::criu_runs::{ORPHANED_CRIU_WAIT, remove_spent_checkpoints};
use super::handle::launched;
use super::holdings::Holdings;
use super::in_flight::InFlight;
use super::{NodeConfig, NodeError, SANDBOX_IDS, ledger, ns_inode, places, sandbox_err};

/// The node's configuration, host resources and records, shared by every part of
/// [`super::LinuxRuntime`] through an [`Arc`].
#[derive(Debug)]
pub(super) struct NodeState {
    pub(super) config: NodeConfig,
    pub(super) cgroups: CgroupDriver,
    pub(super) network: Arc<Network>,
    pub(super) netns_pool: Arc<NetnsPool>,
    pub(super) egress: Arc<crate::net::egress::Egress>,
    pub(super) disks: DiskPool,
    /// Memory granted to sandboxes and the rule for granting more.
    pub(super) ledger: Arc<ledger::ResourceLedger>,
    /// What each sandbox on this node holds: its slot, memory grant, disk promise and layers.
    pub(super) holdings: Holdings,
    pub(super) slots: SlotSet,
    pub(super) layers: crate::storage::layers::LayerStore,
    /// CRIU, once it passed its probe (at start, or later when installed meanwhile).
    pub(super) criu: crate::checkpoint::criu_cell::CriuCell,
    /// Sandboxes booted ahead of demand.
    pub(super) warm: crate::runtime::warm::WarmPool,
    /// The content-addressed copy of the agent binary sandboxes run, and its SHA-256: a
    /// checkpoint can only be restored with the exact binary its processes mapped.
    pub(super) agent_exec: PathBuf,
    pub(super) agent_digest: String,
    /// Where the kernel keeps objects without a path, which a dump plan leaves to CRIU.
    pub(super) kernel_filesystems: crate::checkpoint::KernelFilesystems,
    /// The host's shared libraries the agent maps.
    pub(super) agent_libraries: Vec<AgentLibrary>,
    /// Every agent copy kept at start, by identity and digest: sandboxes started by an
    /// earlier build run an earlier one, and no copy is made after start.
    pub(super) agent_copies: Vec<(crate::checkpoint::FileIdentity, String)>,
    /// Where each sandbox's files sit on the host.
    pub(super) places: places::NodePlaces,
    /// Snapshot parts not yet kept by a template: the core records the template just after
    /// making them (and says so), and the collector must not take them in between. Entries
    /// older than [`FRESH_SNAPSHOT`](super::layers::FRESH_SNAPSHOT) are dropped whatever happened.
    pub(super) fresh_snapshots: Mutex<Vec<(String, std::time::Instant)>>,
    /// Captures of templates whose restore failed here: their sandboxes boot and run the
    /// start command instead, until the process restarts.
    pub(super) unrestorable_captures: Mutex<BTreeSet<String>>,
    /// Checkpoint and snapshot directories whose images this process wrote or already
    /// checked against their checksum: nothing changes them afterwards, so a restore, a fork
    /// of many or a second create does not read them all again. Checkpoints a previous server
    /// left are checked once before their first restore.
    pub(super) verified_images: Mutex<BTreeSet<PathBuf>>,
    /// The cluster's layer store, where one is configured: layers this node lacks are
    /// fetched from it before a sandbox boots on them.
    pub(super) shared_layers: std::sync::OnceLock<Arc<crate::cluster::shared_layers::SharedLayers>>,
    /// Build sandboxes being launched or removed in tasks of their own (a build dropped
    /// where it stands leaves them to finish): the server's stop waits for them.
    pub(super) build_sandboxes_settling: Arc<InFlight>,
    /// What sampling last found of each sandbox, so that idle ones are sampled cheaply.
    pub(super) usage_readings: super::sampling_memo::UsageReadings,
    pub(super) log_marks: super::sampling_memo::LogMarks,
}

impl NodeState {
    /// Checks the host and prepares the node's directories and firewall.
    pub(super) async fn open(config: NodeConfig) -> Result<Self, NodeError> {
        check_agent(&config)?;
        // Before anything looks at sandboxes, checkpoints or agent copies.
        if let Some(criu) = &config.criu {
            Self::wait_for_orphaned_criu(criu, &config.data_dir).await;
        }
        let mut cgroups = CgroupDriver::detect()?;
        cgroups.take_up_spare_memory_groups();
        cgroups.hold_freezer_checks_on();
        let network = open_network(&config)?;
        let egress = start_firewall(&config, &network).await?;
        let disks = open_disks(&config, &mut cgroups).await?;
        make_private_dirs(&config.data_dir)?;
        tracing::info!(cgroup_version = cgroups.version(), "node ready");
        let memory_rule = limit_sandboxes_memory(&config, &mut cgroups);
        let layers = open_layers(&config.data_dir)?;
        let slots = SlotSet::default();
        let netns_pool = NetnsPool::new(network.clone(), slots.clone(), config.netns_pool);
        netns_pool.refill();
        let agent = keep_agent_copies(&config)?;
        let mount_dir = mount_dir_of(&config.data_dir);
        make_checkpoint_dirs(&config.data_dir, &mount_dir)?;
        let (kernel_filesystems, criu) = probe_checkpointing(&config, &mount_dir).await?;
        Ok(Self {
            criu,
            warm: crate::runtime::warm::WarmPool::new(config.warm_pool, config.warm_pool_max),
            agent_exec: agent.exec,
            agent_digest: agent.digest,
            kernel_filesystems,
            agent_libraries: agent.libraries,
            agent_copies: agent.copies,
            places: places::NodePlaces {
                data_dir: config.data_dir.clone(),
                mount_dir,
            },
            fresh_snapshots: Mutex::new(Vec::new()),
            unrestorable_captures: Mutex::new(BTreeSet::new()),
            verified_images: Mutex::new(BTreeSet::new()),
            shared_layers: std::sync::OnceLock::new(),
            build_sandboxes_settling: Default::default(),
            usage_readings: Default::default(),
            log_marks: Default::default(),
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

    /// The node's files a sandbox's processes may hold from outside its mounts, as a dump
    /// plan recognises them: every agent copy (a sandbox started by an earlier build runs an
    /// earlier one), the agent's libraries and the sandbox's own log.
    pub(super) fn placed_files(&self, id: &str) -> std::io::Result<crate::checkpoint::PlacedFiles> {
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
    pub(super) fn library_sources(&self) -> Vec<(String, PathBuf)> {
        self.agent_libraries
            .iter()
            .map(|l| (l.digest.clone(), l.path.clone()))
            .collect()
    }

    /// Removes the sandbox's agent log with what its rotation kept.
    pub(super) fn remove_log(&self, id: &str) {
        crate::runtime::agent_log::AgentLog::new(self.places.log_path(id)).remove();
    }

    pub(super) fn id_map(&self, slot: u32) -> IdMap {
        IdMap {
            host_base: self.config.id_base + slot * SANDBOX_IDS,
            size: SANDBOX_IDS,
        }
    }

    /// The kept directory of a released sandbox, its files given to the id range of the
    /// slot it boots in now when that differs from its last one.
    pub(super) async fn reuse_disk(
        &self,
        id: &str,
        from: u32,
        to: u32,
    ) -> Result<PathBuf, RuntimeError> {
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

    pub(super) fn endpoint(&self, id: &str, slot: u32) -> Result<Endpoint, RuntimeError> {
        let addrs = self.network.addrs(slot).map_err(|e| sandbox_err(id, e))?;
        Ok(Endpoint {
            agent_socket: self.places.socket_path(id),
            address: IpAddr::V4(addrs.sandbox),
        })
    }

    pub(super) async fn update_network(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        let handle = launched(sandbox_id, handle)?;
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

    /// The cgroup limits of sandbox `spec` once it is someone's.
    pub(super) fn limits_of(&self, spec: &LaunchSpec) -> Limits {
        Limits {
            cpu_count: spec.cpu_count,
            memory_mb: spec.memory_mb,
            pids_max: self.config.pids_max,
            cpu_priority: crate::resources::cgroups::CpuPriority::Normal,
            io: self.cgroups.io_rates().with_team(&spec.disk_rates),
        }
    }

    /// Installs `rules` for slot `slot`; an isolated sandbox needs none (its interface name
    /// already cuts it off).
    pub(super) async fn apply_egress(
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
                &crate::net::network::iface_name(slot, egress),
                wanted,
            )
            .await
            .map_err(|e| sandbox_err(id, e))
    }

    /// The network namespace a checkpointed sandbox's processes are restored into; the one
    /// its PID 1 joined at boot, kept alive by a bind mount.
    pub(super) fn keep_netns(&self, id: &str, pid: i32) -> std::io::Result<PathBuf> {
        for kind in ["net", "user"] {
            let target = self.places.kept_ns(id, kind);
            let source = PathBuf::from(format!("/proc/{pid}/ns/{kind}"));
            if ns_inode(&target).is_some() && ns_inode(&target) == ns_inode(&source) {
                continue;
            }
            let _ = sandbar_jail::host::unmount(&target);
            sandbar_jail::host::bind_file(&source, &target)?;
        }
        Ok(self.places.kept_ns(id, "net"))
    }

    /// Removes a sandbox's checkpoint and the namespaces kept for it; nothing if it has none.
    pub(super) fn forget_checkpoint(&self, id: &str) {
        self.unmount_restore_aids(id);
        self.set_verified(&self.places.checkpoint_dir(id), false);
        for kind in ["net", "user"] {
            let kept = self.places.kept_ns(id, kind);
            while sandbar_jail::host::unmount(&kept).is_ok() {}
            let _ = std::fs::remove_file(&kept);
        }
        let _ = std::fs::remove_dir_all(self.places.checkpoint_dir(id));
        let carried = self.places.carried_checkpoint_dir(id);
        self.set_verified(&carried, false);
        let _ = crate::storage::disks::remove_tree(&carried);
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

    pub(super) fn is_verified(&self, images: &Path) -> bool {
        self.verified_images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(images)
    }

    pub(super) fn set_verified(&self, images: &Path, verified: bool) {
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
    pub(super) fn unmount_restore(&self, id: &str, layers: usize) {
        sandbar_jail::host::unmount_root(&self.disks.path(id), layers);
        self.unmount_restore_aids(id);
    }

    /// The mounts outside the sandbox's directory that a restore of sandbox `id` makes for
    /// CRIU (its sysfs, its boot id, its volumes), gone with their mount points.
    pub(super) fn unmount_restore_aids(&self, id: &str) {
        for dir in [
            self.places.restored_sysfs(id),
            self.places.restored_boot_id_dir(id),
        ] {
            let _ = sandbar_jail::host::unmount(&dir);
            let _ = std::fs::remove_dir(&dir);
        }
        let volumes = self.places.restored_volumes_dir(id);
        if let Ok(entries) = std::fs::read_dir(&volumes) {
            for entry in entries.flatten() {
                let _ = sandbar_jail::host::unmount(&entry.path());
                let _ = std::fs::remove_dir(entry.path());
            }
            let _ = std::fs::remove_dir(&volumes);
        }
    }

    /// A checkpoint made before a restart may find CRIU installed only since: probed again.
    pub(super) async fn criu_for_restore(
        &self,
        id: &str,
    ) -> Result<std::sync::Arc<crate::checkpoint::Criu>, RuntimeError> {
        self.criu
            .get_or_probe()
            .await
            .ok_or_else(|| sandbox_err(id, "this node cannot restore checkpoints"))
    }
}

fn check_agent(config: &NodeConfig) -> Result<(), NodeError> {
    std::fs::metadata(&config.agent_bin).map_err(|source| NodeError::AgentMissing {
        path: config.agent_bin.clone(),
        source,
    })?;
    Ok(())
}

/// The sandboxes' address range, shaped to the configured bandwidth; every slot in it must
/// have user and group ids below the kernel's last.
fn open_network(config: &NodeConfig) -> Result<Arc<Network>, NodeError> {
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
    Ok(network)
}

/// Starts the sandboxes' resolver and the firewall that sends their lookups to it.
async fn start_firewall(
    config: &NodeConfig,
    network: &Network,
) -> Result<Arc<crate::net::egress::Egress>, NodeError> {
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
    Ok(egress)
}

/// Opens the sandboxes' disk pool and holds their disk rates on it and on the data directory.
async fn open_disks(
    config: &NodeConfig,
    cgroups: &mut CgroupDriver,
) -> Result<DiskPool, NodeError> {
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
    crate::resources::cgroups::hold_sandboxes_to(
        cgroups,
        config.sandbox_io,
        &[disks.dir(), &config.data_dir],
    );
    Ok(disks)
}

fn make_private_dirs(data_dir: &Path) -> Result<(), NodeError> {
    for dir in [data_dir.join("run"), data_dir.join("logs")] {
        std::fs::create_dir_all(&dir).map_err(|source| NodeError::Io {
            path: dir.clone(),
            source,
        })?;
        // Agent sockets and sandbox layers are the host's business only.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    }
    Ok(())
}

/// Limits the memory of all sandboxes together, where the host's memory can be read, and
/// gives the rule for granting memory to each.
fn limit_sandboxes_memory(
    config: &NodeConfig,
    cgroups: &mut CgroupDriver,
) -> crate::resources::memory::MemoryRule {
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
    memory_rule
}

fn open_layers(data_dir: &Path) -> Result<crate::storage::layers::LayerStore, NodeError> {
    // Image layers live on the pool, whose accounting then sees them; a dot name keeps
    // them out of the sweep of unknown sandboxes.
    let layers = crate::storage::layers::LayerStore::new(
        data_dir.join("templates"),
        data_dir.join("sandboxes").join(".images"),
        data_dir.join("sandboxes").join(".layers"),
    )
    .with_legacy_images_dir(data_dir.join("images").join("layers"))
    .with_checkpoints_dir(data_dir.join("snapshots"));
    for dir in [layers.steps_dir(), layers.images_dir()] {
        std::fs::create_dir_all(dir).map_err(|source| NodeError::Io {
            path: dir.to_owned(),
            source,
        })?;
    }
    Ok(layers)
}

/// The agent binary sandboxes run, as [`keep_agent`] keeps it, and what a dump plan needs
/// to know of it and of the copies earlier builds left.
struct KeptAgent {
    exec: PathBuf,
    digest: String,
    libraries: Vec<AgentLibrary>,
    copies: Vec<(crate::checkpoint::FileIdentity, String)>,
}

fn keep_agent_copies(config: &NodeConfig) -> Result<KeptAgent, NodeError> {
    let (exec, digest) = keep_agent(&config.agent_bin, &config.data_dir)?;
    let libraries = agent_libraries(&exec);
    for removed in collect_agent_copies(&config.data_dir, &digest) {
        tracing::info!(agent = %removed.display(), "removed an agent copy nothing uses");
    }
    let copies = kept_agent_copies(&config.data_dir);
    Ok(KeptAgent {
        exec,
        digest,
        libraries,
        copies,
    })
}

/// One mount directory per data directory, so that two servers on one host keep apart.
fn mount_dir_of(data_dir: &Path) -> PathBuf {
    PathBuf::from(format!(
        "/run/sandbar-{}",
        &hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            data_dir.as_os_str().as_encoded_bytes()
        ))[..12]
    ))
}

fn make_checkpoint_dirs(data_dir: &Path, mount_dir: &Path) -> Result<(), NodeError> {
    for dir in [
        data_dir.join("checkpoints"),
        data_dir.join("snapshots"),
        mount_dir.to_owned(),
    ] {
        std::fs::create_dir_all(&dir).map_err(|source| NodeError::Io {
            path: dir.clone(),
            source,
        })?;
    }
    remove_spent_checkpoints(&data_dir.join("checkpoints"));
    use std::os::unix::fs::PermissionsExt;
    for private in ["checkpoints", "snapshots"] {
        let _ = std::fs::set_permissions(
            data_dir.join(private),
            std::fs::Permissions::from_mode(0o700),
        );
    }
    // Traversable, not listable: a restored sandbox's root task opens its sysfs here.
    let _ = std::fs::set_permissions(mount_dir, std::fs::Permissions::from_mode(0o711));
    Ok(())
}

/// What checkpoints need of the kernel: where it keeps objects without a path, and CRIU
/// once it passed its probe.
async fn probe_checkpointing(
    config: &NodeConfig,
    mount_dir: &Path,
) -> Result<
    (
        crate::checkpoint::KernelFilesystems,
        crate::checkpoint::criu_cell::CriuCell,
    ),
    NodeError,
> {
    let kdat_dir = make_kdat_dir(mount_dir);
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
    Ok((kernel_filesystems, criu))
}

/// The directory for CRIU's kernel probe of this boot.
fn make_kdat_dir(mount_dir: &Path) -> PathBuf {
    // CRIU's kernel probe is cached per boot: an earlier boot's cache may describe another
    // kernel.
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default();
    let kdat_dir = mount_dir.join(format!("criu-{boot_id}"));
    if let Ok(entries) = std::fs::read_dir(mount_dir) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("criu-") && entry.path() != kdat_dir
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&kdat_dir);
    kdat_dir
}
