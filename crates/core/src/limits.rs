//! Per-team request rate limits (GCRA, via governor), each team at its own rate.
//!
//! In a cluster, each process also counts its teams' requests into the store, per minute,
//! and refuses a team's request once the minute's total over every process reached its
//! limit: a client spreading requests over API hosts and nodes gets no more than from one
//! server. Counts go to the store in batches ([`RateLimits::run_sharing`]) that also bring
//! back the totals, so a process may let through what it admits between two batches beyond
//! the limit.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use crate::lock;
use crate::model::Team;
use crate::store::RequestCountRecords;

/// How often a process adds what it counted to the cluster's totals.
const SHARE_EVERY: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
#[error("team {team_id} exceeded its limit of {per_minute} requests per minute")]
pub struct RateLimited {
    pub team_id: String,
    pub per_minute: u32,
    /// How long until the next request would be accepted.
    pub retry_after: Duration,
}

#[derive(Default)]
pub struct RateLimits {
    limiters: Mutex<HashMap<String, (u32, Arc<DefaultDirectRateLimiter>)>>,
    shared: Option<SharedCounts>,
}

/// The cluster's counts, as this process knows them.
struct SharedCounts {
    store: Arc<dyn RequestCountRecords>,
    teams: Mutex<HashMap<String, TeamMinute>>,
}

/// One team's current minute.
#[derive(Debug, Clone, Copy, Default)]
struct TeamMinute {
    /// Unix minute.
    window: i64,
    /// The cluster's total at this process's last batch, its own requests included.
    total: u64,
    /// Requests admitted here since.
    unshared: u64,
}

fn minute_now() -> (i64, Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let window = (now.as_secs() / 60) as i64;
    let next = Duration::from_secs((now.as_secs() / 60 + 1) * 60);
    (window, next.saturating_sub(now))
}

impl std::fmt::Debug for RateLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimits").finish_non_exhaustive()
    }
}

impl RateLimits {
    /// Limits that hold across the processes sharing `store` and count there (see the
    /// module's documentation), with the counting started; in a tokio runtime.
    pub fn shared_through(store: Arc<dyn RequestCountRecords>) -> Arc<Self> {
        let limits = Arc::new(Self::shared(store));
        tokio::spawn(limits.clone().run_sharing());
        limits
    }

    /// Limits that also hold across the processes sharing `store` (see the module's
    /// documentation); [`Self::run_sharing`] must run beside them.
    pub fn shared(store: Arc<dyn RequestCountRecords>) -> Self {
        Self {
            limiters: Mutex::default(),
            shared: Some(SharedCounts {
                store,
                teams: Mutex::default(),
            }),
        }
    }

    /// Adds what this process counted to the cluster's totals and learns them, every
    /// [`SHARE_EVERY`], for as long as the process runs; forgets minutes long past. Does
    /// nothing for limits that are not shared.
    pub async fn run_sharing(self: Arc<Self>) {
        let Some(shared) = &self.shared else {
            return;
        };
        let mut tick = tokio::time::interval(SHARE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut pruned_before = 0;
        loop {
            tick.tick().await;
            let (window, _) = minute_now();
            shared.share_once(window).await;
            if window > pruned_before {
                if let Err(e) = shared.store.prune_team_requests(window - 1).await {
                    tracing::warn!(error = %e, "cannot forget past request counts");
                }
                pruned_before = window;
            }
        }
    }

    /// Counts one request of `team`; teams with a limit of 0 are never limited.
    pub fn check(&self, team: &Team) -> Result<(), RateLimited> {
        let Some(per_minute) = NonZeroU32::new(team.limits.requests_per_minute) else {
            return Ok(());
        };
        let limiter = {
            let mut limiters = lock(&self.limiters);
            let entry = limiters.entry(team.id.clone()).or_insert_with(|| {
                (
                    per_minute.get(),
                    Arc::new(RateLimiter::direct(Quota::per_minute(per_minute))),
                )
            });
            // A changed limit takes effect with a fresh bucket.
            if entry.0 != per_minute.get() {
                *entry = (
                    per_minute.get(),
                    Arc::new(RateLimiter::direct(Quota::per_minute(per_minute))),
                );
            }
            entry.1.clone()
        };
        limiter.check().map_err(|not_until| RateLimited {
            team_id: team.id.clone(),
            per_minute: per_minute.get(),
            retry_after: not_until.wait_time_from(DefaultClock::default().now()),
        })?;
        match &self.shared {
            Some(shared) => shared.admit(team, per_minute.get(), minute_now()),
            None => Ok(()),
        }
    }
}

impl SharedCounts {
    /// Admits one request of `team` in the minute `window`, which ends in `left`.
    fn admit(
        &self,
        team: &Team,
        per_minute: u32,
        (window, left): (i64, Duration),
    ) -> Result<(), RateLimited> {
        let mut teams = lock(&self.teams);
        let minute = teams.entry(team.id.clone()).or_default();
        if minute.window != window {
            *minute = TeamMinute {
                window,
                ..TeamMinute::default()
            };
        }
        if minute.total + minute.unshared >= u64::from(per_minute) {
            return Err(RateLimited {
                team_id: team.id.clone(),
                per_minute,
                retry_after: left,
            });
        }
        minute.unshared += 1;
        Ok(())
    }

    /// Adds what was admitted since the last batch to the store's totals; `window` is the
    /// current minute.
    async fn share_once(&self, window: i64) {
        let batch: Vec<(String, u64)> = {
            let mut teams = lock(&self.teams);
            teams.retain(|_, minute| minute.window >= window - 1);
            // Teams with nothing new are asked too: what other processes admitted counts
            // against what this one admits next.
            teams
                .iter_mut()
                .filter(|(_, minute)| minute.window == window)
                .map(|(team, minute)| (team.clone(), std::mem::take(&mut minute.unshared)))
                .collect()
        };
        if batch.is_empty() {
            return;
        }
        let added = self.store.add_team_requests(window, &batch).await;
        let mut teams = lock(&self.teams);
        match added {
            Ok(totals) => {
                for (team, total) in totals {
                    if let Some(minute) = teams.get_mut(&team).filter(|m| m.window == window) {
                        minute.total = minute.total.max(total);
                    }
                }
            }
            Err(e) => {
                // Counted again with the next batch.
                for (team, counted) in batch {
                    if let Some(minute) = teams.get_mut(&team).filter(|m| m.window == window) {
                        minute.unshared += counted;
                    }
                }
                tracing::warn!(error = %e, "cannot share request counts");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn team(per_minute: u32) -> Team {
        Team {
            slug: "team".into(),
            id: "t".into(),
            name: "t".into(),
            limits: crate::model::TeamLimits {
                max_concurrent_sandboxes: 1,
                max_sandbox_timeout_secs: 1,
                requests_per_minute: per_minute,
                max_vcpu: 0,
                max_memory_mb: 0,
                max_disk_mb: 0,
                disk_rates: Default::default(),
                caps: crate::model::TeamCaps::DEFAULT,
            },
        }
    }

    #[test]
    fn a_burst_beyond_the_limit_is_refused_with_a_wait() {
        let limits = RateLimits::default();
        let t = team(60);
        let accepted = (0..100).filter(|_| limits.check(&t).is_ok()).count();
        assert_eq!(accepted, 60);
        let refused = limits.check(&t).expect_err("over the limit");
        assert!(refused.retry_after > Duration::ZERO);
        assert!(refused.retry_after <= Duration::from_secs(1));
    }

    /// The store's side of shared counts, in memory.
    #[derive(Default)]
    struct Counts(Mutex<HashMap<(String, i64), u64>>);

    #[async_trait::async_trait]
    impl RequestCountRecords for Counts {
        async fn add_team_requests(
            &self,
            window: i64,
            added: &[(String, u64)],
        ) -> Result<Vec<(String, u64)>, crate::StoreError> {
            let mut counts = self.0.lock().unwrap();
            Ok(added
                .iter()
                .map(|(team, requests)| {
                    let total = counts.entry((team.clone(), window)).or_default();
                    *total += requests;
                    (team.clone(), *total)
                })
                .collect())
        }

        async fn prune_team_requests(&self, _: i64) -> Result<u64, crate::StoreError> {
            Ok(0)
        }
    }

    #[tokio::test]
    async fn two_processes_share_one_limit_per_minute() {
        let counts = Arc::new(Counts::default());
        let (a, b) = (
            RateLimits::shared(counts.clone()),
            RateLimits::shared(counts.clone()),
        );
        let (shared_a, shared_b) = (a.shared.as_ref().unwrap(), b.shared.as_ref().unwrap());
        let t = team(10);
        let minute = (1_000, Duration::from_secs(30));
        let admitted =
            |s: &SharedCounts, n: usize| (0..n).filter(|_| s.admit(&t, 10, minute).is_ok()).count();
        assert_eq!(admitted(shared_a, 6), 6);
        shared_a.share_once(minute.0).await;
        // B has not heard of A's six yet: it learns of them with its first batch.
        assert_eq!(admitted(shared_b, 1), 1);
        shared_b.share_once(minute.0).await;
        assert_eq!(
            admitted(shared_b, 10),
            3,
            "the cluster's ten, not ten of its own"
        );
        let refused = shared_b.admit(&t, 10, minute).expect_err("over the limit");
        assert_eq!(
            refused.retry_after,
            Duration::from_secs(30),
            "until the minute ends"
        );
        shared_b.share_once(minute.0).await;
        shared_a.share_once(minute.0).await;
        assert_eq!(admitted(shared_a, 5), 0);
        // A new minute starts afresh.
        let next = (1_001, Duration::from_secs(60));
        assert!(shared_a.admit(&t, 10, next).is_ok());
    }

    #[test]
    fn zero_means_unlimited() {
        let limits = RateLimits::default();
        assert!((0..1000).all(|_| limits.check(&team(0)).is_ok()));
    }
}
