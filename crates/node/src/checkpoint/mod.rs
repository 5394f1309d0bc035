//! Checkpoints of paused sandboxes with CRIU (docs/checkpoint.md): the probe that decides
//! whether this host can take them, the header that marks one complete, what a dump must be
//! told about the host's files and mounts a sandbox uses, and the two commands.

pub(crate) mod criu_cell;

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};
use sha2::Digest;

mod plan;

pub use plan::{
    DumpPlan, FileIdentity, HostProc, KernelFilesystems, LayerDirs, LayerFiles, PlacedFiles,
    PlanError, PlanInput, ProcView, plan_dump, socket_inode,
};

/// The CRIU release our patches are made for; checkpoints are only promised to restore with
/// the version that made them.
pub const CRIU_VERSION: &str = "4.1.1";
/// Where scripts/install-criu.sh records the digest of the patches it built with.
pub const PATCH_STAMP: &str = "/usr/local/share/sandbar/criu-patches.sha256";
const PATCHES: [&[u8]; 6] = [
    include_bytes!("../../../../scripts/criu/0001-userns-check-opt-out.patch"),
    include_bytes!("../../../../scripts/criu/0002-rlimits-from-proc.patch"),
    include_bytes!("../../../../scripts/criu/0003-external-netns-of-another-userns.patch"),
    include_bytes!("../../../../scripts/criu/0004-socket-options-of-newer-kernels.patch"),
    include_bytes!("../../../../scripts/criu/0005-kernel-feature-cache-dir.patch"),
    include_bytes!("../../../../scripts/criu/0006-threads-stay-with-ignored-cgroups.patch"),
];

/// A CRIU binary that passed [`probe`].
#[derive(Debug, Clone)]
pub struct Criu {
    pub path: PathBuf,
    pub version: String,
    /// Where CRIU keeps what it probed of the kernel (patch 0005); a directory of this boot.
    pub kdat_dir: PathBuf,
}

impl Criu {
    /// A `criu` command that reuses the kernel probe of earlier runs: without the cache,
    /// every dump and restore probes the kernel again (about 40 ms here).
    pub fn command(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.path);
        command.env("CRIU_KDAT_DIR", &self.kdat_dir);
        command
    }
}

/// PIDs of the processes of the CRIU binary `criu` working on a directory under `under`:
/// dumps and restores a server that died left running (they outlive it, so that the sandbox
/// they hold is never left half dumped or half restored). Matched by the binary's inode, so
/// a sandbox's own process cannot pass for one by its command line.
pub fn criu_in_flight(criu: &Path, under: &Path) -> Vec<i32> {
    let Ok(binary) = std::fs::metadata(criu) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(exe) = std::fs::metadata(format!("/proc/{pid}/exe")) else {
                return false;
            };
            if (exe.dev(), exe.ino()) != (binary.dev(), binary.ino()) {
                return false;
            }
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.windows(2).any(|w| {
                w[0] == b"--images-dir" && Path::new(OsStr::from_bytes(w[1])).starts_with(under)
            })
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{path} cannot be run: {source}")]
    Missing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is version '{found}', not {CRIU_VERSION}")]
    Version { path: PathBuf, found: String },
    #[error(
        "{PATCH_STAMP} does not name the patches this server was built with; run scripts/install-criu.sh"
    )]
    Patches,
    #[error("`{path} check` failed: {output}")]
    Check { path: PathBuf, output: String },
}

/// Whether `path` is the patched CRIU this server needs, and working on this kernel; its
/// kernel probe is cached in `kdat_dir`, which must not outlive this boot.
pub fn probe(path: &Path, kdat_dir: &Path) -> Result<Criu, ProbeError> {
    let run = |arg: &str| {
        std::process::Command::new(path)
            .arg(arg)
            .env("CRIU_KDAT_DIR", kdat_dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| ProbeError::Missing {
                path: path.to_owned(),
                source,
            })
    };
    let version = run("--version")?;
    let text = String::from_utf8_lossy(&version.stdout);
    let found = text
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default();
    if found != CRIU_VERSION {
        return Err(ProbeError::Version {
            path: path.to_owned(),
            found,
        });
    }
    let mut digest = sha2::Sha256::new();
    for patch in PATCHES {
        digest.update(patch);
    }
    let stamp = std::fs::read_to_string(PATCH_STAMP).unwrap_or_default();
    if stamp.trim() != hex::encode(digest.finalize()) {
        return Err(ProbeError::Patches);
    }
    let check = run("check")?;
    if !check.status.success() {
        let mut output = String::from_utf8_lossy(&check.stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&check.stderr));
        return Err(ProbeError::Check {
            path: path.to_owned(),
            output: output.trim().chars().take(400).collect(),
        });
    }
    Ok(Criu {
        path: path.to_owned(),
        version: found,
        kdat_dir: kdat_dir.to_owned(),
    })
}

const MAGIC: &[u8; 8] = b"SBXCKPT\0";
/// 2: the node's files are recorded by what they are ([`External::Placed`]), no longer by
/// the path a sandbox's descriptor showed. Headers of format 1 are still read.
const FORMAT_VERSION: u32 = 2;
const OLDEST_FORMAT_VERSION: u32 = 1;
/// The header's file name in a checkpoint directory; written last.
pub const HEADER_FILE: &str = "header";
/// CRIU's logs, which are not part of the images.
pub const DUMP_LOG: &str = "dump.log";
pub const RESTORE_LOG: &str = "restore.log";
/// What the dump was told about the host, kept beside the images from before CRIU starts so
/// a dump that outlived the server can still be sealed.
pub const PLAN_FILE: &str = "plan.json";
/// Where a restore writes the PID of the restored PID 1.
pub const RESTORE_PIDFILE: &str = "restore.pid";
/// CRIU writes its statistics as the last step of a dump or restore that succeeded, so
/// their presence tells a finished run from an abandoned one.
pub const DUMP_STATS: &str = "stats-dump";
pub const RESTORE_STATS: &str = "stats-restore";
/// Where the node a checkpoint was made on describes it for another node that may restore
/// it (see the runtime's carried checkpoints); written after the seal, so not an image.
pub const CARRY_ORIGIN: &str = "carry-origin.json";
/// Files in a checkpoint directory that are not images.
const NOT_IMAGES: [&str; 7] = [
    HEADER_FILE,
    CARRY_ORIGIN,
    DUMP_LOG,
    RESTORE_LOG,
    PLAN_FILE,
    RESTORE_PIDFILE,
    RESTORE_STATS,
];

/// What a checkpoint is and needs: written after the images, so a directory without a valid
/// header is an incomplete checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub criu_version: String,
    /// SHA-256 of the agent binary the sandbox runs (kept under the data directory).
    pub agent_digest: String,
    /// Inode of the agent's listening socket, which a restore replaces with a new one.
    pub listener_inode: u64,
    pub externals: Vec<External>,
    pub images: Vec<Image>,
    /// CRC32 of the images' contents, in the order of `images`.
    pub images_crc32: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Image {
    pub name: String,
    pub size: u64,
}

/// Something of the host's that the sandbox uses and the checkpoint does not contain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum External {
    /// A bind of a host device node (`/dev/null`, the `/proc` masks): `key` is mounted again
    /// from `source`.
    Device { key: String, source: PathBuf },
    /// The sandbox's sysfs, made again for its network namespace.
    Sysfs { key: String },
    /// A volume bound into the sandbox: its directory on the host (which outlives the
    /// sandbox), id-mapped again at the restore.
    Volume { key: String, source: PathBuf },
    /// The sandbox's boot id, bound over the kernel's from a filesystem of its own that no
    /// mount of the sandbox shows whole: made again at the restore, holding the id the
    /// restored sandbox is to have.
    BootId { key: String },
    /// A file of the node's that the sandbox's processes map or hold open (the agent binary,
    /// its log), given to the restore as a descriptor the node opens itself.
    Placed {
        key: String,
        file: Placed,
        /// Its size at the dump: CRIU checks it against what the restore hands over.
        size: u64,
        /// A library's content digest, by which a restore finds its own copy.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        digest: Option<String>,
    },
    /// A file of the sandbox's own layers that its processes map (a library of its
    /// template, a program it built): CRIU cannot reach the layer beneath the overlay, so a
    /// restore hands it the file found at `path` in the restored sandbox's layers.
    LayerFile {
        key: String,
        /// Relative to a layer's root, plain names only.
        path: String,
        size: u64,
    },
    /// Format 1: a host file by the path its descriptor showed. Read only to tell which of
    /// the node's files it was; the path is never opened.
    File {
        key: String,
        path: PathBuf,
        append: bool,
        size: u64,
        mtime: i64,
    },
}

/// Which of the node's files a checkpoint's processes held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placed {
    /// The agent binary, named by the header's `agent_digest`.
    Agent,
    /// The sandbox's agent log, which the restoring node chooses.
    Log,
    /// A shared library of the agent's, named by its content digest.
    Library,
}

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("checkpoint {dir} has no header: {source}")]
    Missing {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint {dir} has an invalid header: {reason}")]
    Invalid { dir: PathBuf, reason: String },
}

fn encode(header: &Header) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec(header)?;
    let mut out = Vec::with_capacity(body.len() + 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Why the bytes of a header file are not a header this node reads.
#[derive(Debug, thiserror::Error)]
enum DecodeError {
    #[error("not a checkpoint header")]
    NotAHeader,
    #[error("short header")]
    Short,
    #[error("header checksum mismatch")]
    Checksum,
    #[error("format version {0}, expected {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}")]
    Version(u32),
    #[error("header length mismatch")]
    Length,
    #[error("{0}")]
    Body(serde_json::Error),
}

fn decode(bytes: &[u8]) -> Result<Header, DecodeError> {
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(DecodeError::NotAHeader);
    }
    let (framed, crc) = bytes.split_at(bytes.len() - 4);
    let crc = u32::from_le_bytes(crc.try_into().map_err(|_| DecodeError::Short)?);
    if crc32fast::hash(framed) != crc {
        return Err(DecodeError::Checksum);
    }
    let version = u32::from_le_bytes(framed[8..12].try_into().map_err(|_| DecodeError::Short)?);
    if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(DecodeError::Version(version));
    }
    let len =
        u32::from_le_bytes(framed[12..16].try_into().map_err(|_| DecodeError::Short)?) as usize;
    if framed.len() != 16 + len {
        return Err(DecodeError::Length);
    }
    serde_json::from_slice(&framed[16..]).map_err(DecodeError::Body)
}

/// The image files of `dir` (everything but the header and CRIU's logs), by name, with their
/// sizes and the CRC32 of their contents.
pub fn list_images(dir: &Path) -> std::io::Result<(Vec<Image>, u32)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !NOT_IMAGES.contains(&n.as_str()) && !n.ends_with(".tmp"))
        .collect();
    names.sort();
    let mut images = Vec::with_capacity(names.len());
    for name in names {
        let size = std::fs::metadata(dir.join(&name))?.len();
        images.push(Image { name, size });
    }
    let crc = images_crc32(dir, &images)?;
    Ok((images, crc))
}

/// Pieces the checksum is computed in: small enough that two or more cores share the pages
/// of a large sandbox, large enough that combining them costs nothing.
const CRC_PIECE: u64 = 32 << 20;

/// The CRC32 of `images` read one after another, as one stream; pieces are checksummed on
/// all cores and combined in order (a checkpoint of 1 GiB is mostly one file).
fn images_crc32(dir: &Path, images: &[Image]) -> std::io::Result<u32> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let files = images
        .iter()
        .map(|i| std::fs::File::open(dir.join(&i.name)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut pieces: Vec<(usize, u64, u64)> = Vec::new();
    for (index, image) in images.iter().enumerate() {
        let mut at = 0;
        loop {
            let len = (image.size - at).min(CRC_PIECE);
            pieces.push((index, at, len));
            at += len;
            if at >= image.size {
                break;
            }
        }
    }
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(pieces.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let checksum_pieces = || -> std::io::Result<Vec<(usize, crc32fast::Hasher)>> {
        let mut done = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let at = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(file, offset, len)) = pieces.get(at) else {
                return Ok(done);
            };
            let mut crc = crc32fast::Hasher::new();
            let mut read = 0;
            while read < len {
                let want = (len - read).min(buf.len() as u64) as usize;
                let n = files[file].read_at(&mut buf[..want], offset + read)?;
                if n == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "{} is shorter than {} bytes",
                            images[file].name,
                            offset + len
                        ),
                    ));
                }
                crc.update(&buf[..n]);
                read += n as u64;
            }
            done.push((at, crc));
        }
    };
    let mut done: Vec<(usize, crc32fast::Hasher)> = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..workers).map(|_| scope.spawn(checksum_pieces)).collect();
        let mut all = checksum_pieces()?;
        for helper in helpers {
            all.extend(
                helper
                    .join()
                    .map_err(|_| std::io::Error::other("a checksum thread panicked"))??,
            );
        }
        Ok::<_, std::io::Error>(all)
    })?;
    done.sort_by_key(|(at, _)| *at);
    let mut total = crc32fast::Hasher::new();
    for (_, piece) in &done {
        total.combine(piece);
    }
    Ok(total.finalize())
}

/// Writes the header beside the images and renames it into place.
pub fn write_header(dir: &Path, header: &Header) -> std::io::Result<()> {
    let bytes = encode(header).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!("{HEADER_FILE}.tmp"));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(HEADER_FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

/// Completes the checkpoint in `dir` that a dump told about the host as `plan` says: lists
/// and checksums its images and writes the header that marks it complete.
pub fn seal(
    dir: &Path,
    criu_version: String,
    agent_digest: String,
    plan: DumpPlan,
) -> std::io::Result<Header> {
    let (images, images_crc32) = list_images(dir)?;
    let header = Header {
        criu_version,
        agent_digest: plan.agent_digest.unwrap_or(agent_digest),
        listener_inode: plan.listener_inode,
        externals: plan.externals,
        images,
        images_crc32,
    };
    write_header(dir, &header)?;
    Ok(header)
}

/// Keeps `plan` beside the images a dump is about to write into `dir`.
pub fn write_plan(dir: &Path, plan: &DumpPlan) -> std::io::Result<()> {
    std::fs::write(
        dir.join(PLAN_FILE),
        serde_json::to_vec(plan).map_err(std::io::Error::other)?,
    )
}

/// Seals the checkpoint in `dir` whose dump finished after the server that started it died;
/// an error if the dump did not finish.
pub fn seal_finished_dump(
    dir: &Path,
    criu_version: String,
    agent_digest: String,
) -> Result<Header, SealFinishedError> {
    if !dir.join(DUMP_STATS).is_file() {
        return Err(SealFinishedError::Unfinished {
            dir: dir.to_owned(),
        });
    }
    let bytes =
        std::fs::read(dir.join(PLAN_FILE)).map_err(|source| SealFinishedError::PlanUnreadable {
            dir: dir.to_owned(),
            source,
        })?;
    let plan: DumpPlan =
        serde_json::from_slice(&bytes).map_err(|source| SealFinishedError::PlanInvalid {
            dir: dir.to_owned(),
            source,
        })?;
    seal(dir, criu_version, agent_digest, plan).map_err(|source| SealFinishedError::Seal {
        dir: dir.to_owned(),
        source,
    })
}

/// Why a dump that outlived the server that started it cannot be sealed.
#[derive(Debug, thiserror::Error)]
pub enum SealFinishedError {
    #[error("the dump into {dir} did not finish")]
    Unfinished { dir: PathBuf },
    #[error("the dump into {dir} left no plan: {source}")]
    PlanUnreadable {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the dump into {dir} left no plan: {source}")]
    PlanInvalid {
        dir: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot seal {dir}: {source}")]
    Seal {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// The PID 1 a restore from `dir` made, if that restore ran to its end.
pub fn finished_restore(dir: &Path) -> Option<i32> {
    dir.join(RESTORE_STATS)
        .is_file()
        .then(|| restored_pid(dir))
        .flatten()
}

/// The PID 1 a restore from `dir` wrote, finished or not.
pub fn restored_pid(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join(RESTORE_PIDFILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Removes what a restore from `dir` left there, so the images read as they were dumped.
pub fn clear_restore(dir: &Path) {
    for name in [RESTORE_PIDFILE, RESTORE_STATS] {
        let _ = std::fs::remove_file(dir.join(name));
    }
}

/// The header of the checkpoint in `dir`, checked against the images there (their CRC too
/// when `verify_images`).
pub fn read_header(dir: &Path, verify_images: bool) -> Result<Header, HeaderError> {
    let bytes = std::fs::read(dir.join(HEADER_FILE)).map_err(|source| HeaderError::Missing {
        dir: dir.to_owned(),
        source,
    })?;
    let invalid = |reason: String| HeaderError::Invalid {
        dir: dir.to_owned(),
        reason,
    };
    let header = decode(&bytes).map_err(|e| invalid(e.to_string()))?;
    for image in &header.images {
        let size = std::fs::metadata(dir.join(&image.name))
            .map(|m| m.len())
            .map_err(|e| invalid(format!("image {}: {e}", image.name)))?;
        if size != image.size {
            return Err(invalid(format!(
                "image {} has {size} bytes, {} recorded",
                image.name, image.size
            )));
        }
    }
    if verify_images {
        let (images, crc) = list_images(dir).map_err(|e| invalid(e.to_string()))?;
        if images != header.images || crc != header.images_crc32 {
            return Err(invalid("the images do not match their checksum".into()));
        }
    }
    Ok(header)
}

/// The mount ids of `mountinfo` (a sandbox's mount table), and the dump arguments and
/// externals for the mounts in it that come from the host or from a filesystem the sandbox
/// cannot show whole: device binds, sysfs, its `volumes` (mount point in the sandbox,
/// directory on the host) and its boot id.
fn external_mounts(
    mountinfo: &str,
    volumes: &[(PathBuf, PathBuf)],
) -> (BTreeSet<u64>, Vec<String>, Vec<External>) {
    let mut own_mounts = BTreeSet::new();
    let mut args = Vec::new();
    let mut externals = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(id), Some(root), Some(point), Some(fstype)) = (
            fields.first().and_then(|f| f.parse::<u64>().ok()),
            fields.get(3),
            fields.get(4),
            fields.get(sep + 1),
        ) else {
            continue;
        };
        own_mounts.insert(id);
        let key = || {
            let mut key = String::from("m");
            key.extend(
                point
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
            );
            key
        };
        if let Some((_, source)) = volumes
            .iter()
            .find(|(target, _)| Path::new(point) == target)
        {
            let key = key();
            args.push(format!("--external=mnt[{point}]:{key}"));
            externals.push(External::Volume {
                key,
                source: source.clone(),
            });
            continue;
        }
        if *point == sandbar_jail::BOOT_ID_PATH {
            let key = key();
            args.push(format!("--external=mnt[{point}]:{key}"));
            externals.push(External::BootId { key });
            continue;
        }
        match *fstype {
            "devtmpfs" => {
                let key = key();
                args.push(format!("--external=mnt[{point}]:{key}"));
                externals.push(External::Device {
                    key,
                    source: Path::new("/dev").join(root.trim_start_matches('/')),
                });
            }
            "sysfs" if *point == "/sys" => {
                let key = key();
                args.push(format!("--external=mnt[{point}]:{key}"));
                externals.push(External::Sysfs { key });
            }
            _ => {}
        }
    }
    (own_mounts, args, externals)
}

/// The last error lines of a CRIU log, for a failure message.
pub fn log_errors(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") || l.contains("rror ("))
        .filter(|l| !l.contains("RLIMIT_NOFILE"))
        .collect();
    let picked = if errors.is_empty() {
        text.lines().rev().take(5).collect::<Vec<_>>()
    } else {
        errors.into_iter().rev().take(5).collect()
    };
    picked.into_iter().rev().collect::<Vec<_>>().join("; ")
}

/// Whether `path` is a device node directly under `/dev` (`/dev/null`, `/dev/urandom`): the
/// only host objects a checkpoint binds back by path.
pub fn is_device_node_path(path: &Path) -> bool {
    let Ok(name) = path.strip_prefix("/dev") else {
        return false;
    };
    let name = name.as_os_str().as_bytes();
    !name.is_empty() && name.iter().all(u8::is_ascii_lowercase)
}

/// Where a restore finds the node's files a checkpoint names: the node's own, never a path
/// a checkpoint recorded.
#[derive(Debug, Clone, Copy)]
pub struct PlacedSources<'a> {
    /// The node's content-addressed agent copies (`<data>/agents`).
    pub agents: &'a Path,
    /// The log the restored sandbox's agent is to write; `None` only checks that the rest
    /// is here.
    pub log: Option<&'a Path>,
    /// The restored sandbox's layers, topmost first; `None` only checks that the rest is
    /// here.
    pub layers: Option<&'a [PathBuf]>,
    /// The node's copies of the agent's libraries: content digest and the node's own path.
    pub libraries: &'a [(String, PathBuf)],
}

#[derive(Debug, thiserror::Error)]
pub enum ExternalsError {
    #[error("the checkpoint's agent {digest} is not on this node")]
    NoAgent {
        digest: String,
        source: std::io::Error,
    },
    #[error("the checkpoint names agent '{digest}', which is not a digest")]
    BadDigest { digest: String },
    #[error("cannot open the agent log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the checkpoint names a host file that is neither the agent nor its log")]
    Unknown,
    #[error("the agent's library {digest} that the checkpoint maps is not on this node")]
    NoLibrary { digest: String },
    #[error("the sandbox's layers no longer hold /{path} as it was mapped ({size} bytes)")]
    LayerFile { path: String, size: u64 },
}

/// The descriptors a restore inherits for the node's files the checkpoint names, each opened
/// from `sources` (never by a recorded path) without following links, taking a terminal or
/// blocking. The agent is the copy named by its content digest, so a checkpoint restores on
/// any node that runs the same build.
pub fn open_externals(
    header: &Header,
    sources: PlacedSources<'_>,
) -> Result<Vec<(String, OwnedFd)>, ExternalsError> {
    let mut out = Vec::new();
    for external in &header.externals {
        let (key, placed, digest) = match external {
            External::Placed {
                key, file, digest, ..
            } => (key, *file, digest.as_deref()),
            External::LayerFile { key, path, size } => {
                let Some(layers) = sources.layers else {
                    continue;
                };
                out.push((key.clone(), open_layer_file(layers, path, *size)?));
                continue;
            }
            // Format 1 recorded the log as the one file opened for appending and the agent
            // by its copy's name; the path itself is not used.
            External::File {
                key, path, append, ..
            } => {
                let placed = if *append {
                    Placed::Log
                } else if path.file_name() == Some(OsStr::new(&header.agent_digest)) {
                    Placed::Agent
                } else {
                    return Err(ExternalsError::Unknown);
                };
                (key, placed, None)
            }
            _ => continue,
        };
        let fd = match placed {
            Placed::Agent => open_agent(sources.agents, &header.agent_digest)?,
            Placed::Library => {
                let missing = || ExternalsError::NoLibrary {
                    digest: digest.unwrap_or_default().to_owned(),
                };
                let (_, path) = sources
                    .libraries
                    .iter()
                    .find(|(have, _)| Some(have.as_str()) == digest)
                    .ok_or_else(missing)?;
                open_node_file(path, false).map_err(|_| missing())?
            }
            Placed::Log => {
                let Some(log) = sources.log else { continue };
                open_node_file(log, true).map_err(|source| ExternalsError::Log {
                    path: log.to_owned(),
                    source,
                })?
            }
        };
        out.push((key.clone(), fd));
    }
    Ok(out)
}

/// The file at `path` in the topmost of `layers` that has one, opened beneath that layer
/// without following any link; it must be a regular file of the recorded size.
fn open_layer_file(layers: &[PathBuf], path: &str, size: u64) -> Result<OwnedFd, ExternalsError> {
    let missing = || ExternalsError::LayerFile {
        path: path.to_owned(),
        size,
    };
    for layer in layers {
        let Ok(tree) = sandbar_fs::Tree::open(layer, sandbar_fs::Links::Refused) else {
            continue;
        };
        match tree.open_file(path) {
            Ok(file) => {
                let right_size = file
                    .metadata()
                    .is_ok_and(|m| m.is_file() && m.len() == size);
                return if right_size {
                    Ok(OwnedFd::from(file))
                } else {
                    Err(missing())
                };
            }
            Err(e) if e.is_not_found() => continue,
            Err(_) => return Err(missing()),
        }
    }
    Err(missing())
}

fn open_agent(agents: &Path, digest: &str) -> Result<OwnedFd, ExternalsError> {
    if digest.len() != 64 || !digest.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(ExternalsError::BadDigest {
            digest: digest.to_owned(),
        });
    }
    open_node_file(&agents.join(digest), false).map_err(|source| ExternalsError::NoAgent {
        digest: digest.to_owned(),
        source,
    })
}

/// Opens a regular file of the node's: no link followed, no terminal taken, no wait on a
/// FIFO, and anything but a regular file refused.
fn open_node_file(path: &Path, append: bool) -> std::io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let access = if append {
        OFlags::WRONLY | OFlags::APPEND
    } else {
        OFlags::RDONLY
    };
    let fd = rustix::fs::open(
        path,
        access | OFlags::NOFOLLOW | OFlags::NOCTTY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let stat = rustix::fs::fstat(&fd)?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(std::io::Error::other("not a regular file"));
    }
    // Only there to keep the open itself from waiting; the restored process gets a
    // descriptor like the one it had.
    rustix::fs::fcntl_setfl(&fd, access & OFlags::APPEND)?;
    Ok(fd)
}

/// CRIU's image magics (criu/include/magic.h): every image starts with the common magic and
/// its own.
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const USERNS_MAGIC: u32 = 0x5547_4906;
/// Whether the image file `name` holds a user namespace's id maps (`userns-<id>.img`).
pub fn is_userns_image(name: &str) -> bool {
    name.strip_prefix("userns-")
        .and_then(|rest| rest.strip_suffix(".img"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|c| c.is_ascii_digit()))
}

fn read_varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// One `uid_gid_extent` (images/userns.proto): `first` inside, `lower_first` on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    first: u32,
    lower_first: u32,
    count: u32,
}

fn decode_extent(bytes: &[u8]) -> Option<Extent> {
    let (mut at, mut fields) = (0, [None; 3]);
    while at < bytes.len() {
        let key = read_varint(bytes, &mut at)?;
        if key & 7 != 0 {
            return None;
        }
        let value = u32::try_from(read_varint(bytes, &mut at)?).ok()?;
        match key >> 3 {
            n @ 1..=3 => fields[n as usize - 1] = Some(value),
            _ => return None,
        }
    }
    Some(Extent {
        first: fields[0]?,
        lower_first: fields[1]?,
        count: fields[2]?,
    })
}

fn encode_extent(out: &mut Vec<u8>, field: u64, extent: Extent) {
    let mut body = Vec::with_capacity(16);
    for (n, value) in [extent.first, extent.lower_first, extent.count]
        .into_iter()
        .enumerate()
    {
        write_varint(&mut body, (n as u64 + 1) << 3);
        write_varint(&mut body, u64::from(value));
    }
    write_varint(out, (field << 3) | 2);
    write_varint(out, body.len() as u64);
    out.extend_from_slice(&body);
}

/// The user namespace image of a checkpoint with every extent on the host range starting at
/// `from` moved to the same offset from `to`: a sandbox restored from another's checkpoint
/// gets its own host ids. CRIU records every other owner as seen inside the namespace, so
/// this one image is all that names the host range. `None` when the image is not the
/// expected single `userns_entry` or an extent lies outside `from..from + size`.
pub fn remap_userns_image(image: &[u8], from: u32, to: u32, size: u32) -> Option<Vec<u8>> {
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(image.get(at..at + 4)?.try_into().ok()?))
    };
    if word(0)? != IMG_COMMON_MAGIC || word(4)? != USERNS_MAGIC {
        return None;
    }
    let len = word(8)? as usize;
    let entry = image.get(12..12 + len)?;
    if image.len() != 12 + len {
        return None;
    }
    let mut body = Vec::with_capacity(entry.len());
    let mut at = 0;
    while at < entry.len() {
        let key = read_varint(entry, &mut at)?;
        let field = key >> 3;
        if key & 7 != 2 || !(1..=2).contains(&field) {
            return None;
        }
        let n = usize::try_from(read_varint(entry, &mut at)?).ok()?;
        let mut extent = decode_extent(entry.get(at..at + n)?)?;
        at += n;
        let offset = extent.lower_first.checked_sub(from)?;
        if u64::from(offset) + u64::from(extent.count) > u64::from(size) {
            return None;
        }
        extent.lower_first = to.checked_add(offset)?;
        encode_extent(&mut body, field, extent);
    }
    let mut out = Vec::with_capacity(12 + body.len());
    out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
    out.extend_from_slice(&USERNS_MAGIC.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Some(out)
}

/// A Unix socket of the host's network namespace that a sandbox process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSocket {
    pub pid: i32,
    pub fd: String,
    pub inode: u64,
}

impl std::fmt::Display for HostSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", self.pid)).unwrap_or_default();
        write!(
            f,
            "socket {} held by pid {} ({}) as fd {}",
            self.inode,
            self.pid,
            comm.trim(),
            self.fd
        )
    }
}

/// `held` as one line for a log or an error.
pub fn describe_host_sockets(held: &[HostSocket]) -> String {
    held.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The inodes listed in a `/proc/net/unix` table.
fn unix_table_inodes(table: &str) -> BTreeSet<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(6)?.parse().ok())
        .collect()
}

/// Which of `tasks` hold Unix sockets of the server's own network namespace. The agent's end
/// of a connection made from the host is one (a Unix socket belongs to the namespace of the
/// side that connects), and CRIU cannot dump a sandbox holding one: it only knows the
/// sockets of the sandbox's namespace.
pub fn host_unix_sockets(tasks: &[i32]) -> Vec<HostSocket> {
    let Ok(table) = std::fs::read_to_string("/proc/self/net/unix") else {
        return Vec::new();
    };
    let host = unix_table_inodes(&table);
    let mut held = Vec::new();
    for &pid in tasks {
        let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            let Some(inode) = socket_inode(target.as_os_str()) else {
                continue;
            };
            if host.contains(&inode) {
                held.push(HostSocket {
                    pid,
                    fd: entry.file_name().to_string_lossy().into_owned(),
                    inode,
                });
            }
        }
    }
    held
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// A named pipe at `path`, readable and writable by its owner only.
    pub(super) fn make_fifo(path: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
    }

    #[test]
    fn host_mounts_and_the_boot_id_are_external_and_the_rest_is_dumped() {
        let mountinfo = "\
300 250 0:60 / / rw,relatime - overlay overlay rw,lowerdir=lower/0,upperdir=upper,workdir=work
301 300 0:61 / /proc rw,nosuid,nodev,noexec - proc proc rw
302 300 0:62 / /sys ro,nosuid,nodev,noexec - sysfs sysfs ro
303 300 0:63 / /dev rw,nosuid,noexec - tmpfs tmpfs rw,size=64k
304 303 0:5 /null /dev/null rw,nosuid,noexec - devtmpfs udev rw
305 301 0:64 / /proc/acpi ro - tmpfs tmpfs ro,size=0
306 301 0:61 /sys /proc/sys ro,nosuid,nodev,noexec - proc proc rw
307 306 0:65 /boot_id /proc/sys/kernel/random/boot_id ro,nosuid,nodev,noexec - tmpfs tmpfs ro,size=4k
308 300 0:40 /.volumes/t/v /data rw,nosuid,nodev - btrfs /dev/loop0 rw
";
        let volumes = vec![(PathBuf::from("/data"), PathBuf::from("/pool/.volumes/t/v"))];
        let (own, args, externals) = external_mounts(mountinfo, &volumes);
        assert_eq!(own, (300..=308).collect::<BTreeSet<u64>>());
        assert_eq!(
            args,
            vec![
                "--external=mnt[/sys]:m_sys".to_owned(),
                "--external=mnt[/dev/null]:m_dev_null".into(),
                "--external=mnt[/proc/sys/kernel/random/boot_id]:m_proc_sys_kernel_random_boot_id"
                    .into(),
                "--external=mnt[/data]:m_data".into(),
            ]
        );
        assert_eq!(
            externals,
            vec![
                External::Sysfs {
                    key: "m_sys".into()
                },
                External::Device {
                    key: "m_dev_null".into(),
                    source: "/dev/null".into()
                },
                External::BootId {
                    key: "m_proc_sys_kernel_random_boot_id".into()
                },
                External::Volume {
                    key: "m_data".into(),
                    source: "/pool/.volumes/t/v".into()
                },
            ]
        );
    }

    fn header() -> Header {
        Header {
            criu_version: CRIU_VERSION.into(),
            agent_digest: "ab".repeat(32),
            listener_inode: 42,
            externals: vec![
                External::Device {
                    key: "m_dev_null".into(),
                    source: "/dev/null".into(),
                },
                External::Placed {
                    key: "file[1b:10]".into(),
                    file: Placed::Agent,
                    size: 10,
                    digest: None,
                },
            ],
            images: Vec::new(),
            images_crc32: 0,
        }
    }

    #[test]
    fn a_restore_opens_the_nodes_own_files_and_never_a_recorded_path() {
        let dir = tempfile::tempdir().unwrap();
        let agents = dir.path().join("agents");
        std::fs::create_dir(&agents).unwrap();
        let digest = "ab".repeat(32);
        std::fs::write(agents.join(&digest), b"agent").unwrap();
        let log = dir.path().join("s1.log");
        std::fs::write(&log, b"").unwrap();
        let secret = dir.path().join("secret.txt");
        std::fs::write(&secret, b"host secret").unwrap();
        let sources = PlacedSources {
            agents: &agents,
            log: Some(&log),
            layers: None,
            libraries: &[],
        };
        let mut h = header();
        h.externals.push(External::Placed {
            key: "file[1b:11]".into(),
            file: Placed::Log,
            size: 0,
            digest: None,
        });
        let opened = open_externals(&h, sources).unwrap();
        let keys: Vec<&str> = opened.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["file[1b:10]", "file[1b:11]"]);
        let mut agent = std::fs::File::from(opened.into_iter().next().unwrap().1);
        let mut text = String::new();
        std::io::Read::read_to_string(&mut agent, &mut text).unwrap();
        assert_eq!(text, "agent");

        // Format 1 named files by path: a path that is neither the agent nor the log is
        // refused without being opened, whatever it names.
        let mut old = header();
        old.externals = vec![External::File {
            key: "file[1b:12]".into(),
            path: secret.clone(),
            append: false,
            size: 11,
            mtime: 0,
        }];
        assert!(matches!(
            open_externals(&old, sources),
            Err(ExternalsError::Unknown)
        ));
        // The agent by its old path is the node's copy of the same digest.
        old.externals = vec![External::File {
            key: "file[1b:13]".into(),
            path: PathBuf::from("/elsewhere/agents").join(&digest),
            append: false,
            size: 5,
            mtime: 0,
        }];
        assert_eq!(open_externals(&old, sources).unwrap().len(), 1);

        let mut other = header();
        other.agent_digest = "cd".repeat(32);
        assert!(matches!(
            open_externals(&other, sources),
            Err(ExternalsError::NoAgent { .. })
        ));
        other.agent_digest = "../secret.txt".into();
        assert!(matches!(
            open_externals(&other, sources),
            Err(ExternalsError::BadDigest { .. })
        ));
    }

    #[test]
    fn a_layer_file_is_the_topmost_layers_and_never_reached_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let (upper, lower) = (dir.path().join("upper"), dir.path().join("lower"));
        std::fs::create_dir_all(upper.join("usr")).unwrap();
        std::fs::create_dir_all(lower.join("usr/lib")).unwrap();
        std::fs::write(lower.join("usr/lib/libc.so.6"), b"libc").unwrap();
        std::fs::write(dir.path().join("secret"), b"host").unwrap();
        std::os::unix::fs::symlink(dir.path(), upper.join("usr/escape")).unwrap();
        let layers = [upper.clone(), lower.clone()];
        let mut h = header();
        h.externals = vec![External::LayerFile {
            key: "file[27:1]".into(),
            path: "usr/lib/libc.so.6".into(),
            size: 4,
        }];
        let sources = |layers| PlacedSources {
            agents: dir.path(),
            log: None,
            layers,
            libraries: &[],
        };
        assert_eq!(open_externals(&h, sources(Some(&layers))).unwrap().len(), 1);
        // Only checking what else is needed: layers are not looked at.
        assert_eq!(open_externals(&h, sources(None)).unwrap().len(), 0);
        h.externals = vec![External::LayerFile {
            key: "file[27:1]".into(),
            path: "usr/lib/libc.so.6".into(),
            size: 5,
        }];
        assert!(matches!(
            open_externals(&h, sources(Some(&layers))),
            Err(ExternalsError::LayerFile { .. })
        ));
        h.externals = vec![External::LayerFile {
            key: "file[27:1]".into(),
            path: "usr/escape/secret".into(),
            size: 4,
        }];
        // The layers refuse the link rather than follow it out: the file is not there.
        let escaped = open_externals(&h, sources(Some(&layers)));
        assert!(
            matches!(
                &escaped,
                Err(ExternalsError::LayerFile { path, size: 4 }) if path == "usr/escape/secret"
            ),
            "{escaped:?}"
        );
    }

    #[test]
    fn only_device_nodes_directly_under_dev_are_bound_back() {
        for good in ["/dev/null", "/dev/urandom", "/dev/tty"] {
            assert!(is_device_node_path(Path::new(good)), "{good}");
        }
        for bad in [
            "/dev",
            "/dev/",
            "/etc/shadow",
            "/dev/../etc/shadow",
            "/dev/pts/0",
            "/dev/sda1",
        ] {
            assert!(!is_device_node_path(Path::new(bad)), "{bad}");
        }
    }

    #[test]
    fn a_fifo_where_the_log_should_be_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("s1.log");
        make_fifo(&fifo);
        let mut h = header();
        h.externals = vec![External::Placed {
            key: "file[1b:11]".into(),
            file: Placed::Log,
            size: 0,
            digest: None,
        }];
        let sources = PlacedSources {
            agents: dir.path(),
            log: Some(&fifo),
            layers: None,
            libraries: &[],
        };
        // No reader: a blocking open for writing would wait for ever; this one fails.
        assert!(matches!(
            open_externals(&h, sources),
            Err(ExternalsError::Log { .. })
        ));
    }

    #[test]
    fn a_header_round_trips_and_any_damage_is_caught() {
        let bytes = encode(&header()).unwrap();
        assert_eq!(decode(&bytes).unwrap(), header());
        for at in [0, 9, 14, 20, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 1;
            let expected = if at == 0 {
                "not a checkpoint header"
            } else {
                "header checksum mismatch"
            };
            assert_eq!(
                decode(&bad).map_err(|e| e.to_string()),
                Err(expected.to_owned()),
                "flipped byte {at}"
            );
        }
        assert_eq!(
            decode(&bytes[..bytes.len() - 1]).map_err(|e| e.to_string()),
            Err("header checksum mismatch".to_owned())
        );
    }

    #[test]
    fn a_checkpoint_is_complete_only_with_its_header_and_intact_images() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pages-1.img"), b"pages").unwrap();
        std::fs::write(dir.path().join(DUMP_LOG), b"log").unwrap();
        assert!(matches!(
            read_header(dir.path(), true),
            Err(HeaderError::Missing { .. })
        ));
        let (images, crc) = list_images(dir.path()).unwrap();
        assert_eq!(images.len(), 1);
        let mut h = header();
        h.images = images;
        h.images_crc32 = crc;
        write_header(dir.path(), &h).unwrap();
        assert_eq!(read_header(dir.path(), true).unwrap(), h);
        std::fs::write(dir.path().join("pages-1.img"), b"PAGES").unwrap();
        assert!(read_header(dir.path(), false).is_ok());
        assert_invalid(
            read_header(dir.path(), true),
            "the images do not match their checksum",
        );
        std::fs::write(dir.path().join("pages-1.img"), b"pages!").unwrap();
        assert_invalid(
            read_header(dir.path(), false),
            "image pages-1.img has 6 bytes, 5 recorded",
        );
    }

    /// `read` found the checkpoint invalid for `why`.
    fn assert_invalid(read: Result<Header, HeaderError>, why: &str) {
        assert!(
            matches!(&read, Err(HeaderError::Invalid { reason, .. }) if reason == why),
            "{read:?}"
        );
    }

    #[test]
    fn the_images_checksum_is_that_of_their_contents_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.img"), b"first").unwrap();
        std::fs::write(dir.path().join("b.img"), b"").unwrap();
        // Larger than two checksum pieces, so several threads share it.
        let big = std::fs::File::create(dir.path().join("pages-1.img")).unwrap();
        big.set_len(2 * CRC_PIECE + 12345).unwrap();
        std::os::unix::fs::FileExt::write_at(&big, b"middle", CRC_PIECE + 7).unwrap();
        std::fs::write(dir.path().join(RESTORE_STATS), b"not an image").unwrap();
        let (images, crc) = list_images(dir.path()).unwrap();
        let names: Vec<&str> = images.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["a.img", "b.img", "pages-1.img"]);
        let mut expected = crc32fast::Hasher::new();
        for name in names {
            expected.update(&std::fs::read(dir.path().join(name)).unwrap());
        }
        assert_eq!(crc, expected.finalize());
    }

    #[test]
    fn a_dump_that_outlived_its_server_is_sealed_only_if_it_finished() {
        let dir = tempfile::tempdir().unwrap();
        let plan = DumpPlan {
            args: vec!["--external=mnt[m_dev_null]:m_dev_null".into()],
            externals: header().externals,
            listener_inode: 42,
            agent_digest: None,
        };
        write_plan(dir.path(), &plan).unwrap();
        std::fs::write(dir.path().join("pages-1.img"), b"pages").unwrap();
        let seal_now = || seal_finished_dump(dir.path(), CRIU_VERSION.into(), "ab".repeat(32));
        // CRIU had not written its statistics: the dump did not finish.
        assert_eq!(
            seal_now().map_err(|e| e.to_string()),
            Err(format!(
                "the dump into {} did not finish",
                dir.path().display()
            ))
        );
        let unsealed = read_header(dir.path(), false);
        assert!(
            matches!(
                &unsealed,
                Err(HeaderError::Missing { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound
            ),
            "{unsealed:?}"
        );
        std::fs::write(dir.path().join(DUMP_STATS), b"stats").unwrap();
        let sealed = seal_now().unwrap();
        assert_eq!(sealed.listener_inode, 42);
        assert_eq!(sealed.externals, plan.externals);
        let names: Vec<&str> = sealed.images.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["pages-1.img", DUMP_STATS]);
        assert_eq!(read_header(dir.path(), true).unwrap(), sealed);
    }

    #[test]
    fn what_a_restore_leaves_is_not_part_of_the_images() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pages-1.img"), b"pages").unwrap();
        let (images, crc) = list_images(dir.path()).unwrap();
        let mut h = header();
        h.images = images;
        h.images_crc32 = crc;
        write_header(dir.path(), &h).unwrap();
        std::fs::write(dir.path().join(RESTORE_PIDFILE), b"4242\n").unwrap();
        // A PID without statistics: the restore did not finish.
        assert_eq!(finished_restore(dir.path()), None);
        std::fs::write(dir.path().join(RESTORE_STATS), b"stats").unwrap();
        std::fs::write(dir.path().join(RESTORE_LOG), b"log").unwrap();
        assert_eq!(finished_restore(dir.path()), Some(4242));
        assert_eq!(read_header(dir.path(), true).unwrap(), h);
        clear_restore(dir.path());
        assert_eq!(finished_restore(dir.path()), None);
        assert!(!dir.path().join(RESTORE_PIDFILE).exists());
    }

    fn userns_image(lower_first: u32) -> Vec<u8> {
        let mut body = Vec::new();
        for field in [1, 2] {
            encode_extent(
                &mut body,
                field,
                Extent {
                    first: 0,
                    lower_first,
                    count: 65536,
                },
            );
        }
        let mut out = Vec::new();
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        out.extend_from_slice(&USERNS_MAGIC.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// `userns-14.img` as CRIU 4.1.1 wrote it for a sandbox whose ids start at host id
    /// 1073938432.
    const REAL_USERNS_IMAGE: [u8; 40] = [
        0x19, 0x43, 0x56, 0x54, 0x06, 0x49, 0x47, 0x55, 0x1c, 0x00, 0x00, 0x00, 0x0a, 0x0c, 0x08,
        0x00, 0x10, 0x80, 0x80, 0x8c, 0x80, 0x04, 0x18, 0x80, 0x80, 0x04, 0x12, 0x0c, 0x08, 0x00,
        0x10, 0x80, 0x80, 0x8c, 0x80, 0x04, 0x18, 0x80, 0x80, 0x04,
    ];

    #[test]
    fn a_user_namespace_image_moves_to_another_range() {
        assert_eq!(userns_image(1_073_938_432), REAL_USERNS_IMAGE);
        let moved =
            remap_userns_image(&REAL_USERNS_IMAGE, 1_073_938_432, 2_000_000, 65536).unwrap();
        assert_eq!(moved, userns_image(2_000_000));
        assert_eq!(
            remap_userns_image(&moved, 2_000_000, 1_073_938_432, 65536).unwrap(),
            REAL_USERNS_IMAGE
        );
        assert!(is_userns_image("userns-14.img") && is_userns_image("userns-3.img"));
        assert!(!is_userns_image("utsns-12.img") && !is_userns_image("userns-.img"));
    }

    #[test]
    fn a_user_namespace_image_outside_the_range_or_damaged_is_refused() {
        let image = userns_image(200_000);
        assert!(remap_userns_image(&image, 300_000, 0, 65536).is_none());
        assert!(remap_userns_image(&image, 199_999, 0, 65536).is_none());
        assert!(remap_userns_image(&image[..image.len() - 1], 200_000, 0, 65536).is_none());
        let mut other = image.clone();
        other[4] ^= 1;
        assert!(remap_userns_image(&other, 200_000, 0, 65536).is_none());
    }

    #[test]
    fn unix_table_inodes_reads_the_inode_column() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
                     0000000000000000: 00000002 00000000 00010000 0001 01 3081131 /run/a.sock\n\
                     0000000000000000: 00000003 00000000 00000000 0001 03 42\n";
        assert_eq!(unix_table_inodes(table), BTreeSet::from([3081131, 42]));
    }

    #[test]
    fn socket_inode_reads_only_socket_links() {
        assert_eq!(socket_inode(OsStr::new("socket:[3081131]")), Some(3081131));
        assert_eq!(socket_inode(OsStr::new("pipe:[12]")), None);
        assert_eq!(socket_inode(OsStr::new("/tmp/socket:[1]")), None);
    }

    #[test]
    fn a_connection_made_here_is_a_host_socket_of_the_listener() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("l.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let _client = std::os::unix::net::UnixStream::connect(&path).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        let inode = std::fs::metadata(format!("/proc/self/fd/{}", accepted.as_raw_fd()))
            .expect("fd")
            .ino();
        let held = host_unix_sockets(&[std::process::id() as i32]);
        assert!(held.iter().any(|s| s.inode == inode), "{held:?}");
    }
}
