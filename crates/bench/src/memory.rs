//! Memory of idle sandboxes: host MemAvailable, memory cgroups, and the agents' RSS/PSS.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::client::Api;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Parent cgroup of all sandboxes.
const PARENT: &str = "sandbar";
const MIB: f64 = 1024.0 * 1024.0;

/// Which cgroup hierarchy the host uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V1Hybrid,
    V2,
}

impl CgroupVersion {
    pub fn detect() -> Self {
        let root = Path::new(CGROUP_ROOT);
        if root.join("cgroup.controllers").exists() {
            CgroupVersion::V2
        } else if root.join("unified").is_dir() {
            CgroupVersion::V1Hybrid
        } else {
            CgroupVersion::V1
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V1Hybrid => "v1 (hybrid, controllers on v1)",
            CgroupVersion::V2 => "v2",
        }
    }

    fn memory_dir(self, id: &str) -> PathBuf {
        match self {
            CgroupVersion::V2 => Path::new(CGROUP_ROOT).join(PARENT).join(id),
            _ => Path::new(CGROUP_ROOT).join("memory").join(PARENT).join(id),
        }
    }

    fn procs_file(self, id: &str) -> PathBuf {
        match self {
            CgroupVersion::V2 => Path::new(CGROUP_ROOT).join(PARENT).join(id),
            _ => Path::new(CGROUP_ROOT).join("pids").join(PARENT).join(id),
        }
        .join("cgroup.procs")
    }

    /// Bytes charged to the sandbox's memory cgroup (page cache included).
    fn usage(self, id: &str) -> anyhow::Result<u64> {
        let file = match self {
            CgroupVersion::V2 => "memory.current",
            _ => "memory.usage_in_bytes",
        };
        read_u64(&self.memory_dir(id).join(file))
    }

    /// Anonymous memory of the sandbox's processes, from `memory.stat`.
    fn anon(self, id: &str) -> anyhow::Result<u64> {
        let key = match self {
            CgroupVersion::V2 => "anon",
            _ => "total_rss",
        };
        let path = self.memory_dir(id).join("memory.stat");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim().parse().ok())
            .with_context(|| format!("{} has no {key}", path.display()))
    }

    /// Host PIDs of the sandbox's processes, lowest (the agent) first.
    fn pids(self, id: &str) -> anyhow::Result<Vec<u32>> {
        let path = self.procs_file(id);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut pids: Vec<u32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        pids.sort_unstable();
        Ok(pids)
    }
}

fn read_u64(path: &Path) -> anyhow::Result<u64> {
    std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .trim()
        .parse()
        .with_context(|| format!("{} is not a number", path.display()))
}

/// A `key:   N kB` field of a /proc file, in bytes.
fn kb_field(path: &Path, key: &str) -> anyhow::Result<u64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .with_context(|| format!("{} has no {key}", path.display()))
}

pub fn mem_available() -> anyhow::Result<u64> {
    kb_field(Path::new("/proc/meminfo"), "MemAvailable")
}

/// Kernel memory that sandboxes cost outside any process: unreclaimable slab (namespaces,
/// mounts, network devices, nftables), kernel stacks, page tables and per-CPU allocations.
/// Reclaimable slab (dentry and inode caches) is left out: it is cache, like page cache.
fn kernel_memory() -> anyhow::Result<u64> {
    let meminfo = Path::new("/proc/meminfo");
    let mut sum = 0;
    for key in ["SUnreclaim", "KernelStack", "PageTables", "Percpu"] {
        sum += kb_field(meminfo, key)?;
    }
    Ok(sum)
}

pub fn mem_total() -> anyhow::Result<u64> {
    kb_field(Path::new("/proc/meminfo"), "MemTotal")
}

/// Per-sandbox memory of `n` idle sandboxes, in MiB (process counts are plain numbers).
#[derive(Debug, Clone, Copy)]
pub struct IdleMemory {
    pub n: usize,
    pub host_available_drop: f64,
    /// MemAvailable regained once the sandboxes are killed: a cross-check of the drop.
    pub host_available_regained: Option<f64>,
    /// Growth of unreclaimable slab, kernel stacks, page tables and per-CPU memory.
    pub kernel: f64,
    pub cgroup_usage: f64,
    pub cgroup_anon: f64,
    pub agent_rss: f64,
    pub agent_pss: f64,
    pub all_processes_rss: f64,
    pub processes: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs `cycles` idle measurements and takes the median of each figure, so that memory
/// another process allocates or frees during one cycle does not decide the result.
pub async fn idle_cycles(
    api: &Api,
    cgroups: CgroupVersion,
    n: usize,
    concurrency: usize,
    settle: Duration,
    cycles: usize,
) -> anyhow::Result<(IdleMemory, Vec<IdleMemory>)> {
    let mut all = Vec::with_capacity(cycles);
    for _ in 0..cycles.max(1) {
        all.push(idle(api, cgroups, n, concurrency, settle).await?);
    }
    let pick = |f: fn(&IdleMemory) -> f64| median(all.iter().map(f).collect());
    let regained: Vec<f64> = all
        .iter()
        .filter_map(|m| m.host_available_regained)
        .collect();
    let combined = IdleMemory {
        n,
        host_available_drop: pick(|m| m.host_available_drop),
        host_available_regained: (!regained.is_empty()).then(|| median(regained)),
        kernel: pick(|m| m.kernel),
        cgroup_usage: pick(|m| m.cgroup_usage),
        cgroup_anon: pick(|m| m.cgroup_anon),
        agent_rss: pick(|m| m.agent_rss),
        agent_pss: pick(|m| m.agent_pss),
        all_processes_rss: pick(|m| m.all_processes_rss),
        processes: pick(|m| m.processes),
    };
    Ok((combined, all))
}

/// Creates `n` sandboxes (`concurrency` at a time), lets them settle, measures, kills them.
async fn idle(
    api: &Api,
    cgroups: CgroupVersion,
    n: usize,
    concurrency: usize,
    settle: Duration,
) -> anyhow::Result<IdleMemory> {
    if n == 0 {
        bail!("--idle must be at least 1");
    }
    tokio::time::sleep(settle).await;
    let before = mem_available()?;
    let kernel_before = kernel_memory()?;
    let mut ids = Vec::with_capacity(n);
    let outcome = async {
        while ids.len() < n {
            let batch = concurrency.clamp(1, n - ids.len());
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..batch {
                let api = api.clone();
                tasks.spawn(async move { api.create().await });
            }
            while let Some(joined) = tasks.join_next().await {
                ids.push(joined??.id);
            }
        }
        tokio::time::sleep(settle).await;
        let after = mem_available()?;
        let kernel_after = kernel_memory()?;

        let (mut usage, mut anon, mut agent_rss, mut agent_pss, mut all_rss, mut procs) =
            (0u64, 0u64, 0u64, 0u64, 0u64, 0usize);
        for id in &ids {
            usage += cgroups.usage(id)?;
            anon += cgroups.anon(id)?;
            let pids = cgroups.pids(id)?;
            let agent = *pids
                .first()
                .with_context(|| format!("sandbox {id} has no processes"))?;
            let proc_dir = PathBuf::from(format!("/proc/{agent}"));
            agent_rss += kb_field(&proc_dir.join("status"), "VmRSS")?;
            agent_pss += kb_field(&proc_dir.join("smaps_rollup"), "Pss")?;
            for pid in &pids {
                // Processes may exit between listing and reading; those count as nothing.
                all_rss +=
                    kb_field(Path::new(&format!("/proc/{pid}/status")), "VmRSS").unwrap_or(0);
            }
            procs += pids.len();
        }
        let per = |bytes: u64| bytes as f64 / MIB / n as f64;
        anyhow::Ok((
            after,
            IdleMemory {
                n,
                host_available_drop: (before as f64 - after as f64) / MIB / n as f64,
                host_available_regained: None,
                kernel: (kernel_after as f64 - kernel_before as f64) / MIB / n as f64,
                cgroup_usage: per(usage),
                cgroup_anon: per(anon),
                agent_rss: per(agent_rss),
                agent_pss: per(agent_pss),
                all_processes_rss: per(all_rss),
                processes: procs as f64 / n as f64,
            },
        ))
    }
    .await;
    // The caller's final sweep retries whatever fails here.
    let mut all_killed = true;
    for id in &ids {
        if let Err(e) = api.kill(id).await {
            eprintln!("warning: {e:#}");
            all_killed = false;
        }
    }
    let (during, mut idle) = outcome?;
    if all_killed {
        tokio::time::sleep(settle).await;
        let released = mem_available()?;
        idle.host_available_regained = Some((released as f64 - during as f64) / MIB / n as f64);
    }
    Ok(idle)
}
