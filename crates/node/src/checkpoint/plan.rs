//! What a dump must be told about the objects a sandbox's processes hold, worked out without
//! opening any of them.
//!
//! Everything a sandbox holds is the tenant's to shape: a FIFO blocks whoever opens it, a
//! terminal opened by a session leader becomes its controlling terminal, and a descriptor
//! passed in from elsewhere names a path that means something else on the host. So the plan
//! only reads links (`readlink`), metadata through the kernel's magic links (`statx`, which
//! does not open), through [`ProcView`]. Each descriptor and mapped
//! file is then one of:
//! - on a mount of the sandbox's own (its root, `/proc`, its devpts, volumes): CRIU's to
//!   dump;
//! - a kernel object with no path (a pipe, a socket, an event or memory file): CRIU's too,
//!   recognised by the filesystem the kernel keeps such objects on, learned from objects the
//!   node makes itself ([`KernelFilesystems`]);
//! - a file the node placed in the sandbox (its agent binary, its log), recognised by device
//!   and inode against the node's own ([`PlacedFiles`]) and recorded by what it is, never by
//!   the path its link shows;
//! - anything else held open: the checkpoint is refused, naming the kind of object and no
//!   path. A mapped file is only ever looked at to recognise the node's own: a mapping of the
//!   sandbox's root resolves to the layer beneath its overlay, which its mount table does not
//!   show, and CRIU itself fails on a mapping it cannot find among the sandbox's mounts.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{External, Placed};

/// The two tables of `/proc/<pid>` that list what a process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// `fd/`: open descriptors.
    Fd,
    /// `map_files/`: file-backed memory mappings.
    MapFiles,
}

impl Table {
    fn dir(self) -> &'static str {
        match self {
            Table::Fd => "fd",
            Table::MapFiles => "map_files",
        }
    }
}

/// What kind of object a descriptor refers to, from its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    File,
    Directory,
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
    Symlink,
    Other,
}

impl ObjectKind {
    pub fn from_mode(mode: u32) -> Self {
        match mode & libc::S_IFMT {
            libc::S_IFREG => ObjectKind::File,
            libc::S_IFDIR => ObjectKind::Directory,
            libc::S_IFIFO => ObjectKind::Fifo,
            libc::S_IFCHR => ObjectKind::CharDevice,
            libc::S_IFBLK => ObjectKind::BlockDevice,
            libc::S_IFSOCK => ObjectKind::Socket,
            libc::S_IFLNK => ObjectKind::Symlink,
            _ => ObjectKind::Other,
        }
    }

    /// The object as a refusal names it: its kind, never where it lives.
    fn described(self) -> &'static str {
        match self {
            ObjectKind::File => "a file",
            ObjectKind::Directory => "a directory",
            ObjectKind::Fifo => "a FIFO",
            ObjectKind::CharDevice => "a character device (such as a terminal)",
            ObjectKind::BlockDevice => "a block device",
            ObjectKind::Socket => "a socket",
            ObjectKind::Symlink => "a symbolic link",
            ObjectKind::Other => "an object of an unknown kind",
        }
    }
}

/// A filesystem's device number as `statx` gives it.
pub type Dev = (u32, u32);

/// The metadata of what a descriptor or mapping refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectStat {
    pub kind: ObjectKind,
    pub dev: Dev,
    pub ino: u64,
    pub mnt_id: u64,
    pub size: u64,
    pub nlink: u32,
}

/// The host calls a plan is made from; none of them opens what a sandbox holds.
pub trait ProcView {
    /// The mount table of `pid`'s mount namespace.
    fn mountinfo(&self, pid: i32) -> std::io::Result<String>;
    /// The entry names of one table of `task`.
    fn entries(&self, task: i32, table: Table) -> std::io::Result<Vec<OsString>>;
    /// Where an entry's link points, as text: only ever looked at for a socket's inode.
    fn link(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<OsString>;
    /// The metadata of the object an entry refers to, through its magic link.
    fn stat(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<ObjectStat>;
}

/// [`ProcView`] on this host's `/proc`.
#[derive(Debug)]
pub struct HostProc;

impl HostProc {
    fn entry(task: i32, table: Table, name: &OsStr) -> PathBuf {
        let mut path = PathBuf::from(format!("/proc/{task}/{}", table.dir()));
        path.push(name);
        path
    }
}

impl ProcView for HostProc {
    fn mountinfo(&self, pid: i32) -> std::io::Result<String> {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
    }

    fn entries(&self, task: i32, table: Table) -> std::io::Result<Vec<OsString>> {
        std::fs::read_dir(format!("/proc/{task}/{}", table.dir()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }

    fn link(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<OsString> {
        std::fs::read_link(Self::entry(task, table, name)).map(PathBuf::into_os_string)
    }

    fn stat(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<ObjectStat> {
        use rustix::fs::{AtFlags, StatxFlags};
        // statx resolves the magic link to the object itself without opening it: no FIFO
        // blocks it and no terminal becomes anyone's. Sandboxes have no FUSE device, so no
        // filesystem they reach can stall a getattr.
        let stat = rustix::fs::statx(
            rustix::fs::CWD,
            Self::entry(task, table, name),
            AtFlags::STATX_DONT_SYNC,
            StatxFlags::TYPE
                | StatxFlags::INO
                | StatxFlags::SIZE
                | StatxFlags::NLINK
                | StatxFlags::MNT_ID,
        )?;
        Ok(ObjectStat {
            kind: ObjectKind::from_mode(u32::from(stat.stx_mode)),
            dev: (stat.stx_dev_major, stat.stx_dev_minor),
            ino: stat.stx_ino,
            mnt_id: stat.stx_mnt_id,
            size: stat.stx_size,
            nlink: stat.stx_nlink,
        })
    }
}

/// The filesystems the kernel keeps objects without a path on (pipes, sockets, event and
/// other anonymous descriptors, namespaces, memory files and shared anonymous memory,
/// pidfds): CRIU
/// dumps what lives there itself. Learned from objects made here, so nothing a sandbox
/// shows decides it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelFilesystems {
    devs: BTreeSet<Dev>,
    /// The one where memory files and shared anonymous memory live: only unlinked objects
    /// there are anonymous.
    memory: Option<Dev>,
}

impl KernelFilesystems {
    /// Learned by making one object of each kind and looking at it.
    pub fn probe() -> std::io::Result<Self> {
        let dev_of = |fd: std::os::fd::BorrowedFd<'_>| -> std::io::Result<Dev> {
            let stat = rustix::fs::statx(
                fd,
                "",
                rustix::fs::AtFlags::EMPTY_PATH,
                rustix::fs::StatxFlags::TYPE,
            )?;
            Ok((stat.stx_dev_major, stat.stx_dev_minor))
        };
        let mut devs = BTreeSet::new();
        let (read, _write) = rustix::pipe::pipe()?;
        devs.insert(dev_of(read.as_fd())?);
        let (socket, _peer) = std::os::unix::net::UnixStream::pair()?;
        devs.insert(dev_of(socket.as_fd())?);
        // SAFETY: eventfd(2) with valid flags; the descriptor is owned at once.
        let event = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if event < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `event` is a descriptor just returned to us and owned by nothing else.
        let event = unsafe { std::os::fd::OwnedFd::from_raw_fd(event) };
        devs.insert(dev_of(event.as_fd())?);
        // Namespaces: the agent holds its network namespace, which the dump names as
        // external; any other is CRIU's to carry or refuse.
        let namespace = std::fs::File::open("/proc/self/ns/net")?;
        devs.insert(dev_of(namespace.as_fd())?);
        if let Ok(pidfd) = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        ) {
            devs.insert(dev_of(pidfd.as_fd())?);
        }
        let memfd = rustix::fs::memfd_create("sandbar-probe", rustix::fs::MemfdFlags::CLOEXEC)?;
        let memory = dev_of(memfd.as_fd())?;
        Ok(Self {
            devs,
            memory: Some(memory),
        })
    }

    /// Made of known devices (for tests).
    pub fn of(devs: impl IntoIterator<Item = Dev>, memory: Dev) -> Self {
        Self {
            devs: devs.into_iter().collect(),
            memory: Some(memory),
        }
    }

    fn holds(&self, stat: &ObjectStat) -> bool {
        if self.memory == Some(stat.dev) {
            return stat.nlink == 0;
        }
        self.devs.contains(&stat.dev)
    }
}

/// A file recognised by its device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: Dev,
    pub ino: u64,
}

impl FileIdentity {
    /// The identity of the node's own file at `path` (not one a sandbox can reach).
    pub fn of_path(path: &Path) -> std::io::Result<Self> {
        let stat = rustix::fs::statx(
            rustix::fs::CWD,
            path,
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            rustix::fs::StatxFlags::INO,
        )?;
        Ok(Self {
            dev: (stat.stx_dev_major, stat.stx_dev_minor),
            ino: stat.stx_ino,
        })
    }
}

/// The files of the node's that a sandbox's processes hold from outside its mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedFiles {
    /// The node's agent copies, each with its content digest: a sandbox started by an
    /// earlier build runs an earlier copy.
    pub agents: Vec<(FileIdentity, String)>,
    /// This sandbox's agent log, which the agent writes to.
    pub log: FileIdentity,
    /// The shared libraries the agent binary is linked against, each with its content
    /// digest: the agent maps them from the host.
    pub libraries: Vec<(FileIdentity, String)>,
}

impl PlacedFiles {
    /// Which of the node's files `stat` is, with the agent's digest when it is an agent.
    fn recognise(&self, stat: &ObjectStat) -> Option<(Placed, Option<&str>)> {
        if stat.kind != ObjectKind::File {
            return None;
        }
        let identity = FileIdentity {
            dev: stat.dev,
            ino: stat.ino,
        };
        if identity == self.log {
            return Some((Placed::Log, None));
        }
        if let Some((_, digest)) = self.libraries.iter().find(|(lib, _)| *lib == identity) {
            return Some((Placed::Library, Some(digest.as_str())));
        }
        self.agents
            .iter()
            .find(|(agent, _)| *agent == identity)
            .map(|(_, digest)| (Placed::Agent, Some(digest.as_str())))
    }
}

/// The sandbox's own layers (its writable layer and its template's, as the node keeps them),
/// asked whether a file of theirs is the one a mapping shows.
pub trait LayerFiles: std::fmt::Debug {
    /// Whether `path` (relative, no `..`) names, in one of the layers and without following
    /// any link, the file `identity`.
    fn holds(&self, path: &str, identity: FileIdentity) -> bool;
}

/// [`LayerFiles`] over layer directories of the node's, topmost first.
#[derive(Debug)]
pub struct LayerDirs(pub Vec<PathBuf>);

impl LayerFiles for LayerDirs {
    fn holds(&self, path: &str, identity: FileIdentity) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.0.iter().any(|dir| {
            let Ok(tree) = sandbar_fs::Tree::open(dir, sandbar_fs::Links::Refused) else {
                return false;
            };
            matches!(
                tree.symlink_metadata(path),
                Ok(Some(meta)) if meta.is_file()
                    && meta.ino() == identity.ino
                    && rustix::fs::major(meta.dev()) == identity.dev.0
                    && rustix::fs::minor(meta.dev()) == identity.dev.1
            )
        })
    }
}

/// A mapping's link as a path within the sandbox's layers: relative, made of plain names.
fn layer_path(link: &OsStr) -> Option<String> {
    let text = std::str::from_utf8(link.as_bytes()).ok()?;
    let relative = text.strip_prefix('/')?;
    let plain = !relative.is_empty()
        && relative
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    plain.then(|| relative.to_owned())
}

/// Why a sandbox cannot be checkpointed, or why its plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read the mount table of pid {pid}: {source}")]
    MountTable { pid: i32, source: std::io::Error },
    /// The tenant's doing: something is held that the checkpoint cannot carry or that the
    /// node cannot account for. Names the kind of object only.
    #[error(
        "a process of the sandbox holds {what} from outside the sandbox, which a checkpoint cannot carry"
    )]
    Foreign {
        what: &'static str,
        /// Where it was found (`<task> fd <n>` or `<task> map_files <range>`), for the
        /// node's log; never shown to the tenant.
        found: String,
        dev: Dev,
    },
    #[error("descriptor {fd} of pid {pid} is not the agent's listening socket")]
    NoListener { pid: i32, fd: i32 },
    #[error("the sandbox's processes map two different agent binaries")]
    TwoAgents,
}

impl PlanError {
    /// Whether the refusal comes from what the sandbox holds (and so would come again),
    /// not from the host.
    pub fn is_refusal(&self) -> bool {
        matches!(self, PlanError::Foreign { .. })
    }
}

/// The arguments a dump of the sandbox whose PID 1 is `pid` needs beyond the usual ones, and
/// the externals they name.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DumpPlan {
    pub args: Vec<String>,
    pub externals: Vec<External>,
    pub listener_inode: u64,
    /// The digest of the agent copy the sandbox runs; `None` in plans written before it was
    /// recorded, which named the server's own.
    #[serde(default)]
    pub agent_digest: Option<String>,
}

/// Where CRIU looks for the directories inotify watches on the sandbox's root. An overlay
/// cannot open a file by its handle, which is how CRIU finds a watched directory's path, so
/// without these a desktop session (its fonts, menus, applications and home watched by its
/// programs) could not be dumped. The scan is only given to a sandbox without volumes: then
/// every directory it walks belongs to the sandbox alone, whose processes are frozen for the
/// dump, so nothing can swap a directory for a link while CRIU walks it. A tree made to be
/// slow to walk only runs the dump into its deadline.
const WATCHED_TREES: [&str; 5] = [
    "/home",
    "/root",
    "/usr/share",
    "/usr/local/share",
    "/etc/xdg",
];

/// What the node knows of one sandbox when it plans its dump.
#[derive(Debug)]
pub struct PlanInput<'a> {
    pub pid: i32,
    pub tasks: &'a [i32],
    pub netns_inode: u64,
    pub listener_fd: i32,
    /// Mount point in the sandbox and directory on the host of each of its volumes.
    pub volumes: &'a [(PathBuf, PathBuf)],
    pub kernel: &'a KernelFilesystems,
    pub placed: &'a PlacedFiles,
    pub layers: &'a dyn LayerFiles,
}

/// Plans the dump of a sandbox: its mounts of the host (device binds, sysfs, volumes, its
/// boot id) and the node's files its processes hold, or a refusal if they hold anything
/// else from outside.
pub fn plan_dump(proc: &dyn ProcView, input: &PlanInput<'_>) -> Result<DumpPlan, PlanError> {
    let mountinfo = proc
        .mountinfo(input.pid)
        .map_err(|source| PlanError::MountTable {
            pid: input.pid,
            source,
        })?;
    let (own_mounts, args, externals) = super::external_mounts(&mountinfo, input.volumes);
    let mut found = FoundExternals {
        args,
        externals,
        seen: BTreeSet::new(),
        agent_digest: None,
    };
    for &task in input.tasks {
        for table in [Table::MapFiles, Table::Fd] {
            // A task that ended meanwhile holds nothing.
            let Ok(names) = proc.entries(task, table) else {
                continue;
            };
            for name in names {
                let Ok(stat) = proc.stat(task, table, &name) else {
                    continue;
                };
                if own_mounts.contains(&stat.mnt_id) || input.kernel.holds(&stat) {
                    continue;
                }
                found.add_held(proc, input, HeldObject(task, table, &name), &stat)?;
            }
        }
    }
    let mut args = found.args;
    args.push(format!("--external=net[{}]:extnet", input.netns_inode));
    if input.volumes.is_empty() {
        for path in WATCHED_TREES {
            args.push(format!("--irmap-scan-path={path}"));
        }
    }
    Ok(DumpPlan {
        args,
        externals: found.externals,
        listener_inode: listener_inode(proc, input)?,
        agent_digest: found.agent_digest,
    })
}

/// One object a task holds: the task, its table and the entry's name there.
#[derive(Clone, Copy)]
struct HeldObject<'a>(i32, Table, &'a OsStr);

impl HeldObject<'_> {
    /// How a refusal names the object.
    fn described(&self) -> String {
        let HeldObject(task, table, name) = *self;
        format!("{task} {} {}", table.dir(), name.to_string_lossy())
    }
}

/// The external objects and CRIU arguments a dump plan gathers as it walks the sandbox's
/// tasks, each file once.
struct FoundExternals {
    args: Vec<String>,
    externals: Vec<External>,
    /// CRIU keys already recorded: many tasks hold the same file.
    seen: BTreeSet<String>,
    /// The agent's digest, once a task is found holding it.
    agent_digest: Option<String>,
}

/// CRIU's name for a file it is told is external: mount id and inode, in hex.
fn criu_file_key(stat: &ObjectStat) -> String {
    format!("file[{:x}:{:x}]", stat.mnt_id, stat.ino)
}

impl FoundExternals {
    /// Records one object a task holds from outside the sandbox's own mounts, or refuses it.
    fn add_held(
        &mut self,
        proc: &dyn ProcView,
        input: &PlanInput<'_>,
        held: HeldObject<'_>,
        stat: &ObjectStat,
    ) -> Result<(), PlanError> {
        let recognised = input.placed.recognise(stat);
        if held.1 == Table::MapFiles && recognised.is_none() {
            return self.add_layer_file(proc, input, held, stat);
        }
        let Some((placed, digest)) = recognised else {
            return Err(PlanError::Foreign {
                what: stat.kind.described(),
                found: held.described(),
                dev: stat.dev,
            });
        };
        let library_digest = match (placed, digest) {
            (Placed::Agent, Some(digest)) => {
                match &self.agent_digest {
                    None => self.agent_digest = Some(digest.to_owned()),
                    Some(known) if known != digest => return Err(PlanError::TwoAgents),
                    Some(_) => {}
                }
                None
            }
            (Placed::Library, digest) => digest.map(str::to_owned),
            _ => None,
        };
        let key = criu_file_key(stat);
        if !self.seen.insert(key.clone()) {
            return Ok(());
        }
        self.args.push(format!("--external={key}"));
        self.externals.push(External::Placed {
            key,
            file: placed,
            size: stat.size,
            digest: library_digest,
        });
        Ok(())
    }

    /// A mapping of a file of the sandbox's own root resolves to the layer beneath its
    /// overlay, a mount its table does not show and CRIU cannot find: it is recorded as that
    /// layer's file, by its path within the sandbox's layers, once the node has found the
    /// very same file there through its own handles.
    fn add_layer_file(
        &mut self,
        proc: &dyn ProcView,
        input: &PlanInput<'_>,
        held: HeldObject<'_>,
        stat: &ObjectStat,
    ) -> Result<(), PlanError> {
        let HeldObject(task, table, name) = held;
        let key = criu_file_key(stat);
        if self.seen.contains(&key) {
            return Ok(());
        }
        let identity = FileIdentity {
            dev: stat.dev,
            ino: stat.ino,
        };
        let path = proc
            .link(task, table, name)
            .ok()
            .and_then(|link| layer_path(&link))
            .filter(|path| stat.kind == ObjectKind::File && input.layers.holds(path, identity));
        let Some(path) = path else {
            let link = proc.link(task, table, name).unwrap_or_default();
            return Err(PlanError::Foreign {
                what: "a mapped file",
                // The link is the tenant's text: quoted, so that it cannot forge lines of the
                // node's log.
                found: format!("{} ({:?}, inode {})", held.described(), link, stat.ino),
                dev: stat.dev,
            });
        };
        self.seen.insert(key.clone());
        self.args.push(format!("--external={key}"));
        self.externals.push(External::LayerFile {
            key,
            path,
            size: stat.size,
        });
        Ok(())
    }
}

/// The inode of the socket the sandbox's agent listens on, which the restore hands back.
fn listener_inode(proc: &dyn ProcView, input: &PlanInput<'_>) -> Result<u64, PlanError> {
    proc.link(
        input.pid,
        Table::Fd,
        OsStr::new(&input.listener_fd.to_string()),
    )
    .ok()
    .and_then(|link| socket_inode(&link))
    .ok_or(PlanError::NoListener {
        pid: input.pid,
        fd: input.listener_fd,
    })
}

/// The inode of a `socket:[N]` descriptor link.
pub fn socket_inode(link: &OsStr) -> Option<u64> {
    std::str::from_utf8(link.as_bytes())
        .ok()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use proptest::prelude::*;

    use super::*;

    const MOUNTINFO: &str = "\
300 250 0:60 / / rw,relatime - overlay overlay rw,lowerdir=l,upperdir=u,workdir=w
301 300 0:61 / /proc rw,nosuid,nodev,noexec - proc proc rw
303 300 0:63 / /dev rw,nosuid,noexec - tmpfs tmpfs rw,size=64k
304 303 0:5 /null /dev/null rw,nosuid,noexec - devtmpfs udev rw
309 303 0:66 / /dev/pts rw,nosuid,noexec - devpts devpts rw
308 300 0:40 /.volumes/t/v /data rw,nosuid,nodev - btrfs /dev/loop0 rw
";
    const PIPES: Dev = (0, 14);
    const MEMORY: Dev = (0, 1);
    const HOST_DISK: Dev = (254, 0);
    const AGENT: FileIdentity = FileIdentity {
        dev: HOST_DISK,
        ino: 77,
    };
    const LOG: FileIdentity = FileIdentity {
        dev: HOST_DISK,
        ino: 78,
    };
    const LISTENER_FD: i32 = 3;

    /// One object a fake process holds.
    #[derive(Debug, Clone)]
    struct Held {
        link: String,
        stat: ObjectStat,
    }

    /// A recording fake of `/proc`: the sandbox's processes and what they hold; every call
    /// is recorded, so a test can see that nothing was opened and what was looked at.
    #[derive(Default)]
    struct FakeProc {
        tables: BTreeMap<(i32, &'static str), Vec<(OsString, Held)>>,
        calls: Mutex<Vec<String>>,
    }

    impl FakeProc {
        fn hold(&mut self, task: i32, table: Table, name: &str, held: Held) {
            self.tables
                .entry((task, table.dir()))
                .or_default()
                .push((name.into(), held));
        }

        fn find(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<&Held> {
            self.tables
                .get(&(task, table.dir()))
                .and_then(|t| t.iter().find(|(n, _)| n == name))
                .map(|(_, h)| h)
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }

    impl ProcView for FakeProc {
        fn mountinfo(&self, pid: i32) -> std::io::Result<String> {
            self.calls.lock().unwrap().push(format!("mountinfo {pid}"));
            Ok(MOUNTINFO.into())
        }
        fn entries(&self, task: i32, table: Table) -> std::io::Result<Vec<OsString>> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("entries {task} {}", table.dir()));
            Ok(self
                .tables
                .get(&(task, table.dir()))
                .map(|t| t.iter().map(|(n, _)| n.clone()).collect())
                .unwrap_or_default())
        }
        fn link(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<OsString> {
            self.calls.lock().unwrap().push(format!(
                "link {task} {} {}",
                table.dir(),
                name.to_string_lossy()
            ));
            Ok(self.find(task, table, name)?.link.clone().into())
        }
        fn stat(&self, task: i32, table: Table, name: &OsStr) -> std::io::Result<ObjectStat> {
            self.calls.lock().unwrap().push(format!(
                "stat {task} {} {}",
                table.dir(),
                name.to_string_lossy()
            ));
            Ok(self.find(task, table, name)?.stat)
        }
    }

    fn stat(kind: ObjectKind, dev: Dev, ino: u64, mnt_id: u64) -> ObjectStat {
        ObjectStat {
            kind,
            dev,
            ino,
            mnt_id,
            size: 10,
            nlink: 1,
        }
    }

    fn held(link: &str, stat: ObjectStat) -> Held {
        Held {
            link: link.into(),
            stat,
        }
    }

    /// A booted sandbox: the agent (PID 1) maps its binary, writes its log and listens.
    /// The sandbox with its task 7 holding `object` more, as entry `name` of `table`.
    fn sandbox_holding(table: Table, name: &str, link: &str, object: ObjectStat) -> FakeProc {
        let mut proc = sandbox();
        proc.hold(7, table, name, held(link, object));
        proc
    }

    /// The refusal of a plan of the sandbox holding `object` more, as entry `name` of `table`.
    fn refusal_of(table: Table, name: &str, link: &str, object: ObjectStat) -> PlanError {
        let err = plan(&sandbox_holding(table, name, link, object), &[1, 7]).unwrap_err();
        assert!(err.is_refusal(), "{link}: {err}");
        err
    }

    fn sandbox() -> FakeProc {
        let mut proc = FakeProc::default();
        proc.hold(
            1,
            Table::MapFiles,
            "400000-401000",
            held(
                "/var/lib/sandbar/agents/abc",
                stat(ObjectKind::File, AGENT.dev, AGENT.ino, 25),
            ),
        );
        proc.hold(
            1,
            Table::Fd,
            "2",
            held(
                "/var/lib/sandbar/logs/s1.log",
                stat(ObjectKind::File, LOG.dev, LOG.ino, 25),
            ),
        );
        proc.hold(
            1,
            Table::Fd,
            "3",
            held("socket:[4242]", stat(ObjectKind::Socket, (0, 8), 4242, 15)),
        );
        proc
    }

    /// The sandbox's layers hold `/usr/lib/libc.so.6` as inode 2196868 of device 0:49.
    #[derive(Debug)]
    struct FakeLayers;

    impl LayerFiles for FakeLayers {
        fn holds(&self, path: &str, identity: FileIdentity) -> bool {
            path == "usr/lib/libc.so.6"
                && identity
                    == FileIdentity {
                        dev: (0, 49),
                        ino: 2196868,
                    }
        }
    }

    fn plan(proc: &FakeProc, tasks: &[i32]) -> Result<DumpPlan, PlanError> {
        let volumes = vec![(PathBuf::from("/data"), PathBuf::from("/pool/.volumes/t/v"))];
        plan_with_volumes(proc, tasks, &volumes)
    }

    fn plan_with_volumes(
        proc: &FakeProc,
        tasks: &[i32],
        volumes: &[(PathBuf, PathBuf)],
    ) -> Result<DumpPlan, PlanError> {
        let kernel = KernelFilesystems::of([PIPES, (0, 8)], MEMORY);
        let placed = PlacedFiles {
            agents: vec![
                (AGENT, "ab".repeat(32)),
                (
                    FileIdentity {
                        dev: HOST_DISK,
                        ino: 76,
                    },
                    "cd".repeat(32),
                ),
            ],
            log: LOG,
            libraries: Vec::new(),
        };
        plan_dump(
            proc,
            &PlanInput {
                pid: 1,
                tasks,
                netns_inode: 99,
                listener_fd: LISTENER_FD,
                volumes,
                kernel: &kernel,
                placed: &placed,
                layers: &FakeLayers,
            },
        )
    }

    #[test]
    fn watched_directories_are_looked_for_only_where_the_sandbox_alone_writes() {
        let scans = |plan: &DumpPlan| {
            plan.args
                .iter()
                .filter(|a| a.starts_with("--irmap-scan-path="))
                .count()
        };
        // A volume is shared with sandboxes the dump does not freeze.
        assert_eq!(scans(&plan(&sandbox(), &[1]).unwrap()), 0);
        let alone = plan_with_volumes(&sandbox(), &[1], &[]).unwrap();
        assert_eq!(scans(&alone), WATCHED_TREES.len());
        assert!(
            alone
                .args
                .contains(&"--irmap-scan-path=/usr/share".to_owned())
        );
    }

    #[test]
    fn the_agent_and_its_log_are_recorded_by_what_they_are() {
        let plan = plan(&sandbox(), &[1]).unwrap();
        assert_eq!(plan.listener_inode, 4242);
        assert_eq!(plan.agent_digest, Some("ab".repeat(32)));
        let placed: Vec<_> = plan
            .externals
            .iter()
            .filter_map(|e| match e {
                External::Placed { key, file, .. } => Some((key.as_str(), *file)),
                _ => None,
            })
            .collect();
        assert_eq!(
            placed,
            [("file[19:4d]", Placed::Agent), ("file[19:4e]", Placed::Log)]
        );
        assert!(plan.args.contains(&"--external=file[19:4d]".to_owned()));
        assert!(plan.args.contains(&"--external=net[99]:extnet".to_owned()));
        // A path a link showed is never part of the plan.
        let text = serde_json::to_string(&plan).unwrap();
        assert!(!text.contains("/var/lib/sandbar"), "{text}");
    }

    #[test]
    fn own_mounts_and_kernel_objects_are_left_to_criu() {
        let mut proc = sandbox();
        for (fd, link, stat) in [
            ("4", "/tmp/fifo", stat(ObjectKind::Fifo, (0, 60), 5, 300)),
            (
                "5",
                "/dev/pts/0",
                stat(ObjectKind::CharDevice, (0, 66), 3, 309),
            ),
            (
                "6",
                "/dev/null",
                stat(ObjectKind::CharDevice, (0, 5), 4, 304),
            ),
            ("7", "pipe:[12]", stat(ObjectKind::Fifo, PIPES, 12, 14)),
            (
                "8",
                "/memfd:x (deleted)",
                ObjectStat {
                    nlink: 0,
                    ..stat(ObjectKind::File, MEMORY, 1, 2)
                },
            ),
            ("9", "/data/file", stat(ObjectKind::File, (0, 40), 9, 308)),
        ] {
            proc.hold(7, Table::Fd, fd, held(link, stat));
        }
        let plan = plan(&proc, &[1, 7]).unwrap();
        assert_eq!(
            plan.externals
                .iter()
                .filter(|e| matches!(e, External::Placed { .. }))
                .count(),
            2
        );
    }

    #[test]
    fn a_file_of_another_sandbox_or_the_host_is_refused_without_naming_it() {
        for (kind, what) in [
            (ObjectKind::File, "a file"),
            (ObjectKind::Fifo, "a FIFO"),
            (
                ObjectKind::CharDevice,
                "a character device (such as a terminal)",
            ),
        ] {
            let err = refusal_of(
                Table::Fd,
                "4",
                "/etc/shadow",
                stat(kind, (0, 70), 1234, 555),
            );
            assert!(matches!(&err, PlanError::Foreign { what: w, .. } if *w == what));
            assert!(!err.to_string().contains("shadow"), "{err}");
        }
    }

    #[test]
    fn a_linked_file_on_the_memory_filesystem_is_not_anonymous() {
        refusal_of(
            Table::Fd,
            "7f00-7f01",
            "/dev/shm/x",
            stat(ObjectKind::File, MEMORY, 5, 777),
        );
    }

    #[test]
    fn a_mapping_of_the_sandboxs_layers_is_recorded_by_its_path_within_them() {
        let libc = stat(ObjectKind::File, (0, 49), 2196868, 640);
        let mut proc = sandbox();
        proc.hold(
            7,
            Table::MapFiles,
            "7f00-7f01",
            held("/usr/lib/libc.so.6", libc),
        );
        proc.hold(
            7,
            Table::MapFiles,
            "7f01-7f02",
            held("/usr/lib/libc.so.6", libc),
        );
        let planned = plan(&proc, &[1, 7]).unwrap();
        let layer_files: Vec<_> = planned
            .externals
            .iter()
            .filter_map(|e| match e {
                External::LayerFile { key, path, .. } => Some((key.as_str(), path.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(layer_files, [("file[280:218584]", "usr/lib/libc.so.6")]);

        // The same path, another file (a host's, another sandbox's): refused.
        for (link, object) in [
            (
                "/usr/lib/libc.so.6",
                stat(ObjectKind::File, (254, 0), 2196868, 27),
            ),
            ("/usr/lib/../lib/libc.so.6", libc),
            ("usr/lib/libc.so.6", libc),
        ] {
            let err = refusal_of(Table::MapFiles, "7f00-7f01", link, object);
            assert!(!err.to_string().contains("libc"), "{err}");
        }
    }

    #[test]
    fn a_file_that_looks_like_the_agent_by_name_is_still_refused() {
        refusal_of(
            Table::Fd,
            "4",
            "/var/lib/sandbar/agents/abc",
            stat(ObjectKind::File, (0, 70), AGENT.ino, 556),
        );
    }

    #[test]
    fn the_plan_looks_and_never_opens() {
        let proc = sandbox_holding(
            Table::Fd,
            "4",
            "/tmp/fifo",
            stat(ObjectKind::Fifo, (0, 60), 5, 300),
        );
        plan(&proc, &[1, 7]).unwrap();
        let calls = proc.calls.lock().unwrap();
        assert!(calls.iter().all(|c| c.starts_with("mountinfo")
            || c.starts_with("entries")
            || c.starts_with("stat")
            || c.starts_with("link 1 fd 3")));
        assert!(calls.contains(&"stat 7 fd 4".to_owned()));
    }

    #[test]
    fn the_agent_copy_a_sandbox_runs_is_the_one_recorded() {
        let mut proc = sandbox();
        proc.tables.get_mut(&(1, "map_files")).unwrap()[0]
            .1
            .stat
            .ino = 76;
        assert_eq!(
            plan(&proc, &[1]).unwrap().agent_digest,
            Some("cd".repeat(32))
        );
        proc.hold(
            7,
            Table::MapFiles,
            "400000-401000",
            held("x", stat(ObjectKind::File, AGENT.dev, AGENT.ino, 25)),
        );
        assert!(matches!(plan(&proc, &[1, 7]), Err(PlanError::TwoAgents)));
    }

    #[test]
    fn without_the_agent_socket_there_is_no_plan() {
        let mut proc = sandbox();
        proc.tables
            .get_mut(&(1, "fd"))
            .unwrap()
            .retain(|(n, _)| n != "3");
        assert!(matches!(
            plan(&proc, &[1]),
            Err(PlanError::NoListener { pid: 1, fd: 3 })
        ));
    }

    #[test]
    fn on_this_host_a_held_fifo_and_kernel_objects_are_looked_at_without_waiting() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        crate::checkpoint::tests::make_fifo(&fifo);
        // Read and write, so that this open does not wait for a writer.
        let held = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        let (pipe, _write) = rustix::pipe::pipe().unwrap();
        let kernel = KernelFilesystems::probe().unwrap();
        let me = std::process::id() as i32;
        let name = |fd: i32| OsString::from(fd.to_string());
        let fifo_stat = HostProc
            .stat(me, Table::Fd, &name(held.as_raw_fd()))
            .unwrap();
        assert_eq!(fifo_stat.kind, ObjectKind::Fifo);
        assert!(!kernel.holds(&fifo_stat));
        let pipe_stat = HostProc
            .stat(me, Table::Fd, &name(pipe.as_raw_fd()))
            .unwrap();
        assert_eq!(pipe_stat.kind, ObjectKind::Fifo);
        assert!(kernel.holds(&pipe_stat));
        assert!(HostProc.entries(me, Table::MapFiles).unwrap().len() > 1);
    }

    #[derive(Debug, Clone, Copy)]
    enum Origin {
        OwnMount,
        Pipe,
        AnonymousMemory,
        Agent,
        Log,
        Foreign,
    }

    fn origin() -> impl Strategy<Value = Origin> {
        prop_oneof![
            Just(Origin::OwnMount),
            Just(Origin::Pipe),
            Just(Origin::AnonymousMemory),
            Just(Origin::Agent),
            Just(Origin::Log),
            Just(Origin::Foreign),
        ]
    }

    fn kind() -> impl Strategy<Value = ObjectKind> {
        prop_oneof![
            Just(ObjectKind::File),
            Just(ObjectKind::Fifo),
            Just(ObjectKind::CharDevice),
            Just(ObjectKind::Socket),
            Just(ObjectKind::Directory),
        ]
    }

    proptest! {
        /// Random process trees holding random objects: the plan accounts for every one or
        /// refuses, and it never names anything from outside the sandbox but the node's own
        /// files, by what they are.
        #[test]
        fn every_object_is_accounted_for_or_the_plan_refuses(
            tree in proptest::collection::vec(
                proptest::collection::vec((origin(), kind(), any::<bool>()), 0..6),
                1..5,
            )
        ) {
            let mut proc = sandbox();
            let mut tasks = vec![1];
            let mut foreign = false;
            for (t, objects) in tree.iter().enumerate() {
                let task = 10 + t as i32;
                tasks.push(task);
                for (n, (origin, kind, mapped)) in objects.iter().enumerate() {
                    let object = match origin {
                        Origin::OwnMount => stat(*kind, (0, 60), 100 + n as u64, 300),
                        Origin::Pipe => stat(ObjectKind::Fifo, PIPES, 200 + n as u64, 14),
                        Origin::AnonymousMemory => ObjectStat {
                            nlink: 0,
                            ..stat(ObjectKind::File, MEMORY, 300 + n as u64, 2)
                        },
                        Origin::Agent => stat(ObjectKind::File, AGENT.dev, AGENT.ino, 25),
                        Origin::Log => stat(ObjectKind::File, LOG.dev, LOG.ino, 25),
                        Origin::Foreign => {
                            foreign = true;
                            stat(*kind, (0, 70 + n as u32), 400 + n as u64, 600 + n as u64)
                        }
                    };
                    let table = if *mapped { Table::MapFiles } else { Table::Fd };
                    proc.hold(task, table, &format!("{}", 10 + n), held("/host/secret", object));
                }
            }
            match plan(&proc, &tasks) {
                Ok(plan) => {
                    prop_assert!(!foreign);
                    for external in &plan.externals {
                        let named_host = matches!(
                            external,
                            External::Device { .. } | External::Sysfs { .. }
                                | External::Volume { .. } | External::BootId { .. }
                                | External::Placed { .. }
                        );
                        prop_assert!(named_host);
                    }
                    let text = serde_json::to_string(&plan).unwrap();
                    prop_assert!(!text.contains("secret"));
                }
                Err(err) => {
                    prop_assert!(foreign);
                    prop_assert!(err.is_refusal());
                    prop_assert!(!err.to_string().contains("secret"));
                }
            }
        }
    }
}
