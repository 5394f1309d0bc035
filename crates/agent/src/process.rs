//! Starting, tracking and talking to user processes.
//!
//! Output is fanned out to the streams attached to a process through bounded channels, so a
//! slow attached client slows the process's output down instead of losing it. A process keeps
//! running when every stream detaches; its output is then dropped until someone reattaches.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use crate::exec::{ChildSetup, ExecPlan, Identity};
use crate::reaper::{ExitStatus, Reaper};
use crate::users::User;

/// How long after the process exited its output is still followed, for a descendant that holds
/// the pipes open (e.g. a backgrounded `sleep &`) and writes late. What the process itself wrote
/// does not depend on it: that is read out of the pipes in full whenever this ends.
const LATE_WRITERS_GRACE: Duration = Duration::from_millis(100);
/// How long the output read after the exit may take to reach the attached streams; only a
/// stream that stopped reading altogether reaches it.
const DELIVERY_AFTER_EXIT: Duration = Duration::from_secs(30);
/// The most read out of one pipe once its process has exited: far above a pipe's capacity, so
/// it bounds only a descendant that keeps writing.
const FINAL_READ_LIMIT: usize = 8 << 20;
/// Messages buffered per attached stream before output applies back-pressure.
const SUBSCRIBER_BUFFER: usize = 64;
/// PATH for processes whose environment does not set one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `oom_score_adj` of every process the agent starts: far above the agent's and the host's
/// own (0) and the server's (negative).
const SANDBOX_PROCESS_OOM_SCORE_ADJ: &str = "800";

/// One thing that happened to a process, in the order attached streams see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessOutput {
    /// Bytes written to stdout.
    Stdout(Vec<u8>),
    /// Bytes written to stderr.
    Stderr(Vec<u8>),
    /// Bytes written to the terminal.
    Pty(Vec<u8>),
    /// The process ended; always the last message.
    End(EndInfo),
}

/// The `end` event of a process, shaped like Go's `os.ProcessState` as envd reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndInfo {
    /// Exit code, or -1 when a signal ended the process.
    pub exit_code: i32,
    /// True only for a normal exit.
    pub exited: bool,
    /// `exit status N` or `signal: killed`.
    pub status: String,
    /// Set when the process did not exit with code 0.
    pub error: Option<String>,
}

impl From<Option<ExitStatus>> for EndInfo {
    fn from(status: Option<ExitStatus>) -> Self {
        match status {
            Some(ExitStatus::Exited(code)) => {
                let status = format!("exit status {code}");
                EndInfo {
                    exit_code: code,
                    exited: true,
                    error: (code != 0).then(|| status.clone()),
                    status,
                }
            }
            Some(ExitStatus::Signaled(sig)) => {
                let status = format!("signal: {}", signal_name(sig));
                EndInfo {
                    exit_code: -1,
                    exited: false,
                    error: Some(status.clone()),
                    status,
                }
            }
            None => EndInfo {
                exit_code: -1,
                exited: false,
                status: "unknown".into(),
                error: Some("exit status of the process was lost".into()),
            },
        }
    }
}

/// Signal descriptions as Go prints them, since SDK users see envd's wording.
fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "hangup",
        libc::SIGINT => "interrupt",
        libc::SIGQUIT => "quit",
        libc::SIGILL => "illegal instruction",
        libc::SIGTRAP => "trace/breakpoint trap",
        libc::SIGABRT => "aborted",
        libc::SIGBUS => "bus error",
        libc::SIGFPE => "floating point exception",
        libc::SIGKILL => "killed",
        libc::SIGUSR1 => "user defined signal 1",
        libc::SIGSEGV => "segmentation fault",
        libc::SIGUSR2 => "user defined signal 2",
        libc::SIGPIPE => "broken pipe",
        libc::SIGALRM => "alarm clock",
        libc::SIGTERM => "terminated",
        _ => return format!("signal {sig}"),
    };
    name.to_owned()
}

/// Errors from process operations; each names the process involved.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// No running process matches the selector.
    #[error("process {0} not found")]
    NotFound(String),
    /// The command could not be started.
    #[error("cannot start '{cmd}': {source}")]
    Spawn {
        /// The command.
        cmd: String,
        /// The cause.
        source: io::Error,
    },
    /// Setting up pipes or the terminal failed.
    #[error("cannot set up io for '{cmd}': {source}")]
    Io {
        /// The command.
        cmd: String,
        /// The cause.
        source: io::Error,
    },
    /// The process has no open stdin.
    #[error("stdin of process {0} is not open")]
    StdinClosed(u32),
    /// The process was not started with a terminal.
    #[error("process {0} has no terminal")]
    NoPty(u32),
    /// The process has a terminal, where the operation needs pipes.
    #[error("process {0} uses a terminal; send end-of-transmission (0x04) instead")]
    IsPty(u32),
    /// Writing input failed.
    #[error("cannot write to process {pid}: {source}")]
    Write {
        /// The process.
        pid: u32,
        /// The cause.
        source: io::Error,
    },
    /// Sending a signal failed.
    #[error("cannot signal process {pid}: {source}")]
    Signal {
        /// The process.
        pid: u32,
        /// The cause.
        source: io::Error,
    },
    /// The tag is already used by a running process.
    #[error("a process with tag '{0}' is already running")]
    TagInUse(String),
}

/// Terminal size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtySize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// Everything needed to start one process.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    /// Program to run (looked up in the child's PATH when not a path).
    pub cmd: String,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Full environment of the child.
    pub env: Vec<(String, String)>,
    /// Working directory.
    pub cwd: PathBuf,
    /// Account to run as.
    pub user: User,
    /// Primary and supplementary group ids.
    pub groups: Vec<u32>,
    /// Allocate a terminal of this size.
    pub pty: Option<PtySize>,
    /// Keep a stdin pipe open (otherwise stdin is `/dev/null`).
    pub stdin: bool,
    /// Optional name to select the process by.
    pub tag: Option<String>,
    /// The request's process configuration, echoed by `List`.
    pub config: crate::proto::process::ProcessConfig,
}

#[derive(Debug, Default)]
struct Fanout {
    subscribers: Vec<mpsc::Sender<ProcessOutput>>,
    end: Option<EndInfo>,
}

/// A process started by the agent and still tracked by it.
#[derive(Debug)]
pub struct ManagedProcess {
    /// Process id (in the sandbox's PID namespace).
    pub pid: u32,
    /// Optional tag.
    pub tag: Option<String>,
    /// Configuration it was started with.
    pub config: crate::proto::process::ProcessConfig,
    stdin: tokio::sync::Mutex<Option<Arc<AsyncFd<OwnedFd>>>>,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
    fanout: Mutex<Fanout>,
    done: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the data consistent, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ManagedProcess {
    /// Attaches a new stream. When the process already ended, the stream gets just the end.
    pub fn subscribe(&self) -> mpsc::Receiver<ProcessOutput> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        let mut fanout = lock(&self.fanout);
        match &fanout.end {
            Some(end) => {
                let _ = tx.try_send(ProcessOutput::End(end.clone()));
            }
            None => fanout.subscribers.push(tx),
        }
        rx
    }

    /// True once the process has been reaped.
    pub fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// Resolves once the process has been reaped.
    pub async fn wait_done(&self) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    async fn publish(&self, output: ProcessOutput) {
        let subscribers = lock(&self.fanout).subscribers.clone();
        let mut lost = false;
        for sub in &subscribers {
            lost |= sub.send(output.clone()).await.is_err();
        }
        if lost {
            lock(&self.fanout).subscribers.retain(|s| !s.is_closed());
        }
    }

    async fn finish(&self, end: EndInfo) {
        let subscribers = {
            let mut fanout = lock(&self.fanout);
            fanout.end = Some(end.clone());
            std::mem::take(&mut fanout.subscribers)
        };
        for sub in subscribers {
            let _ = sub.send(ProcessOutput::End(end.clone())).await;
        }
    }

    /// Writes to the stdin pipe, or to the terminal for a terminal process.
    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), ProcessError> {
        let pipe = self.stdin.lock().await.clone();
        let target = match (pipe, &self.pty) {
            (Some(pipe), _) => pipe,
            (None, Some(pty)) => pty.clone(),
            (None, None) => return Err(ProcessError::StdinClosed(self.pid)),
        };
        write_all(&target, data)
            .await
            .map_err(|source| ProcessError::Write {
                pid: self.pid,
                source,
            })
    }

    /// Writes to the terminal.
    pub async fn write_pty(&self, data: &[u8]) -> Result<(), ProcessError> {
        let pty = self.pty.as_ref().ok_or(ProcessError::NoPty(self.pid))?;
        write_all(pty, data)
            .await
            .map_err(|source| ProcessError::Write {
                pid: self.pid,
                source,
            })
    }

    /// Closes stdin so the process reads end-of-file.
    pub async fn close_stdin(&self) -> Result<(), ProcessError> {
        if self.pty.is_some() {
            return Err(ProcessError::IsPty(self.pid));
        }
        self.stdin.lock().await.take();
        Ok(())
    }

    /// Changes the terminal size.
    pub fn resize(&self, size: PtySize) -> Result<(), ProcessError> {
        let pty = self.pty.as_ref().ok_or(ProcessError::NoPty(self.pid))?;
        set_winsize(pty.get_ref(), size).map_err(|source| ProcessError::Write {
            pid: self.pid,
            source,
        })
    }

    /// Sends a signal to the process (not its group, as envd does).
    pub fn signal(&self, signal: i32) -> Result<(), ProcessError> {
        if self.is_done() {
            return Err(ProcessError::NotFound(self.pid.to_string()));
        }
        let pid = libc::pid_t::try_from(self.pid)
            .map_err(|_| ProcessError::NotFound(self.pid.to_string()))?;
        // SAFETY: kill has no memory-safety preconditions; the pid is still ours because it
        // is only reaped (and so reusable) after `done` is set.
        let rc = unsafe { libc::kill(pid, signal) };
        if rc != 0 {
            return Err(ProcessError::Signal {
                pid: self.pid,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

async fn write_all(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        let mut guard = fd.writable().await?;
        match guard
            .try_io(|inner| rustix::io::write(inner.get_ref(), data).map_err(io::Error::from))
        {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

fn set_winsize(fd: impl AsFd, size: PtySize) -> io::Result<()> {
    let winsize = rustix::termios::Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(fd, winsize).map_err(io::Error::from)
}

fn nonblocking(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    rustix::io::ioctl_fionbio(&fd, true)?;
    // SAFETY: the `OwnedFd` moves into the `AsyncFd`, so the descriptor stays open and refers
    // to the same file description until the `AsyncFd` is dropped.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// Which stream a pipe or terminal carries.
#[derive(Debug, Clone, Copy)]
enum Channel {
    Stdout,
    Stderr,
    Pty,
}

impl Channel {
    fn output(self, bytes: &[u8]) -> ProcessOutput {
        let bytes = bytes.to_vec();
        match self {
            Channel::Stdout => ProcessOutput::Stdout(bytes),
            Channel::Stderr => ProcessOutput::Stderr(bytes),
            Channel::Pty => ProcessOutput::Pty(bytes),
        }
    }
}

/// Publishes what one channel of a process writes, until end-of-file, or until `exited` says the
/// process has been reaped and its late writers had their grace: then it reads what the pipe
/// still holds and stops. A write to a pipe completes into the pipe's buffer, so everything the
/// process wrote before it exited is there to read, however late this task gets the CPU.
async fn pump(
    fd: AsyncFd<OwnedFd>,
    channel: Channel,
    process: Arc<ManagedProcess>,
    mut exited: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let mut guard = tokio::select! {
            biased;
            _ = exited.wait_for(|exited| *exited) => break,
            ready = fd.readable() => match ready {
                Ok(guard) => guard,
                Err(_) => return,
            },
        };
        let read = guard.try_io(|inner| {
            rustix::io::read(inner.get_ref(), &mut buf[..]).map_err(io::Error::from)
        });
        match read {
            Ok(Ok(0)) => return,
            Ok(Ok(n)) => process.publish(channel.output(&buf[..n])).await,
            // A terminal master reports EIO once every slave descriptor is closed.
            Ok(Err(_)) => return,
            Err(_would_block) => continue,
        }
    }
    let mut read_after_exit = 0;
    while read_after_exit < FINAL_READ_LIMIT {
        match rustix::io::read(fd.get_ref(), &mut buf[..]) {
            Ok(0) => return,
            Ok(n) => {
                read_after_exit += n;
                process.publish(channel.output(&buf[..n])).await;
            }
            Err(rustix::io::Errno::INTR) => continue,
            // Empty (the descriptor is non-blocking), or a terminal whose slaves are all closed.
            Err(_) => return,
        }
    }
}

/// All processes the agent started that have not ended yet.
#[derive(Debug, Default)]
pub struct ProcessManager {
    processes: Mutex<HashMap<u32, Arc<ManagedProcess>>>,
    /// The sandbox's out-of-memory notifications, where the node passed them.
    oom: Option<Arc<OomEvents>>,
}

/// How long after an out-of-memory notification a process that ends killed is taken to be
/// its victim: the kernel notifies before it kills, so the victim is reaped well within it.
const OOM_WINDOW: Duration = Duration::from_secs(2);
/// The exit status a shell reports for a child killed by SIGKILL (128 + 9).
const SHELL_KILLED: i32 = 128 + libc::SIGKILL;

/// Notifications the kernel gives each time the sandbox's memory cgroup runs out of memory
/// (an eventfd, see `sandbar_jail::OOM_EVENTS_FD`), kept a moment so the process it kills can
/// be told apart when it is reaped.
#[derive(Debug)]
pub struct OomEvents {
    fd: OwnedFd,
    /// The sandbox's memory limit in MiB, 0 when unknown; a sandbox handed to its owner after
    /// it booted learns it late (see `POST /init`).
    limit_mb: std::sync::atomic::AtomicU32,
    /// When each notification not yet matched with a process was seen.
    unclaimed: Mutex<Vec<std::time::Instant>>,
}

impl OomEvents {
    /// Wraps the eventfd the node passed; `limit_mb` is named in messages.
    pub fn new(fd: OwnedFd, limit_mb: Option<u32>) -> Arc<Self> {
        Arc::new(Self {
            fd,
            limit_mb: std::sync::atomic::AtomicU32::new(limit_mb.unwrap_or(0)),
            unclaimed: Mutex::new(Vec::new()),
        })
    }

    /// The memory limit named in messages.
    pub fn limit_mb(&self) -> Option<u32> {
        Some(self.limit_mb.load(std::sync::atomic::Ordering::Relaxed)).filter(|mb| *mb > 0)
    }

    pub fn set_limit_mb(&self, limit_mb: u32) {
        self.limit_mb
            .store(limit_mb, std::sync::atomic::Ordering::Relaxed);
    }

    /// Takes the notifications the eventfd holds; returns how many there were.
    fn drain(&self) -> u64 {
        let mut buf = [0u8; 8];
        match rustix::io::read(&self.fd, &mut buf) {
            Ok(8) => {
                let count = u64::from_ne_bytes(buf);
                let now = std::time::Instant::now();
                let mut unclaimed = lock(&self.unclaimed);
                // A storm of notifications for one shortage: a handful is all that matters.
                for _ in 0..count.min(64) {
                    unclaimed.push(now);
                }
                count
            }
            _ => 0,
        }
    }

    /// Whether a process that just ended killed was the victim of a recent shortage; a
    /// notification is matched with one process at most.
    fn claim(&self) -> bool {
        self.drain();
        let mut unclaimed = lock(&self.unclaimed);
        unclaimed.retain(|seen| seen.elapsed() < OOM_WINDOW);
        if unclaimed.is_empty() {
            return false;
        }
        unclaimed.remove(0);
        true
    }

    /// Logs every shortage as it happens (the server reads the log into the sandbox's logs).
    pub async fn watch(self: Arc<Self>) {
        let Ok(copy) = self.fd.try_clone() else {
            return;
        };
        // SAFETY: the copy moves into the `AsyncFd`, so the descriptor stays open and refers
        // to the same eventfd until the `AsyncFd` is dropped.
        let Ok(ready) = (unsafe { AsyncFd::register(copy) }) else {
            return;
        };
        loop {
            let Ok(mut guard) = ready.readable().await else {
                return;
            };
            let count = self.drain();
            if count > 0 {
                tracing::warn!(
                    limit_mb = self.limit_mb(),
                    "the sandbox ran out of memory{}; the kernel kills a process",
                    limit_text(self.limit_mb())
                );
            }
            guard.clear_ready();
        }
    }
}

fn limit_text(limit_mb: Option<u32>) -> String {
    limit_mb.map_or_else(String::new, |mb| format!(" (limit {mb} MiB)"))
}

/// Names an out-of-memory kill in a process's end: `error` is what the SDKs show.
fn name_oom_kill(end: &mut EndInfo, limit_mb: Option<u32>) {
    let limit = limit_mb.map_or_else(String::new, |mb| {
        format!(": the sandbox's memory limit is {mb} MiB")
    });
    end.error = Some(if end.exited {
        format!(
            "{} (a process was killed for using too much memory{limit})",
            end.status
        )
    } else {
        format!("{} (out of memory{limit})", end.status)
    });
}

/// Whether `status` is how a process killed by SIGKILL, or a shell whose child was, ends.
fn ended_killed(status: Option<&ExitStatus>) -> bool {
    matches!(
        status,
        Some(ExitStatus::Signaled(libc::SIGKILL)) | Some(ExitStatus::Exited(SHELL_KILLED))
    )
}

/// How a call names a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// By process id.
    Pid(u32),
    /// By tag given at start.
    Tag(String),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Pid(pid) => write!(f, "with pid {pid}"),
            Selector::Tag(tag) => write!(f, "with tag '{tag}'"),
        }
    }
}

struct ChildIo {
    stdin: Option<OwnedFd>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    pty: Option<OwnedFd>,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

fn dev_null() -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?)
}

fn open_pty(size: PtySize) -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    set_winsize(&master, size)?;
    Ok((master, slave))
}

impl ProcessManager {
    /// A manager that names out-of-memory kills from `oom` in the ends of the processes.
    pub fn with_oom(oom: Option<Arc<OomEvents>>) -> Self {
        Self {
            processes: Mutex::default(),
            oom,
        }
    }

    /// Names `limit_mb` in the messages of later out-of-memory kills.
    pub fn set_memory_limit(&self, limit_mb: u32) {
        if let Some(oom) = &self.oom {
            oom.set_limit_mb(limit_mb);
        }
    }

    /// Finds a running process.
    pub fn get(&self, selector: &Selector) -> Result<Arc<ManagedProcess>, ProcessError> {
        let processes = lock(&self.processes);
        let found = match selector {
            Selector::Pid(pid) => processes.get(pid).cloned(),
            Selector::Tag(tag) => processes
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
        };
        found.ok_or_else(|| ProcessError::NotFound(selector.to_string()))
    }

    /// Running processes, by pid.
    pub fn list(&self) -> Vec<Arc<ManagedProcess>> {
        let mut all: Vec<_> = lock(&self.processes).values().cloned().collect();
        all.sort_by_key(|p| p.pid);
        all
    }

    /// Starts a process and returns it with a stream already attached, so no early output is
    /// lost. Must run inside a tokio runtime.
    pub fn start(
        self: &Arc<Self>,
        spec: SpawnSpec,
    ) -> Result<(Arc<ManagedProcess>, mpsc::Receiver<ProcessOutput>), ProcessError> {
        if let Some(tag) = &spec.tag
            && self.get(&Selector::Tag(tag.clone())).is_ok()
        {
            return Err(ProcessError::TagInUse(tag.clone()));
        }
        let io_err = |source: io::Error| ProcessError::Io {
            cmd: spec.cmd.clone(),
            source,
        };

        let (exec_plan, exec_report) = ExecPlan::new(
            &spec.cmd,
            &spec.args,
            &spec.env,
            SANDBOX_PROCESS_OOM_SCORE_ADJ,
        )
        .map_err(|source| ProcessError::Spawn {
            cmd: spec.cmd.clone(),
            source,
        })?;
        // The parent's copies of the child's ends, closed once it runs, so end-of-file
        // arrives when it exits.
        let (child_ends, parent, stdio_source) = open_stdio(&spec).map_err(io_err)?;
        let controlling_terminal = spec.pty.is_some();
        let cwd = CString::new(spec.cwd.as_os_str().as_bytes()).map_err(|_| {
            io_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "nul byte found in the working directory",
            ))
        })?;
        let groups: Vec<libc::gid_t> = spec.groups.clone();
        let setup = ChildSetup {
            stdio: stdio_source.map(|i| child_ends[i].as_fd()),
            cwd: &cwd,
            controlling_terminal,
            // Only root may switch; an agent run unprivileged (in tests) runs as itself.
            identity: rustix::process::geteuid().is_root().then_some(Identity {
                uid: spec.user.uid,
                gid: spec.user.gid,
                groups: &groups,
            }),
        };

        let (pid, exit_rx) = {
            let mut guard = Reaper::global().spawn_guard();
            let pid = exec_plan
                .spawn(&setup)
                .map_err(|source| ProcessError::Spawn {
                    cmd: spec.cmd.clone(),
                    source,
                })?;
            (pid, guard.register(pid))
        };
        drop(child_ends);
        // When memory runs out, the kernel kills what a sandbox runs before its agent (and
        // before anything of the host): the trampoline raises the score before the program
        // runs. Waited for outside the reaper's lock, so a slow exec stalls no one else.
        exec_report.wait().map_err(|source| ProcessError::Spawn {
            cmd: spec.cmd.clone(),
            source,
        })?;
        // The command's arguments are left out: they may carry secrets.
        tracing::info!(pid, cmd = %spec.cmd, "process started");

        let shared_async = |fd: Option<OwnedFd>| {
            fd.map(nonblocking)
                .transpose()
                .map(|fd| fd.map(Arc::new))
                .map_err(io_err)
        };
        let pty = shared_async(parent.pty)?;
        let stdin = shared_async(parent.stdin)?;
        let (done, _) = watch::channel(false);
        let process = Arc::new(ManagedProcess {
            pid,
            tag: spec.tag.clone(),
            config: spec.config.clone(),
            stdin: tokio::sync::Mutex::new(stdin),
            pty: pty.clone(),
            fanout: Mutex::new(Fanout::default()),
            done,
        });
        let rx = process.subscribe();
        lock(&self.processes).insert(pid, process.clone());

        let (exited, exit_seen) = watch::channel(false);
        let pumps = start_pumps(
            [parent.stdout, parent.stderr],
            pty.as_deref(),
            &process,
            exit_seen,
        )
        .map_err(io_err)?;
        tokio::spawn(
            self.clone()
                .supervise(process.clone(), exit_rx, pumps, exited),
        );
        Ok((process, rx))
    }

    /// Waits for process `supervised` to end, lets its output pumps finish (a grace for
    /// descendants still writing, then what the pipes hold), and reports its end: named an
    /// out-of-memory kill when the sandbox's notification claims it.
    async fn supervise(
        self: Arc<Self>,
        supervised: Arc<ManagedProcess>,
        exit_rx: tokio::sync::oneshot::Receiver<ExitStatus>,
        mut pumps: Vec<tokio::task::JoinHandle<()>>,
        exited: watch::Sender<bool>,
    ) {
        let status = exit_rx.await.ok();
        // Before draining output: the notification must still be within its window.
        let oom_limit = self
            .oom
            .as_ref()
            .filter(|oom| ended_killed(status.as_ref()) && oom.claim())
            .map(|oom| oom.limit_mb());
        supervised.done.send_replace(true);
        let aborts: Vec<_> = pumps.iter().map(|pump| pump.abort_handle()).collect();
        let mut drained = std::pin::pin!(async {
            for pump in &mut pumps {
                let _ = pump.await;
            }
        });
        if tokio::time::timeout(LATE_WRITERS_GRACE, &mut drained)
            .await
            .is_err()
        {
            exited.send_replace(true);
            if tokio::time::timeout(DELIVERY_AFTER_EXIT, &mut drained)
                .await
                .is_err()
            {
                tracing::warn!(
                    pid = supervised.pid,
                    "output read after the process ended found no stream reading it"
                );
                for pump in &aborts {
                    pump.abort();
                }
            }
        }
        lock(&self.processes).remove(&supervised.pid);
        let mut end = EndInfo::from(status);
        if let Some(limit_mb) = oom_limit {
            name_oom_kill(&mut end, limit_mb);
            tracing::warn!(
                pid = supervised.pid,
                limit_mb,
                "process killed: out of memory{}",
                limit_text(limit_mb)
            );
        }
        tracing::info!(pid = supervised.pid, status = %end.status, "process ended");
        supervised.finish(end).await;
    }
}

/// The process's standard streams: a terminal for all three, or a pipe each (stdin a pipe
/// only when asked for, else `/dev/null`). Returns the child's ends, ours, and which of the
/// child's ends each of its descriptors 0, 1 and 2 takes.
fn open_stdio(spec: &SpawnSpec) -> io::Result<(Vec<OwnedFd>, ChildIo, [usize; 3])> {
    let mut child_ends: Vec<OwnedFd> = Vec::new();
    let mut parent = ChildIo {
        stdin: None,
        stdout: None,
        stderr: None,
        pty: None,
    };
    if let Some(size) = spec.pty {
        let (master, slave) = open_pty(size)?;
        parent.pty = Some(master);
        child_ends.push(slave);
        return Ok((child_ends, parent, [0, 0, 0]));
    }
    if spec.stdin {
        let (read, write) = pipe()?;
        child_ends.push(read);
        parent.stdin = Some(write);
    } else {
        child_ends.push(dev_null()?);
    }
    let (out_read, out_write) = pipe()?;
    let (err_read, err_write) = pipe()?;
    child_ends.push(out_write);
    child_ends.push(err_write);
    parent.stdout = Some(out_read);
    parent.stderr = Some(err_read);
    Ok((child_ends, parent, [0, 1, 2]))
}

/// One task per output stream of `process` (its stdout and stderr pipes, or its terminal),
/// each handing what it reads to the process's subscribers.
fn start_pumps(
    [stdout, stderr]: [Option<OwnedFd>; 2],
    pty: Option<&AsyncFd<OwnedFd>>,
    process: &Arc<ManagedProcess>,
    exit_seen: watch::Receiver<bool>,
) -> io::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut pumps = Vec::new();
    for (fd, channel) in [(stdout, Channel::Stdout), (stderr, Channel::Stderr)] {
        if let Some(fd) = fd {
            let fd = nonblocking(fd)?;
            pumps.push(tokio::spawn(pump(
                fd,
                channel,
                process.clone(),
                exit_seen.clone(),
            )));
        }
    }
    if let Some(master) = pty {
        // The master is shared between writers and this reader; reading needs its own
        // registration, so duplicate the descriptor.
        let reader = nonblocking(master.get_ref().try_clone()?)?;
        pumps.push(tokio::spawn(pump(
            reader,
            Channel::Pty,
            process.clone(),
            exit_seen,
        )));
    }
    Ok(pumps)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn end_info_follows_go_process_state() {
        let ok = EndInfo::from(Some(ExitStatus::Exited(0)));
        assert_eq!(ok.exit_code, 0);
        assert!(ok.exited);
        assert_eq!(ok.status, "exit status 0");
        assert_eq!(ok.error, None);
        let failed = EndInfo::from(Some(ExitStatus::Exited(3)));
        assert_eq!(failed.error.as_deref(), Some("exit status 3"));
        let killed = EndInfo::from(Some(ExitStatus::Signaled(libc::SIGKILL)));
        assert_eq!(killed.exit_code, -1);
        assert!(!killed.exited);
        assert_eq!(killed.status, "signal: killed");
    }

    #[test]
    fn an_out_of_memory_kill_is_named_with_the_limit() {
        let mut killed = EndInfo::from(Some(ExitStatus::Signaled(libc::SIGKILL)));
        name_oom_kill(&mut killed, Some(256));
        assert_eq!(killed.status, "signal: killed");
        assert_eq!(
            killed.error.as_deref(),
            Some("signal: killed (out of memory: the sandbox's memory limit is 256 MiB)")
        );
        let mut shell = EndInfo::from(Some(ExitStatus::Exited(137)));
        name_oom_kill(&mut shell, None);
        assert_eq!(
            shell.error.as_deref(),
            Some("exit status 137 (a process was killed for using too much memory)")
        );
        assert!(ended_killed(Some(&ExitStatus::Signaled(libc::SIGKILL))));
        assert!(ended_killed(Some(&ExitStatus::Exited(137))));
        assert!(!ended_killed(Some(&ExitStatus::Signaled(libc::SIGTERM))));
        assert!(!ended_killed(Some(&ExitStatus::Exited(1))));
        assert!(!ended_killed(None));
    }

    #[test]
    fn a_notification_names_one_kill_within_its_window() {
        // SAFETY: eventfd takes no pointers; the result is checked before it is owned.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let signal = fd.try_clone().unwrap();
        let oom = OomEvents::new(fd, Some(64));
        assert!(!oom.claim(), "no shortage yet");
        rustix::io::write(&signal, &1u64.to_ne_bytes()).unwrap();
        assert!(oom.claim());
        assert!(!oom.claim(), "one notification, one victim");
        rustix::io::write(&signal, &1u64.to_ne_bytes()).unwrap();
        oom.drain();
        lock(&oom.unclaimed)[0] -= OOM_WINDOW;
        assert!(!oom.claim(), "too old to be this process's");
    }

    fn spec(script: &str) -> SpawnSpec {
        let uid = rustix::process::getuid().as_raw();
        let gid = rustix::process::getgid().as_raw();
        SpawnSpec {
            cmd: "/bin/sh".to_owned(),
            args: vec!["-c".to_owned(), script.to_owned()],
            env: vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())],
            cwd: std::env::temp_dir(),
            user: User {
                name: "tester".to_owned(),
                uid,
                gid,
                home: std::env::temp_dir(),
                shell: "/bin/sh".to_owned(),
            },
            groups: vec![gid],
            pty: None,
            stdin: false,
            tag: None,
            config: Default::default(),
        }
    }

    /// Everything a stream gets until the end, and whether the end came last.
    async fn collect(mut rx: mpsc::Receiver<ProcessOutput>, pause: Duration) -> (Vec<u8>, bool) {
        let mut stdout = Vec::new();
        while let Some(output) = rx.recv().await {
            match output {
                ProcessOutput::Stdout(bytes) => stdout.extend(bytes),
                ProcessOutput::End(_) => return (stdout, rx.recv().await.is_none()),
                _ => {}
            }
            tokio::time::sleep(pause).await;
        }
        (stdout, false)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_stream_gets_all_output_of_a_process_that_already_exited() {
        let manager = Arc::new(ProcessManager::default());
        // More than the stream's buffer and the pipe hold, so the process ends while output
        // waits for the stream.
        let size = 5 << 19;
        let (_, rx) = manager
            .start(spec(&format!("head -c {size} /dev/zero | tr '\\0' x")))
            .unwrap();
        // Slower than the grace after the exit, with output still queued when the process ends.
        let (stdout, end_last) = collect(rx, Duration::from_millis(60)).await;
        assert_eq!(stdout.len(), size);
        assert!(stdout.iter().all(|b| *b == b'x'));
        assert!(end_last, "the end is the last message");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn output_before_the_exit_arrives_while_a_descendant_holds_the_pipe() {
        let manager = Arc::new(ProcessManager::default());
        let started = std::time::Instant::now();
        let (_, rx) = manager
            .start(spec("printf first; sleep 5 & printf ' last'"))
            .unwrap();
        let (stdout, end_last) = collect(rx, Duration::ZERO).await;
        assert_eq!(String::from_utf8_lossy(&stdout), "first last");
        assert!(end_last);
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the end does not wait for the backgrounded sleep"
        );
    }
}
