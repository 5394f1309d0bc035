//! Where the edge sends a request naming a sandbox, and what it lets through; traffic to a
//! paused sandbox with `autoResume` wakes it.

use std::sync::Arc;
use std::time::Duration;

use super::lifecycle::Lifecycle;
use super::shared::Shared;
use super::{
    AUTO_RESUME_TIMEOUT_SECS, ROUTE_PATIENCE, Route, SandboxError, UserPortAccess, WakeKeys,
};
use crate::lifecycle::SandboxStatus;

/// The edge's view of the live sandboxes: routes to them, and what their user ports let
/// through.
#[derive(Clone, Debug)]
pub struct EdgeRoutes {
    shared: Arc<Shared>,
    /// Wakes a paused sandbox that traffic may resume.
    lifecycle: Lifecycle,
}

impl EdgeRoutes {
    pub(super) fn new(shared: Arc<Shared>, lifecycle: Lifecycle) -> Self {
        Self { shared, lifecycle }
    }

    /// What sandbox `id` is now, if this node manages it.
    pub fn status_of(&self, id: &str) -> Option<SandboxStatus> {
        self.shared.status_of(id)
    }

    /// Where the edge should send traffic for a running sandbox.
    pub fn route(&self, id: &str) -> Option<Route> {
        self.shared
            .live()
            .get(id)
            .filter(|l| l.status.is_routable())
            .and_then(Route::of)
    }

    /// The running sandbox whose agent access token satisfies `matches`. Signed file URLs
    /// carry no sandbox ID, only a signature made with that token. The tokens are checked
    /// without the registry's lock, which is then taken once, for the sandbox found.
    pub fn route_by_token(&self, matches: impl Fn(&str) -> bool) -> Option<(String, Route)> {
        let id = self.shared.signers.find(matches)?;
        let route = self.route(&id)?;
        Some((id, route))
    }

    /// The endpoint of a running sandbox; a paused one with `autoResume` is resumed first
    /// (the edge calls this for every request naming a sandbox), but only for a request that
    /// `lets_through` says the running sandbox would let through: traffic the edge or the
    /// agent would refuse never wakes a sandbox.
    pub async fn route_or_wake(
        &self,
        id: &str,
        lets_through: impl Fn(&WakeKeys<'_>) -> bool,
    ) -> Result<Route, SandboxError> {
        let not_running = || SandboxError::NotFound(id.to_owned());
        if let Some(route) = self.route(id) {
            return Ok(route);
        }
        let wake = self.shared.live().get(id).is_some_and(|l| {
            l.auto_resume
                && matches!(
                    l.status,
                    SandboxStatus::Paused
                        | SandboxStatus::Checkpointing
                        | SandboxStatus::Checkpointed
                )
                && lets_through(&WakeKeys {
                    envd_access_token: (!l.access_token.is_empty()).then_some(&*l.access_token),
                    traffic_access_token: l.user_ports.traffic_access_token.as_deref(),
                })
        });
        if !wake {
            // A snapshot or a resume under way is waited for; anything else is not running.
            return self.settled_route(id).await.ok_or_else(not_running);
        }
        let mut sandbox = self
            .shared
            .store
            .sandboxes
            .sandbox(id)
            .await?
            .ok_or_else(not_running)?;
        let team = self
            .shared
            .store
            .teams
            .team(&sandbox.team_id)
            .await?
            .ok_or_else(not_running)?;
        if let Ok(from) = self.lifecycle.start_waking(&mut sandbox).await {
            let _claim = match self.shared.resume_slot(&team, id).await {
                Ok(claim) => claim,
                Err(retry_after_secs) => {
                    self.shared.set_status(id, from, None);
                    tracing::warn!(sandbox_id = %id, team_id = %team.id, "not resumed by traffic: the team is at its concurrency limit");
                    return Err(SandboxError::ConcurrencyLimit {
                        id: id.to_owned(),
                        limit: team.limits.max_concurrent_sandboxes,
                        retry_after_secs,
                    });
                }
            };
            match self
                .lifecycle
                .thaw(sandbox, from, AUTO_RESUME_TIMEOUT_SECS, "traffic")
                .await
            {
                Ok(_) => tracing::info!(sandbox_id = %id, "resumed by traffic"),
                Err(err) => {
                    tracing::warn!(sandbox_id = %id, error = %err, "cannot resume on traffic")
                }
            }
            return self.route(id).ok_or_else(not_running);
        }
        // Another request is resuming it (a restore from disk takes up to a few seconds).
        self.settled_route(id).await.ok_or_else(not_running)
    }

    /// The route of sandbox `id` once the resume or snapshot under way has finished, if it
    /// runs then.
    async fn settled_route(&self, id: &str) -> Option<Route> {
        let deadline = tokio::time::Instant::now() + ROUTE_PATIENCE;
        loop {
            if let Some(route) = self.route(id) {
                return Some(route);
            }
            let busy = self.shared.live().get(id).is_some_and(|l| {
                matches!(
                    l.status,
                    SandboxStatus::Snapshotting
                        | SandboxStatus::Resuming
                        | SandboxStatus::Restoring
                )
            });
            if !busy || tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// How the edge may let requests through to a running sandbox's user ports.
    pub fn user_port_access(&self, id: &str) -> Option<UserPortAccess> {
        self.shared
            .live()
            .get(id)
            .filter(|l| l.status.is_routable())
            .map(|l| l.user_ports.clone())
    }

    /// How user ports of a sandbox in any live state (paused too) may be reached: the edge
    /// answers refused traffic to a paused sandbox as it would a running one.
    pub fn user_port_access_any_state(&self, id: &str) -> Option<UserPortAccess> {
        self.shared.live().get(id).map(|l| l.user_ports.clone())
    }
}
