//! Per-sandbox cgroups with a driver for each cgroup version: hosts still mix v1 hierarchies
//! (where resource controllers may live only in v1) with pure v2 ones.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
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
    /// The disk rates every sandbox gets, set once the node knows its devices.
    io: IoThrottle,
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
            io: IoThrottle::default(),
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
                .map(|(name, dir)| (*name, dir.join(PARENT).join(sandbox_id)))
                .collect(),
            Hierarchy::V2 { root } => vec![("unified", root.join(PARENT).join(sandbox_id))],
        }
    }

    /// Names of the sandbox cgroups that exist in any hierarchy: a server killed while it
    /// booted a sandbox can leave some before the sandbox had a disk.
    pub fn names(&self) -> std::collections::BTreeSet<String> {
        let parents: Vec<PathBuf> = match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .map(|(_, dir)| dir.join(PARENT))
                .collect(),
            Hierarchy::V2 { root } => vec![root.join(PARENT)],
        };
        parents
            .iter()
            .filter_map(|parent| std::fs::read_dir(parent).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
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
            let parent = root.join(PARENT);
            std::fs::create_dir_all(&parent).map_err(|source| CgroupError::Create {
                path: parent.clone(),
                source,
            })?;
            write(&parent.join("cgroup.subtree_control"), self.v2_subtree())?;
        }
        for (_, dir) in self.dirs(sandbox_id) {
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
                    write(&dir.join("cpu.cfs_period_us"), &period.to_string())?;
                    let quota_file = dir.join("cpu.cfs_quota_us");
                    if let Err(refused) = write(&quota_file, &quota.to_string()) {
                        // v1 refuses a quota above an ancestor's, as when the node itself runs
                        // in a group held to less CPU than a sandbox asks for (a container's
                        // CPU limit): the sandbox gets what its ancestors allow.
                        match ancestors_cpu_quota(&dir, period).filter(|q| *q < quota) {
                            Some(allowed) => write(&quota_file, &allowed.to_string())?,
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
                    write(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
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
            Some(id) => base.join(PARENT).join(id),
            None => base.join(PARENT),
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
        let file = match &self.hierarchy {
            Hierarchy::V1 { .. } => "memory.oom_control",
            Hierarchy::V2 { .. } => "memory.events",
        };
        parse_oom_kills(&std::fs::read_to_string(self.memory_dir(sandbox_id)?.join(file)).ok()?)
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
                let file = base.1.join(PARENT).join(sandbox_id).join("cpuacct.usage");
                read(file)?.trim().parse().ok()
            }
            Hierarchy::V2 { root } => {
                let cpu = read(root.join(PARENT).join(sandbox_id).join("cpu.stat"))?;
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
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .find(|(name, _)| *name == "memory")
                .map(|(_, dir)| dir.join(PARENT))
                .ok_or_else(|| {
                    CgroupError::Unsupported("cgroup v1 has no memory controller".into())
                })?,
            Hierarchy::V2 { root } => {
                write(&root.join("cgroup.subtree_control"), self.v2_subtree())?;
                root.join(PARENT)
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
            Hierarchy::V1 { controllers } => controllers
                .iter()
                .find(|(name, _)| *name == "memory")
                .map(|(_, dir)| dir.join(PARENT))?,
            Hierarchy::V2 { root } => root.join(PARENT),
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
    pub async fn remove(&self, sandbox_id: &str) -> Result<(), CgroupError> {
        let left = settle(KILL_PATIENCE, KILL_POLL, || {
            let mut busy = false;
            for (_, dir) in self.dirs(sandbox_id) {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(_) => busy = true,
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
