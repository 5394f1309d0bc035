//! Sandbox logs and team metrics: parse and validate, then call [`sandbar_core::Sandboxes`].

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sandbar_core::{
    LogLevel, SandboxLogEntry, SandboxLogQuery, SandboxLogsError, TeamMetric, TeamMetricsError,
};
use serde_json::{Value, json};

use crate::AppState;
use crate::dto::rfc3339;
use crate::error::ApiError;
use crate::extract::{PathParam, QueryPairs, TeamAuth};

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

fn entry_json(entry: &SandboxLogEntry) -> Value {
    json!({
        "timestamp": rfc3339(entry.at),
        "level": entry.level.as_str(),
        "message": entry.message,
        "fields": entry.fields,
    })
}

/// `GET /sandboxes/{id}/logs` (`start` in milliseconds, `limit`): oldest first, each line
/// both as JSON text (`logs`, what the CLI prints) and structured (`logEntries`).
pub(crate) async fn logs_v1(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
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
    let entries = state.sandboxes.logs(&team, &sandbox_id, &request).await?;
    let logs: Vec<Value> = entries
        .iter()
        .map(|e| json!({ "timestamp": rfc3339(e.at), "line": e.line() }))
        .collect();
    let structured: Vec<Value> = entries.iter().map(entry_json).collect();
    Ok(Json(json!({ "logs": logs, "logEntries": structured })))
}

/// `GET /v2/sandboxes/{id}/logs` (`cursor` in milliseconds, `limit`, `direction`, `level`,
/// `search`).
pub(crate) async fn logs_v2(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let cursor = query.int_in("cursor", 0..=i64::MAX)?;
    let limit = query
        .int_in("limit", 0..=DEFAULT_LOG_LIMIT)?
        .unwrap_or(DEFAULT_LOG_LIMIT);
    let forward = match query.get("direction") {
        None | Some("forward") => true,
        Some("backward") => false,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "direction must be forward or backward, got '{other}'"
            )));
        }
    };
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
    let search = query.get("search").filter(|s| !s.is_empty());
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
    let entries = state.sandboxes.logs(&team, &sandbox_id, &request).await?;
    Ok(Json(json!({
        "logs": entries.iter().map(entry_json).collect::<Vec<_>>()
    })))
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
pub(crate) async fn team_metrics(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(team_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let (start, end) = interval(&query)?;
    let points = state
        .sandboxes
        .team_metrics(&team, &team_id, start, end)
        .await?;
    Ok(Json(Value::Array(
        points
            .iter()
            .map(|p| {
                json!({
                    "timestamp": rfc3339(p.at),
                    "timestampUnix": p.at.timestamp(),
                    "concurrentSandboxes": p.concurrent_sandboxes,
                    "sandboxStartRate": p.sandbox_start_rate,
                })
            })
            .collect(),
    )))
}

/// `GET /teams/{teamID}/metrics/max?metric=concurrent_sandboxes|sandbox_start_rate`.
pub(crate) async fn team_metric_max(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(team_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
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
        .team_metric_max(&team, &team_id, metric, start, end)
        .await?;
    Ok(Json(json!({
        "timestamp": rfc3339(max.at),
        "timestampUnix": max.at.timestamp(),
        "value": max.value,
    })))
}

/// The routes of this module, merged into the API router.
pub(crate) fn routes() -> axum::Router<AppState> {
    use axum::routing::get;
    axum::Router::new()
        .route("/sandboxes/{sandbox_id}/logs", get(logs_v1))
        .route("/v2/sandboxes/{sandbox_id}/logs", get(logs_v2))
        .route("/teams/{team_id}/metrics", get(team_metrics))
        .route("/teams/{team_id}/metrics/max", get(team_metric_max))
}
