//! Collects exit statuses for every child of this process.
//!
//! As PID 1 the agent adopts orphans, so it must `waitpid(-1)` or zombies pile up. That
//! conflicts with per-child waiting (tokio::process, `Child::wait`), so children are
//! spawned by `exec::ExecPlan::spawn`, registered here by pid, and a single loop reaps
//! everything and hands each status to whoever registered that pid.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::idle_trim::IdleTrim;

/// How a child ended, as reported by `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// Normal exit with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

type Waiters = HashMap<u32, oneshot::Sender<ExitStatus>>;

/// How often children are reaped when SIGCHLD cannot be listened for.
const POLL_WITHOUT_SIGNALS: Duration = Duration::from_secs(1);

/// Process-wide registry of children awaiting their exit status.
#[derive(Debug)]
pub struct Reaper {
    waiters: Mutex<Waiters>,
}

/// Holding this guard keeps the reaper from calling `waitpid`, so a child spawned while it
/// is held cannot be reaped before it is registered. That matters for a failed `exec` too:
/// std waits for such a child itself and would find it already gone.
#[derive(Debug)]
pub struct SpawnGuard<'a> {
    waiters: MutexGuard<'a, Waiters>,
}

impl SpawnGuard<'_> {
    /// Registers a freshly spawned child; the receiver resolves when it has been reaped.
    pub fn register(&mut self, pid: u32) -> oneshot::Receiver<ExitStatus> {
        let (tx, rx) = oneshot::channel();
        self.waiters.insert(pid, tx);
        rx
    }
}

/// The eventfd the reaper's thread sleeps on: written by the SIGCHLD handler and by
/// [`wake`]. Set once, before the handler is registered, and never closed.
static WAKEUP: OnceLock<OwnedFd> = OnceLock::new();

/// Makes the reaper's thread run its loop once: reap, and let the idle trim look.
pub(crate) fn wake() {
    if let Some(fd) = WAKEUP.get() {
        ring(fd);
    }
}

/// Adds one to the eventfd `fd`. Async-signal-safe: a single `write` system call, made by
/// rustix without the C library.
fn ring(fd: &OwnedFd) {
    // A full counter (EAGAIN) already means a wake-up is pending.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// An eventfd that SIGCHLD rings; `None` when either cannot be had.
fn listen_for_children() -> Option<&'static OwnedFd> {
    let made = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    );
    let fd: &'static OwnedFd = match made {
        Ok(fd) => WAKEUP.get_or_init(|| fd),
        Err(e) => {
            tracing::error!("cannot make the reaper's eventfd, polling only: {e}");
            return None;
        }
    };
    // SAFETY: the action only makes one `write` system call, which is async-signal-safe,
    // on a descriptor that stays open for the life of the process.
    let registered = unsafe { signal_hook_registry::register(libc::SIGCHLD, move || ring(fd)) };
    match registered {
        Ok(_) => Some(fd),
        Err(e) => {
            tracing::error!("cannot listen for SIGCHLD, polling only: {e}");
            None
        }
    }
}

/// Sleeps until `fd` is rung or `deadline` (never when `None`) has come, and empties it.
/// Through rustix's own system calls, and with no clock read when there is no deadline: after
/// a trim, the C library's code stays unmapped.
fn sleep_on(fd: &OwnedFd, deadline: Option<Instant>) {
    let timeout = deadline.and_then(|d| {
        // Rounded up, so that a look due in a fraction of a millisecond does not spin.
        let left = d.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
        rustix::event::Timespec::try_from(left).ok()
    });
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    if rustix::event::poll(&mut fds, timeout.as_ref()).is_ok_and(|ready| ready > 0) {
        let mut count = [0u8; 8];
        let _ = rustix::io::read(fd, &mut count);
    }
}

impl Reaper {
    /// The process-wide reaper, started on first use. There must be exactly one per process
    /// because `waitpid(-1)` from two loops would steal each other's children.
    pub fn global() -> &'static Reaper {
        static REAPER: OnceLock<&'static Reaper> = OnceLock::new();
        REAPER.get_or_init(|| {
            let reaper: &'static Reaper = Box::leak(Box::new(Reaper {
                waiters: Mutex::new(HashMap::new()),
            }));
            // A plain thread that sleeps in `poll` between wake-ups: it runs no async
            // runtime, whose timers would wake an idle agent and map back code the idle
            // trim dropped, and it outlives whichever runtime first touched the reaper
            // (tests create many).
            let spawned = std::thread::Builder::new()
                .name("reaper".into())
                .stack_size(128 * 1024)
                .spawn(move || reaper.run());
            if let Err(e) = spawned {
                tracing::error!("cannot start reaper thread: {e}");
            }
            reaper
        })
    }

    /// Locks out reaping while a child is spawned and registered.
    pub fn spawn_guard(&self) -> SpawnGuard<'_> {
        SpawnGuard {
            waiters: lock(&self.waiters),
        }
    }

    /// Reaps whenever SIGCHLD (or [`wake`]) rings and runs the idle trim's looks in
    /// between. Coalesced signals lose nothing: every wake-up reaps until no child is left,
    /// and a child that ends after the last `waitpid` rings the eventfd again before the
    /// next `poll`. So an idle agent's thread sleeps until something happens, with no
    /// periodic sweep.
    fn run(&'static self) {
        let wakeup = listen_for_children();
        let mut trim = IdleTrim::new(Instant::now());
        loop {
            self.reap_all();
            // The look comes last before the sleep, so that what a trim drops is not mapped
            // back by the loop's own work.
            trim.after_wake(Instant::now());
            match wakeup {
                Some(fd) => sleep_on(fd, trim.next_look()),
                None => std::thread::sleep(POLL_WITHOUT_SIGNALS),
            }
        }
    }

    fn reap_all(&self) {
        let mut waiters = lock(&self.waiters);
        loop {
            let mut status: libc::c_int = 0;
            // SAFETY: waitpid only writes the status integer we pass a valid pointer to.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            let exit = if libc::WIFEXITED(status) {
                ExitStatus::Exited(libc::WEXITSTATUS(status))
            } else if libc::WIFSIGNALED(status) {
                ExitStatus::Signaled(libc::WTERMSIG(status))
            } else {
                continue;
            };
            // Unregistered pids are adopted orphans; reaping them is all they need.
            if let Some(tx) = waiters.remove(&pid.unsigned_abs()) {
                let _ = tx.send(exit);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves the map consistent (inserts/removes are atomic).
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
