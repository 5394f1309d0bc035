//! Template spawn counts, added up in memory and written together: under a burst of creates
//! one statement per template per window, instead of one write per create competing with the
//! creates' own records for the database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

use crate::lock;
use crate::store::Store;

use super::AFTER_CREATE_QUIET;

/// Spawns counted since the last write, by template: how many, and the latest.
#[derive(Debug, Default)]
pub(super) struct SpawnTally {
    pending: Mutex<HashMap<String, (u32, DateTime<Utc>)>>,
}

impl SpawnTally {
    /// Counts a spawn of `template_id` at `at`. The first spawn after a write schedules the
    /// next, after the quiet a create's first command gets; the ones until then join it.
    pub(super) fn add(self: &Arc<Self>, store: &Arc<Store>, template_id: &str, at: DateTime<Utc>) {
        if self.count(template_id, at) {
            let tally = self.clone();
            let store = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(AFTER_CREATE_QUIET).await;
                tally.write(&store).await;
            });
        }
    }

    /// Adds one spawn; true when it is the first since the last write.
    fn count(&self, template_id: &str, at: DateTime<Utc>) -> bool {
        let mut pending = lock(&self.pending);
        let first = pending.is_empty();
        let entry = pending.entry(template_id.to_owned()).or_insert((0, at));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = entry.1.max(at);
        first
    }

    /// Writes what was counted; a failed write is logged, the counts are a statistic.
    async fn write(&self, store: &Arc<Store>) {
        let batch = std::mem::take(&mut *lock(&self.pending));
        for (template_id, (count, last)) in batch {
            if let Err(err) = store
                .templates
                .record_template_spawns(&template_id, count, last)
                .await
            {
                tracing::warn!(%template_id, count, error = %err, "cannot record template spawns");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawns_of_a_template_add_up_with_the_latest_time() {
        let tally = SpawnTally::default();
        let early = Utc::now();
        let late = early + chrono::TimeDelta::seconds(1);
        let firsts: Vec<bool> = [("a", late), ("a", early), ("b", early)]
            .into_iter()
            .map(|(template, at)| tally.count(template, at))
            .collect();
        assert_eq!(
            firsts,
            [true, false, false],
            "one write is scheduled per window"
        );
        let pending = lock(&tally.pending).clone();
        assert_eq!(pending["a"], (2, late));
        assert_eq!(pending["b"], (1, early));
    }
}
