//! Sandbox logs and team metrics: parse and validate, then call [`sandbar_core::Sandboxes`].

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sandbar_core::{LogLevel, SandboxLogQuery, SandboxLogsError, TeamMetric, TeamMetricsError};

use crate::AppState;
use crate::dto::LogLevelName;
use crate::dto::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{PathParam, QueryPairs, TeamAuth};
use crate::openapi::{CommonErrors, SandboxPath, TeamPath};
use serde::Serialize;
use std::collections::BTreeMap;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// A structured line of a sandbox's log.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxLogEntry {
    #[schema(format = DateTime)]
    timestamp: String,
    level: LogLevelName,
    message: String,
    fields: BTreeMap<String, String>,
}

/// A line of a sandbox's log as JSON text.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxLogLine {
    #[schema(format = DateTime)]
    timestamp: String,
    line: String,
}

/// `GET /sandboxes/{sandboxID}/logs`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxLogs {
    logs: Vec<SandboxLogLine>,
    #[serde(rename = "logEntries")]
    log_entries: Vec<SandboxLogEntry>,
}

/// `GET /v2/sandboxes/{sandboxID}/logs`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxLogsV2 {
    logs: Vec<SandboxLogEntry>,
}

/// A sample of a team's sandbox activity.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TeamMetricPoint {
    #[schema(format = DateTime)]
    timestamp: String,
    timestamp_unix: i64,
    concurrent_sandboxes: u32,
    sandbox_start_rate: f64,
}

/// The largest value of a team metric in an interval, and when it was reached.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TeamMetricMax {
    #[schema(format = DateTime)]
    timestamp: String,
    timestamp_unix: i64,
    value: f64,
}

/// Default number of lines of both log reads; the v2 read's maximum.
const DEFAULT_LOG_LIMIT: i64 = 1000;
const MAX_SEARCH_LEN: usize = 256;
/// Latest Unix second a query may name (the end of year 9999).
const MAX_UNIX_SECS: i64 = 253_402_300_799;

impl From<SandboxLogsError> for ApiError {
    fn from(e: SandboxLogsError) -> Self {
        match e {
            SandboxLogsError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            SandboxLogsError::Store(s) => s.into(),
        }
    }
}

impl From<TeamMetricsError> for ApiError {
    fn from(e: TeamMetricsError) -> Self {
        match e {
            TeamMetricsError::OtherTeam(_) => Self::new(StatusCode::FORBIDDEN, e.to_string()),
            TeamMetricsError::StartAfterEnd { .. } => Self::bad_request(e.to_string()),
            TeamMetricsError::Store(s) => s.into(),
        }
    }
}

fn entry_json(entry: &sandbar_core::SandboxLogEntry) -> SandboxLogEntry {
    SandboxLogEntry {
        timestamp: rfc3339(entry.at),
        level: entry.level.into(),
        message: entry.message.clone(),
        fields: entry.fields.clone(),
    }
}

/// `GET /sandboxes/{id}/logs` (`start` in milliseconds, `limit`): oldest first, each line
/// both as JSON text (`logs`, what the CLI prints) and structured (`logEntries`).
#[utoipa::path(
    get,
    path = "/sandboxes/{sandboxID}/logs",
    tag = "sandboxes",
    operation_id = "getSandboxLogs",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        SandboxPath,
        ("start" = Option<i64>, Query, minimum = 0, description = "Milliseconds since the epoch of the first line"),
        ("limit" = Option<i32>, Query, minimum = 0, description = "Most lines returned (default 1000)"),
    ),
    responses(
        (status = 200, description = "The sandbox's log, oldest first", body = SandboxLogs),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn logs_v1(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<SandboxLogs>, ApiError> {
    let start = query.int_in("start", 0..=i64::MAX)?;
    let limit = query
        .int_in("limit", 0..=i64::from(i32::MAX))?
        .unwrap_or(DEFAULT_LOG_LIMIT);
    let request = SandboxLogQuery {
        cursor_ms: start,
        forward: true,
        limit: u32::try_from(limit).unwrap_or(u32::MAX),
        min_level: None,
        search: None,
    };
    let entries = state
        .sandboxes
        .activity()
        .logs(&team, &sandbox_id, &request)
        .await?;
    Ok(Json(SandboxLogs {
        logs: entries
            .iter()
            .map(|e| SandboxLogLine {
                timestamp: rfc3339(e.at),
                line: e.line(),
            })
            .collect(),
        log_entries: entries.iter().map(entry_json).collect(),
    }))
}

/// `GET /v2/sandboxes/{id}/logs` (`cursor` in milliseconds, `limit`, `direction`, `level`,
/// `search`).
#[utoipa::path(
    get,
    path = "/v2/sandboxes/{sandboxID}/logs",
    tag = "sandboxes",
    operation_id = "getV2SandboxLogs",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        SandboxPath,
        ("cursor" = Option<i64>, Query, minimum = 0, description = "Milliseconds since the epoch to start from"),
        ("limit" = Option<i32>, Query, minimum = 0, maximum = 1000, description = "Most lines returned (default 1000)"),
        ("direction" = Option<String>, Query, pattern = "^(forward|backward)$", description = "`forward` (default) or `backward` from the cursor"),
        ("level" = Option<LogLevelName>, Query, description = "Lowest level of the lines returned (upper case is accepted too)"),
        ("search" = Option<String>, Query, max_length = 256, description = "Only lines containing this text"),
    ),
    responses(
        (status = 200, description = "The sandbox's log lines", body = SandboxLogsV2),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn logs_v2(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<SandboxLogsV2>, ApiError> {
    let cursor = query.int_in("cursor", 0..=i64::MAX)?;
    let limit = query
        .int_in("limit", 0..=DEFAULT_LOG_LIMIT)?
        .unwrap_or(DEFAULT_LOG_LIMIT);
    let forward = query.forward()?;
    let min_level = query
        .get("level")
        .map(|l| {
            LogLevel::parse(&l.to_ascii_lowercase()).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "level must be one of debug, info, warn, error; got '{l}'"
                ))
            })
        })
        .transpose()?;
    let search = query.non_empty("search");
    if let Some(search) = search
        && search.chars().count() > MAX_SEARCH_LEN
    {
        return Err(ApiError::bad_request(format!(
            "search must be at most {MAX_SEARCH_LEN} characters, got {}",
            search.chars().count()
        )));
    }
    let request = SandboxLogQuery {
        cursor_ms: cursor,
        forward,
        limit: u32::try_from(limit).unwrap_or(u32::MAX),
        min_level,
        search: search.map(str::to_owned),
    };
    let entries = state
        .sandboxes
        .activity()
        .logs(&team, &sandbox_id, &request)
        .await?;
    Ok(Json(SandboxLogsV2 {
        logs: entries.iter().map(entry_json).collect(),
    }))
}

/// The interval of the team metrics' reads, as the document describes it; [`interval`]
/// reads it.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
// Never constructed: the interval is read from the query's pairs.
#[allow(dead_code)]
struct IntervalParams {
    /// Unix seconds: the interval's start
    #[param(minimum = 0, maximum = 253402300799_i64)]
    start: Option<i64>,
    /// Unix seconds: the interval's end
    #[param(minimum = 0, maximum = 253402300799_i64)]
    end: Option<i64>,
}

fn interval(query: &QueryPairs) -> Result<(Option<i64>, Option<i64>), ApiError> {
    let start = query.int_in("start", 0..=MAX_UNIX_SECS)?;
    let end = query.int_in("end", 0..=MAX_UNIX_SECS)?;
    if let (Some(s), Some(e)) = (start, end)
        && s > e
    {
        return Err(ApiError::bad_request(format!(
            "start {s} must not be after end {e}"
        )));
    }
    Ok((start, end))
}

/// `GET /teams/{teamID}/metrics` (`start`, `end` in Unix seconds).
#[utoipa::path(
    get,
    path = "/teams/{teamID}/metrics",
    tag = "auth",
    operation_id = "getTeamMetrics",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        TeamPath,
        IntervalParams,
    ),
    responses(
        (status = 200, description = "The team's samples, oldest first", body = Vec<TeamMetricPoint>),
        (status = 400, description = "Invalid interval", body = ErrorBody),
        (status = 403, description = "The team is not the caller's", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn team_metrics(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(team_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Vec<TeamMetricPoint>>, ApiError> {
    let (start, end) = interval(&query)?;
    let points = state
        .sandboxes
        .activity()
        .team_metrics(&team, &team_id, start, end)
        .await?;
    Ok(Json(
        points
            .iter()
            .map(|p| TeamMetricPoint {
                timestamp: rfc3339(p.at),
                timestamp_unix: p.at.timestamp(),
                concurrent_sandboxes: p.concurrent_sandboxes,
                sandbox_start_rate: p.sandbox_start_rate,
            })
            .collect(),
    ))
}

/// `GET /teams/{teamID}/metrics/max?metric=concurrent_sandboxes|sandbox_start_rate`.
#[utoipa::path(
    get,
    path = "/teams/{teamID}/metrics/max",
    tag = "auth",
    operation_id = "getTeamMetricsMax",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        TeamPath,
        ("metric" = String, Query, pattern = "^(concurrent_sandboxes|sandbox_start_rate)$", description = "`concurrent_sandboxes` or `sandbox_start_rate`"),
        IntervalParams,
    ),
    responses(
        (status = 200, description = "The metric's largest value in the interval", body = TeamMetricMax),
        (status = 400, description = "Invalid interval", body = ErrorBody),
        (status = 403, description = "The team is not the caller's", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn team_metric_max(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(team_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<TeamMetricMax>, ApiError> {
    let metric = match query.get("metric") {
        None => {
            return Err(ApiError::bad_request(
                "metric is required: concurrent_sandboxes or sandbox_start_rate",
            ));
        }
        Some(m) => TeamMetric::parse(m).ok_or_else(|| {
            ApiError::bad_request(format!(
                "metric must be concurrent_sandboxes or sandbox_start_rate, got '{m}'"
            ))
        })?,
    };
    let (start, end) = interval(&query)?;
    let max = state
        .sandboxes
        .activity()
        .team_metric_max(&team, &team_id, metric, start, end)
        .await?;
    Ok(Json(TeamMetricMax {
        timestamp: rfc3339(max.at),
        timestamp_unix: max.at.timestamp(),
        value: max.value,
    }))
}

/// The routes of this module, merged into the API router.
pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(logs_v1))
        .routes(routes!(logs_v2))
        .routes(routes!(team_metrics))
        .routes(routes!(team_metric_max))
}
