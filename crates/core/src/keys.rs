//! Managing credentials and teams: API keys and access tokens through the API, teams and
//! their limits for the operator.
//!
//! Users exist only behind access tokens: each token belongs to one user, and a user is a
//! member of the teams it was made for. API keys belong to a team and remember the user who
//! created them. Secrets are shown once, at creation; every later read shows a [`Mask`].

use chrono::{DateTime, Utc};

use crate::auth::{Auth, AuthError, TeamLimits};
use crate::ids::{self, ACCESS_TOKEN_PREFIX, API_KEY_PREFIX};
use crate::model::Team;
use crate::secrets::{hash_secret, same_hash, stored};
use crate::store::{StoreError, StoredAccessToken, StoredApiKey, StoredSecret};

/// Hex characters after a secret's prefix (see [`ids::new_secret`]).
pub const SECRET_VALUE_LEN: usize = 40;

/// Longest name accepted for a key, a token or a team.
pub const MAX_NAME_LEN: usize = 256;

/// What may be shown of a secret after its creation, in E2B's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mask {
    /// The secret's type prefix (`e2b_`, `sk_e2b_`).
    pub prefix: String,
    /// Length of the secret after the prefix.
    pub value_length: usize,
    pub masked_value_prefix: String,
    pub masked_value_suffix: String,
}

impl Mask {
    pub fn of(prefix: &str, secret: &StoredSecret) -> Self {
        Self {
            prefix: prefix.to_owned(),
            value_length: SECRET_VALUE_LEN,
            masked_value_prefix: secret.mask_prefix.clone(),
            masked_value_suffix: secret.mask_suffix.clone(),
        }
    }

    /// The secret with its hidden middle as `*`: recognisable, useless as a credential.
    pub fn display(&self) -> String {
        let hidden = self
            .value_length
            .saturating_sub(self.masked_value_prefix.len() + self.masked_value_suffix.len());
        format!(
            "{}{}{}{}",
            self.prefix,
            self.masked_value_prefix,
            "*".repeat(hidden),
            self.masked_value_suffix
        )
    }
}

/// An API key as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyInfo {
    pub id: String,
    pub name: String,
    pub mask: Mask,
    pub created_at: DateTime<Utc>,
    pub created_by: Option<String>,
    pub last_used: Option<DateTime<Utc>>,
}

impl From<&StoredApiKey> for ApiKeyInfo {
    fn from(key: &StoredApiKey) -> Self {
        Self {
            id: key.secret.id.clone(),
            name: key.secret.name.clone(),
            mask: Mask::of(API_KEY_PREFIX, &key.secret),
            created_at: key.secret.created_at,
            created_by: key.created_by.clone(),
            last_used: key.last_used,
        }
    }
}

/// A new API key: the only time its value is available.
#[derive(Debug, Clone)]
pub struct CreatedApiKey {
    pub info: ApiKeyInfo,
    pub key: String,
}

/// A new access token: the only time its value is available.
#[derive(Debug, Clone)]
pub struct CreatedAccessToken {
    pub id: String,
    pub name: String,
    pub token: String,
    pub mask: Mask,
    pub created_at: DateTime<Utc>,
}

/// Whoever presented an access token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub id: String,
    /// The team the presented token was created for.
    pub token_team_id: String,
}

/// A team as its member sees it in `GET /teams`.
#[derive(Debug, Clone)]
pub struct TeamView {
    pub team: Team,
    pub is_default: bool,
    /// The mask of the team's newest API key (empty without keys): only hashes are stored,
    /// so no usable key can be shown here.
    pub api_key: String,
}

/// A team made by the operator with its first credentials.
#[derive(Debug, Clone)]
pub struct NewTeam {
    pub team: Team,
    pub api_key: String,
    pub api_key_id: String,
    pub access_token: String,
}

/// A change of some of a team's limits; `None` keeps the current value.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimitChanges {
    pub max_concurrent_sandboxes: Option<u32>,
    pub max_sandbox_timeout_secs: Option<u64>,
    pub requests_per_minute: Option<u32>,
    pub max_vcpu: Option<u32>,
    pub max_memory_mb: Option<u32>,
    pub max_disk_mb: Option<u32>,
    pub disk_read_mbps: Option<u32>,
    pub disk_write_mbps: Option<u32>,
    pub disk_read_iops: Option<u32>,
    pub disk_write_iops: Option<u32>,
    pub max_snapshots: Option<u32>,
    pub max_snapshot_mb: Option<u32>,
    pub max_templates: Option<u32>,
    pub max_volumes: Option<u32>,
    pub max_volume_mb: Option<u32>,
    pub max_tags_per_template: Option<u32>,
    pub max_api_keys: Option<u32>,
}

impl LimitChanges {
    /// Whether nothing would change.
    pub fn is_empty(&self) -> bool {
        [
            self.max_concurrent_sandboxes,
            self.requests_per_minute,
            self.max_vcpu,
            self.max_memory_mb,
            self.max_disk_mb,
            self.disk_read_mbps,
            self.disk_write_mbps,
            self.disk_read_iops,
            self.disk_write_iops,
            self.max_snapshots,
            self.max_snapshot_mb,
            self.max_templates,
            self.max_volumes,
            self.max_volume_mb,
            self.max_tags_per_template,
            self.max_api_keys,
        ]
        .iter()
        .all(Option::is_none)
            && self.max_sandbox_timeout_secs.is_none()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TeamAccessError {
    #[error("this access token gives no access to team '{0}'")]
    NoAccess(String),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum CreateCredentialError {
    #[error("invalid name: {0}")]
    BadName(NameError),
    #[error(transparent)]
    Cap(#[from] crate::caps::CapError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum RenameApiKeyError {
    #[error("api key '{0}' not found")]
    NotFound(String),
    #[error("invalid name: {0}")]
    BadName(NameError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum DeleteApiKeyError {
    #[error("api key '{0}' not found")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum DeleteAccessTokenError {
    #[error("access token '{0}' not found")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum TeamAdminError {
    #[error("team '{0}' not found")]
    NotFound(String),
    #[error("team name '{0}' is ambiguous: use the team id")]
    Ambiguous(String),
    #[error("invalid name: {0}")]
    BadName(NameError),
    #[error("{field} must be between {min} and {max}, got {value}")]
    BadLimit {
        field: &'static str,
        min: u64,
        max: u64,
        value: u64,
    },
    #[error(transparent)]
    Cap(#[from] crate::caps::CapError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a key's, token's or team's name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("name must not be empty")]
    Empty,
    #[error("name is longer than {MAX_NAME_LEN} characters")]
    TooLong,
    #[error("name must not contain control characters")]
    Control,
}

/// A name is free text, but not empty and not absurdly long; control characters would only
/// garble listings.
fn check_name(name: &str) -> Result<String, NameError> {
    let name = name.trim();
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.chars().count() > MAX_NAME_LEN {
        return Err(NameError::TooLong);
    }
    if name.chars().any(char::is_control) {
        return Err(NameError::Control);
    }
    Ok(name.to_owned())
}

fn check_limit(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), TeamAdminError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(TeamAdminError::BadLimit {
            field,
            min,
            max,
            value,
        })
    }
}

impl TeamLimits {
    /// Ranges an operator may set: a team needs at least one sandbox and one second of
    /// lifetime; the upper bounds keep the numbers inside what the store's integers hold.
    pub fn validate(&self) -> Result<(), TeamAdminError> {
        check_limit(
            "max-sandboxes",
            self.max_concurrent_sandboxes.into(),
            1,
            100_000,
        )?;
        check_limit(
            "max-timeout-secs",
            self.max_sandbox_timeout_secs,
            1,
            i32::MAX as u64,
        )?;
        check_limit(
            "requests-per-minute",
            self.requests_per_minute.into(),
            0,
            1_000_000,
        )?;
        check_limit("max-vcpu", self.max_vcpu.into(), 0, 1024)?;
        check_limit("max-memory-mb", self.max_memory_mb.into(), 0, 1 << 24)?;
        check_limit("max-disk-mb", self.max_disk_mb.into(), 0, 1 << 24)?;
        let rates = &self.disk_rates;
        check_limit("disk-read-mbps", rates.read_mbps.into(), 0, 1 << 20)?;
        check_limit("disk-write-mbps", rates.write_mbps.into(), 0, 1 << 20)?;
        check_limit("disk-read-iops", rates.read_iops.into(), 0, 1 << 24)?;
        check_limit("disk-write-iops", rates.write_iops.into(), 0, 1 << 24)?;
        let caps = &self.caps;
        for (field, value) in [
            ("max-snapshots", caps.max_snapshots),
            ("max-templates", caps.max_templates),
            ("max-volumes", caps.max_volumes),
            ("max-tags-per-template", caps.max_tags_per_template),
            ("max-api-keys", caps.max_api_keys),
        ] {
            check_limit(field, value.into(), 0, 1_000_000)?;
        }
        check_limit("max-snapshot-mb", caps.max_snapshot_mb.into(), 0, 1 << 30)?;
        check_limit("max-volume-mb", caps.max_volume_mb.into(), 0, 1 << 30)?;
        Ok(())
    }

    /// These limits with the given ones changed.
    pub fn with(mut self, changes: LimitChanges) -> Self {
        set_given(
            &mut self.max_concurrent_sandboxes,
            changes.max_concurrent_sandboxes,
        );
        set_given(
            &mut self.max_sandbox_timeout_secs,
            changes.max_sandbox_timeout_secs,
        );
        set_given(&mut self.requests_per_minute, changes.requests_per_minute);
        set_given(&mut self.max_vcpu, changes.max_vcpu);
        set_given(&mut self.max_memory_mb, changes.max_memory_mb);
        set_given(&mut self.max_disk_mb, changes.max_disk_mb);
        set_given(&mut self.disk_rates.read_mbps, changes.disk_read_mbps);
        set_given(&mut self.disk_rates.write_mbps, changes.disk_write_mbps);
        set_given(&mut self.disk_rates.read_iops, changes.disk_read_iops);
        set_given(&mut self.disk_rates.write_iops, changes.disk_write_iops);
        set_given(&mut self.caps.max_snapshots, changes.max_snapshots);
        set_given(&mut self.caps.max_snapshot_mb, changes.max_snapshot_mb);
        set_given(&mut self.caps.max_templates, changes.max_templates);
        set_given(&mut self.caps.max_volumes, changes.max_volumes);
        set_given(&mut self.caps.max_volume_mb, changes.max_volume_mb);
        set_given(
            &mut self.caps.max_tags_per_template,
            changes.max_tags_per_template,
        );
        set_given(&mut self.caps.max_api_keys, changes.max_api_keys);
        self
    }
}

/// Replaces `field` with `change` where one was given.
fn set_given<T>(field: &mut T, change: Option<T>) {
    if let Some(value) = change {
        *field = value;
    }
}

impl Auth {
    /// Creates a team, a user who is its member, an API key and an access token.
    pub(crate) async fn insert_team_with_credentials(
        &self,
        name: &str,
        limits: TeamLimits,
        requested_api_key: Option<&str>,
    ) -> Result<(Team, String, String), StoreError> {
        let team = Team {
            id: ids::new_uuid(),
            name: name.to_owned(),
            slug: self.store.teams.free_team_slug(name).await?,
            limits,
        };
        self.store.teams.insert_team(&team).await?;
        let user_id = ids::new_uuid();
        self.store
            .teams
            .insert_user(&user_id, &team.id, true)
            .await?;
        let api_key = requested_api_key
            .map(str::to_owned)
            .unwrap_or_else(|| ids::new_secret(API_KEY_PREFIX));
        let access_token = ids::new_secret(ACCESS_TOKEN_PREFIX);
        self.store
            .teams
            .insert_team_api_key(&StoredApiKey {
                secret: stored(&team.id, "default", &api_key, API_KEY_PREFIX),
                created_by: None,
                last_used: None,
            })
            .await?;
        self.store
            .teams
            .insert_user_access_token(&StoredAccessToken {
                secret: stored(&team.id, "default", &access_token, ACCESS_TOKEN_PREFIX),
                user_id,
            })
            .await?;
        Ok((team, api_key, access_token))
    }

    /// The user behind an access token, read from the store on every call so that a deleted
    /// token stops working at once.
    pub async fn user_for_access_token(&self, token: Option<&str>) -> Result<User, AuthError> {
        let token = token
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::MissingAccessToken)?;
        let hash = hash_secret(token);
        let stored = self
            .store
            .teams
            .access_token_by_hash(&hash)
            .await?
            .filter(|t| same_hash(&t.secret.secret_hash, &hash))
            .ok_or(AuthError::InvalidAccessToken)?;
        Ok(User {
            id: stored.user_id,
            token_team_id: stored.secret.team_id,
        })
    }

    /// The team a user acts for: the one named (by `X-Team-ID`) if the user is a member, or
    /// else the team the user's token was created for. A team the user is not a member of
    /// is refused the same way whether it exists or not.
    pub async fn team_of_user(
        &self,
        user: &User,
        team_id: Option<&str>,
    ) -> Result<Team, TeamAccessError> {
        let wanted = team_id.unwrap_or(&user.token_team_id);
        self.store
            .teams
            .user_teams(&user.id)
            .await?
            .into_iter()
            .map(|(team, _)| team)
            .find(|team| team.id == wanted)
            .ok_or_else(|| TeamAccessError::NoAccess(wanted.to_owned()))
    }

    pub async fn list_api_keys(&self, team: &Team) -> Result<Vec<ApiKeyInfo>, StoreError> {
        Ok(self
            .store
            .teams
            .team_api_keys(&team.id)
            .await?
            .iter()
            .map(ApiKeyInfo::from)
            .collect())
    }

    pub async fn create_api_key(
        &self,
        team: &Team,
        name: &str,
        created_by: Option<&User>,
    ) -> Result<CreatedApiKey, CreateCredentialError> {
        let name = check_name(name).map_err(CreateCredentialError::BadName)?;
        let key = ids::new_secret(API_KEY_PREFIX);
        let stored = StoredApiKey {
            secret: stored(&team.id, &name, &key, API_KEY_PREFIX),
            created_by: created_by.map(|u| u.id.clone()),
            last_used: None,
        };
        let _turn = self.key_gate.enter(&team.id).await;
        let have = self.store.teams.team_api_keys(&team.id).await?.len();
        crate::caps::check_count(team, "API keys", team.limits.caps.max_api_keys, have)?;
        self.store.teams.insert_team_api_key(&stored).await?;
        Ok(CreatedApiKey {
            info: ApiKeyInfo::from(&stored),
            key,
        })
    }

    pub async fn rename_api_key(
        &self,
        team: &Team,
        id: &str,
        name: &str,
    ) -> Result<(), RenameApiKeyError> {
        let name = check_name(name).map_err(RenameApiKeyError::BadName)?;
        if self.store.teams.rename_api_key(&team.id, id, &name).await? {
            Ok(())
        } else {
            Err(RenameApiKeyError::NotFound(id.to_owned()))
        }
    }

    /// Deletes one of the team's keys; it stops working with the next request. The team's
    /// last key may go too, as in E2B: its access tokens can still create new ones.
    pub async fn delete_api_key(&self, team: &Team, id: &str) -> Result<(), DeleteApiKeyError> {
        if self.store.teams.delete_api_key(Some(&team.id), id).await? {
            self.keys.forget_all();
            Ok(())
        } else {
            Err(DeleteApiKeyError::NotFound(id.to_owned()))
        }
    }

    /// A new token for the same user, created for the same team as the presented one.
    pub async fn create_access_token(
        &self,
        user: &User,
        name: &str,
    ) -> Result<CreatedAccessToken, CreateCredentialError> {
        let name = check_name(name).map_err(CreateCredentialError::BadName)?;
        let token = ids::new_secret(ACCESS_TOKEN_PREFIX);
        let secret = stored(&user.token_team_id, &name, &token, ACCESS_TOKEN_PREFIX);
        self.store
            .teams
            .insert_user_access_token(&StoredAccessToken {
                secret: secret.clone(),
                user_id: user.id.clone(),
            })
            .await?;
        Ok(CreatedAccessToken {
            mask: Mask::of(ACCESS_TOKEN_PREFIX, &secret),
            id: secret.id,
            name,
            token,
            created_at: secret.created_at,
        })
    }

    pub async fn delete_access_token(
        &self,
        user: &User,
        id: &str,
    ) -> Result<(), DeleteAccessTokenError> {
        if self.store.teams.delete_access_token(&user.id, id).await? {
            Ok(())
        } else {
            Err(DeleteAccessTokenError::NotFound(id.to_owned()))
        }
    }

    pub async fn teams_of(&self, user: &User) -> Result<Vec<TeamView>, StoreError> {
        let mut views = Vec::new();
        for (team, is_default) in self.store.teams.user_teams(&user.id).await? {
            let api_key = self
                .store
                .teams
                .team_api_keys(&team.id)
                .await?
                .iter()
                .max_by_key(|k| k.secret.created_at)
                .map(|k| Mask::of(API_KEY_PREFIX, &k.secret).display())
                .unwrap_or_default();
            views.push(TeamView {
                team,
                is_default,
                api_key,
            });
        }
        Ok(views)
    }

    /// The operator's `team create`.
    pub async fn create_team(
        &self,
        name: &str,
        limits: TeamLimits,
    ) -> Result<NewTeam, TeamAdminError> {
        let name = check_name(name).map_err(TeamAdminError::BadName)?;
        limits.validate()?;
        let (team, api_key, access_token) = self
            .insert_team_with_credentials(&name, limits, None)
            .await?;
        let api_key_id = self
            .store
            .teams
            .team_api_keys(&team.id)
            .await?
            .first()
            .map(|k| k.secret.id.clone())
            .unwrap_or_default();
        Ok(NewTeam {
            team,
            api_key,
            api_key_id,
            access_token,
        })
    }

    pub async fn all_teams(&self) -> Result<Vec<Team>, StoreError> {
        self.store.teams.teams().await
    }

    /// A team by id, or by name when exactly one team has it.
    pub async fn find_team(&self, reference: &str) -> Result<Team, TeamAdminError> {
        if let Some(team) = self.store.teams.team(reference).await? {
            return Ok(team);
        }
        let mut named = self
            .store
            .teams
            .teams()
            .await?
            .into_iter()
            .filter(|t| t.name == reference);
        match (named.next(), named.next()) {
            (Some(team), None) => Ok(team),
            (Some(_), Some(_)) => Err(TeamAdminError::Ambiguous(reference.to_owned())),
            _ => Err(TeamAdminError::NotFound(reference.to_owned())),
        }
    }

    /// The operator's `team set-limits`; a running server applies them from its next request
    /// of the team on, since the change moves the store's lookup generation.
    pub async fn set_team_limits(
        &self,
        reference: &str,
        changes: LimitChanges,
    ) -> Result<Team, TeamAdminError> {
        let mut team = self.find_team(reference).await?;
        let limits = team.limits.with(changes);
        limits.validate()?;
        if !self.store.teams.set_team_limits(&team.id, &limits).await? {
            return Err(TeamAdminError::NotFound(reference.to_owned()));
        }
        self.keys.forget_all();
        team.limits = limits;
        Ok(team)
    }

    /// The operator's `key create`.
    pub async fn create_team_api_key(
        &self,
        reference: &str,
        name: &str,
    ) -> Result<CreatedApiKey, TeamAdminError> {
        let team = self.find_team(reference).await?;
        self.create_api_key(&team, name, None)
            .await
            .map_err(|e| match e {
                CreateCredentialError::BadName(m) => TeamAdminError::BadName(m),
                CreateCredentialError::Cap(c) => TeamAdminError::Cap(c),
                CreateCredentialError::Store(s) => TeamAdminError::Store(s),
            })
    }

    /// The operator's `key list`.
    pub async fn team_api_keys(&self, reference: &str) -> Result<Vec<ApiKeyInfo>, TeamAdminError> {
        let team = self.find_team(reference).await?;
        Ok(self.list_api_keys(&team).await?)
    }

    /// The operator's `key revoke`: any team's key.
    pub async fn revoke_api_key(&self, id: &str) -> Result<(), DeleteApiKeyError> {
        if self.store.teams.delete_api_key(None, id).await? {
            self.keys.forget_all();
            Ok(())
        } else {
            Err(DeleteApiKeyError::NotFound(id.to_owned()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(value: &str) -> StoredSecret {
        stored("team", "k", value, API_KEY_PREFIX)
    }

    #[test]
    fn masks_show_only_the_ends_of_a_secret() {
        let key = "e2b_0123456789abcdef0123456789abcdef01234567";
        let stored = secret(key);
        let mask = Mask::of(API_KEY_PREFIX, &stored);
        assert_eq!(mask.prefix, "e2b_");
        assert_eq!(mask.value_length, 40);
        assert_eq!(mask.masked_value_prefix, "01");
        assert_eq!(mask.masked_value_suffix, "4567");
        let shown = mask.display();
        assert_eq!(shown.len(), key.len());
        assert!(shown.starts_with("e2b_01*"));
        assert!(shown.ends_with("*4567"));
        assert_eq!(shown.matches('*').count(), 34);
    }

    #[test]
    fn secrets_are_stored_as_their_sha256() {
        let key = ids::new_secret(API_KEY_PREFIX);
        let stored = secret(&key);
        assert_eq!(stored.secret_hash.len(), 64);
        assert!(!stored.secret_hash.contains(&key[4..]));
        assert_eq!(stored.secret_hash, hash_secret(&key));
        assert_ne!(hash_secret(&key), hash_secret(&format!("{key}0")));
    }

    #[test]
    fn hash_comparison_needs_every_byte() {
        let a = hash_secret("e2b_a");
        assert!(same_hash(&a, &a.clone()));
        let mut b = a.clone().into_bytes();
        b[63] = if b[63] == b'0' { b'1' } else { b'0' };
        assert!(!same_hash(&a, &String::from_utf8(b).expect("ascii")));
        assert!(!same_hash(&a, &a[..63]));
    }

    #[test]
    fn names_are_trimmed_and_checked() {
        assert_eq!(check_name("  ci key ").as_deref(), Ok("ci key"));
        let refusal = |name: &str| check_name(name).map_err(|e| e.to_string());
        assert_eq!(refusal("   "), Err("name must not be empty".to_owned()));
        assert_eq!(
            refusal("a\nb"),
            Err("name must not contain control characters".to_owned())
        );
        assert_eq!(
            refusal(&"x".repeat(MAX_NAME_LEN + 1)),
            Err(format!("name is longer than {MAX_NAME_LEN} characters"))
        );
        assert!(check_name(&"é".repeat(MAX_NAME_LEN)).is_ok());
    }

    #[test]
    fn limits_are_checked_and_changed_one_by_one() {
        let base = TeamLimits {
            max_concurrent_sandboxes: 5,
            max_sandbox_timeout_secs: 3600,
            requests_per_minute: 60,
            max_vcpu: 0,
            max_memory_mb: 0,
            max_disk_mb: 0,
            disk_rates: Default::default(),
            caps: crate::model::TeamCaps::DEFAULT,
        };
        assert!(base.validate().is_ok());
        let changed = base.with(LimitChanges {
            max_vcpu: Some(2),
            ..LimitChanges::default()
        });
        assert_eq!(changed.max_vcpu, 2);
        assert_eq!(changed.max_concurrent_sandboxes, 5);
        for (changes, refused) in [
            (
                LimitChanges {
                    max_concurrent_sandboxes: Some(0),
                    ..LimitChanges::default()
                },
                "max-sandboxes",
            ),
            (
                LimitChanges {
                    max_tags_per_template: Some(1_000_001),
                    ..LimitChanges::default()
                },
                "max-tags-per-template",
            ),
            (
                LimitChanges {
                    disk_read_mbps: Some((1 << 20) + 1),
                    ..LimitChanges::default()
                },
                "disk-read-mbps",
            ),
        ] {
            assert!(
                matches!(
                    base.with(changes).validate(),
                    Err(TeamAdminError::BadLimit { field, .. }) if field == refused
                ),
                "{refused}"
            );
        }
        let capped = base.with(LimitChanges {
            max_snapshots: Some(3),
            max_volume_mb: Some(0),
            max_api_keys: Some(7),
            ..LimitChanges::default()
        });
        assert_eq!(
            (
                capped.caps.max_snapshots,
                capped.caps.max_volume_mb,
                capped.caps.max_api_keys,
                capped.caps.max_templates
            ),
            (3, 0, 7, crate::model::TeamCaps::DEFAULT.max_templates)
        );
        assert!(capped.validate().is_ok());
        let rated = base.with(LimitChanges {
            disk_write_mbps: Some(50),
            disk_read_iops: Some(900),
            ..LimitChanges::default()
        });
        assert_eq!(
            rated.disk_rates,
            crate::model::DiskRates {
                read_mbps: 0,
                write_mbps: 50,
                read_iops: 900,
                write_iops: 0,
            }
        );
        assert!(rated.validate().is_ok());
        assert!(
            !LimitChanges {
                disk_write_iops: Some(1),
                ..LimitChanges::default()
            }
            .is_empty()
        );
        assert!(LimitChanges::default().is_empty());
        assert!(
            !LimitChanges {
                max_api_keys: Some(1),
                ..LimitChanges::default()
            }
            .is_empty()
        );
    }
}
