//! The node's disks as the domain sees them: whether there is room to write, and what to
//! report when there is not.
//!
//! Two filesystems matter. The data disk holds the database, checkpoints, uploads, volumes
//! and logs: below its reserve, every operation that would write to it is refused up front,
//! so none half-writes. The sandbox disk pool holds the sandboxes' own files: a new sandbox
//! is admitted only if the pool can take its disk (the runtime decides, see
//! [`crate::runtime::Runtime::launch`]), and a pool that went read-only is reported.

use std::path::PathBuf;

/// One filesystem the node writes to, as measured now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpace {
    pub path: PathBuf,
    pub size_bytes: u64,
    pub free_bytes: u64,
    /// Bytes kept free: work is refused before the free space goes below this.
    pub reserve_bytes: u64,
    pub read_only: bool,
}

impl DiskSpace {
    fn short(&self) -> bool {
        self.free_bytes < self.reserve_bytes
    }
}

/// The node's disks; `None` for a disk the runtime does not have or cannot measure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskReport {
    pub data: Option<DiskSpace>,
    pub pool: Option<DiskSpace>,
    /// Quotas of every sandbox disk on the pool together.
    pub pool_promised_bytes: u64,
    /// How far those quotas may add up (the pool's overcommit limit).
    pub pool_promise_limit_bytes: u64,
    /// The default template's disk, and how many such sandboxes the pool holds.
    pub pool_holds: Option<PoolHolds>,
}

/// How many sandboxes of the default template's disk a pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolHolds {
    pub default_disk_bytes: u64,
    /// Each filled to its quota, beside the reserve.
    pub filled: u64,
    /// Admitted while their disks are mostly empty, up to the promise limit.
    pub admitted: u64,
}

/// Work refused because the data disk has no room for it (or cannot be written at all).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DiskFull {
    pub path: PathBuf,
    pub message: String,
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

impl DiskReport {
    /// Why work that writes to the data disk must be refused now, if it must.
    pub fn write_refusal(&self) -> Option<DiskFull> {
        let data = self.data.as_ref()?;
        // Tenants read these: they name the disk, not where the host keeps it.
        let message = if data.read_only {
            "this node's data disk is read-only; nothing can be written until it is writable again"
                .to_owned()
        } else if data.short() {
            format!(
                "this node's data disk has {} MiB free, less than the {} MiB kept free; try again when space is freed",
                mib(data.free_bytes),
                mib(data.reserve_bytes)
            )
        } else {
            return None;
        };
        Some(DiskFull {
            path: data.path.clone(),
            message,
        })
    }

    /// Whether `bytes` more can be written to the data disk and leave its reserve.
    pub fn data_has_room_for(&self, bytes: u64) -> bool {
        self.data
            .as_ref()
            .is_none_or(|d| !d.read_only && d.free_bytes >= d.reserve_bytes.saturating_add(bytes))
    }

    /// What an operator should know about the disks, one sentence each; empty when all is
    /// well.
    pub fn problems(&self) -> Vec<String> {
        let mut problems: Vec<String> = self
            .write_refusal()
            .map(|r| r.message)
            .into_iter()
            .collect();
        if let Some(pool) = &self.pool {
            if pool.read_only {
                problems.push(
                    "the sandbox disk pool is read-only (its filesystem failed); no sandbox is admitted until it is mounted again, which happens once the sandboxes on it end"
                        .to_owned(),
                );
            } else if pool.short() {
                problems.push(format!(
                    "the sandbox disk pool has {} MiB free, less than its {} MiB reserve; new sandboxes are refused",
                    mib(pool.free_bytes),
                    mib(pool.reserve_bytes)
                ));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(free_mib: u64, reserve_mib: u64, read_only: bool) -> DiskSpace {
        DiskSpace {
            path: PathBuf::from("/var/lib/sandbar"),
            size_bytes: 10 << 30,
            free_bytes: free_mib << 20,
            reserve_bytes: reserve_mib << 20,
            read_only,
        }
    }

    #[test]
    fn a_healthy_disk_refuses_nothing() {
        let report = DiskReport {
            data: Some(space(5000, 1024, false)),
            pool: Some(space(5000, 512, false)),
            ..DiskReport::default()
        };
        assert_eq!(report.write_refusal(), None);
        assert!(report.problems().is_empty());
        assert!(report.data_has_room_for(1 << 30));
        assert!(!report.data_has_room_for(4000 << 20));
    }

    #[test]
    fn a_data_disk_below_its_reserve_refuses_writes_naming_it() {
        let report = DiskReport {
            data: Some(space(100, 1024, false)),
            ..DiskReport::default()
        };
        let refusal = report.write_refusal().expect("refused");
        assert!(refusal.message.contains("data disk"), "{refusal}");
        assert!(!refusal.message.contains("/var/lib/sandbar"), "{refusal}");
        assert!(refusal.message.contains("100 MiB free"), "{refusal}");
        assert_eq!(report.problems().len(), 1);
    }

    #[test]
    fn a_read_only_data_disk_refuses_writes() {
        let report = DiskReport {
            data: Some(space(5000, 1024, true)),
            ..DiskReport::default()
        };
        assert!(
            report
                .write_refusal()
                .expect("refused")
                .message
                .contains("read-only")
        );
        assert!(!report.data_has_room_for(0));
    }

    #[test]
    fn a_read_only_or_short_pool_is_a_problem_but_refuses_no_write() {
        for pool in [space(5000, 512, true), space(100, 512, false)] {
            let report = DiskReport {
                data: Some(space(5000, 1024, false)),
                pool: Some(pool),
                ..DiskReport::default()
            };
            assert_eq!(report.write_refusal(), None);
            assert_eq!(report.problems().len(), 1, "{:?}", report.problems());
        }
    }

    #[test]
    fn without_measurements_nothing_is_refused() {
        let report = DiskReport::default();
        assert_eq!(report.write_refusal(), None);
        assert!(report.data_has_room_for(u64::MAX));
    }
}
