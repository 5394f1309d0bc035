//! What sandboxes leave behind: their logs, the team metrics, resource samples of running and
//! paused sandboxes, and the out-of-memory kills those show.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::shared::Shared;
use super::{METRICS_KEPT, MetricPoint, SandboxError};
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::lock;
use crate::model::{SandboxEvent, SandboxEventQuery, Team};
use crate::runtime::RuntimeHandle;
use crate::sandbox_logs::{SandboxLogEntry, SandboxLogQuery, SandboxLogsError};
use crate::store::StoreError;
use crate::team_metrics::{TeamMetric, TeamMetricMax, TeamMetricPoint, TeamMetricsError};

/// What sandboxes leave behind: their logs, their resource samples and the team metrics.
#[derive(Clone, Debug)]
pub struct SandboxActivity {
    shared: Arc<Shared>,
}

impl SandboxActivity {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// A team's sandbox's log, also after the sandbox ended (for the retention period).
    pub async fn logs(
        &self,
        team: &Team,
        id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, SandboxLogsError> {
        self.shared.activity.logs(team, id, query).await
    }

    /// A page of `team`'s lifecycle events, also of sandboxes that ended, for the retention
    /// period. Another team's sandbox has none.
    pub async fn events(
        &self,
        team: &Team,
        query: &SandboxEventQuery,
    ) -> Result<Vec<SandboxEvent>, StoreError> {
        self.shared
            .store
            .sandbox_events
            .sandbox_events(&team.id, query)
            .await
    }

    /// `team_id`'s activity from `start` to `end` (Unix seconds); only `team`'s own.
    pub async fn team_metrics(
        &self,
        team: &Team,
        team_id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<Vec<TeamMetricPoint>, TeamMetricsError> {
        self.shared
            .activity
            .team_metrics(team, team_id, start, end)
            .await
    }

    /// The largest value of `metric` for `team_id` from `start` to `end`.
    pub async fn team_metric_max(
        &self,
        team: &Team,
        team_id: &str,
        metric: TeamMetric,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<TeamMetricMax, TeamMetricsError> {
        self.shared
            .activity
            .team_metric_max(team, team_id, metric, start, end)
            .await
    }

    /// Tells a sandbox's log, and the server's, that the kernel killed `killed` of its
    /// processes for lack of memory. The agent names the processes it sees killed at the
    /// sandbox's limit; only the kernel's count also covers kills with the host short of
    /// memory, which signal nothing to the sandbox.
    pub(super) async fn log_oom_kills(&self, id: &str, killed: u64) {
        tracing::warn!(sandbox_id = %id, killed, "the kernel killed sandbox processes for lack of memory");
        self.shared.activity
            .event(
                id,
                LogLevel::Warn,
                &format!(
                    "out of memory: the kernel killed {killed} process{} of this sandbox (at its memory limit, or with the host or all sandboxes together short of memory)",
                    if killed == 1 { "" } else { "es" }
                ),
                &[("oomKills", killed.to_string())],
            )
            .await;
    }

    /// Samples every live sandbox's use; returns the sandboxes whose processes the kernel
    /// killed for lack of memory since the last sample, with how many.
    pub fn sample_metrics(&self) -> Vec<(String, u64)> {
        let targets: Vec<(String, RuntimeHandle, u32, u32, u32)> = self
            .shared
            .live()
            .iter()
            .filter(|(_, l)| {
                matches!(
                    l.status,
                    SandboxStatus::Running | SandboxStatus::Paused | SandboxStatus::Checkpointed
                )
            })
            .map(|(id, l)| {
                (
                    id.clone(),
                    l.handle.clone(),
                    l.cpu_count,
                    l.memory_mb,
                    l.disk_size_mb,
                )
            })
            .collect();
        let now = std::time::Instant::now();
        let at = Utc::now();
        // Read before the samples' lock is taken: a few files a sandbox, which at a thousand
        // sandboxes would keep a reader of the samples waiting for tens of milliseconds.
        let sampled: Vec<_> = targets
            .into_iter()
            .filter_map(|(id, handle, cpu_count, memory_mb, disk_size_mb)| {
                let stats = self.shared.runtime.stats(&id, &handle)?;
                Some((id, stats, cpu_count, memory_mb, disk_size_mb))
            })
            .collect();
        let mut metrics = lock(&self.shared.metrics);
        let mut killed = Vec::new();
        for (id, stats, cpu_count, memory_mb, disk_size_mb) in sampled {
            let series = metrics.entry(id.clone()).or_default();
            if let Some(before) = series.oom_kills
                && stats.oom_kills > before
            {
                killed.push((id, stats.oom_kills - before));
            }
            series.oom_kills = Some(stats.oom_kills);
            let cpu_used_pct = match series.last_cpu {
                Some((then, cpu_ns)) => {
                    let wall = now.duration_since(then).as_nanos() as f64;
                    let used = stats.cpu_ns.saturating_sub(cpu_ns) as f64;
                    if wall > 0.0 {
                        (used / (wall * f64::from(cpu_count.max(1))) * 100.0).clamp(0.0, 100.0)
                    } else {
                        0.0
                    }
                }
                None => 0.0,
            };
            series.last_cpu = Some((now, stats.cpu_ns));
            series.points.push_back(MetricPoint {
                at,
                cpu_count,
                cpu_used_pct,
                mem_used: stats.memory_used,
                mem_total: u64::from(memory_mb) << 20,
                mem_cache: stats.memory_cache,
                disk_used: stats.disk_used,
                disk_total: if stats.disk_total > 0 {
                    stats.disk_total
                } else {
                    u64::from(disk_size_mb) << 20
                },
            });
            while series.points.len() > METRICS_KEPT {
                series.points.pop_front();
            }
        }
        killed
    }

    /// A team's sandbox's samples between `start` and `end` (inclusive, either open).
    pub async fn metrics(
        &self,
        team: &Team,
        id: &str,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> Result<Vec<MetricPoint>, SandboxError> {
        self.shared.get(team, id).await?;
        Ok(self.metric_points(id, start, end))
    }

    /// The newest sample of each of `ids` that belongs to `team`.
    pub async fn latest_metrics(
        &self,
        team: &Team,
        ids: &[String],
    ) -> Result<Vec<(String, MetricPoint)>, SandboxError> {
        let mut out = Vec::new();
        for id in ids {
            if self.shared.get(team, id).await.is_err() {
                continue;
            }
            if let Some(point) = self.metric_points(id, None, None).pop() {
                out.push((id.clone(), point));
            }
        }
        Ok(out)
    }

    fn metric_points(
        &self,
        id: &str,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> Vec<MetricPoint> {
        lock(&self.shared.metrics)
            .get(id)
            .map(|series| {
                series
                    .points
                    .iter()
                    .filter(|p| start.is_none_or(|s| p.at >= s) && end.is_none_or(|e| p.at <= e))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}
