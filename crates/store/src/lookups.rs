//! The generation that answers cached from the store are compared against (see
//! `sandbar_core::store::LookupGenerations`): triggers keep it, in both databases.
//!
//! SQLite raises a counter in table `lookup_generation`, which a server reads before each
//! cached answer: one row instead of the records it guards, and a change made by another
//! process (the admin commands) is seen by the very next read. PostgreSQL notifies channel
//! `sandbar_lookups` when a change commits; [`LookupWatch`] listens on a connection of its own
//! and counts the notifications, so a cached answer costs no statement at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sandbar_core::StoreError;
use sandbar_core::store::LookupGenerations;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use crate::backend::Read;
use crate::{SqliteDb, err};

/// The channel the PostgreSQL triggers notify.
const CHANNEL: &str = "sandbar_lookups";

/// How long the watch waits before listening again after its connection failed.
const RELISTEN_PAUSE: Duration = Duration::from_millis(500);

/// The counter a SQLite database keeps.
#[derive(Debug, Clone)]
pub(crate) struct SqliteLookups {
    pub(crate) db: SqliteDb,
}

#[async_trait::async_trait]
impl LookupGenerations for SqliteLookups {
    async fn lookup_generation(&self) -> Result<u64, StoreError> {
        let (generation,) =
            sqlx::query_as::<_, (i64,)>("SELECT generation FROM lookup_generation WHERE id = 1")
                .one(&self.db)
                .await?
                .ok_or_else(|| StoreError::NotFound {
                    what: "lookup generation",
                    id: "1".to_owned(),
                })?;
        u64::try_from(generation).map_err(err)
    }
}

/// The notifications a PostgreSQL database sent, counted: each one, and each time the watch
/// (re)starts listening, is a new generation.
#[derive(Debug, Default)]
pub(crate) struct LookupWatch {
    generation: AtomicU64,
    /// Whether a notification sent now would reach the watch. While it is not, no
    /// generation is ever answered twice, so nothing cached is used.
    listening: AtomicBool,
}

impl LookupWatch {
    /// Starts listening on a connection of its own, for as long as the process runs.
    pub(crate) fn start(pool: &PgPool) -> Arc<Self> {
        let watch = Arc::new(Self::default());
        tokio::spawn(Arc::clone(&watch).listen(pool.clone()));
        watch
    }

    async fn listen(self: Arc<Self>, pool: PgPool) {
        while !pool.is_closed() {
            match PgListener::connect_with(&pool).await {
                Ok(mut listener) => {
                    if let Err(e) = listener.listen(CHANNEL).await {
                        tracing::warn!(error = %e, "cannot listen for changes of cached lookups");
                    } else {
                        // Whatever changed while nobody listened is covered by a new generation.
                        self.changed();
                        self.listening.store(true, Ordering::SeqCst);
                        // `None`: the connection was lost, and notifications with it.
                        while let Ok(Some(_)) = listener.try_recv().await {
                            self.changed();
                        }
                        self.listening.store(false, Ordering::SeqCst);
                        self.changed();
                        tracing::warn!("lost the connection that hears changes of cached lookups");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot connect to hear changes of cached lookups");
                }
            }
            tokio::time::sleep(RELISTEN_PAUSE).await;
        }
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl LookupGenerations for LookupWatch {
    async fn lookup_generation(&self) -> Result<u64, StoreError> {
        if self.listening.load(Ordering::SeqCst) {
            Ok(self.generation.load(Ordering::SeqCst))
        } else {
            Ok(self.generation.fetch_add(1, Ordering::SeqCst) + 1)
        }
    }
}
