//! The reaper: sandboxes whose time is up are stopped (or paused), sandboxes frozen past
//! their grace are checkpointed, dead ones are cleaned up, and agent logs and team metrics
//! are written on the way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{
    METRICS_EVERY_ROUNDS, PRUNE_EVERY_ROUNDS, Sandboxes, TEAM_METRICS_EVERY_ROUNDS, expired,
};
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;

impl Sandboxes {
    /// Stops every sandbox whose end time has passed.
    pub async fn reap_expired(&self) {
        let to_pause = self.running_where(|_, l| expired(l) && l.auto_pause);
        for (id, _) in to_pause {
            let sandbox = match self.store.sandbox(&id).await {
                Ok(Some(sandbox)) => sandbox,
                Ok(None) => continue,
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause");
                    continue;
                }
            };
            // Claimed under the lock an extend takes: one that came first keeps it running.
            let claimed = self.claim_where(
                &id,
                |l| l.status == SandboxStatus::Running && expired(l) && l.auto_pause,
                SandboxStatus::Pausing,
            );
            if claimed.is_err() {
                continue;
            }
            self.activity
                .event(&id, LogLevel::Info, "sandbox timed out: pausing", &[])
                .await;
            let paused = self.pause_marked(&sandbox, sandbox.auto_pause_memory).await;
            match paused {
                Ok(()) => tracing::info!(sandbox_id = %id, "sandbox timed out: paused"),
                Err(err) => {
                    tracing::error!(sandbox_id = %id, error = %err, "sandbox timed out: cannot pause")
                }
            }
        }
        let due = self.running_where(|_, l| expired(l) && !l.auto_pause);
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
        // Checked outside the registry lock: each check reads /proc.
        let dead = self
            .running_where(|_, _| true)
            .into_iter()
            .filter(|(id, handle)| !self.runtime.is_alive(id, handle))
            .collect();
        // Unless it was paused, shelved or resumed meanwhile: its handle would differ.
        self.stop_all(
            dead,
            |l, picked| l.status == SandboxStatus::Running && l.handle == *picked,
            "sandbox died",
            LogLevel::Error,
        )
        .await;
    }

    /// Reads new agent log lines of every running sandbox.
    async fn ingest_agent_logs(&self) {
        let ids: Vec<String> = self
            .live()
            .iter()
            .filter(|(_, l)| l.status == SandboxStatus::Running)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.activity
                .ingest_agent_log(self.runtime.as_ref(), &id)
                .await;
        }
    }

    async fn flush_team_metrics(&self) {
        let mut running: HashMap<String, u32> = HashMap::new();
        for l in self.live().values() {
            if l.status.holds_a_slot() {
                *running.entry(l.team_id.clone()).or_default() += 1;
            }
        }
        self.activity.flush_team_metrics(running).await;
    }

    /// Expires sandboxes about twice a second and looks for dead ones every few seconds,
    /// forever.
    pub async fn run_reaper(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for round in 0u64.. {
            tick.tick().await;
            self.reap_expired().await;
            self.spawn_checkpoint_paused();
            if round % 10 == 0 {
                self.reap_dead().await;
            }
            if round % METRICS_EVERY_ROUNDS == 0 {
                for (id, killed) in self.sample_metrics() {
                    self.log_oom_kills(&id, killed).await;
                }
                self.ingest_agent_logs().await;
            }
            if round % TEAM_METRICS_EVERY_ROUNDS == 0 {
                self.flush_team_metrics().await;
            }
            if round % PRUNE_EVERY_ROUNDS == 0 {
                self.activity.prune().await;
            }
        }
    }
}
