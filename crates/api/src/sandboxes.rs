//! Sandbox endpoints: parse and validate, then call [`sandbar_core::Sandboxes`].

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sandbar_core::{CreateSandbox, EgressConfig, ListQuery, SandboxState, Team};
use utoipa::IntoResponses;

use crate::AppState;
use crate::dto::{
    ListedSandbox, NetworkConfig, NewSandbox, RefreshBody, SandboxCreated, SandboxDetail,
    SandboxStateName, TimeoutBody, next_token_header,
};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiKeyTeam, JsonBody, PathParam, QueryPairs};
use crate::openapi::{CommonErrors, SandboxPath};

/// Default lifetime when a v2 create names none (E2B's documented default).
const DEFAULT_TIMEOUT_V2: i64 = 300;
/// The v1 create's documented default; real clients always send one.
const DEFAULT_TIMEOUT_V1: i64 = 15;
const MAX_PAGE: i64 = 100;
const MAX_REFRESH_SECS: i64 = 3600;
/// E2B keeps a refreshed sandbox alive at least this long, also when `duration` is omitted.
const MIN_REFRESH_SECS: i64 = 15;

/// The API types timeouts as int32: parsed wider so an out-of-range value gets an error that
/// names the field instead of serde's.
fn non_negative(field: &str, value: i64) -> Result<u64, ApiError> {
    if (0..=i64::from(i32::MAX)).contains(&value) {
        Ok(value as u64)
    } else {
        Err(ApiError::bad_request(format!(
            "{field} must be between 0 and {} seconds, got {value}",
            i32::MAX
        )))
    }
}

/// Options this server cannot honour are refused rather than ignored, since a client relying
/// on them would be misled.
fn unsupported<T>(what: &str) -> Result<T, ApiError> {
    Err(ApiError::bad_request(format!(
        "{what} is not supported by this server"
    )))
}

fn validate_create(body: NewSandbox, default_timeout: i64) -> Result<CreateSandbox, ApiError> {
    let auto_resume = body
        .auto_resume
        .as_ref()
        .filter(|v| !v.is_null())
        .map(|v| v.get("enabled").and_then(|e| e.as_bool()).unwrap_or(true))
        .unwrap_or(false);
    if auto_resume && body.auto_pause != Some(true) {
        return Err(ApiError::bad_request(
            "autoResume needs autoPause: only a sandbox that pauses on timeout can resume on traffic",
        ));
    }
    let auto_pause_files_only = body.auto_pause_memory == Some(false);
    if auto_pause_files_only && body.auto_pause != Some(true) {
        return Err(ApiError::bad_request(
            "autoPauseMemory needs autoPause: it says how a sandbox pauses on timeout",
        ));
    }
    if auto_pause_files_only && auto_resume {
        return Err(ApiError::bad_request(
            "autoResume cannot be combined with autoPauseMemory: false: a sandbox paused without its memory boots again only when resumed explicitly",
        ));
    }
    if body.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return unsupported("mcp");
    }
    let volume_mounts = crate::volumes::mount_requests(body.volume_mounts.as_deref())?;
    let network = body.network.unwrap_or_default();
    let egress = egress_config(&network)?;
    let network = sandbar_core::NetworkConfig {
        egress,
        allow_public_traffic: network.allow_public_traffic.unwrap_or(true),
        mask_request_host: network.mask_request_host,
    };
    let env_vars = body.env_vars.unwrap_or_default();
    sandbar_core::inputs::check_env_names(env_vars.keys())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let metadata = body.metadata.unwrap_or_default();
    sandbar_core::inputs::check_metadata(&metadata)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(CreateSandbox {
        template: body.template_id,
        timeout_secs: non_negative("timeout", body.timeout.unwrap_or(default_timeout))?,
        metadata,
        env_vars,
        allow_internet_access: body.allow_internet_access.unwrap_or(true),
        network,
        auto_pause: body.auto_pause.unwrap_or(false),
        auto_resume,
        auto_pause_files_only,
        volume_mounts,
    })
}

/// The egress part of a network config.
fn egress_config(network: &NetworkConfig) -> Result<EgressConfig, ApiError> {
    if network.egress_proxy.as_ref().is_some_and(|v| !v.is_null()) {
        return unsupported("network.egressProxy");
    }
    if network.rules.as_ref().is_some_and(|r| !r.is_empty()) {
        return unsupported("network.rules (egress request transforms)");
    }
    if network.https_ports.as_ref().is_some_and(|p| !p.is_empty()) {
        return unsupported("network.httpsPorts");
    }
    Ok(EgressConfig {
        allow_out: network.allow_out.clone().unwrap_or_default(),
        deny_out: network.deny_out.clone().unwrap_or_default(),
        dns_servers: network.dns_servers.clone(),
    })
}

/// `PUT /sandboxes/{id}/network`: replaces the egress rules; omitted fields clear.
#[utoipa::path(
    put,
    path = "/sandboxes/{sandboxID}/network",
    tag = "sandboxes",
    operation_id = "putSandboxNetwork",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body = NetworkConfig,
    responses(
        (status = 204, description = "The egress rules were replaced"),
        (status = 400, description = "Invalid or unsupported rules", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn update_network(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<NetworkConfig>,
) -> Result<StatusCode, ApiError> {
    let egress = egress_config(&body)?;
    state
        .sandboxes
        .lifecycle()
        .update_network(
            &team,
            &sandbox_id,
            egress,
            body.allow_internet_access.unwrap_or(true),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn create(
    state: &AppState,
    team: &Team,
    request: CreateSandbox,
) -> Result<Response, ApiError> {
    let sandbox = state.sandboxes.registry().create(team, request).await?;
    Ok((StatusCode::CREATED, Json(SandboxCreated::from(&sandbox))).into_response())
}

/// How starting a sandbox fails, in either API version.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum CreateErrors {
    #[response(
        status = 400,
        description = "Invalid or unsupported request, or a limit of the team exceeded"
    )]
    Invalid(ErrorBody),
    #[response(status = 404, description = "No such template or volume")]
    NotFound(ErrorBody),
    #[response(status = 409, description = "The template's build has not finished")]
    NotBuilt(ErrorBody),
    #[response(
        status = 501,
        description = "Volume mounts were asked of a server without volume storage"
    )]
    NoVolumeStorage(ErrorBody),
    #[response(status = 503, description = "No capacity to start the sandbox",
        headers(("Retry-After" = u64, description = "Seconds until capacity is expected back")))]
    NoCapacity(ErrorBody),
}

#[utoipa::path(
    post,
    path = "/v2/sandboxes",
    tag = "sandboxes",
    operation_id = "postSandboxV2",
    security(("ApiKeyAuth" = [])),
    request_body = NewSandbox,
    responses(
        (status = 201, description = "The sandbox was started", body = SandboxCreated),
        CreateErrors,
        CommonErrors,
    )
)]
pub(crate) async fn create_v2(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<NewSandbox>,
) -> Result<Response, ApiError> {
    let request = validate_create(body, DEFAULT_TIMEOUT_V2)?;
    create(&state, &team, request).await
}

/// `POST /sandboxes`: [`create_v2`] with v1's default timeout, documented as a copy of it
/// (see `crate::rest_routes`).
pub(crate) async fn create_v1(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<NewSandbox>,
) -> Result<Response, ApiError> {
    let request = validate_create(body, DEFAULT_TIMEOUT_V1)?;
    create(&state, &team, request).await
}

/// A create body read and checked as the create handlers read and check it, for the API host
/// of a cluster: a node is offered only a create it would take, and the typed value is what
/// goes to it.
pub(crate) fn checked_create(bytes: &[u8]) -> Result<NewSandbox, ApiError> {
    let body: NewSandbox = crate::extract::json_body(bytes)?;
    // The default only fills in an absent timeout, and either version's is valid.
    validate_create(body.clone(), DEFAULT_TIMEOUT_V2)?;
    Ok(body)
}

/// The `metadata` filter arrives as `k=v&k2=v2` whose keys and values were URL-encoded before
/// the whole string was encoded again as one query value: undo both.
fn metadata_filter(query: &QueryPairs) -> Result<BTreeMap<String, String>, ApiError> {
    let Some(raw) = query.get("metadata") else {
        return Ok(BTreeMap::new());
    };
    let once = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| ApiError::bad_request("metadata filter is not valid UTF-8"))?;
    let mut filter = BTreeMap::new();
    for (k, v) in url::form_urlencoded::parse(once.as_bytes()) {
        if k.is_empty() {
            return Err(ApiError::bad_request(format!(
                "invalid metadata filter '{raw}': expected key=value pairs joined by &"
            )));
        }
        filter.insert(k.into_owned(), v.into_owned());
    }
    Ok(filter)
}

fn state_filter(query: &QueryPairs) -> Result<Option<Vec<SandboxState>>, ApiError> {
    let values = query.list("state");
    if values.is_empty() {
        return Ok(None);
    }
    values
        .into_iter()
        .map(|v| {
            SandboxState::parse(v).ok_or_else(|| {
                ApiError::bad_request(format!("invalid state '{v}': expected running or paused"))
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `startedAfter` as an RFC 3339 date-time. A `+` of an offset the client left unencoded
/// arrives as a space.
fn started_after(query: &QueryPairs) -> Result<Option<chrono::DateTime<chrono::Utc>>, ApiError> {
    let Some(raw) = query.non_empty("startedAfter") else {
        return Ok(None);
    };
    chrono::DateTime::parse_from_rfc3339(&raw.replace(' ', "+"))
        .map(|t| Some(t.with_timezone(&chrono::Utc)))
        .map_err(|_| {
            ApiError::bad_request(format!(
                "invalid startedAfter '{raw}': expected an RFC 3339 date-time such as 2025-01-01T00:00:00Z"
            ))
        })
}

#[utoipa::path(
    get,
    path = "/v2/sandboxes",
    tag = "sandboxes",
    operation_id = "getV2Sandboxes",
    security(("ApiKeyAuth" = [])),
    params(
        ("metadata" = Option<String>, Query, description = "Filter: `key=value` pairs joined by `&`, keys and values URL-encoded"),
        ("state" = Option<Vec<SandboxStateName>>, Query, style = Form, explode = false, description = "Filter by states (comma-separated or repeated)"),
        ("nextToken" = Option<String>, Query, description = "Cursor from the previous page's `X-Next-Token`"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Items per page (default 100)"),
        ("order" = Option<String>, Query, pattern = "^(asc|desc)$", description = "By start time: `desc` (default) or `asc`"),
        ("startedAfter" = Option<String>, Query, format = DateTime, description = "Only sandboxes started after this RFC 3339 time"),
        ("template" = Option<String>, Query, description = "Only sandboxes of this template"),
    ),
    responses(
        (status = 200, description = "A page of the team's sandboxes", body = Vec<ListedSandbox>,
            headers(
                ("X-Next-Token" = String, description = "Cursor of the next page, absent on the last"),
                ("X-Total-Running" = u64, description = "The team's running sandboxes"),
            )),
        (status = 400, description = "Invalid filter or cursor", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn list_v2(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let limit = query.int_in("limit", 1..=MAX_PAGE)?.unwrap_or(MAX_PAGE);
    let ascending = match query.get("order") {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "invalid order '{other}': expected asc or desc"
            )));
        }
    };
    let list = ListQuery {
        metadata: metadata_filter(&query)?,
        states: state_filter(&query)?,
        ascending,
        limit: limit as usize,
        next_token: query.non_empty("nextToken").map(str::to_owned),
        started_after: started_after(&query)?,
        template: query.non_empty("template").map(str::to_owned),
    };
    let page = state.sandboxes.registry().list(&team, &list).await?;
    let items: Vec<ListedSandbox> = page.items.iter().map(ListedSandbox::from).collect();
    let mut headers = next_token_header(page.next_token.as_deref());
    if list
        .states
        .as_ref()
        .is_none_or(|s| s.contains(&SandboxState::Running))
    {
        headers.insert("X-Total-Running", HeaderValue::from(page.running_total));
    }
    Ok((headers, Json(items)).into_response())
}

#[utoipa::path(
    get,
    path = "/sandboxes",
    tag = "sandboxes",
    operation_id = "getSandboxes",
    security(("ApiKeyAuth" = [])),
    params(
        ("metadata" = Option<String>, Query, description = "Filter: `key=value` pairs joined by `&`, keys and values URL-encoded"),
    ),
    responses(
        (status = 200, description = "The team's running sandboxes", body = Vec<ListedSandbox>),
        (status = 400, description = "Invalid filter", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn list_v1(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    query: QueryPairs,
) -> Result<Json<Vec<ListedSandbox>>, ApiError> {
    let mut list = ListQuery {
        metadata: metadata_filter(&query)?,
        states: Some(vec![SandboxState::Running]),
        limit: MAX_PAGE as usize,
        next_token: None,
        ascending: false,
        started_after: None,
        template: None,
    };
    let mut items = Vec::new();
    loop {
        let page = state.sandboxes.registry().list(&team, &list).await?;
        items.extend(page.items.iter().map(ListedSandbox::from));
        match page.next_token {
            Some(token) => list.next_token = Some(token),
            None => break,
        }
    }
    Ok(Json(items))
}

#[utoipa::path(
    get,
    path = "/sandboxes/{sandboxID}",
    tag = "sandboxes",
    operation_id = "getSandbox",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    responses(
        (status = 200, description = "The sandbox", body = SandboxDetail),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn detail(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
) -> Result<Json<SandboxDetail>, ApiError> {
    let sandbox = state.sandboxes.registry().get(&team, &sandbox_id).await?;
    let mounts = crate::volumes::sandbox_mounts(&state, &sandbox.id).await?;
    Ok(Json(
        SandboxDetail::from(&sandbox).with_volume_mounts(mounts),
    ))
}

#[utoipa::path(
    delete,
    path = "/sandboxes/{sandboxID}",
    tag = "sandboxes",
    operation_id = "deleteSandbox",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    responses(
        (status = 204, description = "The sandbox was killed (after a pause, resume or snapshot under way finished)"),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "A transition under way did not finish within a minute, or processes outlived the kill for a few seconds (their count is named)", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn kill(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    state.sandboxes.lifecycle().kill(&team, &sandbox_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/timeout",
    tag = "sandboxes",
    operation_id = "postSandboxTimeout",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body = TimeoutBody,
    responses(
        (status = 204, description = "The sandbox's end was moved"),
        (status = 400, description = "Invalid timeout, or longer than the team allows", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is in a transition", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn set_timeout(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<TimeoutBody>,
) -> Result<StatusCode, ApiError> {
    let timeout = non_negative("timeout", body.timeout)?;
    state
        .sandboxes
        .lifecycle()
        .set_timeout(&team, &sandbox_id, timeout)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/refreshes",
    tag = "sandboxes",
    operation_id = "postSandboxRefreshes",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body = RefreshBody,
    responses(
        (status = 204, description = "The sandbox is kept alive"),
        (status = 400, description = "Invalid duration, or longer than the team allows", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is in a transition", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn refresh(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<RefreshBody>,
) -> Result<StatusCode, ApiError> {
    let duration = body.duration.unwrap_or(MIN_REFRESH_SECS);
    if !(0..=MAX_REFRESH_SECS).contains(&duration) {
        return Err(ApiError::bad_request(format!(
            "duration must be between 0 and {MAX_REFRESH_SECS} seconds, got {duration}"
        )));
    }
    state
        .sandboxes
        .lifecycle()
        .extend(&team, &sandbox_id, duration.max(MIN_REFRESH_SECS) as u64)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `memory: false` resumes a sandbox paused with its memory afresh on its files.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
pub(crate) struct ConnectBody {
    /// Seconds from now after which the sandbox ends.
    #[schema(minimum = 0, maximum = 2147483647)]
    timeout: i64,
    /// True (the default) restores the processes with their memory; false boots the sandbox
    /// afresh on its files, dropping them.
    memory: Option<bool>,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
pub(crate) struct OptionalTimeoutConnectBody {
    /// Seconds from now after which the sandbox ends (300 when omitted).
    #[schema(minimum = 0, maximum = 2147483647)]
    timeout: Option<i64>,
    /// True (the default) restores the processes with their memory; false boots the sandbox
    /// afresh on its files, dropping them.
    memory: Option<bool>,
}

async fn connect(
    state: &AppState,
    team: &Team,
    sandbox_id: &str,
    timeout: Option<i64>,
    memory: Option<bool>,
) -> Result<(StatusCode, Json<SandboxCreated>), ApiError> {
    let timeout = non_negative("timeout", timeout.unwrap_or(DEFAULT_TIMEOUT_V2))?;
    let (sandbox, resumed) = state
        .sandboxes
        .lifecycle()
        .resume(team, sandbox_id, timeout, false, memory.unwrap_or(true))
        .await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(SandboxCreated::from(&sandbox))))
}

/// How connecting to a sandbox fails, in either API version.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum ConnectErrors {
    #[response(
        status = 400,
        description = "Invalid timeout, or longer than the team allows"
    )]
    Invalid(ErrorBody),
    #[response(status = 404, description = "No such sandbox")]
    NotFound(ErrorBody),
    #[response(
        status = 409,
        description = "A transition under way did not finish within a minute"
    )]
    Busy(ErrorBody),
    #[response(status = 503, description = "No capacity to start the sandbox again",
        headers(("Retry-After" = u64, description = "Seconds until capacity is expected back")))]
    NoCapacity(ErrorBody),
}

#[utoipa::path(
    post,
    path = "/v2/sandboxes/{sandboxID}/connect",
    tag = "sandboxes",
    operation_id = "postV2SandboxConnect",
    security(("ApiKeyAuth" = [])),
    request_body = OptionalTimeoutConnectBody,
    params(SandboxPath),
    responses(
        (status = 200, description = "The sandbox was running (or another request resumed it meanwhile)", body = SandboxCreated),
        (status = 201, description = "The sandbox was paused and has been resumed", body = SandboxCreated),
        ConnectErrors,
        CommonErrors,
    )
)]
pub(crate) async fn connect_v2(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<OptionalTimeoutConnectBody>,
) -> Result<(StatusCode, Json<SandboxCreated>), ApiError> {
    connect(&state, &team, &sandbox_id, body.timeout, body.memory).await
}

#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/connect",
    tag = "sandboxes",
    operation_id = "postSandboxConnect",
    security(("ApiKeyAuth" = [])),
    request_body = ConnectBody,
    params(SandboxPath),
    responses(
        (status = 200, description = "The sandbox was running (or another request resumed it meanwhile)", body = SandboxCreated),
        (status = 201, description = "The sandbox was paused and has been resumed", body = SandboxCreated),
        ConnectErrors,
        CommonErrors,
    )
)]
pub(crate) async fn connect_v1(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<ConnectBody>,
) -> Result<(StatusCode, Json<SandboxCreated>), ApiError> {
    connect(&state, &team, &sandbox_id, Some(body.timeout), body.memory).await
}

/// One resource sample of a sandbox; memory and disk in bytes.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SandboxMetric {
    #[schema(format = DateTime)]
    timestamp: String,
    timestamp_unix: i64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// `GET /sandboxes/metrics`: the latest sample by sandbox ID.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct SandboxesMetrics {
    sandboxes: BTreeMap<String, SandboxMetric>,
}

fn metric_json(point: &sandbar_core::MetricPoint) -> SandboxMetric {
    SandboxMetric {
        timestamp: crate::dto::rfc3339(point.at),
        timestamp_unix: point.at.timestamp(),
        cpu_count: point.cpu_count,
        cpu_used_pct: point.cpu_used_pct,
        mem_used: point.mem_used,
        mem_total: point.mem_total,
        mem_cache: point.mem_cache,
        disk_used: point.disk_used,
        disk_total: point.disk_total,
    }
}

fn unix_param(
    query: &QueryPairs,
    key: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, ApiError> {
    query
        .int_in(key, 0..=i64::from(i32::MAX) * 4)?
        .map(|secs| {
            chrono::DateTime::from_timestamp(secs, 0).ok_or_else(|| {
                ApiError::bad_request(format!("{key} is not a valid Unix time: {secs}"))
            })
        })
        .transpose()
}

/// `GET /sandboxes/{id}/metrics` (`start`, `end` in Unix seconds).
#[utoipa::path(
    get,
    path = "/sandboxes/{sandboxID}/metrics",
    tag = "sandboxes",
    operation_id = "getSandboxMetrics",
    security(("ApiKeyAuth" = [])),
    params(
        SandboxPath,
        ("start" = Option<i64>, Query, minimum = 0, maximum = 8589934588_i64, description = "Unix seconds: the interval's start"),
        ("end" = Option<i64>, Query, minimum = 0, maximum = 8589934588_i64, description = "Unix seconds: the interval's end"),
    ),
    responses(
        (status = 200, description = "The sandbox's samples, oldest first", body = Vec<SandboxMetric>),
        (status = 400, description = "Invalid interval", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn metrics(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Vec<SandboxMetric>>, ApiError> {
    let start = unix_param(&query, "start")?;
    let end = unix_param(&query, "end")?;
    if let (Some(s), Some(e)) = (start, end)
        && s > e
    {
        return Err(ApiError::bad_request("start must not be after end"));
    }
    let points = state
        .sandboxes
        .activity()
        .metrics(&team, &sandbox_id, start, end)
        .await?;
    Ok(Json(points.iter().map(metric_json).collect()))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest sample of each (at most 100).
#[utoipa::path(
    get,
    path = "/sandboxes/metrics",
    tag = "sandboxes",
    operation_id = "getSandboxesMetrics",
    security(("ApiKeyAuth" = [])),
    params(
        ("sandbox_ids" = Vec<String>, Query, style = Form, explode = false, max_items = 100, min_items = 1, description = "Sandbox IDs, comma-separated (at most 100)"),
    ),
    responses(
        (status = 200, description = "The latest sample of each of the team's sandboxes named", body = SandboxesMetrics),
        (status = 400, description = "No IDs, or more than 100", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn batch_metrics(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    query: QueryPairs,
) -> Result<Json<SandboxesMetrics>, ApiError> {
    let ids: Vec<String> = query
        .list("sandbox_ids")
        .into_iter()
        .map(str::to_owned)
        .collect();
    if ids.is_empty() {
        return Err(ApiError::bad_request("sandbox_ids is required"));
    }
    if ids.len() > 100 {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids holds at most 100 IDs, got {}",
            ids.len()
        )));
    }
    let latest = state
        .sandboxes
        .activity()
        .latest_metrics(&team, &ids)
        .await?;
    let sandboxes = latest
        .iter()
        .map(|(id, p)| (id.clone(), metric_json(p)))
        .collect();
    Ok(Json(SandboxesMetrics { sandboxes }))
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PauseBody {
    /// True (the default) freezes the sandbox with its memory; false ends its processes and
    /// keeps only its files, and a resume boots it again on them.
    memory: Option<bool>,
    #[allow(dead_code)]
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: the sandbox is frozen with its memory, or with `memory:
/// false` its processes end and only its files are kept (204; 409 when it is already paused).
#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/pause",
    tag = "sandboxes",
    operation_id = "postSandboxPause",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body(content = Option<PauseBody>),
    responses(
        (status = 204, description = "The sandbox was paused, with its memory or (memory: false) only its files"),
        (status = 400, description = "Invalid or unsupported request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is already paused or in a transition", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn pause(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<PauseBody>,
) -> Result<StatusCode, ApiError> {
    state
        .sandboxes
        .lifecycle()
        .pause(&team, &sandbox_id, body.memory.unwrap_or(true))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ResumeBody {
    /// Seconds until the resumed sandbox ends (15 when omitted).
    #[schema(minimum = 0, maximum = 2147483647)]
    timeout: Option<i64>,
    #[allow(dead_code)]
    auto_pause: Option<bool>,
    /// True (the default) restores the processes with their memory; false boots the sandbox
    /// afresh on its files, dropping them.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/resume` (older SDKs): 201 with the sandbox; 409 unless paused.
#[utoipa::path(
    post,
    path = "/sandboxes/{sandboxID}/resume",
    tag = "sandboxes",
    operation_id = "postSandboxResume",
    security(("ApiKeyAuth" = [])),
    params(SandboxPath),
    request_body(content = Option<ResumeBody>),
    responses(
        (status = 201, description = "The sandbox was resumed", body = SandboxCreated),
        (status = 400, description = "Invalid timeout, or longer than the team allows", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not paused", body = ErrorBody),
        (status = 503, description = "No capacity to start the sandbox again", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds until capacity is expected back"))),
        CommonErrors,
    )
)]
pub(crate) async fn resume(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(sandbox_id): PathParam<String>,
    JsonBody(body): JsonBody<ResumeBody>,
) -> Result<(StatusCode, Json<SandboxCreated>), ApiError> {
    let timeout = non_negative("timeout", body.timeout.unwrap_or(DEFAULT_TIMEOUT_V1))?;
    let (sandbox, _) = state
        .sandboxes
        .lifecycle()
        .resume(
            &team,
            &sandbox_id,
            timeout,
            true,
            body.memory.unwrap_or(true),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(SandboxCreated::from(&sandbox))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(raw: &str) -> QueryPairs {
        QueryPairs(
            url::form_urlencoded::parse(raw.as_bytes())
                .into_owned()
                .collect(),
        )
    }

    #[test]
    fn metadata_filter_undoes_the_sdks_double_encoding() {
        let filter = metadata_filter(&pairs("metadata=k%3Dv%252520w")).expect("parse");
        assert_eq!(filter.get("k").map(String::as_str), Some("v w"));
        let two = metadata_filter(&pairs("metadata=a%3D1%26b%3D2")).expect("parse");
        assert_eq!(two.len(), 2);
    }

    #[test]
    fn states_are_checked() {
        assert_eq!(
            state_filter(&pairs("state=running%2Cpaused")).expect("parse"),
            Some(vec![SandboxState::Running, SandboxState::Paused])
        );
        let err = state_filter(&pairs("state=killed")).expect_err("not a listable state");
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{err:?}");
        assert!(err.message.contains("invalid state 'killed'"), "{err:?}");
        assert_eq!(state_filter(&pairs("")).expect("none"), None);
    }
}
