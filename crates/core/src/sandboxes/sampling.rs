//! The reaper's own thread for reads that cover every sandbox: liveness, usage and agent logs.

use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

/// Runs the reaper's reads of every sandbox's files, one round after another, on one thread
/// of their own. Not the blocking pool: the runtime may lower this thread's CPU priority
/// (see [`crate::Runtime::prepare_sampling_thread`]), so a round over a thousand sandboxes
/// gives way to any create or command that wants the CPU, instead of stretching it by its
/// length.
pub(super) struct SamplingThread {
    /// Run first on the thread, once.
    prepare: Arc<dyn Fn() + Send + Sync>,
    /// Started at the first round, so that a `Sandboxes` that never reaps starts no thread;
    /// the thread ends when this (the last sender) is dropped.
    jobs: OnceLock<Option<mpsc::Sender<Job>>>,
}

impl std::fmt::Debug for SamplingThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplingThread").finish_non_exhaustive()
    }
}

impl SamplingThread {
    pub(super) fn new(prepare: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            prepare: Arc::new(prepare),
            jobs: OnceLock::new(),
        }
    }

    fn start(&self) -> Option<mpsc::Sender<Job>> {
        let (sender, jobs) = mpsc::channel::<Job>();
        let prepare = Arc::clone(&self.prepare);
        let started = std::thread::Builder::new()
            .name("sandbar-sampling".into())
            .spawn(move || {
                prepare();
                for job in jobs {
                    // A panicking read drops its answer (its round sees `None`) and leaves
                    // the thread to the next round.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            });
        match started {
            Ok(_) => Some(sender),
            Err(err) => {
                tracing::warn!(error = %err, "cannot start the sampling thread: sampling on the blocking pool");
                None
            }
        }
    }

    /// Runs `read` on the sampling thread and waits for its answer; `None` if it panicked.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        read: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let Some(jobs) = self.jobs.get_or_init(|| self.start()) else {
            return tokio::task::spawn_blocking(read).await.ok();
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = answer.send(read());
        });
        // The thread outlives every panic of a job and runs until the last sender is
        // dropped, so the send cannot fail while `self` holds the sender.
        jobs.send(job).ok()?;
        answered.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn reads_run_on_one_prepared_thread_that_outlives_a_panic() {
        let prepared = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&prepared);
        let sampling = SamplingThread::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let first = sampling.run(|| std::thread::current().id()).await;
        let panicked = sampling.run(|| -> u32 { panic!("a read failed") }).await;
        let after = sampling.run(|| std::thread::current().id()).await;
        assert_eq!(panicked, None, "a panicking read answers nothing");
        assert!(first.is_some());
        assert_eq!(first, after, "the same thread, still there after the panic");
        assert_ne!(first, Some(std::thread::current().id()));
        assert_eq!(prepared.load(Ordering::SeqCst), 1, "prepared once");
    }
}
