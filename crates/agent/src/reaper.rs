//! Collects exit statuses for every child of this process.
//!
//! As PID 1 the agent adopts orphans, so it must `waitpid(-1)` or zombies pile up. That
//! conflicts with per-child waiting (tokio::process, `Child::wait`), so children are
//! spawned by `exec::ExecPlan::spawn`, registered here by pid, and a single loop reaps
//! everything and hands each status to whoever registered that pid.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

/// How a child ended, as reported by `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// Normal exit with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

type Waiters = HashMap<u32, oneshot::Sender<ExitStatus>>;

/// How often children are reaped without a SIGCHLD.
const SAFETY_SWEEP: Duration = Duration::from_secs(30);
/// How often they are reaped when SIGCHLD cannot be listened for.
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

impl Reaper {
    /// The process-wide reaper, started on first use. There must be exactly one per process
    /// because `waitpid(-1)` from two loops would steal each other's children.
    pub fn global() -> &'static Reaper {
        static REAPER: OnceLock<&'static Reaper> = OnceLock::new();
        REAPER.get_or_init(|| {
            let reaper: &'static Reaper = Box::leak(Box::new(Reaper {
                waiters: Mutex::new(HashMap::new()),
            }));
            // A dedicated thread with its own runtime keeps the loop alive independently of
            // whichever runtime first touched the reaper (tests create many runtimes).
            let spawned = std::thread::Builder::new()
                .name("reaper".into())
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

    fn run(&'static self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!("cannot build reaper runtime: {e}");
                return;
            }
        };
        runtime.block_on(async move {
            let mut signals =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::error!("cannot listen for SIGCHLD, polling only: {e}");
                        None
                    }
                };
            // Coalesced SIGCHLDs lose nothing: every wake-up reaps until no child is left,
            // and a signal that comes during a sweep is kept pending for the next `recv`.
            // The sweep is only a safety net, and a sparse one: on a host of 2,000 sandboxes
            // a sweep every second woke 2,000 agents a second, a tenth of the CPU.
            let mut tick = tokio::time::interval(if signals.is_some() {
                SAFETY_SWEEP
            } else {
                POLL_WITHOUT_SIGNALS
            });
            loop {
                self.reap_all();
                match signals.as_mut() {
                    Some(sig) => {
                        tokio::select! {
                            _ = sig.recv() => {}
                            _ = tick.tick() => {}
                        }
                    }
                    None => {
                        tick.tick().await;
                    }
                }
            }
        });
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
