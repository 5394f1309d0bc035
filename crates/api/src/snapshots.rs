//! Snapshots and forks of running sandboxes.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sandbar_core::sandboxes::{ForkResult, SnapshotInfo, SnapshotQuery};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::dto::{SandboxCreated, next_token_header};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiKeyTeam, JsonBody, PathParam, QueryPairs};
use crate::openapi::{CommonErrors, SandboxPath};

const DEFAULT_FORK_TIMEOUT: i64 = 15;
const MAX_PAGE: i64 = 100;

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct SnapshotBody {
    /// Name of the snapshot template; a snapshot of this name gets the new copy as its
    /// latest build.
    name: Option<String>,
    /// True (the default) copies the processes with their memory; false only the files,
    /// and sandboxes made from it boot afresh on them.
    memory: Option<bool>,
}

/// A snapshot template.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = SnapshotInfo)]
pub(crate) struct SnapshotView {
    /// What `Sandbox.create` takes to start from it: `name:default`, or `<templateID>:default`.
    #[serde(rename = "snapshotID")]
    snapshot_id: String,
    names: Vec<String>,
}

impl From<&SnapshotInfo> for SnapshotView {
    fn from(s: &SnapshotInfo) -> Self {
        Self {
            snapshot_id: s.snapshot_id.clone(),
            names: s.names.clone(),
        }
    }
}

/// `POST /sandboxes/{id}/snapshots`: the sandbox's files and processes copied into a
/// template; the sandbox runs on.
#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/snapshots",
    tag = "sandboxes",
    operation_id = "postSandboxSnapshots",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body(content = Option<SnapshotBody>),
    responses(
        (status = 201, description = "The snapshot was created", body = SnapshotView),
        (status = 400, description = "Invalid name", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running, or the name belongs to another template", body = ErrorBody),
        (status = 507, description = "The team's snapshots hold as many bytes as its limit allows", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<SnapshotBody>,
) -> Result<(StatusCode, Json<SnapshotView>), ApiError> {
    let info = state
        .sandboxes
        .snapshots()
        .snapshot(
            &team,
            &sandbox_id,
            body.name.as_deref(),
            body.memory.unwrap_or(true),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(SnapshotView::from(&info))))
}

/// `GET /snapshots`: the team's snapshots, newest first.
#[utoipa::path(
    get,
    path = "/snapshots",
    tag = "snapshots",
    operation_id = "getSnapshots",
    security(("ApiKeyAuth" = [])),
    params(
        ("sandboxID" = Option<String>, Query, description = "Only snapshots of this sandbox"),
        ("name" = Option<String>, Query, description = "Only the snapshot of this name or template ID (a tag is ignored)"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Items per page (default 100)"),
        ("nextToken" = Option<String>, Query, description = "Cursor from the previous page's `X-Next-Token`"),
    ),
    responses(
        (status = 200, description = "A page of the team's snapshots", body = Vec<SnapshotView>,
            headers(("X-Next-Token" = String, description = "Cursor of the next page, absent on the last"))),
        (status = 400, description = "Invalid limit", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let limit = query.int_in("limit", 1..=MAX_PAGE)?.unwrap_or(MAX_PAGE);
    let text = |name: &str| query.non_empty(name).map(str::to_owned);
    let filter = SnapshotQuery {
        sandbox_id: text("sandboxID"),
        name: text("name"),
        limit: limit as usize,
        next_token: text("nextToken"),
    };
    let (snapshots, next) = state
        .sandboxes
        .snapshots()
        .list_snapshots(&team, &filter)
        .await?;
    let body: Vec<SnapshotView> = snapshots.iter().map(SnapshotView::from).collect();
    Ok((next_token_header(next.as_deref()), Json(body)).into_response())
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ForkBody {
    /// Seconds the forks live (15 when omitted).
    #[schema(minimum = 0, maximum = 2147483647)]
    timeout: Option<i64>,
    /// How many forks to start, 1 to 100 (1 when omitted).
    #[schema(minimum = 1, maximum = 100)]
    count: Option<i64>,
}

/// One fork's outcome: exactly one of `sandbox` and `error`.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = SandboxForkResult)]
pub(crate) struct ForkView {
    #[serde(skip_serializing_if = "Option::is_none")]
    sandbox: Option<SandboxCreated>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorBody>,
}

/// `POST /sandboxes/{id}/fork`: the sandbox is snapshotted once (it runs on) and `count`
/// sandboxes start from the copy, each reported on its own.
#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/fork",
    tag = "sandboxes",
    operation_id = "postSandboxFork",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body(content = Option<ForkBody>),
    responses(
        (status = 201, description = "The sandbox was snapshotted and the forks attempted", body = Vec<ForkView>),
        (status = 400, description = "Invalid count or timeout", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn fork(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<Vec<ForkView>>), ApiError> {
    let timeout = body.timeout.unwrap_or(DEFAULT_FORK_TIMEOUT);
    let timeout = u64::try_from(timeout)
        .map_err(|_| ApiError::bad_request(format!("timeout {timeout} must not be negative")))?;
    let count = body.count.unwrap_or(1);
    let count = u32::try_from(count)
        .ok()
        .filter(|c| (1..=100).contains(c))
        .ok_or_else(|| ApiError::bad_request(format!("count {count} is outside 1..=100")))?;
    let results = state
        .sandboxes
        .snapshots()
        .fork(&team, &sandbox_id, timeout, count)
        .await?;
    let views = results
        .into_iter()
        .map(|r| match r {
            ForkResult::Started(sandbox) => ForkView {
                sandbox: Some(SandboxCreated::from(sandbox.as_ref())),
                error: None,
            },
            ForkResult::Failed(err) => ForkView {
                sandbox: None,
                error: Some(ErrorBody::from(ApiError::from(err))),
            },
        })
        .collect();
    Ok((StatusCode::CREATED, Json(views)))
}
