//! Sandbox lifecycle events: parse and validate, then read them through
//! [`sandbar_core::Sandboxes`].

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use sandbar_core::{SandboxEvent, SandboxEventQuery, SandboxEventType};
use serde::Serialize;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::dto::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{PathParam, QueryPairs, TeamAuth};
use crate::openapi::{CommonErrors, SandboxPath};

/// Events returned when `limit` is not given, and the most one page holds.
const DEFAULT_EVENT_LIMIT: i64 = 10;
const MAX_EVENT_LIMIT: i64 = 100;

/// A change in a sandbox's life.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SandboxEventView {
    /// The event shape's version (`v2`).
    version: String,
    id: String,
    /// `sandbox.lifecycle.` and one of `created`, `updated`, `paused`, `resumed`,
    /// `checkpointed`, `killed`.
    #[serde(rename = "type")]
    event_type: String,
    event_data: SandboxEventDataView,
    sandbox_build_id: String,
    sandbox_execution_id: String,
    sandbox_id: String,
    sandbox_team_id: String,
    sandbox_template_id: String,
    #[schema(format = DateTime)]
    timestamp: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxEventDataView {
    sandbox_metadata: BTreeMap<String, String>,
    /// On `paused` and `killed` events: the run that ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    execution: Option<SandboxExecutionView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxExecutionView {
    #[schema(format = DateTime)]
    started_at: String,
    vcpu_count: u32,
    memory_mb: u32,
    /// Milliseconds from `started_at` to the event.
    execution_time: i64,
}

impl From<&SandboxEvent> for SandboxEventView {
    fn from(e: &SandboxEvent) -> Self {
        Self {
            version: e.version.clone(),
            id: e.id.clone(),
            event_type: e.event_type.as_str().to_owned(),
            event_data: SandboxEventDataView {
                sandbox_metadata: e.event_data.sandbox_metadata.clone(),
                execution: e
                    .event_data
                    .execution
                    .as_ref()
                    .map(|x| SandboxExecutionView {
                        started_at: rfc3339(x.started_at),
                        vcpu_count: x.vcpu_count,
                        memory_mb: x.memory_mb,
                        execution_time: x.execution_time,
                    }),
            },
            sandbox_build_id: e.sandbox_build_id.clone(),
            sandbox_execution_id: e.sandbox_execution_id.clone(),
            sandbox_id: e.sandbox_id.clone(),
            sandbox_team_id: e.sandbox_team_id.clone(),
            sandbox_template_id: e.sandbox_template_id.clone(),
            timestamp: rfc3339(e.timestamp),
        }
    }
}

/// The query both event reads take, as the document describes it; [`event_query`] reads it.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
// Never constructed: the query is read from its pairs, as `types` may repeat.
#[allow(dead_code)]
struct EventParams {
    /// Events to skip (default 0)
    #[param(minimum = 0)]
    offset: Option<i32>,
    /// Most events returned (default 10)
    #[param(minimum = 1, maximum = 100)]
    limit: Option<i32>,
    /// Oldest first (default: newest first)
    #[param(rename = "orderAsc")]
    order_asc: Option<bool>,
    /// Only events of these types; repeat for several
    types: Option<Vec<String>>,
}

/// The query both event reads take: `offset`, `limit`, `orderAsc` and any number of
/// `types`.
fn event_query(
    query: &QueryPairs,
    sandbox_id: Option<String>,
) -> Result<SandboxEventQuery, ApiError> {
    let offset = query
        .int_in("offset", 0..=i64::from(i32::MAX))?
        .unwrap_or(0);
    let limit = query
        .int_in("limit", 1..=MAX_EVENT_LIMIT)?
        .unwrap_or(DEFAULT_EVENT_LIMIT);
    let ascending = match query.get("orderAsc") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "query parameter orderAsc must be true or false, got '{other}'"
            )));
        }
    };
    let mut types = Vec::new();
    for (_, name) in query.0.iter().filter(|(k, _)| k == "types") {
        let parsed = SandboxEventType::parse(name).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown event type '{name}': use one of {}",
                SandboxEventType::ALL
                    .map(SandboxEventType::as_str)
                    .join(", ")
            ))
        })?;
        if !types.contains(&parsed) {
            types.push(parsed);
        }
    }
    Ok(SandboxEventQuery {
        sandbox_id,
        types,
        offset: u32::try_from(offset).unwrap_or(u32::MAX),
        limit: u32::try_from(limit).unwrap_or(1),
        ascending,
    })
}

async fn read_events(
    state: &AppState,
    team: &sandbar_core::Team,
    query: SandboxEventQuery,
) -> Result<Json<Vec<SandboxEventView>>, ApiError> {
    let events = state.sandboxes.activity().events(team, &query).await?;
    Ok(Json(events.iter().map(SandboxEventView::from).collect()))
}

/// `GET /events/sandboxes`: the team's latest sandbox lifecycle events.
#[utoipa::path(
    get,
    path = "/events/sandboxes",
    tag = "events",
    operation_id = "getSandboxesEvents",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(EventParams),
    responses(
        (status = 200, description = "A page of the team's events", body = Vec<SandboxEventView>),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn team_events(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    query: QueryPairs,
) -> Result<Json<Vec<SandboxEventView>>, ApiError> {
    read_events(&state, &team, event_query(&query, None)?).await
}

/// `GET /events/sandboxes/{sandboxID}`: one sandbox's lifecycle events, also after it ended.
#[utoipa::path(
    get,
    path = "/events/sandboxes/{sandboxID}",
    tag = "events",
    operation_id = "getSandboxEvents",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        SandboxPath,
        EventParams,
    ),
    responses(
        (status = 200, description = "A page of the sandbox's events; none for a sandbox of another team", body = Vec<SandboxEventView>),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn sandbox_events(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Vec<SandboxEventView>>, ApiError> {
    read_events(&state, &team, event_query(&query, Some(sandbox_id))?).await
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(team_events))
        .routes(routes!(sandbox_events))
}
