//! Per-sandbox cgroups with a driver for each cgroup version: hosts still mix v1 hierarchies
//! (where resource controllers may live only in v1) with pure v2 ones.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::resources::io::{IoCounts, IoRates, IoThrottle};

const PARENT: &str = "sandbar";
/// v1 controllers a node works without: no freezer means no pause in memory, no blkio no
/// disk rates, and cpuacct often shares the cpu hierarchy.
const OPTIONAL_V1_CONTROLLERS: [&str; 3] = ["freezer", "cpuacct", "blkio"];
const ROOT: &str = "/sys/fs/cgroup";
/// How long a kill waits for a sandbox's processes to be gone: killed tasks take a moment
/// to exit and be reaped, longer on a loaded host, before their cgroup is empty.
pub const KILL_PATIENCE: Duration = Duration::from_secs(5);
/// Between two looks at a cgroup a kill is emptying.
const KILL_POLL: Duration = Duration::from_millis(10);
/// How the names of the server's own groups begin: no sandbox or warm name begins with a dot.
const OWN_PREFIX: &str = ".";
/// How the names of kept memory groups begin.
const SPARE_PREFIX: &str = ".spare-";
/// How the name of the empty freezer group held frozen begins (see
/// [`CgroupDriver::hold_freezer_checks_on`]).
const FROZEN_ANCHOR_PREFIX: &str = ".frozen-";
/// Kept memory groups at most: enough for a steady rate of creates and kills, few enough
/// that a burst of kills leaves little behind (each costs the kernel some memory, and
/// reclaim visits it).
const MAX_SPARE_MEMORY_GROUPS: usize = 32;
/// Charges a kept group may carry: kernel objects of the ended sandbox still being freed
/// (measured after idle sandboxes: 440 KiB at the median, 764 KiB at most). A group holding
/// more is emptied first, and removed if that leaves more, rather than handed to another
/// sandbox.
const SPARE_LEFT_BYTES: u64 = 1 << 20;

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub pids_max: u32,
    pub cpu_priority: CpuPriority,
    /// Its disk rates: the node's, or its team's where the team sets them.
    pub io: IoRates,
}

/// The sandbox's share of the CPU when the cores are contended, on top of its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuPriority {
    /// The kernel's default weight: what every sandbox in use gets.
    #[default]
    Normal,
    /// The smallest weight: work done ahead of demand (warm boots) runs on cycles nobody
    /// else wants, so it never slows down the requests it is meant to speed up.
    Background,
}

impl CpuPriority {
    /// cgroup v1 `cpu.shares`.
    fn shares(self) -> u32 {
        match self {
            CpuPriority::Normal => 1024,
            CpuPriority::Background => 2,
        }
    }

    /// cgroup v2 `cpu.weight`.
    fn weight(self) -> u32 {
        match self {
            CpuPriority::Normal => 100,
            CpuPriority::Background => 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no usable cgroup hierarchy: {0}")]
    Unsupported(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create cgroup {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot rename cgroup {path} to {to}: {source}")]
    Rename {
        path: PathBuf,
        to: String,
        source: std::io::Error,
    },
    #[error("cgroup {path} still has processes after killing them")]
    Busy { path: PathBuf },
    /// Processes outlived a kill for longer than [`KILL_PATIENCE`]. Names no host path: the
    /// message reaches clients.
    #[error(
        "sandbox {sandbox_id}: {processes} processes still remain {}s after being killed",
        KILL_PATIENCE.as_secs()
    )]
    Lingering {
        sandbox_id: String,
        processes: usize,
    },
    #[error("cannot watch {path} for out-of-memory events: {source}")]
    OomWatch {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The `oom_kill` count of a v1 `memory.oom_control` or a v2 `memory.events`: processes the
/// kernel killed because the cgroup reached its memory limit.
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == "oom_kill").then(|| value.trim().parse().ok())?
    })
}

/// Makes, limits, freezes and removes the cgroups of sandboxes.
#[derive(Debug, Clone)]
pub struct CgroupDriver {
    hierarchy: Hierarchy,
    /// The group under each hierarchy's root that holds the sandboxes' groups.
    parent: &'static str,
    /// The disk rates every sandbox gets, set once the node knows its devices.
    io: IoThrottle,
    spares: Arc<SpareMemoryGroups>,
}

/// Memory cgroups of ended sandboxes, kept for the next ones (cgroup v1).
///
/// Removing a memory cgroup makes the kernel move its entries off the memory-aware object
/// lists of every superblock on the host, and each sandbox mounts several: next to 1,000
/// sandboxes that took about 7 ms of a kernel worker per kill, the largest cost a kill left
/// to the creates around it. Renaming a group costs the same at any count. On v2 a
/// group's CPU, I/O and event counters live in the same directory and cannot be reset, so
/// there groups are removed as before.
#[derive(Debug, Default)]
struct SpareMemoryGroups {
    names: Mutex<Vec<String>>,
    made: AtomicU64,
}

impl SpareMemoryGroups {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        // A poisoned list is still a list of names.
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new_name(&self) -> String {
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        format!("{SPARE_PREFIX}{}-{n}", std::process::id())
    }
}

#[derive(Debug, Clone)]
enum Hierarchy {
    /// One directory per controller hierarchy.
    V1 {
        controllers: Vec<(&'static str, PathBuf)>,
    },
    /// One unified hierarchy.
    V2 { root: PathBuf },
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_owned(),
        source,
    })
}

/// Writes `value` unless the file already holds it. For a group's CPU bandwidth files: each
/// write makes the kernel check every CPU group on the host against its parent's quota, so a
/// write of what is already there costs time that grows with the number of sandboxes.
fn write_if_changed(path: &Path, value: &str) -> Result<(), CgroupError> {
    match std::fs::read_to_string(path) {
        Ok(held) if held.trim() == value => Ok(()),
        _ => write(path, value),
    }
}

/// A sandbox's memory as its memory cgroup counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUse {
    /// Memory in use, page cache excluded.
    pub used: u64,
    pub cache: u64,
}

/// Sets a v1 group's memory limit and, where swap is accounted, its memory+swap limit to the
/// same: the memory limit may never exceed the memory+swap one, so when it is raised past it
/// (the first write refused), the memory+swap one goes first.
fn write_v1_memory_limit(dir: &Path, bytes: u64) -> Result<(), CgroupError> {
    let limit = dir.join("memory.limit_in_bytes");
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    let value = bytes.to_string();
    if write(&limit, &value).is_err() {
        if memsw.exists() {
            write(&memsw, &value)?;
        }
        write(&limit, &value)?;
    }
    if memsw.exists() {
        write(&memsw, &value)?;
    }
    Ok(())
}

/// Memory a group uses, page cache excluded, and its page cache: v1 counts the cache of the
/// whole subtree as `total_cache`, v2 as `file`.
fn memory_use(dir: &Path, v1: bool) -> Option<(u64, u64)> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let (usage_file, cache_key) = if v1 {
        ("memory.usage_in_bytes", "total_cache")
    } else {
        ("memory.current", "file")
    };
    let usage: u64 = read(usage_file)?.trim().parse().ok()?;
    let stat = read("memory.stat").unwrap_or_default();
    let cache: u64 = stat
        .lines()
        .find_map(|l| {
            l.strip_prefix(cache_key)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0);
    Some((usage.saturating_sub(cache), cache))
}

/// The smallest CPU quota among the v1 groups above `dir`, in microseconds per `period`;
/// `None` when none has one.
fn ancestors_cpu_quota(dir: &Path, period: u64) -> Option<u64> {
    let read =
        |path: PathBuf| -> Option<i64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let mut smallest: Option<u64> = None;
    for ancestor in dir.ancestors().skip(1) {
        let (Some(quota), Some(their_period)) = (
            read(ancestor.join("cpu.cfs_quota_us")),
            read(ancestor.join("cpu.cfs_period_us")),
        ) else {
            // Past the top of the hierarchy's mount.
            break;
        };
        if let (Ok(quota), Ok(their_period)) = (u64::try_from(quota), u64::try_from(their_period))
            && their_period > 0
        {
            let scaled = (quota.saturating_mul(period) / their_period).max(1000);
            smallest = Some(smallest.map_or(scaled, |s| s.min(scaled)));
        }
    }
    smallest
}

/// The memory of all sandboxes together, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxesMemory {
    pub limit: u64,
    /// In use, page cache excluded.
    pub used: u64,
}

impl CgroupDriver {
    /// Picks v2 when the unified hierarchy owns the controllers, v1 otherwise.
    pub fn detect() -> Result<Self, CgroupError> {
        let root = Path::new(ROOT);
        if root.join("cgroup.controllers").exists() {
            let available =
                std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            for needed in ["memory", "cpu", "pids"] {
                if !available.split_whitespace().any(|c| c == needed) {
                    return Err(CgroupError::Unsupported(format!(
                        "controller {needed} is not available in {ROOT}"
                    )));
                }
            }
            return Ok(Self::with_hierarchy(Hierarchy::V2 {
                root: root.to_owned(),
            }));
        }
        let mut controllers = Vec::new();
        for name in ["memory", "cpu", "pids", "freezer", "cpuacct", "blkio"] {
            let dir = root.join(name);
            if dir.join("cgroup.procs").exists() {
                // Where cpu and cpuacct share a hierarchy, the cpu directory is already it.
                if name == "cpuacct"
                    && controllers
                        .iter()
                        .any(|(_, d): &(&str, PathBuf)| d.join("cpuacct.usage").exists())
                {
                    continue;
                }
                controllers.push((name, dir));
            } else if !OPTIONAL_V1_CONTROLLERS.contains(&name) {
                return Err(CgroupError::Unsupported(format!(
                    "cgroup v1 controller {name} is not mounted at {}",
                    dir.display()
                )));
            }
        }
        Ok(Self::with_hierarchy(Hierarchy::V1 { controllers }))
    }

    fn with_hierarchy(hierarchy: Hierarchy) -> Self {
        Self {
            hierarchy,
            parent: PARENT,
            io: IoThrottle::default(),
            spares: Arc::default(),
        }
    }

    /// Holds every sandbox made from now on to `io`.
    /// Returns whether this host can: v1 needs the blkio controller mounted, v2 the io one.
    pub fn set_io_throttle(&mut self, io: IoThrottle) -> bool {
        let able = match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers.iter().any(|(name, _)| *name == "blkio"),
            Hierarchy::V2 { root } => std::fs::read_to_string(root.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "io")),
        };
        if able {
            self.io = io;
        }
        able
    }

    /// The disk rates sandboxes get.
    pub fn io_throttle(&self) -> &IoThrottle {
        &self.io
    }

    /// The controllers a v2 parent hands its children: io only where it is held to rates.
    fn v2_subtree(&self) -> &'static str {
        if self.io.is_active() {
            "+memory +cpu +pids +io"
        } else {
            "+memory +cpu +pids"
        }
    }

    pub fn version(&self) -> u8 {
        match &self.hierarchy {
            Hierarchy::V1 { .. } => 1,
            Hierarchy::V2 { .. } => 2,
        }
    }

    fn dirs(&self, sandbox_id: &str) -> Vec<(&'static str, PathBuf)> {
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .map(|(name, dir)| (*name, dir.join(self.parent).join(sandbox_id)))
                .collect(),
            Hierarchy::V2 { root } => vec![("unified", root.join(self.parent).join(sandbox_id))],
        }
    }

    /// Names of the sandbox cgroups that exist in any hierarchy: a server killed while it
    /// booted a sandbox can leave some before the sandbox had a disk.
    pub fn names(&self) -> std::collections::BTreeSet<String> {
        let parents: Vec<PathBuf> = match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .map(|(_, dir)| dir.join(self.parent))
                .collect(),
            Hierarchy::V2 { root } => vec![root.join(self.parent)],
        };
        parents
            .iter()
            .filter_map(|parent| std::fs::read_dir(parent).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with(OWN_PREFIX))
            .collect()
    }

    /// The files a single-threaded process writes `0` into to move itself into the
    /// sandbox's cgroups.
    ///
    /// On v1 that is `tasks`: moving only the calling thread skips the global threadgroup
    /// lock whose first use after a quiet spell waits a full RCU grace period (measured
    /// here: ~12 ms through `cgroup.procs`, ~0.1 ms through `tasks`). A process that has
    /// one thread moves whole either way.
    pub fn join_files(&self, sandbox_id: &str) -> Vec<PathBuf> {
        let file = match &self.hierarchy {
            Hierarchy::V1 { .. } => "tasks",
            Hierarchy::V2 { .. } => "cgroup.procs",
        };
        self.dirs(sandbox_id)
            .into_iter()
            .map(|(_, dir)| dir.join(file))
            .collect()
    }

    /// The directory whose `cgroup.procs` lists every process of the sandbox.
    fn census_dir(&self, sandbox_id: &str) -> PathBuf {
        let dirs = self.dirs(sandbox_id);
        dirs.iter()
            .find(|(name, _)| *name == "pids" || *name == "unified")
            .or(dirs.first())
            .map(|(_, d)| d.clone())
            .unwrap_or_default()
    }

    pub fn create(&self, sandbox_id: &str, limits: Limits) -> Result<(), CgroupError> {
        if let Hierarchy::V2 { root } = &self.hierarchy {
            // Controllers must be enabled on every ancestor for the leaf to get the files.
            write(&root.join("cgroup.subtree_control"), self.v2_subtree())?;
            let parent = root.join(self.parent);
            std::fs::create_dir_all(&parent).map_err(|source| CgroupError::Create {
                path: parent.clone(),
                source,
            })?;
            write(&parent.join("cgroup.subtree_control"), self.v2_subtree())?;
        }
        for (name, dir) in self.dirs(sandbox_id) {
            if name == "memory" && self.take_spare_memory_group(&dir) {
                continue;
            }
            std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Create {
                path: dir.clone(),
                source,
            })?;
        }
        // A new group has no limit on any disk: only a rate to hold it to is written.
        if !limits.io.is_unlimited() {
            self.throttle_io(sandbox_id, limits.io)?;
        }
        self.apply_limits(sandbox_id, limits)
    }

    /// The node's own disk rates, which a sandbox gets unless its team sets others.
    pub fn io_rates(&self) -> IoRates {
        self.io.rates
    }

    /// Holds sandbox `sandbox_id`'s groups to `rates` on the node's disks (a rate of 0 lifts
    /// that limit). Set when the groups are made, and again when a warm sandbox is taken by
    /// a team with rates of its own.
    pub fn throttle_io(&self, sandbox_id: &str, rates: IoRates) -> Result<(), CgroupError> {
        if !self.io.is_active() {
            return Ok(());
        }
        for (name, dir) in self.dirs(sandbox_id) {
            for device in &self.io.devices {
                match name {
                    "blkio" => {
                        for (file, line) in rates.v1_lines(*device) {
                            write(&dir.join(file), &line)?;
                        }
                    }
                    "unified" => write(&dir.join("io.max"), &rates.v2_line(*device))?,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Sets the limits of an existing sandbox's cgroups.
    pub fn apply_limits(&self, sandbox_id: &str, limits: Limits) -> Result<(), CgroupError> {
        let memory = u64::from(limits.memory_mb) * 1024 * 1024;
        let period: u64 = 100_000;
        let quota = period * u64::from(limits.cpu_count.max(1));
        for (name, dir) in self.dirs(sandbox_id) {
            match name {
                "memory" => {
                    write_v1_memory_limit(&dir, memory)?;
                    // Limits add up past the host (they are ceilings, not reservations): when
                    // the host runs short, the kernel reclaims first from the sandboxes that
                    // are furthest above a quarter of their limit, so the busiest slow down
                    // before anyone is killed.
                    let soft = dir.join("memory.soft_limit_in_bytes");
                    if soft.exists() {
                        write(&soft, &(memory / 4).to_string())?;
                    }
                }
                "cpu" => {
                    write_if_changed(&dir.join("cpu.cfs_period_us"), &period.to_string())?;
                    let quota_file = dir.join("cpu.cfs_quota_us");
                    if let Err(refused) = write_if_changed(&quota_file, &quota.to_string()) {
                        // v1 refuses a quota above an ancestor's, as when the node itself runs
                        // in a group held to less CPU than a sandbox asks for (a container's
                        // CPU limit): the sandbox gets what its ancestors allow.
                        match ancestors_cpu_quota(&dir, period).filter(|q| *q < quota) {
                            Some(allowed) => write_if_changed(&quota_file, &allowed.to_string())?,
                            None => return Err(refused),
                        }
                    }
                    write(
                        &dir.join("cpu.shares"),
                        &limits.cpu_priority.shares().to_string(),
                    )?;
                }
                "pids" => write(&dir.join("pids.max"), &limits.pids_max.to_string())?,
                "unified" => {
                    write(&dir.join("memory.max"), &memory.to_string())?;
                    let swap = dir.join("memory.swap.max");
                    if swap.exists() {
                        write(&swap, "0")?;
                    }
                    write_if_changed(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
                    write(
                        &dir.join("cpu.weight"),
                        &limits.cpu_priority.weight().to_string(),
                    )?;
                    write(&dir.join("pids.max"), &limits.pids_max.to_string())?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// What sandbox `sandbox_id`, or all sandboxes together when it is `None`, read and wrote
    /// on disk: cumulative, for the groups that exist now.
    pub fn io_counts(&self, sandbox_id: Option<&str>) -> Option<IoCounts> {
        let dir = |base: &Path| match sandbox_id {
            Some(id) => base.join(self.parent).join(id),
            None => base.join(self.parent),
        };
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => {
                let base = &controllers.iter().find(|(name, _)| *name == "blkio")?.1;
                let dir = dir(base);
                // The parent's recursive files include its children's I/O; a leaf's own
                // files are all of its I/O.
                let read = |file: &str| {
                    std::fs::read_to_string(dir.join(format!("{file}_recursive")))
                        .or_else(|_| std::fs::read_to_string(dir.join(file)))
                        .ok()
                };
                let (read_bytes, write_bytes) =
                    IoCounts::v1_sums(&read("blkio.throttle.io_service_bytes")?);
                let (read_ops, write_ops) = IoCounts::v1_sums(&read("blkio.throttle.io_serviced")?);
                Some(IoCounts {
                    read_bytes,
                    write_bytes,
                    read_ops,
                    write_ops,
                })
            }
            Hierarchy::V2 { root } => {
                let text = std::fs::read_to_string(dir(root).join("io.stat")).ok()?;
                Some(IoCounts::from_v2(&text))
            }
        }
    }

    /// Gives sandbox `from`'s cgroups the name `to`; its processes stay in them.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), CgroupError> {
        for ((_, old), (_, new)) in self.dirs(from).into_iter().zip(self.dirs(to)) {
            std::fs::rename(&old, &new).map_err(|source| CgroupError::Rename {
                path: old.clone(),
                to: to.to_owned(),
                source,
            })?;
        }
        Ok(())
    }

    fn memory_dir(&self, sandbox_id: &str) -> Option<PathBuf> {
        self.dirs(sandbox_id)
            .into_iter()
            .find(|(name, _)| *name == "memory" || *name == "unified")
            .map(|(_, dir)| dir)
    }

    /// How many of the sandbox's processes the kernel killed for reaching its memory limit;
    /// `None` once its cgroup is gone (or on a kernel without the count).
    pub fn oom_kills(&self, sandbox_id: &str) -> Option<u64> {
        self.oom_kills_in(&self.memory_dir(sandbox_id)?)
    }

    /// The OOM kill count of the memory group at `dir`.
    fn oom_kills_in(&self, dir: &Path) -> Option<u64> {
        let file = match &self.hierarchy {
            Hierarchy::V1 { .. } => "memory.oom_control",
            Hierarchy::V2 { .. } => "memory.events",
        };
        parse_oom_kills(&std::fs::read_to_string(dir.join(file)).ok()?)
    }

    /// An eventfd the kernel signals each time the sandbox's memory cgroup runs out of memory
    /// (before it kills), for the sandbox's agent: v1's `cgroup.event_control` registration.
    /// v2 has no such registration, so `None` there.
    pub fn oom_notifier(&self, sandbox_id: &str) -> Result<Option<OwnedFd>, CgroupError> {
        let Hierarchy::V1 { .. } = &self.hierarchy else {
            return Ok(None);
        };
        let Some(dir) = self.memory_dir(sandbox_id) else {
            return Ok(None);
        };
        let fail = |path: PathBuf| move |source| CgroupError::OomWatch { path, source };
        let control_path = dir.join("memory.oom_control");
        let control = std::fs::File::open(&control_path).map_err(fail(control_path.clone()))?;
        // SAFETY: eventfd takes no pointers; the result is checked before it is owned.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(fail(control_path)(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let events = unsafe { OwnedFd::from_raw_fd(raw) };
        // The kernel keeps the registration (not the control file) until the cgroup goes.
        write(
            &dir.join("cgroup.event_control"),
            &format!("{} {}", events.as_raw_fd(), control.as_raw_fd()),
        )?;
        Ok(Some(events))
    }

    /// Process IDs (host view) still in the sandbox's cgroups.
    pub fn members(&self, sandbox_id: &str) -> Vec<i32> {
        std::fs::read_to_string(self.census_dir(sandbox_id).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// The directory and file that freeze the sandbox, with the values for frozen and
    /// thawed.
    fn freezer(&self, sandbox_id: &str) -> Option<(PathBuf, &'static str, &'static str)> {
        match &self.hierarchy {
            Hierarchy::V1 { .. } => self
                .dirs(sandbox_id)
                .into_iter()
                .find(|(name, _)| *name == "freezer")
                .map(|(_, dir)| (dir.join("freezer.state"), "FROZEN", "THAWED")),
            Hierarchy::V2 { .. } => self
                .dirs(sandbox_id)
                .into_iter()
                .next()
                .map(|(_, dir)| (dir.join("cgroup.freeze"), "1", "0")),
        }
    }

    /// CPU time the sandbox used so far: one small read, cheap enough to tell every few
    /// seconds which of a thousand sandboxes did anything at all.
    pub fn cpu_ns(&self, sandbox_id: &str) -> Option<u64> {
        let read = |path: PathBuf| std::fs::read_to_string(path).ok();
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => {
                // A separately mounted cpuacct holds the count; otherwise the cpu directory is
                // the shared cpu,cpuacct one.
                let base = controllers
                    .iter()
                    .find(|(name, _)| *name == "cpuacct")
                    .or_else(|| controllers.iter().find(|(name, _)| *name == "cpu"))?;
                let file = base
                    .1
                    .join(self.parent)
                    .join(sandbox_id)
                    .join("cpuacct.usage");
                read(file)?.trim().parse().ok()
            }
            Hierarchy::V2 { root } => {
                let cpu = read(root.join(self.parent).join(sandbox_id).join("cpu.stat"))?;
                let usage_usec: u64 = cpu.lines().find_map(|l| {
                    l.strip_prefix("usage_usec")?
                        .strip_prefix(' ')?
                        .trim()
                        .parse()
                        .ok()
                })?;
                Some(usage_usec * 1000)
            }
        }
    }

    /// Memory the sandbox holds now.
    pub fn memory_use(&self, sandbox_id: &str) -> Option<MemoryUse> {
        let v1 = matches!(&self.hierarchy, Hierarchy::V1 { .. });
        let (used, cache) = memory_use(&self.memory_dir(sandbox_id)?, v1)?;
        Some(MemoryUse { used, cache })
    }

    /// The cgroup holding every sandbox's (memory controller), made if missing.
    fn sandboxes_memory_dir(&self) -> Result<PathBuf, CgroupError> {
        let dir = match &self.hierarchy {
            Hierarchy::V1 { .. } => self.memory_parent().ok_or_else(|| {
                CgroupError::Unsupported("cgroup v1 has no memory controller".into())
            })?,
            Hierarchy::V2 { root } => {
                write(&root.join("cgroup.subtree_control"), self.v2_subtree())?;
                root.join(self.parent)
            }
        };
        std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Create {
            path: dir.clone(),
            source,
        })?;
        if let Hierarchy::V2 { .. } = &self.hierarchy {
            write(&dir.join("cgroup.subtree_control"), self.v2_subtree())?;
        }
        Ok(dir)
    }

    /// Limits the memory of all sandboxes together to `bytes`: when they reach it, the kernel
    /// reclaims and, failing that, kills among their processes only, so the server, the host's
    /// services and the agents' bookkeeping outside never feel the pressure.
    pub fn limit_sandboxes_memory(&self, bytes: u64) -> Result<(), CgroupError> {
        let dir = self.sandboxes_memory_dir()?;
        match &self.hierarchy {
            Hierarchy::V1 { .. } => write_v1_memory_limit(&dir, bytes),
            Hierarchy::V2 { .. } => write(&dir.join("memory.max"), &bytes.to_string()),
        }
    }

    /// What all sandboxes together may use and use now, page cache excluded (the kernel
    /// reclaims it before it kills).
    pub fn sandboxes_memory(&self) -> Option<SandboxesMemory> {
        let dir = match &self.hierarchy {
            Hierarchy::V1 { .. } => self.memory_parent()?,
            Hierarchy::V2 { root } => root.join(self.parent),
        };
        let v1 = matches!(&self.hierarchy, Hierarchy::V1 { .. });
        let limit_file = if v1 {
            "memory.limit_in_bytes"
        } else {
            "memory.max"
        };
        let limit = match std::fs::read_to_string(dir.join(limit_file)).ok()?.trim() {
            "max" => u64::MAX,
            text => text.parse().ok()?,
        };
        let (used, _) = memory_use(&dir, v1)?;
        Some(SandboxesMemory { limit, used })
    }

    /// Whether every process of the sandbox is frozen.
    pub fn is_frozen(&self, sandbox_id: &str) -> bool {
        match &self.hierarchy {
            Hierarchy::V1 { .. } => self.freezer(sandbox_id).is_some_and(|(file, _, _)| {
                std::fs::read_to_string(file).is_ok_and(|s| s.trim() == "FROZEN")
            }),
            Hierarchy::V2 { .. } => self.dirs(sandbox_id).first().is_some_and(|(_, dir)| {
                std::fs::read_to_string(dir.join("cgroup.events"))
                    .is_ok_and(|s| s.lines().any(|l| l.trim() == "frozen 1"))
            }),
        }
    }

    /// Stops every process of the sandbox where it is (the cgroup freezer) and waits until
    /// the kernel reports them all frozen; their memory stays as it is.
    pub async fn freeze(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        let file = self.request_freeze(sandbox_id)?;
        for _ in 0..500 {
            if self.is_frozen(sandbox_id) {
                return Ok(());
            }
            if let Hierarchy::V1 { .. } = &self.hierarchy {
                // A v1 freeze that met a task in an uninterruptible wait stays FREEZING until
                // asked again.
                let _ = self.request_freeze(sandbox_id);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = self.thaw(sandbox_id);
        Err(CgroupError::Busy { path: file })
    }

    /// Asks the freezer to stop every process of the sandbox at its next return to user space,
    /// without waiting for that: a process in a system call finishes it first. Returns the
    /// freezer's file.
    pub fn request_freeze(&self, sandbox_id: &str) -> Result<PathBuf, CgroupError> {
        let (file, frozen, _) = self.freezer(sandbox_id).ok_or_else(|| {
            CgroupError::Unsupported("the freezer controller is not mounted".into())
        })?;
        write(&file, frozen)?;
        Ok(file)
    }

    /// The v1 freezer group held frozen by this process.
    fn frozen_anchor(&self) -> Option<PathBuf> {
        let parent = self.v1_parent("freezer")?;
        Some(parent.join(format!("{FROZEN_ANCHOR_PREFIX}{}", std::process::id())))
    }

    /// Holds an empty v1 freezer group frozen for as long as the server runs, removing any an
    /// earlier server left. The kernel switches its freezer checks on in running code (a
    /// static key, patched on every CPU with a round of interrupts) when the first group
    /// freezes and off when the last one thaws; each create stops the warm boot under way and
    /// lets it go after, so without a group that stays frozen every create paid two such
    /// patches. An empty group holds no task, so nothing is stopped by it. Whether it is held.
    pub fn hold_freezer_checks_on(&self) -> bool {
        let Some(anchor) = self.frozen_anchor() else {
            return false;
        };
        let Some(parent) = anchor.parent() else {
            return false;
        };
        if let Ok(entries) = std::fs::read_dir(parent) {
            for entry in entries.flatten() {
                if entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with(FROZEN_ANCHOR_PREFIX)
                {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        std::fs::create_dir_all(&anchor).is_ok()
            && std::fs::write(anchor.join("freezer.state"), "FROZEN").is_ok()
    }

    /// Lets the freezer checks go off again (at a clean stop).
    pub fn release_freezer_checks(&self) {
        if let Some(anchor) = self.frozen_anchor() {
            let _ = std::fs::remove_dir(anchor);
        }
    }

    /// The cgroup directory whose freezer holds the sandbox (for CRIU's `--freeze-cgroup`).
    pub fn freezer_dir(&self, sandbox_id: &str) -> Option<PathBuf> {
        self.freezer(sandbox_id)
            .and_then(|(file, _, _)| file.parent().map(Path::to_owned))
    }

    /// Drops the page cache still charged to the sandbox's memory cgroup once its processes
    /// are gone (files it read stay charged to it otherwise).
    pub fn empty_memory(&self, sandbox_id: &str) {
        for (name, dir) in self.dirs(sandbox_id) {
            match name {
                "memory" => {
                    let _ = std::fs::write(dir.join("memory.force_empty"), "0");
                }
                "unified" => {
                    let _ = std::fs::write(dir.join("memory.reclaim"), "1G");
                }
                _ => {}
            }
        }
    }

    /// Gives a new sandbox's memory group the directory `dir` by renaming a kept one there;
    /// whether one was. A kept group that cannot be renamed is removed.
    fn take_spare_memory_group(&self, dir: &Path) -> bool {
        let Some(parent) = dir.parent() else {
            return false;
        };
        loop {
            let Some(spare) = self.spares.lock().pop() else {
                return false;
            };
            let from = parent.join(&spare);
            if std::fs::rename(&from, dir).is_ok() {
                return true;
            }
            if dir.exists() {
                // The sandbox's group is there already (left by a boot that failed): the
                // spare stays one.
                self.spares.lock().push(spare);
                return false;
            }
            tracing::warn!(group = %from.display(), "a kept memory cgroup could not be reused");
            let _ = std::fs::remove_dir(&from);
        }
    }

    /// Keeps the memory group at `dir`, whose processes are all gone, for a later sandbox:
    /// holding at most [`SPARE_LEFT_BYTES`] of what the ended one left charged to it, its
    /// peaks reset, renamed to a spare name. Whether it was kept; a group that killed for
    /// lack of memory keeps that in a count nothing resets, so it is not.
    fn keep_spare_memory_group(&self, dir: &Path) -> bool {
        if !matches!(self.hierarchy, Hierarchy::V1 { .. })
            || self.spares.lock().len() >= MAX_SPARE_MEMORY_GROUPS
        {
            return false;
        }
        let Some(parent) = dir.parent() else {
            return false;
        };
        let still_held = std::fs::read_to_string(dir.join("cgroup.procs"))
            .map_or(true, |procs| !procs.trim().is_empty());
        let killed = self.oom_kills_in(dir).is_some_and(|kills| kills > 0);
        if still_held || killed {
            return false;
        }
        let charged = || {
            std::fs::read_to_string(dir.join("memory.usage_in_bytes"))
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
        };
        // An idle sandbox leaves a few hundred KiB of kernel objects still being freed, which
        // go on their own; emptying costs a few milliseconds (a drain on every CPU and
        // reclaim passes), so only a group holding more is emptied.
        if charged().is_none_or(|bytes| bytes > SPARE_LEFT_BYTES)
            && (std::fs::write(dir.join("memory.force_empty"), "0").is_err()
                || charged().is_none_or(|bytes| bytes > SPARE_LEFT_BYTES))
        {
            return false;
        }
        for peak in [
            "memory.max_usage_in_bytes",
            "memory.failcnt",
            "memory.memsw.max_usage_in_bytes",
            "memory.memsw.failcnt",
        ] {
            match std::fs::write(dir.join(peak), "0") {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return false,
                _ => {}
            }
        }
        let name = self.spares.new_name();
        if std::fs::rename(dir, parent.join(&name)).is_err() {
            return false;
        }
        self.spares.lock().push(name);
        true
    }

    /// The v1 directory of controller `controller` that holds the sandboxes' groups.
    fn v1_parent(&self, controller: &str) -> Option<PathBuf> {
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .find(|(name, _)| *name == controller)
                .map(|(_, dir)| dir.join(self.parent)),
            Hierarchy::V2 { .. } => None,
        }
    }

    /// The v1 directory holding the sandboxes' memory groups.
    fn memory_parent(&self) -> Option<PathBuf> {
        self.v1_parent("memory")
    }

    /// Takes up the memory groups an earlier server kept (an empty one, up to the bound)
    /// and removes the others.
    pub fn take_up_spare_memory_groups(&self) {
        let Some(parent) = self.memory_parent() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(&parent) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(SPARE_PREFIX) {
                continue;
            }
            // Checked and emptied as a sandbox's would be, under a name of this process.
            let dir = entry.path();
            if !self.keep_spare_memory_group(&dir)
                && let Err(e) = std::fs::remove_dir(&dir)
            {
                tracing::warn!(group = %dir.display(), error = %e, "cannot remove a memory cgroup an earlier server kept");
            }
        }
    }

    /// Removes every kept memory group (at a clean stop: nothing of the server's is left).
    pub fn remove_spare_memory_groups(&self) {
        let Some(parent) = self.memory_parent() else {
            return;
        };
        let spares = std::mem::take(&mut *self.spares.lock());
        for spare in spares {
            let _ = std::fs::remove_dir(parent.join(spare));
        }
    }

    /// How many memory groups are kept for later sandboxes.
    pub fn spare_memory_groups(&self) -> usize {
        self.spares.lock().len()
    }

    /// Lets a frozen sandbox run again.
    pub fn thaw(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        match self.freezer(sandbox_id) {
            Some((file, _, thawed)) if file.exists() => write(&file, thawed),
            _ => Ok(()),
        }
    }

    /// Kills every process in the sandbox's cgroups and waits, at most [`KILL_PATIENCE`],
    /// until none is left.
    pub async fn kill_all(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        let census = self.census_dir(sandbox_id);
        if !census.exists() {
            return Ok(());
        }
        // Frozen tasks do not act on SIGKILL until they run again.
        let _ = self.thaw(sandbox_id);
        if let Hierarchy::V2 { .. } = &self.hierarchy {
            let _ = std::fs::write(census.join("cgroup.kill"), "1");
        }
        let left = settle(KILL_PATIENCE, KILL_POLL, || self.kill_members(sandbox_id)).await;
        none_left(sandbox_id, left)
    }

    /// Sends SIGKILL to every process listed in the sandbox's cgroup; returns how many.
    fn kill_members(&self, sandbox_id: &str) -> usize {
        let members = self.members(sandbox_id);
        for &pid in &members {
            // SAFETY: kill with a PID read from the sandbox's own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        members.len()
    }

    /// Removes the sandbox's cgroups once they are empty, waiting at most [`KILL_PATIENCE`]:
    /// a killed task leaves its cgroup's list before it is done exiting, and the cgroup
    /// cannot be removed until it is.
    ///
    /// The memory group goes last, once the others are gone: only then have its processes
    /// finished exiting, and only then may it be kept for another sandbox.
    pub async fn remove(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        let left = settle(KILL_PATIENCE, KILL_POLL, || {
            let mut busy = false;
            let (memory, others): (Vec<_>, Vec<_>) = self
                .dirs(sandbox_id)
                .into_iter()
                .partition(|(name, _)| *name == "memory");
            for (_, dir) in others {
                busy |= !remove_group(&dir);
            }
            for (_, dir) in memory {
                if !busy && !self.keep_spare_memory_group(&dir) {
                    busy |= !remove_group(&dir);
                }
            }
            if busy {
                // At least the one still exiting, listed or not.
                self.kill_members(sandbox_id).max(1)
            } else {
                0
            }
        })
        .await;
        none_left(sandbox_id, left)
    }
}

/// Removes the cgroup `dir`; whether it is gone.
fn remove_group(dir: &Path) -> bool {
    match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Asks `left` how much remains every `every` until it says nothing or `patience` passed;
/// returns its last answer.
async fn settle(patience: Duration, every: Duration, mut left: impl FnMut() -> usize) -> usize {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let remaining = left();
        if remaining == 0 || tokio::time::Instant::now() >= deadline {
            return remaining;
        }
        tokio::time::sleep(every).await;
    }
}

/// Holds every sandbox `cgroups` makes to `rates` on the disks under `dirs`, and says so.
pub fn hold_sandboxes_to(cgroups: &mut CgroupDriver, rates: IoRates, dirs: &[&Path]) {
    // The disks are found even with no rate of the node's own: a team's rates need them.
    let throttle = IoThrottle::for_dirs(rates, dirs);
    if throttle.devices.is_empty() {
        tracing::warn!(
            "sandbox disk rates are not limited: no block device found under the data directory"
        );
        return;
    }
    let devices = throttle
        .devices
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    if cgroups.set_io_throttle(throttle) {
        tracing::info!(
            devices,
            read_bytes_per_s = rates.read_bytes,
            write_bytes_per_s = rates.write_bytes,
            read_ops_per_s = rates.read_ops,
            write_ops_per_s = rates.write_ops,
            "each sandbox's disk I/O is limited to these rates unless its team sets its own (0: no limit)"
        );
    } else {
        tracing::warn!(
            "sandbox disk rates are not limited: the host has no blkio (cgroup v1) or io (v2) controller"
        );
    }
}

/// Refuses the `left` processes of sandbox `sandbox_id` still there once [`KILL_PATIENCE`]
/// has passed.
fn none_left(sandbox_id: &str, left: usize) -> Result<(), CgroupError> {
    if left == 0 {
        Ok(())
    } else {
        Err(CgroupError::Lingering {
            sandbox_id: sandbox_id.to_owned(),
            processes: left,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bandwidth_value_already_held_is_not_written_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let quota = dir.path().join("cpu.cfs_quota_us");
        std::fs::write(&quota, "200000\n").expect("quota");
        let long_ago = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1);
        std::fs::File::options()
            .write(true)
            .open(&quota)
            .and_then(|f| f.set_modified(long_ago))
            .expect("mtime");
        let modified = || {
            std::fs::metadata(&quota)
                .and_then(|m| m.modified())
                .expect("stat")
        };

        write_if_changed(&quota, "200000").expect("same value");
        assert_eq!(modified(), long_ago, "a held value was written again");

        write_if_changed(&quota, "100000").expect("new value");
        assert_eq!(std::fs::read_to_string(&quota).expect("read"), "100000");
        assert_ne!(modified(), long_ago);
    }

    #[test]
    fn a_sandbox_quota_stays_within_its_ancestors() {
        let top = tempfile::tempdir().expect("tempdir");
        let node = top.path().join("node");
        let sandbox = node.join("sandbar").join("sbx");
        std::fs::create_dir_all(&sandbox).expect("dirs");
        let set = |dir: &Path, quota: &str, period: &str| {
            std::fs::write(dir.join("cpu.cfs_quota_us"), quota).expect("quota");
            std::fs::write(dir.join("cpu.cfs_period_us"), period).expect("period");
        };
        set(top.path(), "-1", "100000");
        set(&node, "-1", "100000");
        set(&node.join("sandbar"), "-1", "100000");
        assert_eq!(
            ancestors_cpu_quota(&sandbox, 100_000),
            None,
            "no ancestor limits"
        );
        set(&node, "25000", "50000");
        assert_eq!(
            ancestors_cpu_quota(&sandbox, 100_000),
            Some(50_000),
            "half a core"
        );
        set(&node.join("sandbar"), "20000", "100000");
        assert_eq!(
            ancestors_cpu_quota(&sandbox, 100_000),
            Some(20_000),
            "the smallest"
        );
    }

    /// A driver over the host's own v1 hierarchies under a parent of this test's, whose
    /// groups are all removed when it drops, even after a failed assertion; `None` where the
    /// test cannot run (not root, or cgroup v2).
    struct HostGroups {
        driver: CgroupDriver,
    }

    impl HostGroups {
        fn new(parent: &'static str) -> Option<Self> {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("skipped: needs root to make cgroups");
                return None;
            }
            let mut driver = CgroupDriver::detect().ok()?;
            if driver.version() != 1 {
                eprintln!("skipped: memory groups are kept on cgroup v1 only");
                return None;
            }
            driver.parent = parent;
            Some(Self { driver })
        }

        fn memory_dir(&self, name: &str) -> PathBuf {
            self.driver
                .memory_parent()
                .expect("a v1 memory hierarchy")
                .join(name)
        }

        /// Runs `script` with `sh` in sandbox `id`'s memory group until it ends.
        fn run_in(&self, id: &str, script: &str) {
            let tasks = self.memory_dir(id).join("tasks");
            // A process the kernel killed for memory ends by a signal; its status is not asked.
            std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("echo $$ > {} && {script}", tasks.display()))
                .status()
                .expect("sh");
        }

        fn usage(&self, id: &str) -> u64 {
            let text = std::fs::read_to_string(self.memory_dir(id).join("memory.usage_in_bytes"))
                .expect("usage");
            text.trim().parse().expect("a number")
        }
    }

    impl Drop for HostGroups {
        fn drop(&mut self) {
            let Hierarchy::V1 { controllers } = &self.driver.hierarchy else {
                return;
            };
            for (_, base) in controllers {
                let parent = base.join(self.driver.parent);
                if let Ok(entries) = std::fs::read_dir(&parent) {
                    for entry in entries.flatten() {
                        let _ = std::fs::remove_dir(entry.path());
                    }
                }
                let _ = std::fs::remove_dir(&parent);
            }
        }
    }

    fn small_limits() -> Limits {
        Limits {
            cpu_count: 1,
            memory_mb: 48,
            pids_max: 64,
            cpu_priority: CpuPriority::Normal,
            io: IoRates::default(),
        }
    }

    #[tokio::test]
    async fn an_ended_sandboxs_memory_group_is_emptied_and_kept_for_the_next() {
        let Some(host) = HostGroups::new("sandbar-unit-spares") else {
            return;
        };
        let cg = &host.driver;
        cg.create("first", small_limits()).expect("create");
        let scratch = tempfile::tempdir_in("/var/tmp").expect("scratch");
        let file = scratch.path().join("written");
        // Page cache written from inside stays charged to the group after its process ends.
        host.run_in(
            "first",
            &format!(
                "dd if=/dev/zero of={} bs=1M count=8 conv=fsync status=none && cat {} > /dev/null",
                file.display(),
                file.display()
            ),
        );
        assert!(host.usage("first") > 4 << 20, "the write was charged");
        cg.remove("first").await.expect("remove");
        assert!(!host.memory_dir("first").exists());
        assert_eq!(cg.spare_memory_groups(), 1, "the emptied group is kept");
        assert!(
            cg.names().is_empty(),
            "a kept group is no sandbox's: {:?}",
            cg.names()
        );

        cg.create("second", small_limits()).expect("create");
        assert_eq!(cg.spare_memory_groups(), 0, "the kept group was taken");
        assert!(
            host.usage("second") <= SPARE_LEFT_BYTES,
            "the next sandbox starts with nothing of the last one's"
        );
        let peak =
            std::fs::read_to_string(host.memory_dir("second").join("memory.max_usage_in_bytes"))
                .expect("peak");
        assert!(peak.trim().parse::<u64>().expect("a number") <= SPARE_LEFT_BYTES);
        let limit =
            std::fs::read_to_string(host.memory_dir("second").join("memory.limit_in_bytes"))
                .expect("limit");
        assert_eq!(limit.trim(), (48u64 << 20).to_string());
        cg.remove("second").await.expect("remove");
        assert_eq!(cg.spare_memory_groups(), 1);

        // What a stopped server left is taken up by the next one.
        let next = CgroupDriver {
            spares: Arc::default(),
            ..cg.clone()
        };
        next.take_up_spare_memory_groups();
        assert_eq!(next.spare_memory_groups(), 1);
        next.remove_spare_memory_groups();
        assert_eq!(next.spare_memory_groups(), 0);
        let left: Vec<_> = std::fs::read_dir(host.driver.memory_parent().expect("parent"))
            .expect("parent")
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .collect();
        assert!(left.is_empty(), "groups left after a clean stop: {left:?}");
    }

    #[test]
    fn an_empty_frozen_group_keeps_the_freezer_on_and_goes_at_the_stop() {
        let Some(host) = HostGroups::new("sandbar-unit-frozen") else {
            return;
        };
        let cg = &host.driver;
        let anchor = cg.frozen_anchor().expect("a v1 freezer");
        let stale = anchor.with_file_name(format!("{FROZEN_ANCHOR_PREFIX}1"));
        std::fs::create_dir_all(&stale).expect("a group a killed server left");
        assert!(cg.hold_freezer_checks_on());
        assert!(!stale.exists(), "an earlier server's group is removed");
        let state = std::fs::read_to_string(anchor.join("freezer.state")).expect("state");
        assert_eq!(state.trim(), "FROZEN");
        assert!(
            cg.names().is_empty(),
            "the server's own group is no sandbox's"
        );
        cg.release_freezer_checks();
        assert!(!anchor.exists());
    }

    #[tokio::test]
    async fn a_memory_group_that_killed_is_removed_not_kept() {
        let Some(host) = HostGroups::new("sandbar-unit-killed") else {
            return;
        };
        let cg = &host.driver;
        cg.create("greedy", small_limits()).expect("create");
        host.run_in("greedy", "exec python3 -c 'b = bytearray(256 << 20)'");
        assert_eq!(
            cg.oom_kills("greedy"),
            Some(1),
            "the kernel killed the allocation"
        );
        cg.remove("greedy").await.expect("remove");
        assert_eq!(cg.spare_memory_groups(), 0);
        assert!(!host.memory_dir("greedy").exists());
    }

    #[test]
    fn reads_the_oom_kill_count_of_either_version() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_oom_kills(v1), Some(3));
        let v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(v2), Some(2));
        // Kernels before 4.13 have no count.
        assert_eq!(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n"), None);
        assert_eq!(parse_oom_kills("oom_kill x\n"), None);
    }

    #[tokio::test]
    async fn a_kill_waits_for_stragglers_within_its_patience() {
        let patience = Duration::from_secs(2);
        let started = tokio::time::Instant::now();
        let mut looks = 0;
        let left = settle(patience, Duration::from_millis(1), || {
            looks += 1;
            // Two processes, then one, then none: a slow exit.
            3_usize.saturating_sub(looks)
        })
        .await;
        assert_eq!(left, 0);
        assert_eq!(looks, 3);
        assert!(started.elapsed() < patience);
    }

    #[tokio::test]
    async fn a_kill_gives_up_after_its_patience_saying_how_many_remain() {
        let patience = Duration::from_millis(50);
        let started = tokio::time::Instant::now();
        let left = settle(patience, Duration::from_millis(5), || 2).await;
        assert_eq!(left, 2);
        assert!(started.elapsed() >= patience);
        let err = CgroupError::Lingering {
            sandbox_id: "sbx-1".into(),
            processes: left,
        }
        .to_string();
        assert_eq!(
            err,
            "sandbox sbx-1: 2 processes still remain 5s after being killed"
        );
        assert!(!err.contains('/'), "a host path in {err}");
    }
}
