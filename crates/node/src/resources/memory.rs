//! Memory admission by what the host really has, not by what sandboxes may use.
//!
//! A sandbox's `memoryMB` is its hard cgroup ceiling, not a reservation: an idle sandbox uses
//! about a megabyte. So a new sandbox is refused only when the host is short now (available
//! memory below the host's reserve plus what a start costs, or memory pressure stalling
//! tasks), or when the ceilings of all sandboxes together would pass an overcommit ratio of
//! the host's memory, which bounds how far the promises may run ahead of the hardware.

use std::path::Path;

/// Memory a sandbox's start needs on top of the host's reserve: its agent, boot process and
/// page tables, with room to spare.
pub const START_COST_MB: u64 = 64;

/// The host's memory as measured now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostMemory {
    pub total_mb: u64,
    /// `MemAvailable`: what can be had without swapping, page cache included.
    pub available_mb: u64,
    /// Share of the last 10 s in which every non-idle task stalled on memory (PSI `full
    /// avg10`, in percent); `None` without PSI.
    pub stalled_percent: Option<f64>,
}

impl HostMemory {
    pub fn read() -> Option<Self> {
        Self::parse(
            &std::fs::read_to_string("/proc/meminfo").ok()?,
            std::fs::read_to_string(Path::new("/proc/pressure/memory"))
                .ok()
                .as_deref(),
        )
    }

    fn parse(meminfo: &str, pressure: Option<&str>) -> Option<Self> {
        let field = |name: &str| -> Option<u64> {
            let line = meminfo.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / 1024)
        };
        let stalled_percent = pressure.and_then(|text| {
            let full = text.lines().find(|l| l.starts_with("full "))?;
            full.split_whitespace()
                .find_map(|part| part.strip_prefix("avg10="))?
                .parse()
                .ok()
        });
        Some(Self {
            total_mb: field("MemTotal:")?,
            available_mb: field("MemAvailable:")?,
            stalled_percent,
        })
    }
}

impl HostMemory {
    /// The host as sandboxes see it when their common cgroup is limited: no more in all than
    /// the limit, and no more available than it leaves them less a twentieth kept for what
    /// they already hold to grow, so creates stop while they press on it. The host's reserve
    /// lies outside the limit and is added back, as the rule subtracts it.
    pub fn within(
        self,
        sandboxes: crate::resources::cgroups::SandboxesMemory,
        reserve_mb: u64,
    ) -> Self {
        let limit_mb = sandboxes.limit >> 20;
        let room_mb = limit_mb
            .saturating_sub(sandboxes.used >> 20)
            .saturating_sub(limit_mb / 20);
        Self {
            total_mb: self.total_mb.min(limit_mb.saturating_add(reserve_mb)),
            available_mb: self.available_mb.min(room_mb.saturating_add(reserve_mb)),
            stalled_percent: self.stalled_percent,
        }
    }
}

/// How the node admits memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryRule {
    /// Memory kept for the host and the server, in MiB.
    pub reserve_mb: u64,
    /// How many times the host's memory (less the reserve) the sandboxes' ceilings may add
    /// up to.
    pub overcommit: u32,
    /// Memory pressure (PSI `full avg10`, percent) at which new sandboxes are refused.
    pub pressure_limit_percent: f64,
}

impl MemoryRule {
    /// What the ceilings of all sandboxes may add up to, in MiB.
    pub fn promise_limit_mb(&self, host: &HostMemory) -> u64 {
        host.total_mb.saturating_sub(self.reserve_mb) * u64::from(self.overcommit.max(1))
    }

    /// Whether a sandbox with a ceiling of `request_mb` may start when `promised_mb` is
    /// already promised; the refusal names what is short.
    pub fn admit(
        &self,
        host: &HostMemory,
        promised_mb: u64,
        request_mb: u32,
    ) -> Result<(), MemoryRefusal> {
        let needed = self.reserve_mb + START_COST_MB;
        if host.available_mb < needed {
            return Err(MemoryRefusal::Short {
                available_mb: host.available_mb,
                reserve_mb: self.reserve_mb,
            });
        }
        if let Some(stalled) = host.stalled_percent
            && stalled >= self.pressure_limit_percent
        {
            return Err(MemoryRefusal::Pressure {
                stalled_percent: stalled,
            });
        }
        let limit = self.promise_limit_mb(host);
        if promised_mb + u64::from(request_mb) > limit {
            return Err(MemoryRefusal::PastLimit {
                promised_mb,
                request_mb,
                limit_mb: limit,
                overcommit: self.overcommit,
            });
        }
        Ok(())
    }
}

/// Why the node's memory cannot take another sandbox now.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemoryRefusal {
    #[error(
        "this node has {available_mb} MiB of memory available and keeps {reserve_mb} MiB for itself, too little to start a sandbox; try again when sandboxes end or use less"
    )]
    Short { available_mb: u64, reserve_mb: u64 },
    #[error(
        "this node is under memory pressure (tasks stalled on memory {stalled_percent:.1}% of the last 10 s); try again shortly"
    )]
    Pressure { stalled_percent: f64 },
    #[error(
        "the sandboxes on this node may already use {promised_mb} MiB of memory, and {request_mb} MiB more would pass its limit of {limit_mb} MiB ({overcommit}x its memory); try again when sandboxes end"
    )]
    PastLimit {
        promised_mb: u64,
        request_mb: u32,
        limit_mb: u64,
        overcommit: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: MemoryRule = MemoryRule {
        reserve_mb: 1024,
        overcommit: 25,
        pressure_limit_percent: 10.0,
    };

    fn host(available_mb: u64, stalled: Option<f64>) -> HostMemory {
        HostMemory {
            total_mb: 24 * 1024,
            available_mb,
            stalled_percent: stalled,
        }
    }

    #[test]
    fn reads_meminfo_and_pressure() {
        let meminfo = "MemTotal:       24684084 kB\nMemFree: 1 kB\nMemAvailable:   23576416 kB\n";
        let pressure = "some avg10=1.50 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.75 avg60=0.00 avg300=0.00 total=2\n";
        let read = HostMemory::parse(meminfo, Some(pressure)).expect("parsed");
        assert_eq!(read.total_mb, 24105);
        assert_eq!(read.available_mb, 23023);
        assert_eq!(read.stalled_percent, Some(0.75));
        assert_eq!(
            HostMemory::parse(meminfo, None)
                .expect("parsed")
                .stalled_percent,
            None
        );
    }

    #[test]
    fn a_thousand_idle_default_sandboxes_fit_a_24_gib_host() {
        assert_eq!(RULE.admit(&host(20_000, Some(0.0)), 999 * 512, 512), Ok(()));
    }

    #[test]
    fn a_host_short_of_memory_refuses_naming_it() {
        let refused = RULE
            .admit(&host(1024 + START_COST_MB - 1, None), 0, 512)
            .expect_err("refused")
            .to_string();
        assert!(
            refused.contains("1087 MiB of memory available"),
            "{refused}"
        );
        assert_eq!(
            RULE.admit(&host(1024 + START_COST_MB, None), 0, 512),
            Ok(())
        );
    }

    #[test]
    fn memory_pressure_refuses() {
        let refused = RULE
            .admit(&host(20_000, Some(12.5)), 0, 512)
            .expect_err("refused")
            .to_string();
        assert!(refused.contains("memory pressure"), "{refused}");
    }

    #[test]
    fn sandboxes_pressing_on_their_common_limit_stop_creates() {
        let together = |limit_mb: u64, used_mb: u64| crate::resources::cgroups::SandboxesMemory {
            limit: limit_mb << 20,
            used: used_mb << 20,
        };
        let roomy = host(20_000, Some(0.0)).within(together(2048, 512), RULE.reserve_mb);
        assert_eq!(roomy.total_mb, 2048 + 1024);
        assert_eq!(roomy.available_mb, 2048 - 512 - 102 + 1024);
        assert_eq!(RULE.admit(&roomy, 0, 512), Ok(()));
        let pressed = host(20_000, Some(0.0)).within(together(2048, 1900), RULE.reserve_mb);
        let refused = RULE
            .admit(&pressed, 0, 512)
            .expect_err("refused")
            .to_string();
        assert!(refused.contains("memory available"), "{refused}");
        // The promises stop at the overcommit ratio of the common limit.
        assert_eq!(RULE.promise_limit_mb(&roomy), 2048 * 25);
        // No limit set: the host as it is.
        let unlimited =
            host(20_000, None).within(together(u64::MAX >> 20 << 20, 0), RULE.reserve_mb);
        assert_eq!(unlimited.available_mb, 20_000);
    }

    #[test]
    fn promises_stop_at_the_overcommit_ratio() {
        let limit = RULE.promise_limit_mb(&host(20_000, None));
        assert_eq!(limit, (24 * 1024 - 1024) * 25);
        assert_eq!(RULE.admit(&host(20_000, None), limit - 512, 512), Ok(()));
        let refused = RULE
            .admit(&host(20_000, None), limit - 511, 512)
            .expect_err("refused")
            .to_string();
        assert!(refused.contains("25x its memory"), "{refused}");
    }
}
