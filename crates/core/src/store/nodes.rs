//! Nodes and their leases.

use super::StoreError;
use crate::model::NodeRecord;

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
}
