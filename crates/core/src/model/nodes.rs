//! Nodes: the hosts that run sandboxes, as they announce themselves to the cluster.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A node as it last renewed its lease.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    /// Chosen by the operator (`--node-id`); sandboxes name the node that runs them by it.
    pub id: String,
    /// Where API hosts reach the node's API, e.g. `http://10.0.0.11:3000`.
    pub url: String,
    /// When this run of the node started: a node that restarted has a later one.
    pub started_at: DateTime<Utc>,
    /// Until when the node counts as alive; it renews this every few seconds.
    pub lease_until: DateTime<Utc>,
    pub report: NodeReport,
}

impl NodeRecord {
    pub fn is_live(&self, now: DateTime<Utc>) -> bool {
        self.lease_until > now
    }
}

/// What a node measured of itself at its last renewal: what placement weighs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeReport {
    pub memory_total_bytes: u64,
    pub memory_available_bytes: u64,
    /// Memory limits of its sandboxes together, and how far they may add up.
    pub memory_promised_bytes: u64,
    pub memory_promise_limit_bytes: u64,
    /// Its sandbox disk pool: size and free space, the sandboxes' disk quotas together and
    /// how far they may add up. Zero from a node that does not report them.
    pub disk_pool_bytes: u64,
    pub disk_pool_free_bytes: u64,
    pub disk_promised_bytes: u64,
    pub disk_promise_limit_bytes: u64,
    /// Sandboxes it holds in any status.
    pub sandboxes: u32,
    /// Templates whose every layer is on its disk, by id: creates of them need no pull.
    pub templates: Vec<String>,
    /// Its tenants' build slots and how many builds hold or wait for one: where builds go.
    pub builds: BuildSlotUse,
    /// When the node counted its sandboxes, by its clock: a create sent to it later is not
    /// in `sandboxes`, one sent earlier is. `None` from a node that does not say.
    pub measured_at: Option<DateTime<Utc>>,
}

/// A node's build slots as its build queue counts them (the server's own builds of its
/// built-in templates take none, so they are not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BuildSlotUse {
    /// Builds of all teams that may run at once (`--concurrent-builds`); 0 from a node that
    /// does not report it.
    pub slots: u32,
    pub running: u32,
    pub waiting: u32,
}

impl BuildSlotUse {
    /// Builds that hold a slot or wait for one.
    pub fn used(&self) -> u64 {
        u64::from(self.running) + u64::from(self.waiting)
    }

    pub fn has_room(&self) -> bool {
        self.used() < u64::from(self.slots)
    }
}

impl NodeReport {
    /// Room for more sandboxes, in bytes: what is free now, and what the overcommit limit
    /// still allows, whichever is less.
    pub fn headroom_bytes(&self) -> u64 {
        let promisable = self
            .memory_promise_limit_bytes
            .saturating_sub(self.memory_promised_bytes);
        if self.memory_promise_limit_bytes == 0 {
            return self.memory_available_bytes;
        }
        self.memory_available_bytes.min(promisable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_is_the_smaller_of_free_memory_and_promises_left() {
        let report = NodeReport {
            memory_available_bytes: 8 << 30,
            memory_promised_bytes: 90 << 30,
            memory_promise_limit_bytes: 100 << 30,
            ..NodeReport::default()
        };
        assert_eq!(report.headroom_bytes(), 8 << 30);
        let full = NodeReport {
            memory_promised_bytes: 100 << 30,
            ..report.clone()
        };
        assert_eq!(full.headroom_bytes(), 0);
        let unlimited = NodeReport {
            memory_promise_limit_bytes: 0,
            ..report
        };
        assert_eq!(unlimited.headroom_bytes(), 8 << 30);
    }

    #[test]
    fn a_lease_in_the_past_is_a_lost_node() {
        let now = Utc::now();
        let node = NodeRecord {
            id: "n1".into(),
            url: "http://10.0.0.1:3000".into(),
            started_at: now,
            lease_until: now - chrono::TimeDelta::seconds(1),
            report: NodeReport::default(),
        };
        assert!(!node.is_live(now));
        assert!(
            NodeRecord {
                lease_until: now + chrono::TimeDelta::seconds(5),
                ..node
            }
            .is_live(now)
        );
    }
}

/// A slot of a team's concurrency, claimed by a node for a sandbox it is about to start,
/// until the sandbox is recorded (or will not start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotClaim {
    pub sandbox_id: String,
    pub team_id: String,
    pub node_id: String,
    /// A claim its node never let go of (it died mid-create) counts no longer than this.
    pub until: DateTime<Utc>,
}
