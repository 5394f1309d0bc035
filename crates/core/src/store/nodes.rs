//! Nodes and their leases.

use super::StoreError;
use crate::model::{NodeRecord, SlotClaim};

#[async_trait::async_trait]
pub trait NodeRecords: Send + Sync {
    /// Records the node, or renews its lease and report if it is recorded.
    async fn renew_node(&self, node: &NodeRecord) -> Result<(), StoreError>;
    /// Every node ever recorded, live or not, by id.
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
    /// The node a sandbox is recorded on; `None` when no such sandbox is recorded.
    async fn sandbox_node(&self, sandbox_id: &str) -> Result<Option<String>, StoreError>;
    /// Records the sandbox on node `to` if it is still recorded on `from`; false when it is
    /// not (another node took it first, or it is gone).
    async fn move_sandbox(
        &self,
        sandbox_id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool, StoreError>;
    /// Takes `claim` if the team's sandboxes holding a slot on the claim's node and the nodes
    /// of `live_nodes` (recorded with a status among `slot_statuses`, or claimed and not
    /// recorded so: a start, or a resume of a paused one) number fewer than `limit`; decided
    /// under a lock per team, so two claims never both take the last slot. False when there
    /// is no room.
    async fn claim_team_slot(
        &self,
        claim: &SlotClaim,
        limit: usize,
        live_nodes: &[String],
        slot_statuses: &[&str],
    ) -> Result<bool, StoreError>;
    /// Lets go of the claim for `sandbox_id`: the sandbox is recorded, or will not start.
    async fn release_team_slot(&self, sandbox_id: &str) -> Result<(), StoreError>;
}
