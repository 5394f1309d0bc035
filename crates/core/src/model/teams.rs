//! Teams and the limits set on them.

/// A team owns every other resource; its limits are per team so operators can set them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    pub id: String,
    pub name: String,
    /// The team's namespace in template and snapshot names (`slug/name:tag`): unique, made
    /// from the name when the team is made.
    pub slug: String,
    pub limits: TeamLimits,
}

/// What an operator sets on a team (`sandbar team set-limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TeamLimits {
    pub max_concurrent_sandboxes: u32,
    pub max_sandbox_timeout_secs: u64,
    /// API requests allowed per minute; 0 means no limit.
    pub requests_per_minute: u32,
    /// Ceilings on one sandbox's resources; 0 leaves only the server's own limits.
    pub max_vcpu: u32,
    pub max_memory_mb: u32,
    pub max_disk_mb: u32,
    /// The rates each of its sandboxes' disk I/O is held to.
    pub disk_rates: DiskRates,
    /// Ceilings on what the team keeps.
    pub caps: TeamCaps,
}

impl TeamLimits {
    /// Limits on a team's sandboxes, their number, lifetime and API requests a minute (0 for
    /// none), and nothing else beyond the server's own: the limits of a team the operator has
    /// not tuned.
    pub const fn new(
        max_concurrent_sandboxes: u32,
        max_sandbox_timeout_secs: u64,
        requests_per_minute: u32,
    ) -> Self {
        TeamLimits {
            max_concurrent_sandboxes,
            max_sandbox_timeout_secs,
            requests_per_minute,
            max_vcpu: 0,
            max_memory_mb: 0,
            max_disk_mb: 0,
            disk_rates: DiskRates::NODE,
            caps: TeamCaps::DEFAULT,
        }
    }

    /// The first of one sandbox's resources above this team's ceiling for it: its API name
    /// (`cpuCount`, `memoryMB`, `diskSizeMB`), the value asked for and the ceiling. A ceiling
    /// of 0 holds nothing back.
    pub fn exceeded_by(
        &self,
        cpu_count: u32,
        memory_mb: u32,
        disk_size_mb: u32,
    ) -> Option<(&'static str, u32, u32)> {
        [
            ("cpuCount", cpu_count, self.max_vcpu),
            ("memoryMB", memory_mb, self.max_memory_mb),
            ("diskSizeMB", disk_size_mb, self.max_disk_mb),
        ]
        .into_iter()
        .find(|&(_, value, max)| max != 0 && value > max)
    }
}

/// The rates one sandbox's disk I/O is held to, each 0 for the node's own rate (its
/// `--sandbox-disk-*` flags): an operator raises or lowers them for a team.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskRates {
    pub read_mbps: u32,
    pub write_mbps: u32,
    pub read_iops: u32,
    pub write_iops: u32,
}

impl DiskRates {
    /// The node's own rate for every one: what a team gets unless the operator says otherwise.
    pub const NODE: DiskRates = DiskRates {
        read_mbps: 0,
        write_mbps: 0,
        read_iops: 0,
        write_iops: 0,
    };
}

/// Ceilings on what a team keeps, as opposed to what one sandbox may have: each answers a
/// create past it (429 for a count, 507 for bytes); 0 means no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TeamCaps {
    /// Snapshot templates the team keeps.
    pub max_snapshots: u32,
    /// MiB of memory images (checkpoints on the data disk) the team's snapshots hold.
    pub max_snapshot_mb: u32,
    /// Templates the team keeps, snapshots not counted.
    pub max_templates: u32,
    pub max_volumes: u32,
    /// MiB the files of all the team's volumes hold in the disk pool.
    pub max_volume_mb: u32,
    pub max_tags_per_template: u32,
    pub max_api_keys: u32,
}

impl TeamCaps {
    /// What a team gets unless the operator says otherwise: room for ordinary use, not for
    /// one tenant filling the host's disks with records or images.
    pub const DEFAULT: TeamCaps = TeamCaps {
        max_snapshots: 100,
        max_snapshot_mb: 20 * 1024,
        max_templates: 100,
        max_volumes: 100,
        max_volume_mb: 50 * 1024,
        max_tags_per_template: 100,
        max_api_keys: 100,
    };
}

impl Default for TeamCaps {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A slug made from a team's name: lower-case letters and digits, runs of anything else
/// made one `-`, at most 48 bytes; `team` when nothing is left.
pub fn slug_of(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') && !slug.is_empty() {
            slug.push('-');
        }
        if slug.len() >= 48 {
            break;
        }
    }
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        "team".to_owned()
    } else {
        slug.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::{TeamLimits, slug_of};

    #[test]
    fn the_first_resource_over_its_ceiling_is_named_and_a_zero_ceiling_holds_nothing() {
        let open = TeamLimits::new(1, 1, 0);
        assert_eq!(open.exceeded_by(64, 1 << 20, 1 << 20), None);
        let held = TeamLimits {
            max_vcpu: 2,
            max_memory_mb: 1024,
            max_disk_mb: 4096,
            ..open
        };
        assert_eq!(held.exceeded_by(2, 1024, 4096), None);
        assert_eq!(held.exceeded_by(3, 2048, 4096), Some(("cpuCount", 3, 2)));
        assert_eq!(
            held.exceeded_by(2, 2048, 8192),
            Some(("memoryMB", 2048, 1024))
        );
        assert_eq!(
            held.exceeded_by(1, 512, 8192),
            Some(("diskSizeMB", 8192, 4096))
        );
    }

    #[test]
    fn slugs_are_lower_case_letters_digits_and_single_dashes() {
        assert_eq!(slug_of("Acme Corp"), "acme-corp");
        assert_eq!(slug_of("  --Team__42!!"), "team-42");
        assert_eq!(slug_of("日本"), "team");
        assert_eq!(slug_of(&"a".repeat(100)).len(), 48);
    }
}
