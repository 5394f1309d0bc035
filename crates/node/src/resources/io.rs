//! Each sandbox's share of the disks it writes through: byte and operation rates per second on
//! the block devices under the disk pool and the data directory, so one tenant's writes cannot
//! take a whole device from its neighbours.
//!
//! The limits act on I/O a sandbox's own processes submit: direct I/O, reads, and the writes an
//! `fsync` flushes. On cgroup v1 the kernel's writeback of buffered pages runs outside the
//! writer's group and is not held to its rate; on v2, with the memory and io controllers in one
//! hierarchy, it is.

use sandbar_core::DiskRates;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Rates per second, each `0` for no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoRates {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
}

impl IoRates {
    /// Rates given in MiB/s for bytes and operations per second.
    pub fn from_flags(read_mbps: u64, write_mbps: u64, read_iops: u64, write_iops: u64) -> Self {
        Self {
            read_bytes: read_mbps << 20,
            write_bytes: write_mbps << 20,
            read_ops: read_iops,
            write_ops: write_iops,
        }
    }

    pub fn is_unlimited(&self) -> bool {
        *self == Self::default()
    }

    /// These rates with a team's own in place of each one it sets (MiB/s and operations/s;
    /// 0 keeps this one).
    pub fn with_team(self, team: &DiskRates) -> Self {
        let pick = |own: u64, theirs: u64| if theirs == 0 { own } else { theirs };
        Self {
            read_bytes: pick(self.read_bytes, u64::from(team.read_mbps) << 20),
            write_bytes: pick(self.write_bytes, u64::from(team.write_mbps) << 20),
            read_ops: pick(self.read_ops, u64::from(team.read_iops)),
            write_ops: pick(self.write_ops, u64::from(team.write_iops)),
        }
    }

    /// The v1 files (`blkio.throttle.*`) with what each gets for `device`; a rate of 0 is
    /// written as 0, which lifts that limit.
    pub(crate) fn v1_lines(&self, device: BlockDevice) -> [(&'static str, String); 4] {
        [
            ("blkio.throttle.read_bps_device", self.read_bytes),
            ("blkio.throttle.write_bps_device", self.write_bytes),
            ("blkio.throttle.read_iops_device", self.read_ops),
            ("blkio.throttle.write_iops_device", self.write_ops),
        ]
        .map(|(file, rate)| (file, format!("{device} {rate}")))
    }

    /// The v2 `io.max` line for `device`.
    pub(crate) fn v2_line(&self, device: BlockDevice) -> String {
        let rate = |value: u64| match value {
            0 => "max".to_owned(),
            v => v.to_string(),
        };
        format!(
            "{device} rbps={} wbps={} riops={} wiops={}",
            rate(self.read_bytes),
            rate(self.write_bytes),
            rate(self.read_ops),
            rate(self.write_ops)
        )
    }
}

/// A whole block device, by number: the kernel takes limits for whole disks only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockDevice {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for BlockDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// The rates every sandbox gets, and the devices they apply to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoThrottle {
    pub rates: IoRates,
    pub devices: Vec<BlockDevice>,
}

impl IoThrottle {
    /// The throttle for sandboxes whose files live under each of `dirs`: the whole disks
    /// behind the filesystems mounted there, found in the host's mount table. A directory on
    /// no block device (a tmpfs) adds none.
    pub fn for_dirs(rates: IoRates, dirs: &[&Path]) -> Self {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut devices: Vec<BlockDevice> = dirs
            .iter()
            .filter_map(|dir| mount_source(&mounts, dir))
            .filter_map(|source| whole_disk_of(&source))
            .collect();
        devices.sort();
        devices.dedup();
        Self { rates, devices }
    }

    /// Whether anything is limited.
    /// Whether there is a disk to hold sandboxes on: with none, no rate is written.
    pub fn is_active(&self) -> bool {
        !self.devices.is_empty()
    }
}

/// The source of the mount that holds `dir` (the longest mount point that is a prefix of it),
/// from a `/proc/self/mountinfo` text.
fn mount_source(mountinfo: &str, dir: &Path) -> Option<PathBuf> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let mount_point = PathBuf::from(unescape(fields.get(4)?));
            let after = fields.iter().position(|f| *f == "-")?;
            let source = fields.get(after + 2)?;
            dir.starts_with(&mount_point).then(|| {
                (
                    mount_point.as_os_str().len(),
                    PathBuf::from(unescape(source)),
                )
            })
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, source)| source)
}

/// Mount table fields escape space, tab, newline and backslash as octal.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The whole disk behind block device node `source`: the device itself, or the disk a
/// partition belongs to.
fn whole_disk_of(source: &Path) -> Option<BlockDevice> {
    let meta = std::fs::metadata(source).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    let device = BlockDevice {
        major: libc::major(rdev),
        minor: libc::minor(rdev),
    };
    let sys = PathBuf::from(format!("/sys/dev/block/{device}"));
    if !sys.join("partition").exists() {
        return Some(device);
    }
    let parent = std::fs::read_to_string(sys.join("..").join("dev")).ok()?;
    parse_device(parent.trim())
}

fn parse_device(text: &str) -> Option<BlockDevice> {
    let (major, minor) = text.split_once(':')?;
    Some(BlockDevice {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// Bytes and operations a group has read and written on any device, cumulative, from a v1
/// `blkio.throttle.io_service_bytes` / `io_serviced` pair or a v2 `io.stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoCounts {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
}

impl IoCounts {
    /// Sums the `MAJ:MIN Read N` / `MAJ:MIN Write N` lines of a v1 file.
    pub(crate) fn v1_sums(text: &str) -> (u64, u64) {
        let mut read = 0u64;
        let mut write = 0u64;
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let (Some(_device), Some(kind), Some(value)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let Ok(value) = value.parse::<u64>() else {
                continue;
            };
            match kind {
                "Read" => read = read.saturating_add(value),
                "Write" => write = write.saturating_add(value),
                _ => {}
            }
        }
        (read, write)
    }

    /// Sums the `rbytes= wbytes= rios= wios=` of every device in a v2 `io.stat`.
    pub(crate) fn from_v2(text: &str) -> Self {
        let mut counts = Self::default();
        for pair in text.split_whitespace() {
            let Some((key, value)) = pair.split_once('=') else {
                continue;
            };
            let Ok(value) = value.parse::<u64>() else {
                continue;
            };
            let slot = match key {
                "rbytes" => &mut counts.read_bytes,
                "wbytes" => &mut counts.write_bytes,
                "rios" => &mut counts.read_ops,
                "wios" => &mut counts.write_ops,
                _ => continue,
            };
            *slot = slot.saturating_add(value);
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_become_each_version_s_lines() {
        let rates = IoRates::from_flags(200, 100, 0, 2000);
        let device = BlockDevice { major: 7, minor: 3 };
        let v1 = rates.v1_lines(device);
        assert_eq!(
            v1[0],
            ("blkio.throttle.read_bps_device", "7:3 209715200".into())
        );
        assert_eq!(
            v1[1],
            ("blkio.throttle.write_bps_device", "7:3 104857600".into())
        );
        assert_eq!(v1[2], ("blkio.throttle.read_iops_device", "7:3 0".into()));
        assert_eq!(
            v1[3],
            ("blkio.throttle.write_iops_device", "7:3 2000".into())
        );
        assert_eq!(
            rates.v2_line(device),
            "7:3 rbps=209715200 wbps=104857600 riops=max wiops=2000"
        );
    }

    #[test]
    fn a_team_s_rates_replace_only_those_it_sets() {
        let node = IoRates::from_flags(200, 100, 4000, 2000);
        assert_eq!(node.with_team(&DiskRates::default()), node);
        let team = DiskRates {
            read_mbps: 0,
            write_mbps: 50,
            read_iops: 0,
            write_iops: 10,
        };
        assert_eq!(
            node.with_team(&team),
            IoRates::from_flags(200, 50, 4000, 10)
        );
        // A node without rates of its own still holds a team that sets some.
        assert_eq!(
            IoRates::default().with_team(&team),
            IoRates::from_flags(0, 50, 0, 10)
        );
    }

    #[test]
    fn the_longest_mount_point_names_the_source() {
        let mountinfo = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:45 / /var/tmp/data/sandboxes rw,noatime shared:50 - btrfs /dev/loop3 rw
91 22 0:46 / /var/tmp/with\\040space rw - btrfs /dev/loop4 rw
";
        assert_eq!(
            mount_source(mountinfo, Path::new("/var/tmp/data/sandboxes/sbx-1")),
            Some(PathBuf::from("/dev/loop3"))
        );
        assert_eq!(
            mount_source(mountinfo, Path::new("/var/tmp/data")),
            Some(PathBuf::from("/dev/vda"))
        );
        assert_eq!(
            mount_source(mountinfo, Path::new("/var/tmp/with space/x")),
            Some(PathBuf::from("/dev/loop4"))
        );
    }

    #[test]
    fn a_source_that_is_no_block_device_adds_none() {
        assert_eq!(whole_disk_of(Path::new("tmpfs")), None);
        assert_eq!(whole_disk_of(Path::new("/dev/null")), None);
    }

    #[test]
    fn counts_sum_over_devices() {
        let v1 = "7:0 Read 100\n7:0 Write 50\n7:0 Sync 150\n7:0 Total 150\n254:0 Read 1\n254:0 Write 2\nTotal 153\n";
        assert_eq!(IoCounts::v1_sums(v1), (101, 52));
        let v2 = "7:0 rbytes=10 wbytes=20 rios=1 wios=2 dbytes=0 dios=0\n254:0 rbytes=5 wbytes=5 rios=1 wios=1\n";
        assert_eq!(
            IoCounts::from_v2(v2),
            IoCounts {
                read_bytes: 15,
                write_bytes: 25,
                read_ops: 2,
                write_ops: 3
            }
        );
    }
}
