//! Ceilings on what a team keeps (snapshots and their memory images, templates, tags,
//! volumes and their bytes, API keys), checked where each is made.
//!
//! A count is compared with the records the team has, so the check and the write that adds
//! one must not interleave with another create of the same team: each service holds the
//! team's [`TeamGate`] from the count to the write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::lock;
use crate::model::Team;

const MIB: u64 = 1024 * 1024;

/// A team at one of its caps.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapError {
    #[error("team {team_id} has reached its limit of {limit} {what}")]
    Count {
        team_id: String,
        /// The kept thing, plural (`snapshots`, `tags per template`).
        what: &'static str,
        limit: u32,
    },
    #[error(
        "team {team_id} has reached its limit of {limit_mb} MiB of {what}: {used_mb} MiB are in use{}",
        needed_note(*.needed_bytes)
    )]
    Bytes {
        team_id: String,
        what: &'static str,
        limit_mb: u32,
        used_mb: u64,
        /// What the refused create would have added, when it is known.
        needed_bytes: Option<u64>,
    },
}

fn needed_note(needed: Option<u64>) -> String {
    match needed {
        Some(bytes) => format!(" and this would add {} MiB", bytes.div_ceil(MIB)),
        None => String::new(),
    }
}

/// Refuses one more of `what` when the team keeps `have` and its cap is `limit` (0: none).
pub fn check_count(
    team: &Team,
    what: &'static str,
    limit: u32,
    have: usize,
) -> Result<(), CapError> {
    if limit != 0 && have >= limit as usize {
        return Err(CapError::Count {
            team_id: team.id.clone(),
            what,
            limit,
        });
    }
    Ok(())
}

/// Refuses `adding` bytes more of `what` (unknown yet: `None`, refused only once the cap is
/// reached) when the team holds `used` bytes and its cap is `limit_mb` MiB (0: none).
pub fn check_bytes(
    team: &Team,
    what: &'static str,
    limit_mb: u32,
    used: u64,
    adding: Option<u64>,
) -> Result<(), CapError> {
    let limit = u64::from(limit_mb) * MIB;
    let over = match adding {
        Some(bytes) => used.saturating_add(bytes) > limit,
        None => used >= limit,
    };
    if limit_mb != 0 && over {
        return Err(CapError::Bytes {
            team_id: team.id.clone(),
            what,
            limit_mb,
            used_mb: used.div_ceil(MIB),
            needed_bytes: adding,
        });
    }
    Ok(())
}

/// One lock per team, so a create's count and its write are not interleaved with another
/// create of the same team in this process.
#[derive(Debug, Default)]
pub struct TeamGate {
    teams: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl TeamGate {
    /// Waits for the team's turn; it lasts as long as the guard.
    pub async fn enter(&self, team_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut teams = lock(&self.teams);
            // Locks nobody holds or waits for are dropped, so the map follows active teams.
            teams.retain(|_, l| Arc::strong_count(l) > 1);
            teams.entry(team_id.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TeamCaps;

    fn team() -> Team {
        Team {
            id: "t1".into(),
            name: "t".into(),
            slug: "t".into(),
            limits: crate::model::TeamLimits {
                max_concurrent_sandboxes: 1,
                max_sandbox_timeout_secs: 1,
                requests_per_minute: 0,
                max_vcpu: 0,
                max_memory_mb: 0,
                max_disk_mb: 0,
                disk_rates: Default::default(),
                caps: TeamCaps::DEFAULT,
            },
        }
    }

    #[test]
    fn counts_stop_at_the_cap_and_zero_means_none() {
        let t = team();
        assert!(check_count(&t, "snapshots", 2, 1).is_ok());
        let refused = check_count(&t, "snapshots", 2, 2).expect_err("at the cap");
        assert_eq!(
            refused.to_string(),
            "team t1 has reached its limit of 2 snapshots"
        );
        assert!(check_count(&t, "snapshots", 0, 1_000_000).is_ok());
    }

    #[test]
    fn bytes_stop_at_the_cap_and_name_what_is_used() {
        let t = team();
        assert!(check_bytes(&t, "volumes", 1, MIB - 1, None).is_ok());
        // Not knowing the size yet, only a full cap refuses.
        assert_eq!(
            check_bytes(&t, "volumes", 1, MIB, None),
            Err(CapError::Bytes {
                team_id: "t1".into(),
                what: "volumes",
                limit_mb: 1,
                used_mb: 1,
                needed_bytes: None,
            })
        );
        assert!(check_bytes(&t, "volumes", 1, MIB / 2, Some(MIB / 2)).is_ok());
        let refused = check_bytes(&t, "volumes", 1, MIB / 2, Some(MIB)).expect_err("past it");
        assert_eq!(
            refused.to_string(),
            "team t1 has reached its limit of 1 MiB of volumes: 1 MiB are in use and this would add 1 MiB"
        );
        assert!(check_bytes(&t, "volumes", 0, u64::MAX, Some(1)).is_ok());
    }

    #[tokio::test]
    async fn a_team_waits_for_its_own_turn_only() {
        let gate = TeamGate::default();
        let held = gate.enter("a").await;
        // Another team goes ahead at once.
        let other = tokio::time::timeout(std::time::Duration::from_secs(1), gate.enter("b")).await;
        assert!(other.is_ok());
        let same =
            tokio::time::timeout(std::time::Duration::from_millis(50), gate.enter("a")).await;
        assert!(
            same.is_err(),
            "the same team got in while its turn was held"
        );
        drop(held);
        let after = tokio::time::timeout(std::time::Duration::from_secs(1), gate.enter("a")).await;
        assert!(after.is_ok());
    }
}
