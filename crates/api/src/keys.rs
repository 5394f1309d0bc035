//! API keys, access tokens and teams: `/api-keys`, `/access-tokens`, `/teams`.
//!
//! These take an access token as `Authorization: Bearer …` (E2B's `AuthProviderBearerAuth`),
//! and the API-key routes the team in `X-Team-ID` (`AuthProviderTeamAuth`); without that
//! header they act for the team the token was created for.

use axum::Json;
use axum::extract::{FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use sandbar_core::{ApiKeyInfo, CreatedAccessToken, CreatedApiKey, Mask, Team, TeamView, User};
use serde::{Deserialize, Serialize};

use crate::AppState;
use crate::dto::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{JsonBody, PathParam};
use crate::openapi::{ApiKeyPath, CommonErrors};
use utoipa::{IntoResponses, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The user behind the bearer access token.
pub(crate) struct BearerUser(pub User);

impl FromRequestParts<AppState> for BearerUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let bearer = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        Ok(BearerUser(state.auth.user_for_access_token(bearer).await?))
    }
}

/// The bearer's user and the team it acts for (`X-Team-ID`, or its token's team).
pub(crate) struct UserTeam(pub User, pub Team);

impl FromRequestParts<AppState> for UserTeam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let BearerUser(user) = BearerUser::from_request_parts(parts, state).await?;
        let team_id = match parts.headers.get("x-team-id") {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .map(str::trim)
                    .map_err(|_| ApiError::bad_request("X-Team-ID must be a team id"))?,
            ),
        };
        let team = state.auth.team_of_user(&user, team_id).await?;
        state.rate_limits.check(&team)?;
        Ok(UserTeam(user, team))
    }
}

/// A name for a new or renamed key or token.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct NameBody {
    /// Free text without control characters, not blank, at most
    /// `sandbar_core::keys::MAX_NAME_LEN` characters.
    #[schema(min_length = 1, max_length = 256, pattern = "\\S")]
    pub name: String,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = IdentifierMaskingDetails)]
pub(crate) struct MaskBody {
    prefix: String,
    #[serde(rename = "valueLength")]
    value_length: usize,
    #[serde(rename = "maskedValuePrefix")]
    masked_value_prefix: String,
    #[serde(rename = "maskedValueSuffix")]
    masked_value_suffix: String,
}

impl From<&Mask> for MaskBody {
    fn from(m: &Mask) -> Self {
        Self {
            prefix: m.prefix.clone(),
            value_length: m.value_length,
            masked_value_prefix: m.masked_value_prefix.clone(),
            masked_value_suffix: m.masked_value_suffix.clone(),
        }
    }
}

/// `TeamUser`: users have no e-mail address here, and E2B marks the field deprecated.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TeamUser {
    id: String,
    #[schema(required = true)]
    email: Option<String>,
}

/// `TeamAPIKey`, and with `key` set `CreatedTeamAPIKey`.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = TeamAPIKey)]
pub(crate) struct ApiKeyBody {
    id: String,
    /// The key itself, only in the answer to its creation.
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<String>,
    name: String,
    mask: MaskBody,
    #[serde(rename = "createdAt")]
    #[schema(format = DateTime)]
    created_at: String,
    #[serde(rename = "createdBy")]
    #[schema(required = true)]
    created_by: Option<TeamUser>,
    #[serde(rename = "lastUsed")]
    #[schema(format = DateTime, required = true)]
    last_used: Option<String>,
}

impl From<&ApiKeyInfo> for ApiKeyBody {
    fn from(k: &ApiKeyInfo) -> Self {
        Self {
            id: k.id.clone(),
            key: None,
            name: k.name.clone(),
            mask: MaskBody::from(&k.mask),
            created_at: rfc3339(k.created_at),
            created_by: k.created_by.clone().map(|id| TeamUser { id, email: None }),
            last_used: k.last_used.map(rfc3339),
        }
    }
}

impl From<&CreatedApiKey> for ApiKeyBody {
    fn from(k: &CreatedApiKey) -> Self {
        Self {
            key: Some(k.key.clone()),
            ..Self::from(&k.info)
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = CreatedAccessToken)]
pub(crate) struct AccessTokenBody {
    id: String,
    name: String,
    token: String,
    mask: MaskBody,
    #[serde(rename = "createdAt")]
    #[schema(format = DateTime)]
    created_at: String,
}

impl From<&CreatedAccessToken> for AccessTokenBody {
    fn from(t: &CreatedAccessToken) -> Self {
        Self {
            id: t.id.clone(),
            name: t.name.clone(),
            token: t.token.clone(),
            mask: MaskBody::from(&t.mask),
            created_at: rfc3339(t.created_at),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Team)]
pub(crate) struct TeamBody {
    #[serde(rename = "teamID")]
    team_id: String,
    name: String,
    /// The mask of the team's newest key, never a usable key (only hashes are stored).
    #[serde(rename = "apiKey")]
    api_key: String,
    #[serde(rename = "isDefault")]
    is_default: bool,
}

impl From<&TeamView> for TeamBody {
    fn from(t: &TeamView) -> Self {
        Self {
            team_id: t.team.id.clone(),
            name: t.team.name.clone(),
            api_key: t.api_key.clone(),
            is_default: t.is_default,
        }
    }
}

/// What an operation for the team in `X-Team-ID` answers when that header is wrong.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum TeamHeaderErrors {
    #[response(status = 400, description = "Invalid `X-Team-ID` header")]
    InvalidHeader(ErrorBody),
    #[response(
        status = 403,
        description = "The user is not a member of the team in `X-Team-ID`"
    )]
    NotAMember(ErrorBody),
}

/// As [`TeamHeaderErrors`], for operations that take a name as well.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum NamedTeamHeaderErrors {
    #[response(status = 400, description = "Invalid name or `X-Team-ID` header")]
    Invalid(ErrorBody),
    #[response(
        status = 403,
        description = "The user is not a member of the team in `X-Team-ID`"
    )]
    NotAMember(ErrorBody),
}

#[utoipa::path(
    get,
    path = "/api-keys",
    tag = "auth",
    operation_id = "getApiKeys",
    security(("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = []), ("AccessTokenAuth" = [])),
    responses(
        (status = 200, description = "The team's API keys, masked", body = Vec<ApiKeyBody>),
        TeamHeaderErrors,
        CommonErrors,
    )
)]
pub(crate) async fn list_api_keys(
    State(state): State<AppState>,
    UserTeam(_, team): UserTeam,
) -> Result<Json<Vec<ApiKeyBody>>, ApiError> {
    let keys = state.auth.list_api_keys(&team).await?;
    Ok(Json(keys.iter().map(ApiKeyBody::from).collect()))
}

#[utoipa::path(
    post,
    path = "/api-keys",
    tag = "auth",
    operation_id = "postApiKeys",
    security(("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = []), ("AccessTokenAuth" = [])),
    request_body = NameBody,
    responses(
        (status = 201, description = "The new key, with its value shown this once", body = ApiKeyBody),
        NamedTeamHeaderErrors,
        CommonErrors,
    )
)]
pub(crate) async fn create_api_key(
    State(state): State<AppState>,
    UserTeam(user, team): UserTeam,
    JsonBody(body): JsonBody<NameBody>,
) -> Result<(StatusCode, Json<ApiKeyBody>), ApiError> {
    let created = state
        .auth
        .create_api_key(&team, &body.name, Some(&user))
        .await?;
    Ok((StatusCode::CREATED, Json(ApiKeyBody::from(&created))))
}

#[utoipa::path(
    patch,
    path = "/api-keys/{apiKeyID}",
    tag = "auth",
    operation_id = "patchApiKey",
    security(("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = []), ("AccessTokenAuth" = [])),
    params(ApiKeyPath),
    request_body = NameBody,
    responses(
        (status = 200, description = "The key was renamed"),
        NamedTeamHeaderErrors,
        (status = 404, description = "No such key in the team", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn rename_api_key(
    State(state): State<AppState>,
    UserTeam(_, team): UserTeam,
    PathParam(id): PathParam<String>,
    JsonBody(body): JsonBody<NameBody>,
) -> Result<StatusCode, ApiError> {
    state.auth.rename_api_key(&team, &id, &body.name).await?;
    Ok(StatusCode::OK)
}

#[utoipa::path(
    delete,
    path = "/api-keys/{apiKeyID}",
    tag = "auth",
    operation_id = "deleteApiKey",
    security(("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = []), ("AccessTokenAuth" = [])),
    params(ApiKeyPath),
    responses(
        (status = 204, description = "The key was deleted"),
        TeamHeaderErrors,
        (status = 404, description = "No such key in the team", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn delete_api_key(
    State(state): State<AppState>,
    UserTeam(_, team): UserTeam,
    PathParam(id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    state.auth.delete_api_key(&team, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post,
    path = "/access-tokens",
    tag = "auth",
    operation_id = "postAccessTokens",
    security(("AccessTokenAuth" = []), ("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = [])),
    request_body = NameBody,
    responses(
        (status = 201, description = "The new token, with its value shown this once", body = AccessTokenBody),
        NamedTeamHeaderErrors,
        CommonErrors,
    )
)]
pub(crate) async fn create_access_token(
    State(state): State<AppState>,
    UserTeam(user, _): UserTeam,
    JsonBody(body): JsonBody<NameBody>,
) -> Result<(StatusCode, Json<AccessTokenBody>), ApiError> {
    let created = state.auth.create_access_token(&user, &body.name).await?;
    Ok((StatusCode::CREATED, Json(AccessTokenBody::from(&created))))
}

#[utoipa::path(
    delete,
    path = "/access-tokens/{accessTokenID}",
    tag = "auth",
    operation_id = "deleteAccessToken",
    security(("AccessTokenAuth" = []), ("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = [])),
    params(("accessTokenID" = String, Path, description = "The token's ID")),
    responses(
        (status = 204, description = "The token was deleted"),
        TeamHeaderErrors,
        (status = 404, description = "No such token of the user", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn delete_access_token(
    State(state): State<AppState>,
    UserTeam(user, _): UserTeam,
    PathParam(id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    state.auth.delete_access_token(&user, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    get,
    path = "/teams",
    tag = "auth",
    operation_id = "getTeams",
    security(("AccessTokenAuth" = []), ("AuthProviderBearerAuth" = [], "AuthProviderTeamAuth" = [])),
    responses(
        (status = 200, description = "The user's teams", body = Vec<TeamBody>),
        TeamHeaderErrors,
        CommonErrors,
    )
)]
pub(crate) async fn list_teams(
    State(state): State<AppState>,
    UserTeam(user, _): UserTeam,
) -> Result<Json<Vec<TeamBody>>, ApiError> {
    let teams = state.auth.teams_of(&user).await?;
    Ok(Json(teams.iter().map(TeamBody::from).collect()))
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_api_keys, create_api_key))
        .routes(routes!(rename_api_key, delete_api_key))
        .routes(routes!(create_access_token))
        .routes(routes!(delete_access_token))
        .routes(routes!(list_teams))
}
