//! Teams, their members, API keys and access tokens.

use chrono::{DateTime, Utc};

use super::StoreError;
use crate::model::{Team, TeamLimits};

/// A stored credential: only the hash of the secret is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSecret {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub secret_hash: String,
    pub mask_prefix: String,
    pub mask_suffix: String,
    pub created_at: DateTime<Utc>,
}

/// An API key as listed: its secret's hash and mask, who made it and when it was last used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredApiKey {
    pub secret: StoredSecret,
    /// The user whose access token created the key; `None` for the operator's keys.
    pub created_by: Option<String>,
    pub last_used: Option<DateTime<Utc>>,
}

/// An access token; `secret.team_id` is the team it was created for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAccessToken {
    pub secret: StoredSecret,
    pub user_id: String,
}

#[async_trait::async_trait]
pub trait TeamRecords: Send + Sync {
    async fn team_count(&self) -> Result<u64, StoreError>;
    async fn insert_team(&self, team: &Team) -> Result<(), StoreError>;
    async fn insert_api_key(&self, key: &StoredSecret) -> Result<(), StoreError>;
    async fn insert_access_token(&self, token: &StoredSecret) -> Result<(), StoreError>;
    /// The team owning the API key whose hash is `hash`, recording the use.
    async fn team_by_api_key_hash(&self, hash: &str) -> Result<Option<Team>, StoreError>;
    async fn team_by_access_token_hash(&self, hash: &str) -> Result<Option<Team>, StoreError>;
    async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>, StoreError>;
    /// A slug for a new team named `name` that no team has yet.
    async fn free_team_slug(&self, name: &str) -> Result<String, StoreError>;
    /// The API key whose hash is `hash`, with its team.
    async fn api_key_by_hash(&self, hash: &str)
    -> Result<Option<(StoredApiKey, Team)>, StoreError>;
    async fn touch_api_key(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;
    async fn insert_team_api_key(&self, key: &StoredApiKey) -> Result<(), StoreError>;
    /// A team's API keys, oldest first.
    async fn team_api_keys(&self, team_id: &str) -> Result<Vec<StoredApiKey>, StoreError>;
    /// Renames the key if it belongs to `team_id`; whether it did.
    async fn rename_api_key(&self, team_id: &str, id: &str, name: &str)
    -> Result<bool, StoreError>;
    /// Deletes the key if it belongs to `team_id` (any team's for `None`); whether it did.
    async fn delete_api_key(&self, team_id: Option<&str>, id: &str) -> Result<bool, StoreError>;
    /// Creates a user who is a member of `team_id`.
    async fn insert_user(
        &self,
        id: &str,
        team_id: &str,
        is_default: bool,
    ) -> Result<(), StoreError>;
    async fn insert_user_access_token(&self, token: &StoredAccessToken) -> Result<(), StoreError>;
    async fn access_token_by_hash(
        &self,
        hash: &str,
    ) -> Result<Option<StoredAccessToken>, StoreError>;
    /// Deletes the token if it belongs to `user_id`; whether it did.
    async fn delete_access_token(&self, user_id: &str, id: &str) -> Result<bool, StoreError>;
    /// The teams `user_id` is a member of, each with whether it is the user's default.
    async fn user_teams(&self, user_id: &str) -> Result<Vec<(Team, bool)>, StoreError>;
    async fn team(&self, id: &str) -> Result<Option<Team>, StoreError>;
    /// Every team, oldest first.
    async fn teams(&self) -> Result<Vec<Team>, StoreError>;
    /// Replaces the team's limits; whether the team exists.
    async fn set_team_limits(&self, id: &str, limits: &TeamLimits) -> Result<bool, StoreError>;
}
