//! Secrets as the store keeps them: a hash to compare presented secrets against, and the few
//! characters that may be shown again.

use chrono::Utc;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::ids;
use crate::store::StoredSecret;

/// Hex SHA-256 of a secret: keys are long and random, so a fast hash is enough to make a
/// leaked database useless for authentication.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Compares two secret hashes without an early exit, so response times say nothing about
/// how much of a guess matched.
pub(crate) fn same_hash(a: &str, b: &str) -> bool {
    bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

pub(crate) fn stored(team_id: &str, name: &str, secret: &str, prefix: &str) -> StoredSecret {
    let value = &secret[prefix.len()..];
    StoredSecret {
        id: ids::new_uuid(),
        team_id: team_id.to_owned(),
        name: name.to_owned(),
        secret_hash: hash_secret(secret),
        mask_prefix: value[..2].to_owned(),
        mask_suffix: value[value.len() - 4..].to_owned(),
        created_at: Utc::now(),
    }
}
