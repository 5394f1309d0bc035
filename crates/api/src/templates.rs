//! Template endpoints: lookups, the build flow of the SDKs (`POST /v3/templates`, file
//! uploads, `POST /v2/templates/{id}/builds/{buildID}`, status and logs) and administration.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sandbar_core::builds::{
    BuildLogEntry, BuildRecord, BuildSource, BuildSpec, BuildStep, LogLevel, RegistryCredentials,
    RequestBuild, StepKind,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoResponses, ToSchema};

use crate::AppState;
use crate::dto::{BuildStatusName, LogLevelName, TemplateItem, next_token_header, rfc3339};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiKeyTeam, JsonBody, PathParam, QueryPairs, TeamAuth};
use crate::openapi::{BuildPath, CommonErrors, FilesPath, TemplatePath};

/// `GET /templates/aliases/{alias}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AliasLookup {
    #[serde(rename = "templateID")]
    template_id: String,
    public: bool,
}

/// The answer to a build request of the SDK's build flow.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BuildRequestedBody {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    public: bool,
    names: Vec<String>,
    aliases: Vec<String>,
    tags: Vec<String>,
}

/// `GET /templates/{templateID}/files/{hash}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct FileLink {
    /// Whether the files are already stored (then there is nothing to upload).
    present: bool,
    /// Where to `PUT` the files' tar archive; absent when they are present.
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
}

/// A line of a build's log.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BuildLogLine {
    #[schema(format = DateTime)]
    timestamp: String,
    level: LogLevelName,
    message: String,
    /// The build step the line belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BuildFailureReason {
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<String>,
}

/// `GET /templates/{templateID}/builds/{buildID}/status`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BuildStatusBody {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    status: BuildStatusName,
    /// The lines as text, each `<timestamp> <message>\n`.
    logs: Vec<String>,
    log_entries: Vec<BuildLogLine>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<BuildFailureReason>,
}

/// `GET /templates/{templateID}/builds/{buildID}/logs`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BuildLogsBody {
    logs: Vec<BuildLogLine>,
}

/// A build of a template.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TemplateBuild {
    #[serde(rename = "buildID")]
    build_id: String,
    status: BuildStatusName,
    #[schema(format = DateTime)]
    created_at: String,
    #[schema(format = DateTime)]
    updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime)]
    finished_at: Option<String>,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
}

/// `GET /templates/{templateID}`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TemplateDetail {
    #[serde(rename = "templateID")]
    template_id: String,
    public: bool,
    aliases: Vec<String>,
    names: Vec<String>,
    #[schema(format = DateTime)]
    created_at: String,
    #[schema(format = DateTime)]
    updated_at: String,
    #[schema(format = DateTime, required = true)]
    last_spawned_at: Option<String>,
    spawn_count: u64,
    builds: Vec<TemplateBuild>,
}

/// The names of a template after an update.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TemplateNames {
    names: Vec<String>,
}

/// `POST /templates/tags`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TagsAssigned {
    #[serde(rename = "buildID")]
    build_id: String,
    tags: Vec<String>,
}

/// An item of `GET /templates/{templateID}/tags`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TemplateTag {
    tag: String,
    #[serde(rename = "buildID")]
    build_id: String,
    #[serde(rename = "createdAt")]
    #[schema(format = DateTime)]
    created_at: String,
}

#[utoipa::path(
    get,
    path = "/templates",
    tag = "templates",
    operation_id = "getTemplates",
    security(("ApiKeyAuth" = [])),
    params(("teamID" = Option<String>, Query, description = "Ignored: the key's team is listed")),
    responses(
        (status = 200, description = "The team's and the public templates", body = Vec<TemplateItem>),
        CommonErrors,
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
) -> Result<Json<Vec<TemplateItem>>, ApiError> {
    let templates = state.templates.list(&team).await?;
    Ok(Json(templates.iter().map(TemplateItem::from).collect()))
}

#[utoipa::path(
    get,
    path = "/templates/aliases/{alias}",
    tag = "templates",
    operation_id = "getTemplatesAlias",
    security(("ApiKeyAuth" = [])),
    params(("alias" = String, Path, description = "The template's alias")),
    responses(
        (status = 200, description = "The template the alias names", body = AliasLookup),
        (status = 400, description = "Invalid alias", body = ErrorBody),
        (status = 404, description = "No such alias", body = ErrorBody),
        (status = 409, description = "The template's build has not finished", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn alias(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(alias): PathParam<String>,
) -> Result<Json<AliasLookup>, ApiError> {
    let template = state.templates.resolve(&team, &alias).await?;
    Ok(Json(AliasLookup {
        template_id: template.id,
        public: template.public,
    }))
}

/// The body of `POST /v3/templates` and `POST /v2/templates`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RequestBuildBody {
    name: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    alias: Option<String>,
    /// Ignored: the key's team owns the template.
    #[serde(rename = "teamID")]
    #[allow(dead_code)]
    team_id: Option<String>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
    /// Accepted for the SDK's sake; build disks are sized by the node.
    #[allow(dead_code)]
    min_free_disk_mb: Option<u64>,
}

/// How requesting a build of the SDK's flow fails, in either API version.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum RequestBuildErrors {
    #[response(status = 400, description = "Invalid name, tags or resources")]
    Invalid(ErrorBody),
    #[response(status = 404, description = "No such template")]
    NotFound(ErrorBody),
    #[response(status = 409, description = "The name belongs to another template")]
    NameTaken(ErrorBody),
}

/// `POST /v3/templates`: registers a template build of the SDK's build flow.
#[utoipa::path(
    post,
    path = "/v3/templates",
    tag = "templates",
    operation_id = "postV3Templates",
    security(("ApiKeyAuth" = [])),
    request_body = RequestBuildBody,
    responses(
        (status = 202, description = "The template and its build were registered", body = BuildRequestedBody),
        RequestBuildErrors,
        CommonErrors,
    )
)]
pub(crate) async fn request_build(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<RequestBuildBody>,
) -> Result<(StatusCode, Json<BuildRequestedBody>), ApiError> {
    let requested = state
        .builds
        .request(
            &team,
            RequestBuild {
                name: body.name.or(body.alias),
                tags: body.tags,
                cpu_count: body.cpu_count,
                memory_mb: body.memory_mb,
            },
        )
        .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(BuildRequestedBody {
            names: requested.template.names(),
            template_id: requested.template.id,
            build_id: requested.build_id,
            public: requested.template.public,
            aliases: requested.template.aliases,
            tags: requested.tags,
        }),
    ))
}

fn external_base(headers: &HeaderMap) -> String {
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .filter(|p| *p == "https" || *p == "http")
        .unwrap_or("http");
    format!("{scheme}://{host}")
}

/// `GET /templates/{id}/files/{hash}`.
#[utoipa::path(
    get,
    path = "/templates/{templateID}/files/{hash}",
    tag = "templates",
    operation_id = "getTemplateFiles",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(FilesPath),
    responses(
        (status = 201, description = "Whether the files are stored, and where to upload them if not", body = FileLink),
        (status = 400, description = "Invalid hash", body = ErrorBody),
        (status = 404, description = "No such template", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn file_link(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, hash)): PathParam<(String, String)>,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<FileLink>), ApiError> {
    let (present, token) = state.builds.upload_link(&team, &template_id, &hash).await?;
    let url = token.map(|token| {
        format!(
            "{}/upload/templates/{template_id}/files/{hash}?token={token}",
            external_base(&headers)
        )
    });
    Ok((StatusCode::CREATED, Json(FileLink { present, url })))
}

/// `PUT /upload/templates/{id}/files/{hash}?token=…`: the upload link itself, no API key.
#[utoipa::path(
    put,
    path = "/upload/templates/{templateID}/files/{hash}",
    tag = "templates",
    operation_id = "putTemplateFiles",
    security(()),
    params(
        FilesPath,
        ("token" = String, Query, description = "The token of the link `GET /templates/{templateID}/files/{hash}` gave"),
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "A tar archive of the files"),
    responses(
        (status = 201, description = "The files were stored"),
        (status = 400, description = "Invalid hash, or the archive does not match it", body = ErrorBody),
        (status = 403, description = "Missing, invalid or expired token", body = ErrorBody),
        (status = 404, description = "No such template", body = ErrorBody),
        (status = 413, description = "The archive is too large, or the team's uploads would take more than it may keep", body = ErrorBody),
        (status = 429, description = "The team keeps as many uploads as it may", body = ErrorBody),
        (status = 500, description = "The files could not be stored", body = ErrorBody),
    )
)]
pub(crate) async fn upload(
    State(state): State<AppState>,
    PathParam((_template_id, hash)): PathParam<(String, String)>,
    query: QueryPairs,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let token = query
        .get("token")
        .ok_or_else(|| ApiError::new(StatusCode::FORBIDDEN, "the upload link has no token"))?
        .to_owned();
    // Read as it arrives and written to disk by the node, so a large upload never sits in
    // memory.
    let reader = crate::body_stream::BodyReader::new(body);
    state.builds.upload(&hash, &token, Box::pin(reader)).await?;
    Ok(StatusCode::CREATED)
}

/// A step of a build: `COPY`, `RUN`, `ENV`, `WORKDIR` or `USER`, with its arguments.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StepBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
    #[serde(default)]
    force: bool,
    #[allow(dead_code)]
    force_upload: Option<bool>,
}

/// Credentials of the base image's registry; only type `registry` is supported.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RegistryBody {
    #[serde(rename = "type")]
    kind: String,
    username: Option<String>,
    password: Option<String>,
}

/// The body of `POST /v2/templates/{templateID}/builds/{buildID}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct StartBuildBody {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<RegistryBody>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    steps: Vec<StepBody>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

fn parse_step(index: usize, step: StepBody) -> Result<BuildStep, ApiError> {
    let n = index + 1;
    let arg = |i: usize| step.args.get(i).cloned().filter(|a| !a.is_empty());
    let need = |i: usize, what: &str| {
        arg(i).ok_or_else(|| {
            ApiError::bad_request(format!("step {n} ({}): {what} is required", step.kind))
        })
    };
    let kind = match step.kind.as_str() {
        "COPY" => {
            let mode = match arg(3) {
                Some(m) => Some(u32::from_str_radix(&m, 8).map_err(|_| {
                    ApiError::bad_request(format!("step {n} (COPY): invalid octal mode '{m}'"))
                })?),
                None => None,
            };
            StepKind::Copy {
                src: need(0, "a source")?,
                dest: need(1, "a destination")?,
                owner: arg(2),
                mode,
                files_hash: step.files_hash.clone().ok_or_else(|| {
                    ApiError::bad_request(format!("step {n} (COPY): filesHash is required"))
                })?,
            }
        }
        "RUN" => StepKind::Run {
            command: need(0, "a command")?,
            user: arg(1),
        },
        "ENV" => {
            if step.args.is_empty() || !step.args.len().is_multiple_of(2) {
                return Err(ApiError::bad_request(format!(
                    "step {n} (ENV): arguments must be name and value pairs"
                )));
            }
            let vars: Vec<(String, String)> = step
                .args
                .chunks(2)
                .map(|p| (p[0].clone(), p[1].clone()))
                .collect();
            sandbar_core::inputs::check_env_names(vars.iter().map(|(name, _)| name))
                .map_err(|e| ApiError::bad_request(format!("step {n} (ENV): {e}")))?;
            StepKind::Env { vars }
        }
        "WORKDIR" => StepKind::Workdir {
            path: need(0, "a path")?,
        },
        "USER" => StepKind::User {
            user: need(0, "a user")?,
        },
        other => {
            return Err(ApiError::bad_request(format!(
                "step {n}: unsupported step type '{other}' (supported: COPY, RUN, ENV, WORKDIR, USER)"
            )));
        }
    };
    Ok(BuildStep {
        kind,
        force: step.force,
    })
}

/// `POST /v2/templates/{id}/builds/{buildID}`.
#[utoipa::path(
    post,
    path = "/v2/templates/{templateID}/builds/{buildID}",
    tag = "templates",
    operation_id = "postV2TemplateBuild",
    security(("ApiKeyAuth" = [])),
    params(BuildPath),
    request_body = StartBuildBody,
    responses(
        (status = 202, description = "The build was started"),
        (status = 400, description = "Invalid build specification", body = ErrorBody),
        (status = 404, description = "No such template or build", body = ErrorBody),
        (status = 409, description = "The build was already started", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn start_build(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
    JsonBody(body): JsonBody<StartBuildBody>,
) -> Result<StatusCode, ApiError> {
    let source = match (body.from_image, body.from_template) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give either fromImage or fromTemplate, not both",
            ));
        }
        (Some(reference), None) => {
            let credentials = match body.from_image_registry {
                None => None,
                Some(r) if r.kind == "registry" => Some(RegistryCredentials {
                    username: r.username.unwrap_or_default(),
                    password: r.password.unwrap_or_default(),
                }),
                Some(r) => {
                    return Err(ApiError::bad_request(format!(
                        "fromImageRegistry type '{}' is not supported (only 'registry')",
                        r.kind
                    )));
                }
            };
            BuildSource::Image {
                reference,
                credentials,
            }
        }
        (None, Some(reference)) => BuildSource::Template { reference },
        (None, None) => {
            return Err(ApiError::bad_request(
                "fromImage or fromTemplate is required",
            ));
        }
    };
    let steps = body
        .steps
        .into_iter()
        .enumerate()
        .map(|(i, s)| parse_step(i, s))
        .collect::<Result<Vec<_>, _>>()?;
    state
        .builds
        .start(
            &team,
            &template_id,
            &build_id,
            BuildSpec {
                source,
                steps,
                force: body.force,
                start_cmd: body.start_cmd,
                start_user: None,
                ready_cmd: body.ready_cmd,
            },
        )
        .await?;
    Ok(StatusCode::ACCEPTED)
}

fn entry_json(e: &BuildLogEntry) -> BuildLogLine {
    BuildLogLine {
        timestamp: rfc3339(e.timestamp),
        level: e.level.into(),
        message: e.message.clone(),
        step: e.step.clone(),
    }
}

fn level_param(query: &QueryPairs) -> Result<Option<LogLevel>, ApiError> {
    query
        .get("level")
        .map(|l| {
            LogLevel::parse(l).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "level must be one of debug, info, warn, error; got '{l}'"
                ))
            })
        })
        .transpose()
}

/// `GET /templates/{id}/builds/{buildID}/status`.
#[utoipa::path(
    get,
    path = "/templates/{templateID}/builds/{buildID}/status",
    tag = "templates",
    operation_id = "getTemplateBuildStatus",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        BuildPath,
        ("logsOffset" = Option<i64>, Query, minimum = 0, maximum = 4294967295_i64, description = "Index of the first log line returned (default 0)"),
        ("limit" = Option<i32>, Query, minimum = 0, maximum = 100, description = "Most log lines returned (default 100)"),
        ("level" = Option<LogLevelName>, Query, description = "Lowest level of the lines returned"),
    ),
    responses(
        (status = 200, description = "The build's status and log lines", body = BuildStatusBody),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        (status = 404, description = "No such template or build", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn build_status(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
    query: QueryPairs,
) -> Result<Json<BuildStatusBody>, ApiError> {
    let offset = query
        .int_in("logsOffset", 0..=i64::from(u32::MAX))?
        .unwrap_or(0) as u64;
    let limit = query.int_in("limit", 0..=100)?.unwrap_or(100) as u64;
    let level = level_param(&query)?;
    let (build, logs) = state
        .builds
        .status(&team, &template_id, &build_id, offset, limit, level)
        .await?;
    Ok(Json(BuildStatusBody {
        logs: logs
            .iter()
            .map(|e| format!("{} {}\n", rfc3339(e.timestamp), e.message))
            .collect(),
        log_entries: logs.iter().map(entry_json).collect(),
        reason: build.failure.as_ref().map(|f| BuildFailureReason {
            message: f.message.clone(),
            step: f.step.clone(),
        }),
        template_id: build.template_id,
        build_id: build.id,
        status: build.status.into(),
    }))
}

/// `GET /templates/{id}/builds/{buildID}/logs` (`cursor` in milliseconds, `direction`).
#[utoipa::path(
    get,
    path = "/templates/{templateID}/builds/{buildID}/logs",
    tag = "templates",
    operation_id = "getTemplateBuildLogs",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        BuildPath,
        ("cursor" = Option<i64>, Query, minimum = 0, description = "Milliseconds since the epoch to start from"),
        ("limit" = Option<i32>, Query, minimum = 0, maximum = 100, description = "Most lines returned (default 100)"),
        ("direction" = Option<String>, Query, pattern = "^(forward|backward)$", description = "`forward` (default) or `backward` from the cursor"),
        ("level" = Option<LogLevelName>, Query, description = "Lowest level of the lines returned"),
        ("source" = Option<String>, Query, description = "Ignored: every line is kept"),
    ),
    responses(
        (status = 200, description = "The build's log lines", body = BuildLogsBody),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        (status = 404, description = "No such template or build", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn build_logs(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
    query: QueryPairs,
) -> Result<Json<BuildLogsBody>, ApiError> {
    let build = state
        .builds
        .visible_build(&team, &template_id, &build_id)
        .await?;
    let limit = query.int_in("limit", 0..=100)?.unwrap_or(100) as usize;
    let cursor = query.int_in("cursor", 0..=i64::MAX)?;
    let level = level_param(&query)?;
    let forward = query.forward()?;
    let mut logs: Vec<BuildLogEntry> = state
        .builds
        .all_logs(&build.id)
        .await?
        .into_iter()
        .filter(|e| level.is_none_or(|min| e.level >= min))
        .filter(|e| match cursor {
            None => true,
            Some(c) if forward => e.timestamp.timestamp_millis() >= c,
            Some(c) => e.timestamp.timestamp_millis() <= c,
        })
        .collect();
    if !forward {
        logs.reverse();
    }
    logs.truncate(limit);
    Ok(Json(BuildLogsBody {
        logs: logs.iter().map(entry_json).collect(),
    }))
}

fn build_json(b: &BuildRecord) -> TemplateBuild {
    TemplateBuild {
        build_id: b.id.clone(),
        status: b.status.into(),
        created_at: rfc3339(b.created_at),
        updated_at: rfc3339(b.updated_at),
        finished_at: b.finished_at.map(rfc3339),
        cpu_count: b.cpu_count,
        memory_mb: b.memory_mb,
        disk_size_mb: b.disk_size_mb,
    }
}

/// `GET /templates/{id}` with its builds (`limit`, `nextToken` = offset).
#[utoipa::path(
    get,
    path = "/templates/{templateID}",
    tag = "templates",
    operation_id = "getTemplate",
    security(("ApiKeyAuth" = [])),
    params(
        TemplatePath,
        ("nextToken" = Option<String>, Query, pattern = "^[0-9]+$", description = "Cursor from the previous page's `X-Next-Token`"),
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 100, description = "Builds per page (default 100)"),
    ),
    responses(
        (status = 200, description = "The template with a page of its builds", body = TemplateDetail,
            headers(("X-Next-Token" = String, description = "Cursor of the next page, absent on the last"))),
        (status = 400, description = "Invalid reference or query parameter", body = ErrorBody),
        (status = 404, description = "No such template", body = ErrorBody),
        (status = 409, description = "The template's build has not finished", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn detail(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let template = state.templates.resolve(&team, &template_id).await?;
    let limit = query.int_in("limit", 1..=100)?.unwrap_or(100) as usize;
    let start: usize = match query.get("nextToken") {
        None => 0,
        Some(t) => t
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid nextToken '{t}'")))?,
    };
    let builds = state.builds.builds_of(&template.id).await?;
    let page: Vec<TemplateBuild> = builds
        .iter()
        .skip(start)
        .take(limit)
        .map(build_json)
        .collect();
    let body = TemplateDetail {
        names: template.names(),
        template_id: template.id,
        public: template.public,
        aliases: template.aliases,
        created_at: rfc3339(template.created_at),
        updated_at: rfc3339(template.updated_at),
        last_spawned_at: template.last_spawned_at.map(rfc3339),
        spawn_count: template.spawn_count,
        builds: page,
    };
    let next = (start + limit < builds.len()).then(|| (start + limit).to_string());
    Ok((next_token_header(next.as_deref()), Json(body)).into_response())
}

#[utoipa::path(
    delete,
    path = "/templates/{templateID}",
    tag = "templates",
    operation_id = "deleteTemplate",
    security(("ApiKeyAuth" = [])),
    params(TemplatePath),
    responses(
        (status = 204, description = "The template and its builds were deleted"),
        ChangeErrors,
        CommonErrors,
    )
)]
pub(crate) async fn delete(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    state.builds.delete_template(&team, &template_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of a template update.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpdateBody {
    public: Option<bool>,
}

/// How changing a template, its tags or its settings fails.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum ChangeErrors {
    #[response(status = 400, description = "Invalid request")]
    Invalid(ErrorBody),
    #[response(status = 403, description = "A built-in template cannot be changed")]
    BuiltIn(ErrorBody),
    #[response(status = 404, description = "No such template")]
    NotFound(ErrorBody),
}

/// How changing a template's settings fails besides [`ChangeErrors`], in either API version.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum UpdateErrors {
    #[response(status = 409, description = "The template's build has not finished")]
    NotBuilt(ErrorBody),
}

#[utoipa::path(
    patch,
    path = "/templates/{templateID}",
    tag = "templates",
    operation_id = "patchTemplate",
    security(("ApiKeyAuth" = [])),
    params(TemplatePath),
    request_body = UpdateBody,
    responses(
        (status = 200, description = "The template's names", body = TemplateNames),
        ChangeErrors,
        UpdateErrors,
        CommonErrors,
    )
)]
pub(crate) async fn update(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
    JsonBody(body): JsonBody<UpdateBody>,
) -> Result<Json<TemplateNames>, ApiError> {
    let template = match body.public {
        Some(public) => state.builds.set_public(&team, &template_id, public).await?,
        None => state.templates.resolve(&team, &template_id).await?,
    };
    Ok(Json(TemplateNames {
        names: template.names(),
    }))
}

/// The body of `POST /templates/tags`: `target` is `name:tag` or `name` (its latest build).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AssignTagsBody {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`.
#[utoipa::path(
    post,
    path = "/templates/tags",
    tag = "templates",
    operation_id = "postTemplatesTags",
    security(("ApiKeyAuth" = [])),
    request_body = AssignTagsBody,
    responses(
        (status = 201, description = "The tags now name the target's build", body = TagsAssigned),
        ChangeErrors,
        CommonErrors,
    )
)]
pub(crate) async fn assign_tags(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<AssignTagsBody>,
) -> Result<(StatusCode, Json<TagsAssigned>), ApiError> {
    let (build_id, tags) = state
        .builds
        .assign_tags(&team, &body.target, &body.tags)
        .await?;
    Ok((StatusCode::CREATED, Json(TagsAssigned { build_id, tags })))
}

/// The body of `DELETE /templates/tags`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteTagsBody {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`.
#[utoipa::path(
    delete,
    path = "/templates/tags",
    tag = "templates",
    operation_id = "deleteTemplatesTags",
    security(("ApiKeyAuth" = [])),
    request_body = DeleteTagsBody,
    responses(
        (status = 204, description = "The tags were removed"),
        ChangeErrors,
        CommonErrors,
    )
)]
pub(crate) async fn delete_tags(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<DeleteTagsBody>,
) -> Result<StatusCode, ApiError> {
    state
        .builds
        .delete_tags(&team, &body.name, &body.tags)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags`.
#[utoipa::path(
    get,
    path = "/templates/{templateID}/tags",
    tag = "templates",
    operation_id = "getTemplateTags",
    security(("ApiKeyAuth" = [])),
    params(TemplatePath),
    responses(
        (status = 200, description = "The template's tags and the builds they name", body = Vec<TemplateTag>),
        ChangeErrors,
        CommonErrors,
    )
)]
pub(crate) async fn tags(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
) -> Result<Json<Vec<TemplateTag>>, ApiError> {
    let tags = state.builds.tags(&team, &template_id).await?;
    Ok(Json(
        tags.iter()
            .map(|(tag, build)| TemplateTag {
                tag: tag.clone(),
                build_id: build.id.clone(),
                created_at: rfc3339(build.finished_at.unwrap_or(build.created_at)),
            })
            .collect(),
    ))
}

/// The body of a Dockerfile build request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct DockerfileBody {
    dockerfile: String,
    alias: Option<String>,
    #[serde(rename = "teamID")]
    #[allow(dead_code)]
    team_id: Option<String>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
}

async fn dockerfile_build(
    state: &AppState,
    team: &sandbar_core::Team,
    template_id: Option<&str>,
    body: DockerfileBody,
) -> Result<(StatusCode, Json<TemplateItem>), ApiError> {
    let requested = state
        .builds
        .request_dockerfile(
            team,
            template_id,
            sandbar_core::builds::DockerfileRequest {
                dockerfile: body.dockerfile,
                alias: body.alias,
                start_cmd: body.start_cmd,
                ready_cmd: body.ready_cmd,
                cpu_count: body.cpu_count,
                memory_mb: body.memory_mb,
            },
        )
        .await?;
    let item = TemplateItem::from(&requested.template).with_build_id(requested.build_id);
    Ok((StatusCode::ACCEPTED, Json(item)))
}

/// How a Dockerfile build of a new or existing template fails.
#[derive(IntoResponses)]
// Never constructed: it only names answers for the document.
#[allow(dead_code)]
enum DockerfileErrors {
    #[response(status = 400, description = "Invalid Dockerfile, name or resources")]
    Invalid(ErrorBody),
    #[response(status = 404, description = "No such template")]
    NotFound(ErrorBody),
    #[response(status = 409, description = "The alias belongs to another template")]
    AliasTaken(ErrorBody),
}

/// `POST /templates`: a new template from a Dockerfile.
#[utoipa::path(
    post,
    path = "/templates",
    tag = "templates",
    operation_id = "postTemplates",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    request_body = DockerfileBody,
    responses(
        (status = 202, description = "The template and its build were registered; start the build next", body = TemplateItem),
        DockerfileErrors,
        CommonErrors,
    )
)]
pub(crate) async fn create_from_dockerfile(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    JsonBody(body): JsonBody<DockerfileBody>,
) -> Result<(StatusCode, Json<TemplateItem>), ApiError> {
    dockerfile_build(&state, &team, None, body).await
}

/// `POST /templates/{id}`: a new Dockerfile build of an existing template.
#[utoipa::path(
    post,
    path = "/templates/{templateID}",
    tag = "templates",
    operation_id = "postTemplate",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(TemplatePath),
    request_body = DockerfileBody,
    responses(
        (status = 202, description = "The template and its build were registered; start the build next", body = TemplateItem),
        DockerfileErrors,
        CommonErrors,
    )
)]
pub(crate) async fn rebuild_from_dockerfile(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(template_id): PathParam<String>,
    JsonBody(body): JsonBody<DockerfileBody>,
) -> Result<(StatusCode, Json<TemplateItem>), ApiError> {
    dockerfile_build(&state, &team, Some(&template_id), body).await
}

/// `POST /templates/{id}/builds/{buildID}`: starts a Dockerfile build.
#[utoipa::path(
    post,
    path = "/templates/{templateID}/builds/{buildID}",
    tag = "templates",
    operation_id = "postTemplateBuild",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(BuildPath),
    responses(
        (status = 202, description = "The build was started"),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "No such template or build", body = ErrorBody),
        (status = 409, description = "The build was already started", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn start_dockerfile_build(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state
        .builds
        .start_dockerfile(&team, &template_id, &build_id)
        .await?;
    Ok(StatusCode::ACCEPTED)
}

/// `DELETE /templates/{id}/builds/{buildID}`: cancels a build that waits or runs.
#[utoipa::path(
    delete,
    path = "/templates/{templateID}/builds/{buildID}",
    tag = "templates",
    operation_id = "deleteTemplateBuild",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(("templateID" = String, Path, description = "The template's ID"), ("buildID" = String, Path, description = "The build's ID")),
    responses(
        (status = 204, description = "The build was cancelled: its status is error and its sandbox is gone"),
        (status = 404, description = "No such template or build", body = ErrorBody),
        (status = 409, description = "The build already ended", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn cancel_build(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state.builds.cancel(&team, &template_id, &build_id).await?;
    Ok(StatusCode::NO_CONTENT)
}
