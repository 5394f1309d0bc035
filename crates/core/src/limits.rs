//! Per-team request rate limits (GCRA, via governor), each team at its own rate.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use crate::model::Team;

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
}

impl std::fmt::Debug for RateLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimits").finish_non_exhaustive()
    }
}

impl RateLimits {
    /// Counts one request of `team`; teams with a limit of 0 are never limited.
    pub fn check(&self, team: &Team) -> Result<(), RateLimited> {
        let Some(per_minute) = NonZeroU32::new(team.requests_per_minute) else {
            return Ok(());
        };
        let limiter = {
            let mut limiters = self.limiters.lock().unwrap_or_else(|e| e.into_inner());
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn team(per_minute: u32) -> Team {
        Team {
            slug: "team".into(),
            id: "t".into(),
            name: "t".into(),
            max_concurrent_sandboxes: 1,
            max_sandbox_timeout_secs: 1,
            requests_per_minute: per_minute,
            max_vcpu: 0,
            max_memory_mb: 0,
            max_disk_mb: 0,
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

    #[test]
    fn zero_means_unlimited() {
        let limits = RateLimits::default();
        assert!((0..1000).all(|_| limits.check(&team(0)).is_ok()));
    }
}
