//! The reaper: sandboxes whose time is up are stopped (or paused), sandboxes frozen past
//! their grace are checkpointed, dead ones are cleaned up, and agent logs and team metrics
//! are written on the way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use super::activity::SandboxActivity;
use super::lifecycle::Lifecycle;
use super::sampling::SamplingThread;
use super::shared::Shared;
use super::{Claim, Live, METRICS_EVERY_ROUNDS, PRUNE_EVERY_ROUNDS, TEAM_METRICS_EVERY_ROUNDS};
use crate::activity::AGENT_LOG_READ_MAX;
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::runtime::RuntimeHandle;

/// Whether a sandbox's end has passed, read at the moment of the check.
fn expired(live: &Live) -> bool {
    live.end_at <= Utc::now()
}

/// The background rounds over the live sandboxes: expiry, checkpoints of paused ones,
/// clean-up of dead ones, and the samples, agent logs and team metrics written on the way.
#[derive(Clone, Debug)]
pub struct Reaper {
    shared: Arc<Shared>,
    /// Pauses sandboxes that time out with `autoPause`, and checkpoints paused ones.
    lifecycle: Lifecycle,
    /// Samples the sandboxes and logs their out-of-memory kills.
    activity: SandboxActivity,
    /// Where the reads that cover every sandbox run, off the async runtime's threads.
    sampling: Arc<SamplingThread>,
}

impl Reaper {
    pub(super) fn new(
        shared: Arc<Shared>,
        lifecycle: Lifecycle,
        activity: SandboxActivity,
    ) -> Self {
        Self {
            sampling: Arc::new(SamplingThread::new({
                let runtime = Arc::clone(&shared.runtime);
                move || runtime.prepare_sampling_thread()
            })),
            shared,
            lifecycle,
            activity,
        }
    }

    /// Stops every sandbox whose end time has passed.
    pub async fn reap_expired(&self) {
        let to_pause = self.shared.running_where(|_, l| expired(l) && l.auto_pause);
        for (id, _) in to_pause {
            let sandbox = match self.shared.store.sandboxes.sandbox(&id).await {
                Ok(Some(sandbox)) => sandbox,
                Ok(None) => continue,
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause");
                    continue;
                }
            };
            // Claimed under the lock an extend takes: one that came first keeps it running.
            let claimed = self.shared.claim_where(
                &id,
                |l| l.status == SandboxStatus::Running && expired(l) && l.auto_pause,
                SandboxStatus::Pausing,
            );
            if claimed.is_err() {
                continue;
            }
            self.shared
                .activity
                .event(&id, LogLevel::Info, "sandbox timed out: pausing", &[])
                .await;
            let paused = self
                .lifecycle
                .pause_marked(&sandbox, sandbox.auto_pause_memory)
                .await;
            match paused {
                Ok(()) => tracing::info!(sandbox_id = %id, "sandbox timed out: paused"),
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause")
                }
            }
        }
        let due = self
            .shared
            .running_where(|_, l| expired(l) && !l.auto_pause);
        self.stop_all(
            due,
            |l, _| l.status == SandboxStatus::Running && expired(l) && !l.auto_pause,
            "sandbox timed out",
            LogLevel::Info,
        )
        .await;
    }

    /// Cleans up sandboxes whose processes died on their own (their agent can no longer
    /// answer), so they stop being listed and routed to.
    pub async fn reap_dead(&self) {
        // Checked outside the registry lock, on the sampling thread: each check reads /proc,
        // a thousand of them some milliseconds that requests would wait behind.
        let running = self.shared.running_where(|_, _| true);
        let runtime = Arc::clone(&self.shared.runtime);
        let dead = self
            .sampling
            .run(move || {
                running
                    .into_iter()
                    .filter(|(id, handle)| !runtime.is_alive(id, handle))
                    .collect()
            })
            .await
            .unwrap_or_default();
        // Unless it was paused, shelved or resumed meanwhile: its handle would differ.
        self.stop_all(
            dead,
            |l, picked| l.status == SandboxStatus::Running && l.handle == *picked,
            "sandbox died",
            LogLevel::Error,
        )
        .await;
    }

    /// Reads new agent log lines of every running sandbox: the files on the sampling thread,
    /// then the lines into the store.
    async fn ingest_agent_logs(&self) {
        let ids: Vec<String> = self
            .shared
            .live()
            .iter()
            .filter(|(_, l)| l.status == SandboxStatus::Running)
            .map(|(id, _)| id.clone())
            .collect();
        let reads = self.shared.activity.agent_log_reads(ids).await;
        let runtime = Arc::clone(&self.shared.runtime);
        let read = self
            .sampling
            .run(move || {
                reads
                    .into_iter()
                    .map(|read| {
                        let chunk =
                            runtime.agent_log(&read.sandbox_id, read.offset, AGENT_LOG_READ_MAX);
                        (read, chunk)
                    })
                    .collect()
            })
            .await
            .unwrap_or_default();
        self.shared.activity.ingest_agent_logs_read(read).await;
    }

    async fn flush_team_metrics(&self) {
        let mut running: HashMap<String, u32> = HashMap::new();
        for l in self.shared.live().values() {
            if l.status.holds_a_slot() {
                *running.entry(l.team_id.clone()).or_default() += 1;
            }
        }
        self.shared.activity.flush_team_metrics(running).await;
    }

    /// Expires sandboxes about twice a second and looks for dead ones every few seconds,
    /// forever.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for round in 0u64.. {
            tick.tick().await;
            self.reap_expired().await;
            self.lifecycle.spawn_checkpoint_paused();
            if round % 10 == 0 {
                self.reap_dead().await;
            }
            if round % METRICS_EVERY_ROUNDS == 0 {
                // Reads a few cgroup files a sandbox: at a thousand sandboxes, tens of
                // milliseconds that would hold one of the async runtime's threads, and the
                // requests queued on it, every time.
                let activity = self.activity.clone();
                let sampled = self.sampling.run(move || activity.sample_metrics());
                for (id, killed) in sampled.await.unwrap_or_default() {
                    self.activity.log_oom_kills(&id, killed).await;
                }
                self.ingest_agent_logs().await;
            }
            if round % TEAM_METRICS_EVERY_ROUNDS == 0 {
                self.flush_team_metrics().await;
            }
            if round % PRUNE_EVERY_ROUNDS == 0 {
                self.shared.activity.prune().await;
            }
        }
    }

    /// Stops each of `sandboxes` that `still` holds for when its turn comes, logging why; one
    /// failure does not hold up the rest. The reaper picks its sandboxes before it stops
    /// them: a request in between (an extend, a pause, a kill) wins over it.
    async fn stop_all(
        &self,
        sandboxes: Vec<(String, RuntimeHandle)>,
        still: impl Fn(&Live, &RuntimeHandle) -> bool,
        why: &str,
        level: LogLevel,
    ) {
        for (id, picked) in sandboxes {
            let Claim::Claimed { previous, handle } =
                self.shared.claim_stop(&id, |l| still(l, &picked))
            else {
                continue;
            };
            match self
                .shared
                .finish_stop(&id, Some(previous), &handle, None, level, why)
                .await
            {
                Ok(()) => tracing::info!(sandbox_id = %id, "{why}: stopped"),
                Err(err) => tracing::error!(sandbox_id = %id, error = %err, "{why}: cannot stop"),
            }
        }
    }
}
