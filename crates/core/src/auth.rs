//! Teams' credentials: API keys (`e2b_…`) and access tokens (`sk_e2b_…`), stored as SHA-256
//! hashes and shown in full only once.

use std::sync::Arc;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;

use crate::ids::{self, API_KEY_PREFIX};
use crate::lookup_cache::LookupCache;
use crate::model::Team;
use crate::secrets::same_hash;
use crate::store::{Store, StoreError};

pub use crate::secrets::hash_secret;

/// How stale an API key's `lastUsed` may get: the store is written at most this often per key.
pub const LAST_USED_RESOLUTION: TimeDelta = TimeDelta::seconds(5);

/// The first credentials of an installation, written once for the operator.
#[derive(Debug, Clone, Serialize)]
pub struct Credentials {
    #[serde(rename = "apiKey")]
    pub api_key: String,
    #[serde(rename = "accessToken")]
    pub access_token: String,
    #[serde(rename = "teamID")]
    pub team_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("missing api key: send it in the X-API-Key header")]
    MissingApiKey,
    #[error("invalid api key")]
    InvalidApiKey,
    #[error("missing access token: send it as Authorization: Bearer <token>")]
    MissingAccessToken,
    #[error("invalid access token")]
    InvalidAccessToken,
    #[error(
        "the requested first api key is malformed: expected e2b_ followed by 40 lowercase hex characters"
    )]
    MalformedRequestedKey,
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub use crate::model::teams::TeamLimits;

#[derive(Clone)]
pub struct Auth {
    pub(crate) store: Arc<Store>,
    /// Held from counting a team's API keys to recording a new one.
    pub(crate) key_gate: Arc<crate::caps::TeamGate>,
    /// Valid API keys by the hash of their secret, kept while the store's lookup generation
    /// holds: a revoked key or a changed limit moves it.
    pub(crate) keys: Arc<LookupCache<String, KnownKey>>,
}

/// What a valid API key was found to be.
#[derive(Debug, Clone)]
pub(crate) struct KnownKey {
    id: String,
    last_used: Option<DateTime<Utc>>,
    team: Team,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth").finish_non_exhaustive()
    }
}

impl Auth {
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            key_gate: Arc::default(),
            keys: Arc::default(),
        }
    }

    /// On an empty store, creates the default team with its first API key (the requested one
    /// if given) and access token, and returns them; afterwards returns `None`.
    pub async fn bootstrap(
        &self,
        requested_api_key: Option<&str>,
        limits: TeamLimits,
    ) -> Result<Option<Credentials>, AuthError> {
        if let Some(key) = requested_api_key
            && !ids::is_well_formed_secret(key, API_KEY_PREFIX)
        {
            return Err(AuthError::MalformedRequestedKey);
        }
        if self.store.teams.team_count().await? > 0 {
            return Ok(None);
        }
        let inserted = self
            .insert_team_with_credentials("default", limits, requested_api_key)
            .await;
        let (team, api_key, access_token) = match inserted {
            Ok(inserted) => inserted,
            // Another host of a cluster started on the same empty store at the same moment
            // and made the first team (or its key) first: that team is the one there is.
            Err(StoreError::Conflict { .. }) if self.store.teams.team_count().await? > 0 => {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Some(Credentials {
            api_key,
            access_token,
            team_id: team.id,
        }))
    }

    /// The team of an API key. A revoked key or a changed limit applies to the very next
    /// request: an answer is kept only while the store's lookup generation holds.
    pub async fn team_for_api_key(&self, key: Option<&str>) -> Result<Team, AuthError> {
        let key = key
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::MissingApiKey)?;
        let hash = hash_secret(key);
        let generation = self.store.lookups.lookup_generation().await?;
        let known = match self.keys.get(generation, hash.as_str()) {
            Ok(known) => known,
            Err(miss) => {
                let (stored, team) = self
                    .store
                    .teams
                    .api_key_by_hash(&hash)
                    .await?
                    .filter(|(stored, _)| same_hash(&stored.secret.secret_hash, &hash))
                    .ok_or(AuthError::InvalidApiKey)?;
                let known = KnownKey {
                    id: stored.secret.id,
                    last_used: stored.last_used,
                    team,
                };
                self.keys.put(miss, hash.clone(), known.clone());
                known
            }
        };
        let now = Utc::now();
        if known
            .last_used
            .is_none_or(|last| now - last >= LAST_USED_RESOLUTION)
        {
            // Bounded to one write per key every few seconds, so busy keys do not serialize
            // every request on the database's write lock.
            self.store.teams.touch_api_key(&known.id, now).await?;
            self.keys.update(hash.as_str(), |k| k.last_used = Some(now));
        }
        Ok(known.team)
    }

    pub async fn team_for_access_token(&self, token: Option<&str>) -> Result<Team, AuthError> {
        let token = token
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::MissingAccessToken)?;
        let user = self.user_for_access_token(Some(token)).await?;
        self.store
            .teams
            .team(&user.token_team_id)
            .await?
            .ok_or(AuthError::InvalidAccessToken)
    }
}
