//! What answers cached from the store are compared against.

use super::StoreError;

/// A number the database raises whenever a team, an API key, a template, its names or its
/// builds change, whichever process changed them. An answer cached while it read `g` is
/// current while it still reads `g`.
#[async_trait::async_trait]
pub trait LookupGenerations: Send + Sync {
    /// The generation now. Read before the records it guards, so that an answer read after
    /// a change is never kept under the generation before it. A backend that cannot tell
    /// answers a number it never answered before, and nothing cached is used.
    async fn lookup_generation(&self) -> Result<u64, StoreError>;
}
