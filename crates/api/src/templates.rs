//! Template endpoints: lookups, the build flow of the SDKs (`POST /v3/templates`, file
//! uploads, `POST /v2/templates/{id}/builds/{buildID}`, status and logs) and administration.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use sandbar_core::builds::{
    BuildLogEntry, BuildRecord, BuildSource, BuildSpec, BuildStep, LogLevel, RegistryCredentials,
    RequestBuild, StepKind,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::dto::{TemplateItem, rfc3339};
use crate::error::ApiError;
use crate::extract::{ApiKeyTeam, JsonBody, PathParam, QueryPairs, TeamAuth};

pub(crate) async fn list(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
) -> Result<Json<Vec<TemplateItem>>, ApiError> {
    let templates = state.templates.list(&team).await?;
    Ok(Json(templates.iter().map(TemplateItem::from).collect()))
}

pub(crate) async fn alias(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(alias): PathParam<String>,
) -> Result<Json<Value>, ApiError> {
    let template = state.templates.resolve(&team, &alias).await?;
    Ok(Json(
        json!({"templateID": template.id, "public": template.public}),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RequestBuildBody {
    name: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    alias: Option<String>,
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

/// `POST /v3/templates` (and `POST /v2/templates`, whose body names the template `alias`).
pub(crate) async fn request_build(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<RequestBuildBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
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
        Json(json!({
            "templateID": requested.template.id,
            "buildID": requested.build_id,
            "public": requested.template.public,
            "names": requested.template.aliases,
            "aliases": requested.template.aliases,
            "tags": requested.tags,
        })),
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
pub(crate) async fn file_link(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, hash)): PathParam<(String, String)>,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let (present, token) = state.builds.upload_link(&team, &template_id, &hash).await?;
    let mut body = json!({ "present": present });
    if let Some(token) = token {
        body["url"] = Value::String(format!(
            "{}/upload/templates/{template_id}/files/{hash}?token={token}",
            external_base(&headers)
        ));
    }
    Ok((StatusCode::CREATED, Json(body)))
}

/// `PUT /upload/templates/{id}/files/{hash}?token=…`: the upload link itself, no API key.
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
    // The body streams through a pipe, so a large upload never sits in memory.
    let (reader, mut writer) = tokio::io::duplex(256 * 1024);
    let forward = tokio::spawn(async move {
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data()
                && tokio::io::AsyncWriteExt::write_all(&mut writer, &data)
                    .await
                    .is_err()
            {
                break;
            }
        }
    });
    let result = state.builds.upload(&hash, &token, Box::pin(reader)).await;
    forward.abort();
    result?;
    Ok(StatusCode::CREATED)
}

#[derive(Debug, Deserialize)]
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

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RegistryBody {
    #[serde(rename = "type")]
    kind: String,
    username: Option<String>,
    password: Option<String>,
}

#[derive(Debug, Deserialize)]
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
            StepKind::Env {
                vars: step
                    .args
                    .chunks(2)
                    .map(|p| (p[0].clone(), p[1].clone()))
                    .collect(),
            }
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
                ready_cmd: body.ready_cmd,
            },
        )
        .await?;
    Ok(StatusCode::ACCEPTED)
}

fn entry_json(e: &BuildLogEntry) -> Value {
    let mut v = json!({
        "timestamp": rfc3339(e.timestamp),
        "level": e.level.as_str(),
        "message": e.message,
    });
    if let Some(step) = &e.step {
        v["step"] = Value::String(step.clone());
    }
    v
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
pub(crate) async fn build_status(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let offset = query
        .int_in("logsOffset", 0..=i64::from(u32::MAX))?
        .unwrap_or(0) as u64;
    let limit = query.int_in("limit", 0..=100)?.unwrap_or(100) as u64;
    let level = level_param(&query)?;
    let (build, logs) = state
        .builds
        .status(&team, &template_id, &build_id, offset, limit, level)
        .await?;
    let mut body = json!({
        "templateID": build.template_id,
        "buildID": build.id,
        "status": build.status.as_str(),
        "logs": logs.iter().map(|e| format!("{} {}\n", rfc3339(e.timestamp), e.message)).collect::<Vec<_>>(),
        "logEntries": logs.iter().map(entry_json).collect::<Vec<_>>(),
    });
    if let Some(failure) = &build.failure {
        let mut reason = json!({ "message": failure.message });
        if let Some(step) = &failure.step {
            reason["step"] = Value::String(step.clone());
        }
        body["reason"] = reason;
    }
    Ok(Json(body))
}

/// `GET /templates/{id}/builds/{buildID}/logs` (`cursor` in milliseconds, `direction`).
pub(crate) async fn build_logs(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam((template_id, build_id)): PathParam<(String, String)>,
    query: QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let build = state
        .builds
        .visible_build(&team, &template_id, &build_id)
        .await?;
    let limit = query.int_in("limit", 0..=100)?.unwrap_or(100) as usize;
    let cursor = query.int_in("cursor", 0..=i64::MAX)?;
    let level = level_param(&query)?;
    let forward = match query.get("direction").unwrap_or("forward") {
        "forward" => true,
        "backward" => false,
        other => {
            return Err(ApiError::bad_request(format!(
                "direction must be forward or backward, got '{other}'"
            )));
        }
    };
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
    Ok(Json(
        json!({ "logs": logs.iter().map(entry_json).collect::<Vec<_>>() }),
    ))
}

fn build_json(b: &BuildRecord) -> Value {
    let mut v = json!({
        "buildID": b.id,
        "status": b.status.as_str(),
        "createdAt": rfc3339(b.created_at),
        "updatedAt": rfc3339(b.updated_at),
        "cpuCount": b.cpu_count,
        "memoryMB": b.memory_mb,
        "diskSizeMB": b.disk_size_mb,
    });
    if let Some(at) = b.finished_at {
        v["finishedAt"] = Value::String(rfc3339(at));
    }
    v
}

/// `GET /templates/{id}` with its builds (`limit`, `nextToken` = offset).
pub(crate) async fn detail(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
    query: QueryPairs,
) -> Result<Response, ApiError> {
    let template = state
        .templates
        .resolve(&team, &template_id)
        .await
        .map_err(|e| match e {
            sandbar_core::TemplateError::Forbidden(_) => ApiError::new(
                StatusCode::NOT_FOUND,
                format!("template '{template_id}' not found"),
            ),
            other => other.into(),
        })?;
    let limit = query.int_in("limit", 1..=100)?.unwrap_or(100) as usize;
    let start: usize = match query.get("nextToken") {
        None => 0,
        Some(t) => t
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid nextToken '{t}'")))?,
    };
    let builds = state.builds.builds_of(&template.id).await?;
    let page: Vec<Value> = builds
        .iter()
        .skip(start)
        .take(limit)
        .map(build_json)
        .collect();
    let body = json!({
        "templateID": template.id,
        "public": template.public,
        "aliases": template.aliases,
        "names": template.aliases,
        "createdAt": rfc3339(template.created_at),
        "updatedAt": rfc3339(template.updated_at),
        "lastSpawnedAt": template.last_spawned_at.map(rfc3339),
        "spawnCount": template.spawn_count,
        "builds": page,
    });
    let mut response = Json(body).into_response();
    if start + limit < builds.len()
        && let Ok(v) = (start + limit).to_string().parse()
    {
        response.headers_mut().insert("x-next-token", v);
    }
    Ok(response)
}

pub(crate) async fn delete(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    state.builds.delete_template(&team, &template_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpdateBody {
    public: Option<bool>,
}

pub(crate) async fn update(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
    JsonBody(body): JsonBody<UpdateBody>,
) -> Result<Json<Value>, ApiError> {
    let template = match body.public {
        Some(public) => state.builds.set_public(&team, &template_id, public).await?,
        None => state.templates.resolve(&team, &template_id).await?,
    };
    Ok(Json(json!({ "names": template.aliases })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AssignTagsBody {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`.
pub(crate) async fn assign_tags(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<AssignTagsBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let (build_id, tags) = state
        .builds
        .assign_tags(&team, &body.target, &body.tags)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "buildID": build_id, "tags": tags })),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteTagsBody {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`.
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
pub(crate) async fn tags(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(template_id): PathParam<String>,
) -> Result<Json<Value>, ApiError> {
    let tags = state.builds.tags(&team, &template_id).await?;
    Ok(Json(Value::Array(
        tags.iter()
            .map(|(tag, build)| {
                json!({
                    "tag": tag,
                    "buildID": build.id,
                    "createdAt": rfc3339(build.finished_at.unwrap_or(build.created_at)),
                })
            })
            .collect(),
    )))
}

#[derive(Debug, Deserialize)]
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
) -> Result<(StatusCode, Json<Value>), ApiError> {
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
    let mut item = serde_json::to_value(TemplateItem::from(&requested.template))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    item["buildID"] = Value::String(requested.build_id);
    Ok((StatusCode::ACCEPTED, Json(item)))
}

/// `POST /templates`: a new template from a Dockerfile.
pub(crate) async fn create_from_dockerfile(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    JsonBody(body): JsonBody<DockerfileBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    dockerfile_build(&state, &team, None, body).await
}

/// `POST /templates/{id}`: a new Dockerfile build of an existing template.
pub(crate) async fn rebuild_from_dockerfile(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(template_id): PathParam<String>,
    JsonBody(body): JsonBody<DockerfileBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    dockerfile_build(&state, &team, Some(&template_id), body).await
}

/// `POST /templates/{id}/builds/{buildID}`: starts a Dockerfile build.
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
