//! Nodes and their leases.

use sandbar_core::store::NodeRecords;
use sandbar_core::{NodeRecord, SlotClaim, StoreError};

use crate::rows::NodeRow;
use crate::{SqliteDb, err, micros, to_json};

/// Nodes and their leases, in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteNodes {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl NodeRecords for SqliteNodes {
    async fn renew_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO nodes (id, url, started_at, lease_until, report) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, started_at = excluded.started_at, \
             lease_until = excluded.lease_until, report = excluded.report",
        )
        .bind(&node.id)
        .bind(&node.url)
        .bind(micros(node.started_at))
        .bind(micros(node.lease_until))
        .bind(to_json(&node.report)?)
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(())
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows = sqlx::query_as::<_, NodeRow<i64>>("SELECT * FROM nodes ORDER BY id")
            .fetch_all(&self.db.reads)
            .await
            .map_err(err)?;
        rows.into_iter().map(NodeRecord::try_from).collect()
    }

    async fn sandbox_node(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
        sqlx::query_scalar("SELECT node_id FROM sandboxes WHERE id = ?")
            .bind(sandbox_id)
            .fetch_optional(&self.db.reads)
            .await
            .map_err(err)
    }

    async fn move_sandbox(
        &self,
        sandbox_id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool, StoreError> {
        let moved = sqlx::query("UPDATE sandboxes SET node_id = ? WHERE id = ? AND node_id = ?")
            .bind(to)
            .bind(sandbox_id)
            .bind(from)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(moved.rows_affected() == 1)
    }

    async fn claim_team_slot(
        &self,
        claim: &SlotClaim,
        limit: usize,
        live_nodes: &[String],
        slot_statuses: &[&str],
    ) -> Result<bool, StoreError> {
        // One statement: SQLite runs it under its single writer's lock, so the count and the
        // insert cannot interleave with another claim's.
        let claimed = sqlx::query(
            "INSERT INTO slot_claims (sandbox_id, team_id, node_id, claimed_until) \
             SELECT ?1, ?2, ?3, ?4 WHERE \
             (SELECT count(*) FROM sandboxes WHERE team_id = ?2 AND id <> ?1 \
                AND (node_id = ?3 OR node_id IN (SELECT value FROM json_each(?5))) \
                AND status IN (SELECT value FROM json_each(?6))) \
             + (SELECT count(*) FROM slot_claims WHERE team_id = ?2 AND sandbox_id <> ?1 \
                AND (node_id = ?3 OR node_id IN (SELECT value FROM json_each(?5))) \
                AND claimed_until >= ?7 \
                AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.id = slot_claims.sandbox_id \
                  AND s.status IN (SELECT value FROM json_each(?6)))) < ?8 \
             ON CONFLICT (sandbox_id) DO UPDATE SET claimed_until = excluded.claimed_until",
        )
        .bind(&claim.sandbox_id)
        .bind(&claim.team_id)
        .bind(&claim.node_id)
        .bind(micros(claim.until))
        .bind(serde_json::to_string(live_nodes).map_err(err)?)
        .bind(serde_json::to_string(slot_statuses).map_err(err)?)
        .bind(micros(chrono::Utc::now()))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.db.writes)
        .await
        .map_err(err)?;
        Ok(claimed.rows_affected() == 1)
    }

    async fn release_team_slot(&self, sandbox_id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM slot_claims WHERE sandbox_id = ?")
            .bind(sandbox_id)
            .execute(&self.db.writes)
            .await
            .map_err(err)?;
        Ok(())
    }
}
