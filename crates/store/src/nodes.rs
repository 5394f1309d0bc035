//! Nodes and their leases.

use chrono::Utc;
use sandbar_core::store::NodeRecords;
use sandbar_core::{NodeRecord, SlotClaim, StoreError};
use sqlx::PgPool;

use crate::backend::{Backend, Read, Write};
use crate::rows::NodeRow;
use crate::{SqliteDb, err, micros, to_json};

/// Nodes and their leases, in either database.
#[derive(Debug, Clone)]
pub struct Nodes<B> {
    pub(crate) db: B,
}

// A team's slots are counted and claimed atomically in each database's own way: SQLite in
// one statement under its single writer, PostgreSQL under a lock on the team.
impl Nodes<SqliteDb> {
    async fn claim(
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
        .bind(micros(Utc::now()))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .write(&self.db)
        .await?;
        Ok(claimed == 1)
    }
}

impl Nodes<PgPool> {
    async fn claim(
        &self,
        claim: &SlotClaim,
        limit: usize,
        live_nodes: &[String],
        slot_statuses: &[&str],
    ) -> Result<bool, StoreError> {
        let mut tx = self.db.begin().await.map_err(err)?;
        // A claim is a lease of seconds that its create either turns into a sandbox row or
        // gives back: lost in a crash of the database, it takes nothing from anyone. So its
        // commit does not wait for the disk, which the team's other claims would otherwise
        // queue behind, one flush each, while they wait for the lock below.
        sqlx::query("SET LOCAL synchronous_commit TO off")
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        // Claims of one team wait for each other until their transactions end; other teams'
        // go on.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7716))")
            .bind(&claim.team_id)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        let statuses: Vec<String> = slot_statuses.iter().map(|s| (*s).to_owned()).collect();
        let held: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM sandboxes WHERE team_id = $1 AND id <> $2 \
                AND (node_id = $3 OR node_id = ANY($4)) AND status = ANY($5)) \
             + (SELECT count(*) FROM slot_claims WHERE team_id = $1 AND sandbox_id <> $2 \
                AND (node_id = $3 OR node_id = ANY($4)) AND claimed_until >= now() \
                AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.id = slot_claims.sandbox_id \
                  AND s.status = ANY($5)))",
        )
        .bind(&claim.team_id)
        .bind(&claim.sandbox_id)
        .bind(&claim.node_id)
        .bind(live_nodes)
        .bind(&statuses)
        .fetch_one(&mut *tx)
        .await
        .map_err(err)?;
        if usize::try_from(held).unwrap_or(usize::MAX) >= limit {
            tx.rollback().await.map_err(err)?;
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO slot_claims (sandbox_id, team_id, node_id, claimed_until) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (sandbox_id) DO UPDATE SET claimed_until = excluded.claimed_until",
        )
        .bind(&claim.sandbox_id)
        .bind(&claim.team_id)
        .bind(&claim.node_id)
        .bind(claim.until)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(true)
    }
}

on_both! {
    #[async_trait::async_trait]
    impl NodeRecords for Nodes<B> {
        async fn renew_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
            sqlx::query(
                "INSERT INTO nodes (id, url, started_at, lease_until, report) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (id) DO UPDATE SET url = excluded.url, started_at = excluded.started_at, \
                 lease_until = excluded.lease_until, report = excluded.report",
            )
            .bind(&node.id)
            .bind(&node.url)
            .bind(B::time(node.started_at))
            .bind(B::time(node.lease_until))
            .bind(to_json(&node.report)?)
            .run(&self.db).await
        }

        async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
            sqlx::query_as::<_, NodeRow<Time>>("SELECT * FROM nodes ORDER BY id COLLATE \"C\"")
                .all(&self.db)
                .await
        }

        async fn sandbox_node(&self, sandbox_id: &str) -> Result<Option<String>, StoreError> {
            sqlx::query_scalar("SELECT node_id FROM sandboxes WHERE id = $1")
                .bind(sandbox_id)
                .fetch_optional(self.db.reads())
                .await
                .map_err(err)
        }

        async fn move_sandbox(
            &self,
            sandbox_id: &str,
            from: &str,
            to: &str,
        ) -> Result<bool, StoreError> {
            let moved =
                sqlx::query("UPDATE sandboxes SET node_id = $1 WHERE id = $2 AND node_id = $3")
                    .bind(to)
                    .bind(sandbox_id)
                    .bind(from)
                    .write(&self.db)
                    .await?;
            Ok(moved == 1)
        }

        async fn claim_team_slot(
            &self,
            claim: &SlotClaim,
            limit: usize,
            live_nodes: &[String],
            slot_statuses: &[&str],
        ) -> Result<bool, StoreError> {
            self.claim(claim, limit, live_nodes, slot_statuses).await
        }

        async fn release_team_slot(&self, sandbox_id: &str) -> Result<(), StoreError> {
            sqlx::query("DELETE FROM slot_claims WHERE sandbox_id = $1")
                .bind(sandbox_id)
                .run(&self.db)
                .await
        }
    }
}
