//! Volume endpoints: the control plane (`/volumes`, with `X-API-Key`) and the content API
//! (`/volumecontent/{volumeID}/…`, with the volume's own token as `Authorization: Bearer`).
//! Parse and validate here, then call [`sandbar_core::Volumes`].

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandbar_core::volumes::{EntryOwner, EntryStat, VolumePath};
use sandbar_core::{Volume, Volumes};
use serde::{Deserialize, Serialize};

use crate::AppState;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiKeyTeam, JsonBody, PathParam, QueryPairs};
use crate::openapi::{CommonErrors, VolumeIdPath};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The control plane's volume routes, described in the API document.
pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(detail, delete))
}

/// The volume content API: authorised by each volume's own token and served raw, so it is
/// not part of the control plane's document.
pub(crate) fn content_routes() -> axum::Router<AppState> {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/volumecontent/{volume_id}/path",
            get(stat).patch(update_metadata).delete(remove),
        )
        .route(
            "/volumecontent/{volume_id}/file",
            get(read_file).put(write_file),
        )
        .route(
            "/volumecontent/{volume_id}/dir",
            get(list_dir).post(make_dir),
        )
}

/// `volumeMounts` of a create request: `[{name, path}]`, each entry named in errors.
pub(crate) fn mount_requests(
    raw: Option<&[serde_json::Value]>,
) -> Result<Vec<sandbar_core::MountRequest>, ApiError> {
    let mut mounts = Vec::new();
    for (index, entry) in raw.unwrap_or_default().iter().enumerate() {
        let field = |key: &str| {
            entry.get(key).and_then(|v| v.as_str()).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "volumeMounts[{index}]: {key} must be a string, got {}",
                    entry.get(key).map_or("nothing".into(), |v| v.to_string())
                ))
            })
        };
        mounts.push(sandbar_core::MountRequest {
            name: field("name")?.to_owned(),
            path: field("path")?.to_owned(),
        });
    }
    Ok(mounts)
}

/// A sandbox's recorded mounts as `GET /sandboxes/{id}` shows them.
pub(crate) async fn sandbox_mounts(
    state: &AppState,
    sandbox_id: &str,
) -> Result<Vec<crate::dto::VolumeMount>, ApiError> {
    let Some(volumes) = state.sandboxes.volumes() else {
        return Ok(Vec::new());
    };
    Ok(volumes
        .sandbox_mounts(sandbox_id)
        .await?
        .into_iter()
        .map(|m| crate::dto::VolumeMount {
            name: m.name,
            path: m.path,
        })
        .collect())
}

/// Largest file the content API accepts in one upload. Uploads stream to disk, so this
/// bounds what one request may take of the disk pool, not the server's memory.
pub(crate) const MAX_UPLOAD_BYTES: u64 = 256 << 20;

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct NewVolume {
    /// At most `sandbar_core::volumes::MAX_NAME_LEN` characters.
    #[schema(
        required = true,
        pattern = "^[a-zA-Z0-9_-]+$",
        min_length = 1,
        max_length = 128
    )]
    name: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Volume)]
pub(crate) struct VolumeView {
    #[serde(rename = "volumeID")]
    volume_id: String,
    name: String,
}

/// A volume with the token of its content API.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    volume_id: String,
    name: String,
    token: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct EntryView {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: String,
    mtime: String,
    ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

impl From<EntryStat> for EntryView {
    fn from(e: EntryStat) -> Self {
        let ts = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339();
        Self {
            name: e.name,
            kind: e.kind.as_str(),
            path: e.path,
            size: e.size,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            atime: ts(e.atime),
            mtime: ts(e.mtime),
            ctime: ts(e.ctime),
            target: e.target,
        }
    }
}

/// `PATCH /volumecontent/{id}/path` body.
#[derive(Debug, Deserialize, Default)]
pub(crate) struct MetadataBody {
    uid: Option<i64>,
    gid: Option<i64>,
    mode: Option<i64>,
}

fn volumes(state: &AppState) -> Result<&Arc<Volumes>, ApiError> {
    state.sandboxes.volumes().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "this server has no volume storage",
        )
    })
}

fn with_token(volumes: &Volumes, v: Volume) -> VolumeAndToken {
    VolumeAndToken {
        token: volumes.token(&v),
        volume_id: v.id,
        name: v.name,
    }
}

#[utoipa::path(
    get,
    path = "/volumes",
    tag = "volumes",
    operation_id = "getVolumes",
    security(("ApiKeyAuth" = [])),
    responses(
        (status = 200, description = "The team's volumes", body = Vec<VolumeView>),
        (status = 501, description = "This server has no volume storage", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
) -> Result<Json<Vec<VolumeView>>, ApiError> {
    let volumes = volumes(&state)?.list(&team).await?;
    Ok(Json(
        volumes
            .into_iter()
            .map(|v| VolumeView {
                volume_id: v.id,
                name: v.name,
            })
            .collect(),
    ))
}

#[utoipa::path(
    post,
    path = "/volumes",
    tag = "volumes",
    operation_id = "postVolumes",
    security(("ApiKeyAuth" = [])),
    request_body = NewVolume,
    responses(
        (status = 201, description = "The new volume", body = VolumeAndToken),
        (status = 400, description = "Missing or invalid name", body = ErrorBody),
        (status = 409, description = "The team has a volume of that name", body = ErrorBody),
        (status = 501, description = "This server has no volume storage", body = ErrorBody),
        (status = 507, description = "The team's volumes hold as many bytes as its limit allows", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    JsonBody(body): JsonBody<NewVolume>,
) -> Result<Response, ApiError> {
    let volumes = volumes(&state)?;
    let name = body
        .name
        .ok_or_else(|| ApiError::bad_request("the volume's name is required"))?;
    let volume = volumes.create(&team, &name).await?;
    Ok((StatusCode::CREATED, Json(with_token(volumes, volume))).into_response())
}

#[utoipa::path(
    get,
    path = "/volumes/{volumeID}",
    tag = "volumes",
    operation_id = "getVolume",
    security(("ApiKeyAuth" = [])),
    params(VolumeIdPath),
    responses(
        (status = 200, description = "The volume", body = VolumeAndToken),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "No such volume in the team", body = ErrorBody),
        (status = 501, description = "This server has no volume storage", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn detail(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(volume_id): PathParam<String>,
) -> Result<Json<VolumeAndToken>, ApiError> {
    let volumes = volumes(&state)?;
    let volume = volumes.get(&team, &volume_id).await?;
    Ok(Json(with_token(volumes, volume)))
}

#[utoipa::path(
    delete,
    path = "/volumes/{volumeID}",
    tag = "volumes",
    operation_id = "deleteVolume",
    security(("ApiKeyAuth" = [])),
    params(VolumeIdPath),
    responses(
        (status = 204, description = "The volume was deleted"),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "No such volume in the team", body = ErrorBody),
        (status = 409, description = "A sandbox has the volume mounted", body = ErrorBody),
        (status = 501, description = "This server has no volume storage", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn delete(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(volume_id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    volumes(&state)?.delete(&team, &volume_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The volume a content request names, authorised by its bearer token.
pub(crate) struct Authorized {
    volumes: Arc<Volumes>,
    volume: Volume,
}

impl FromRequestParts<AppState> for Authorized {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let PathParam(volume_id) = PathParam::<String>::from_request_parts(parts, state).await?;
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let volumes = volumes(state)?.clone();
        let volume = volumes.authorize(&volume_id, token).await?;
        Ok(Authorized { volumes, volume })
    }
}

impl Authorized {
    fn path(&self, query: &QueryPairs) -> Result<VolumePath, ApiError> {
        let raw = query
            .get("path")
            .ok_or_else(|| ApiError::bad_request("query parameter path is required"))?;
        Ok(Volumes::parse_path(&self.volume, raw)?)
    }
}

fn id_param(query: &QueryPairs, key: &str) -> Result<Option<u32>, ApiError> {
    Ok(query
        .int_in(key, 0..=i64::from(u32::MAX))?
        .map(|v| v as u32))
}

fn owner(query: &QueryPairs) -> Result<EntryOwner, ApiError> {
    Ok(EntryOwner {
        uid: id_param(query, "uid")?,
        gid: id_param(query, "gid")?,
        mode: id_param(query, "mode")?,
    })
}

fn flag(query: &QueryPairs, key: &str) -> Result<bool, ApiError> {
    match query.get(key) {
        None => Ok(false),
        Some("true" | "1") => Ok(true),
        Some("false" | "0") => Ok(false),
        Some(other) => Err(ApiError::bad_request(format!(
            "query parameter {key} must be true or false, got '{other}'"
        ))),
    }
}

/// `GET /volumecontent/{id}/path`: one entry, links not followed.
pub(crate) async fn stat(auth: Authorized, query: QueryPairs) -> Result<Json<EntryView>, ApiError> {
    let path = auth.path(&query)?;
    let entry = auth.volumes.stat(&auth.volume, path).await?;
    Ok(Json(entry.into()))
}

/// `GET /volumecontent/{id}/file`: the file's bytes, streamed from disk as the client reads.
pub(crate) async fn read_file(auth: Authorized, query: QueryPairs) -> Result<Response, ApiError> {
    let path = auth.path(&query)?;
    let file = auth.volumes.read(&auth.volume, path).await?;
    let mut response = Response::new(crate::body_stream::sized_body(file.reader, file.size));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(file.size));
    Ok(response)
}

/// `PUT /volumecontent/{id}/file`: the raw body becomes the file, written as it arrives.
pub(crate) async fn write_file(
    auth: Authorized,
    query: QueryPairs,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let path = auth.path(&query)?;
    let owner = owner(&query)?;
    let parents = flag(&query, "force")?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_UPLOAD_BYTES) {
        return Err(sandbar_core::VolumeContentError::TooLarge {
            volume_id: auth.volume.id.clone(),
            limit: MAX_UPLOAD_BYTES,
        }
        .into());
    }
    let body = Box::pin(crate::body_stream::BodyReader::new(body));
    let entry = auth
        .volumes
        .write(&auth.volume, path, body, MAX_UPLOAD_BYTES, owner, parents)
        .await?;
    Ok((StatusCode::CREATED, Json(EntryView::from(entry))).into_response())
}

/// `GET /volumecontent/{id}/dir`.
pub(crate) async fn list_dir(
    auth: Authorized,
    query: QueryPairs,
) -> Result<Json<Vec<EntryView>>, ApiError> {
    let path = auth.path(&query)?;
    let depth = query.int_in("depth", 1..=32)?.unwrap_or(1) as u32;
    let entries = auth.volumes.list_dir(&auth.volume, path, depth).await?;
    Ok(Json(entries.into_iter().map(EntryView::from).collect()))
}

/// `POST /volumecontent/{id}/dir`.
pub(crate) async fn make_dir(auth: Authorized, query: QueryPairs) -> Result<Response, ApiError> {
    let path = auth.path(&query)?;
    let owner = owner(&query)?;
    let parents = flag(&query, "force")?;
    let entry = auth
        .volumes
        .make_dir(&auth.volume, path, owner, parents)
        .await?;
    Ok((StatusCode::CREATED, Json(EntryView::from(entry))).into_response())
}

/// `DELETE /volumecontent/{id}/path`.
pub(crate) async fn remove(auth: Authorized, query: QueryPairs) -> Result<StatusCode, ApiError> {
    let path = auth.path(&query)?;
    auth.volumes.remove(&auth.volume, path).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PATCH /volumecontent/{id}/path`.
pub(crate) async fn update_metadata(
    auth: Authorized,
    query: QueryPairs,
    JsonBody(body): JsonBody<MetadataBody>,
) -> Result<Json<EntryView>, ApiError> {
    let path = auth.path(&query)?;
    let field = |name: &str, v: Option<i64>| -> Result<Option<u32>, ApiError> {
        v.map(|v| {
            u32::try_from(v).map_err(|_| {
                ApiError::bad_request(format!("{name} must be a non-negative integer, got {v}"))
            })
        })
        .transpose()
    };
    let owner = EntryOwner {
        uid: field("uid", body.uid)?,
        gid: field("gid", body.gid)?,
        mode: field("mode", body.mode)?,
    };
    let entry = auth.volumes.set_owner(&auth.volume, path, owner).await?;
    Ok(Json(entry.into()))
}
