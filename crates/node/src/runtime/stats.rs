//! What the node reports of its sandboxes and itself: usage, memory, disks, the warm pool and
//! agent logs.

use sandbar_core::AgentLogChunk;

node_part! {
    /// Reports what the node's sandboxes use and what the node has left.
    pub(super) struct NodeReports;
}

impl NodeReports {
    pub(super) fn agent_log(
        &self,
        sandbox_id: &str,
        offset: u64,
        max: usize,
    ) -> Option<AgentLogChunk> {
        let log = crate::runtime::agent_log::AgentLog::new(self.node.places.log_path(sandbox_id));
        let marks = &self.node.log_marks;
        let now = std::time::Instant::now();
        let Some(shape) = log_shape(log.path()) else {
            marks.forget(sandbox_id);
            return None;
        };
        let limit = self.node.config.agent_log_rotate_bytes;
        if shape.len <= limit && marks.nothing_new(sandbox_id, now, shape, offset) {
            return Some(AgentLogChunk {
                start: offset,
                bytes: Vec::new(),
            });
        }
        // Checked where the server reads the log, every few seconds while the sandbox runs,
        // and only past the limit (the size above already says whether it is).
        // A frozen sandbox's log is left alone: a checkpoint may be recording its size.
        let rotated = if shape.len > limit {
            log.rotate_if_over(limit, || !self.node.cgroups.is_frozen(sandbox_id))
        } else {
            Ok(false)
        };
        let shape = match rotated {
            Ok(false) => Some(shape),
            Ok(true) => log_shape(log.path()),
            Err(e) => {
                tracing::warn!(sandbox_id, error = %e, "cannot rotate the agent log");
                None
            }
        };
        let chunk = log.read(offset, max)?;
        // Short of `max`, the read stopped at the end of the file, which is at or past the
        // shape taken before it.
        match shape {
            Some(shape) if chunk.bytes.len() < max => {
                let end = chunk.start + chunk.bytes.len() as u64;
                marks.read_to_end(sandbox_id, now, shape, end);
            }
            _ => marks.forget(sandbox_id),
        }
        Some(chunk)
    }

    pub(super) fn stats(&self, sandbox_id: &str) -> Option<sandbar_core::runtime::RuntimeStats> {
        self.node.usage_readings.read(
            sandbox_id,
            std::time::Instant::now(),
            self.node.cgroups.cpu_ns(sandbox_id),
            |cpu_ns| self.stats_in_full(sandbox_id, cpu_ns),
        )
    }

    /// Everything but the CPU time, which the caller has just read.
    fn stats_in_full(
        &self,
        sandbox_id: &str,
        cpu_ns: u64,
    ) -> Option<sandbar_core::runtime::RuntimeStats> {
        let memory = self.node.cgroups.memory_use(sandbox_id)?;
        let disk = self.node.disks.usage(sandbox_id);
        Some(sandbar_core::runtime::RuntimeStats {
            cpu_ns,
            memory_used: memory.used,
            memory_cache: memory.cache,
            disk_used: disk.map_or(0, |d| d.used),
            disk_total: disk.map_or(0, |d| d.total),
            oom_kills: self.node.cgroups.oom_kills(sandbox_id).unwrap_or(0),
        })
    }

    pub(super) fn is_paused(&self, sandbox_id: &str) -> bool {
        self.node.cgroups.is_frozen(sandbox_id)
    }

    pub(super) fn disk_io(&self) -> Option<sandbar_core::DiskIoReport> {
        let counts = self.node.cgroups.io_counts(None)?;
        let rates = self.node.cgroups.io_throttle().rates;
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

    pub(super) fn memory(&self) -> Option<sandbar_core::MemoryReport> {
        let host = self.node.memory_view()?;
        let promised = self.node.ledger.promised_mb();
        Some(sandbar_core::MemoryReport {
            total_bytes: host.total_mb << 20,
            available_bytes: host.available_mb << 20,
            promised_bytes: promised << 20,
            promise_limit_bytes: self.node.ledger.memory_rule().promise_limit_mb(&host) << 20,
            overcommit: self.node.ledger.memory_rule().overcommit,
            stalled_percent: host.stalled_percent,
        })
    }

    pub(super) fn warm_pool(&self) -> Option<sandbar_core::WarmPoolReport> {
        let report = self.node.warm.report();
        Some(sandbar_core::WarmPoolReport {
            target: report.target as u64,
            waiting: report.waiting as u64,
            taken: report.taken,
            missed: report.missed,
        })
    }

    pub(super) fn data_disk(&self) -> Option<sandbar_core::DiskSpace> {
        let data_dir = &self.node.config.data_dir;
        let space = crate::storage::disks::Space::of(data_dir).ok()?;
        Some(sandbar_core::DiskSpace {
            path: data_dir.clone(),
            size_bytes: space.size,
            free_bytes: space.free,
            reserve_bytes: self.node.config.data_reserve_bytes,
            read_only: space.read_only,
        })
    }

    pub(super) fn disks(&self) -> sandbar_core::DiskReport {
        let pool = self.node.disks.report();
        sandbar_core::DiskReport {
            data: self.data_disk(),
            pool: pool.map(|p| sandbar_core::DiskSpace {
                path: self.node.disks.dir().to_path_buf(),
                size_bytes: p.space.size,
                free_bytes: p.space.free,
                reserve_bytes: p.reserve,
                read_only: p.space.read_only,
            }),
            pool_promised_bytes: pool.map_or(0, |p| p.promised),
            pool_promise_limit_bytes: pool.map_or(0, |p| p.promise_limit),
            pool_holds: pool.map(|p| {
                let disk = u64::from(self.node.config.default_disk_mb) << 20;
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

    pub(super) fn oom_kills(&self) -> u64 {
        self.node
            .ledger
            .oom_kills(|id| self.node.cgroups.oom_kills(id))
    }
}

/// Nice value of the thread that samples every sandbox: at a thousand sandboxes a round is
/// thousands of small reads, which would otherwise take a core from a create for their length.
const SAMPLING_NICE: i32 = 19;

/// Lowers the calling thread's priority to [`SAMPLING_NICE`]. Unlike the warm boots' thread
/// it forks nothing, so nothing inherits the low priority.
pub(super) fn run_sampling_in_background() {
    if let Err(err) =
        rustix::process::setpriority_process(Some(rustix::thread::gettid()), SAMPLING_NICE)
    {
        tracing::warn!(error = %err, "sampling runs at the server's priority");
    }
}

/// The agent log's size and modification time; `None` when there is none.
fn log_shape(path: &std::path::Path) -> Option<super::sampling_memo::LogShape> {
    let meta = std::fs::metadata(path).ok()?;
    Some(super::sampling_memo::LogShape {
        len: meta.len(),
        modified: meta.modified().ok()?,
    })
}
