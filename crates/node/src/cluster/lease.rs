//! A node's lease in the cluster: renewed every few seconds with what the node measured of
//! itself, so API hosts know it is alive and how much room it has.

use std::sync::Arc;

use chrono::Utc;
use sandbar_core::cluster::{LEASE_RENEWAL, NodeLease};
use sandbar_core::{Builds, NodeReport, Sandboxes, Store};

use crate::LinuxRuntime;

/// Renews the lease for as long as the process runs. A renewal that fails is tried again at
/// the next tick: the lease outlives several missed renewals.
pub async fn renew_forever(
    store: Arc<Store>,
    lease: NodeLease,
    runtime: Arc<LinuxRuntime>,
    sandboxes: Arc<Sandboxes>,
    builds: Builds,
) {
    let mut ticks = tokio::time::interval(LEASE_RENEWAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let report = measure(store.as_ref(), &runtime, &sandboxes, &builds).await;
        if let Err(e) = store
            .nodes
            .renew_node(&lease.record(report, Utc::now()))
            .await
        {
            tracing::warn!(node_id = %lease.id, error = %e, "cannot renew the node's lease");
        }
    }
}

async fn measure(
    store: &Store,
    runtime: &LinuxRuntime,
    sandboxes: &Sandboxes,
    builds: &Builds,
) -> NodeReport {
    let templates = match store.templates.templates().await {
        Ok(templates) => {
            let layers = runtime.layers().layer_store();
            templates
                .into_iter()
                .filter(|t| {
                    t.image
                        .as_ref()
                        .is_some_and(|image| image.parts().iter().all(|l| layers.exists(l)))
                })
                .map(|t| t.id)
                .collect()
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot list templates for the node's report");
            Vec::new()
        }
    };
    NodeReport {
        templates,
        builds: builds.slot_use(),
        ..sandboxes.health().report()
    }
}
