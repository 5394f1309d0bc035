//! Children that must not outlive the server, even a `kill -9` of it.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process.
//! Runtime threads come and go: a blocking-pool thread exits after a few idle seconds, and a
//! worker that runs `block_in_place` turns into one. A child forked on such a thread would be
//! killed in the middle of its work. So these children are forked on one thread of their own
//! that lives as long as the server.

use std::io;
use std::sync::OnceLock;
use std::sync::mpsc;

type Reply = mpsc::SyncSender<io::Result<tokio::process::Child>>;

struct Job {
    command: tokio::process::Command,
    runtime: tokio::runtime::Handle,
    reply: Reply,
}

fn spawner() -> io::Result<&'static mpsc::Sender<Job>> {
    static SPAWNER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    if let Some(sender) = SPAWNER.get() {
        return Ok(sender);
    }
    let (sender, jobs) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("tied-children".into())
        .spawn(move || {
            // Never returns while the server runs: the sender lives in a static.
            for mut job in jobs {
                // The child is registered with the caller's runtime, which reaps it.
                let _entered = job.runtime.enter();
                let _ = job.reply.send(job.command.spawn());
            }
        })?;
    // Another caller may have won the race; its thread serves, this one ends with its channel.
    Ok(SPAWNER.get_or_init(|| sender))
}

/// Spawns `command`, whose `pre_exec` arms `PR_SET_PDEATHSIG`, on the server's long-lived
/// spawning thread. Must be called from within a Tokio runtime.
pub(crate) fn spawn(command: tokio::process::Command) -> io::Result<tokio::process::Child> {
    let runtime = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
    let (reply, answer) = mpsc::sync_channel(1);
    spawner()?
        .send(Job {
            command,
            runtime,
            reply,
        })
        .map_err(|_| io::Error::other("the spawning thread has stopped"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("the spawning thread has stopped"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn sleeper() -> tokio::process::Command {
        let mut command = tokio::process::Command::new("sleep");
        command.arg("5").kill_on_drop(true);
        // SAFETY: only prctl between fork and exec.
        unsafe {
            command.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                Ok(())
            });
        }
        command
    }

    /// Whether a child spawned by `how` on a blocking-pool thread, which ends soon after,
    /// is still running a moment later.
    fn survives(how: fn(tokio::process::Command) -> io::Result<tokio::process::Child>) -> bool {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_keep_alive(Duration::from_millis(10))
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut child = tokio::task::spawn_blocking(move || how(sleeper()))
                .await
                .expect("join")
                .expect("spawn");
            tokio::time::sleep(Duration::from_millis(500)).await;
            let alive = child.try_wait().expect("try_wait").is_none();
            let _ = child.kill().await;
            alive
        })
    }

    #[test]
    fn a_child_forked_on_a_thread_that_ends_dies_with_it() {
        assert!(!survives(|mut command| command.spawn()));
    }

    #[test]
    fn a_child_forked_on_the_spawning_thread_outlives_the_calling_thread() {
        assert!(survives(spawn));
    }
}
