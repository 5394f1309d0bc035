//! `GET /files` and `POST /files`: streamed downloads and uploads.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde::Deserialize;
use tokio::io::AsyncReadExt as _;
use tokio::sync::mpsc;

use crate::AgentState;
use crate::auth::{FileOperation, basic_auth_user, header_token_ok, verify_file_signature};
use crate::file_metadata::{Metadata, WriteMetadataError};
use crate::fs::{ensure_dirs, resolve_path};
use crate::http_error::{HttpError, json_error};
use crate::users::{Accounts, User};

const CHUNK: usize = 64 * 1024;

/// Query parameters shared by download and upload.
#[derive(Debug, Deserialize)]
pub struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<i64>,
}

/// How a file request was let in, which decides whose it is.
#[derive(Debug, PartialEq, Eq)]
enum Grant {
    /// The access token, or no token is configured: the caller may act as any user.
    Token,
    /// A signed URL, which acts as the user it was signed for ('' for the default user) and
    /// no other.
    Signed { user: String },
}

fn authorize(
    state: &AgentState,
    headers: &HeaderMap,
    query: &FileQuery,
    operation: FileOperation,
) -> Result<Grant, HttpError> {
    let config = state.config();
    let Some(token) = config.access_token.as_deref() else {
        return Ok(Grant::Token);
    };
    if headers.get(crate::auth::ACCESS_TOKEN_HEADER).is_some()
        && header_token_ok(headers, Some(token))
    {
        return Ok(Grant::Token);
    }
    let Some(signature) = query.signature.as_deref() else {
        return Err(HttpError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized access, please provide a valid access token or signature",
        ));
    };
    let path = query.path.as_deref().unwrap_or_default();
    // The signature covers the user the URL names (the SDKs sign '' when it names none), so
    // a URL cannot be turned into one for another user.
    let named = query.username.as_deref().unwrap_or_default();
    let now = chrono::Utc::now().timestamp();
    verify_file_signature(
        signature,
        path,
        operation,
        &[named],
        token,
        query.signature_expiration,
        now,
    )
    .map_err(|e| HttpError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
    Ok(Grant::Signed {
        user: named.to_owned(),
    })
}

/// The name of the user a file request acts as. With the token: the URL's `username`, else
/// the `Authorization: Basic` user, else the default. With a signature: the user it was
/// signed for, whatever else the request says; a Basic header naming another user is
/// refused rather than quietly overruled, so the caller learns the URL is not theirs to use
/// that way.
fn requested_user(
    grant: &Grant,
    query_user: Option<&str>,
    header_user: Option<String>,
    default_user: &str,
) -> Result<String, HttpError> {
    match grant {
        Grant::Token => Ok(query_user
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .or(header_user)
            .unwrap_or_else(|| default_user.to_owned())),
        Grant::Signed { user } => {
            let signed = if user.is_empty() { default_user } else { user };
            match header_user {
                Some(named) if named != signed => Err(HttpError::new(
                    StatusCode::UNAUTHORIZED,
                    format!(
                        "the URL is signed for user '{signed}', but the Authorization header names user '{named}'"
                    ),
                )),
                _ => Ok(signed.to_owned()),
            }
        }
    }
}

fn pick_user(
    state: &AgentState,
    headers: &HeaderMap,
    query: &FileQuery,
    grant: &Grant,
) -> Result<(User, Accounts), HttpError> {
    let name = requested_user(
        grant,
        query.username.as_deref(),
        basic_auth_user(headers),
        &state.config().default_user,
    )?;
    let accounts = Accounts::load()
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let user = accounts
        .user(&name)
        .map_err(|e| HttpError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
    Ok((user, accounts))
}

/// The answer to a download whose file `what` (open, stat) failed on.
fn unreadable(path: &Path, what: &str, e: &std::io::Error) -> Response {
    if e.kind() == std::io::ErrorKind::NotFound {
        return json_error(
            StatusCode::NOT_FOUND,
            format!("path '{}' does not exist", path.display()),
        );
    }
    json_error(io_status(e), format!("{what} '{}': {e}", path.display()))
}

fn io_status(e: &std::io::Error) -> StatusCode {
    match e.kind() {
        std::io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
        std::io::ErrorKind::PermissionDenied => StatusCode::UNAUTHORIZED,
        // Out of space, or over the sandbox's disk quota: envd's 507, which the SDKs turn
        // into their not-enough-space error.
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
            StatusCode::INSUFFICIENT_STORAGE
        }
        // A path through a magic link is one the agent cannot use, like a bad path.
        std::io::ErrorKind::IsADirectory
        | std::io::ErrorKind::NotADirectory
        | std::io::ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|enc| {
            let mut parts = enc.trim().split(';');
            let name = parts.next().unwrap_or_default().trim();
            let rejected = parts.any(|p| p.trim().replace(' ', "") == "q=0");
            name.eq_ignore_ascii_case("gzip") && !rejected
        })
}

/// `GET /files`.
pub async fn download(
    State(state): State<Arc<AgentState>>,
    headers: HeaderMap,
    Query(query): Query<FileQuery>,
) -> Response {
    let grant = match authorize(&state, &headers, &query, FileOperation::Read) {
        Ok(grant) => grant,
        Err(e) => return e.into_response(),
    };
    let (user, accounts) = match pick_user(&state, &headers, &query, &grant) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let Some(raw_path) = query.path.as_deref().filter(|p| !p.is_empty()) else {
        return json_error(StatusCode::BAD_REQUEST, "missing 'path' query parameter");
    };
    let path = resolve_path(raw_path, &user);
    let opened = {
        let path = path.clone();
        crate::identity::as_user(&user, accounts.group_ids(&user), move || {
            crate::paths::open_read(&path)
        })
        .await
    };
    let file = match opened {
        Ok(f) => f,
        Err(e) => return unreadable(&path, "open", &e),
    };
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => return unreadable(&path, "stat", &e),
    };
    if meta.is_dir() {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("path '{}' is a directory", path.display()),
        );
    }
    let file = tokio::fs::File::from_std(file);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace('"', ""))
        .unwrap_or_default();
    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(
            header::CONTENT_DISPOSITION,
            HeaderValue::from_str(&format!("inline; filename=\"{name}\""))
                .unwrap_or(HeaderValue::from_static("inline")),
        );
    let body = if accepts_gzip(&headers) {
        builder = builder
            .header(header::CONTENT_ENCODING, "gzip")
            .header(header::VARY, "Accept-Encoding");
        gzip_body(file.into_std().await)
    } else {
        builder = builder.header(header::CONTENT_LENGTH, meta.len());
        Body::from_stream(file_stream(file))
    };
    builder
        .body(body)
        .unwrap_or_else(|e| json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

fn file_stream(file: tokio::fs::File) -> impl Stream<Item = std::io::Result<Bytes>> {
    futures_util::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = bytes::BytesMut::with_capacity(CHUNK);
        match file.read_buf(&mut buf).await {
            Ok(0) => None,
            Ok(_) => Some((Ok(buf.freeze()), Some(file))),
            Err(e) => Some((Err(e), None)),
        }
    })
}

/// Sends what a blocking writer produces to an async body.
struct ChannelWriter(mpsc::Sender<std::io::Result<Bytes>>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn gzip_body(mut file: std::fs::File) -> Body {
    let (tx, rx) = mpsc::channel(8);
    let errors = tx.clone();
    tokio::task::spawn_blocking(move || {
        let sink = std::io::BufWriter::with_capacity(CHUNK, ChannelWriter(tx));
        let mut encoder = flate2::write::GzEncoder::new(sink, flate2::Compression::fast());
        let result = std::io::copy(&mut file, &mut encoder)
            .and_then(|_| encoder.finish())
            .and_then(|mut sink| sink.flush());
        if let Err(e) = result {
            let _ = errors.blocking_send(Err(e));
        }
    });
    Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

#[derive(Debug, serde::Serialize)]
struct WrittenEntry {
    name: String,
    r#type: &'static str,
    path: String,
    /// What the file holds after the write, read back rather than echoed, so a filesystem
    /// without attributes does not seem to have kept any.
    #[serde(skip_serializing_if = "Metadata::is_empty")]
    metadata: Metadata,
}

/// Most of an upload a refused client may still be sending that is read before answering.
const REJECTED_UPLOAD_DRAIN_LIMIT: usize = 8 << 20;

/// Answers a refused upload only after reading what the client is still sending (within a
/// bound): closing the connection on an unread body makes the client, or the proxy in front
/// of the agent, see a broken pipe instead of the refusal.
async fn reject_unread_upload(request: Request, error: HttpError) -> Response {
    let mut body = request.into_body().into_data_stream();
    let drain = async {
        let mut seen = 0;
        while let Some(Ok(chunk)) = body.next().await {
            seen += chunk.len();
            if seen > REJECTED_UPLOAD_DRAIN_LIMIT {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
    error.into_response()
}

/// How much of a request body the agent still reads after its handler answered.
const TRAILING_BODY_DRAIN_LIMIT: usize = 8 << 20;

/// Hands the handler a body that is read to its end (within a bound) before the response
/// leaves. A multipart parser stops at the closing boundary, and an early error stops sooner;
/// if the answer went out while the client (or the edge in front of the agent) was still
/// sending the rest, the server would close the connection under it and the sender would see
/// a failed body write instead of the answer (seen under CPU load as sporadic 502s on
/// uploads).
pub async fn read_whole_body(request: Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = request.into_parts();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, axum::Error>>(8);
    let pump = tokio::spawn(async move {
        let mut stream = body.into_data_stream();
        let mut discarded = 0usize;
        let mut forwarding = true;
        while let Some(item) = stream.next().await {
            if forwarding {
                if let Err(returned) = tx.send(item).await {
                    // The handler is done with the body: keep reading, without keeping.
                    forwarding = false;
                    discarded += returned.0.map_or(0, |b| b.len());
                }
            } else {
                discarded += item.map_or(0, |b| b.len());
            }
            if discarded > TRAILING_BODY_DRAIN_LIMIT {
                break;
            }
        }
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }));
    let response = next.run(Request::from_parts(parts, body)).await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), pump).await;
    response
}

/// `POST /files`.
pub async fn upload(
    State(state): State<Arc<AgentState>>,
    Query(query): Query<FileQuery>,
    request: Request,
) -> Response {
    let headers = request.headers().clone();
    let grant = match authorize(&state, &headers, &query, FileOperation::Write) {
        Ok(grant) => grant,
        Err(e) => return reject_unread_upload(request, e).await,
    };
    let (user, accounts) = match pick_user(&state, &headers, &query, &grant) {
        Ok(u) => u,
        Err(e) => return reject_unread_upload(request, e).await,
    };
    // One set for every file of the request, checked before anything is written.
    let metadata = match crate::file_metadata::from_headers(&headers) {
        Ok(m) => m,
        Err(e) => {
            return reject_unread_upload(
                request,
                HttpError::new(StatusCode::BAD_REQUEST, e.to_string()),
            )
            .await;
        }
    };
    let groups = accounts.group_ids(&user);
    let query_path = query
        .path
        .as_deref()
        .filter(|p| !p.is_empty())
        .map(|p| resolve_path(p, &user));
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();

    let mut written: Vec<(PathBuf, Metadata)> = Vec::new();
    if content_type.starts_with("multipart/") {
        let mut multipart = match Multipart::from_request(request, &()).await {
            Ok(m) => m,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, e.body_text()),
        };
        loop {
            let field = match multipart.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return json_error(StatusCode::BAD_REQUEST, e.body_text()),
            };
            if field.name() != Some("file") {
                continue;
            }
            let dest = match (&query_path, field.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(name)) if !name.is_empty() => resolve_path(name, &user),
                _ => {
                    return json_error(
                        StatusCode::BAD_REQUEST,
                        "file part has no filename and no 'path' query parameter was given",
                    );
                }
            };
            if written.iter().any(|(p, _)| *p == dest) {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    format!("cannot upload several files to '{}'", dest.display()),
                );
            }
            let stream = futures_util::stream::unfold(field, |mut field| async move {
                match field.chunk().await {
                    Ok(Some(chunk)) => Some((Ok(chunk), field)),
                    Ok(None) => None,
                    Err(e) => Some((Err(std::io::Error::other(e.body_text())), field)),
                }
            });
            match write_stream(&dest, &user, &groups, false, &metadata, stream).await {
                Ok(kept) => written.push((dest, kept)),
                Err(e) => return e.into_response(),
            }
        }
    } else {
        let Some(dest) = query_path else {
            return json_error(StatusCode::BAD_REQUEST, "missing 'path' query parameter");
        };
        let gzip = headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"));
        let stream = request
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other));
        match write_stream(&dest, &user, &groups, gzip, &metadata, stream).await {
            Ok(kept) => written.push((dest, kept)),
            Err(e) => return e.into_response(),
        }
    }
    let entries: Vec<WrittenEntry> = written
        .into_iter()
        .map(|(p, metadata)| WrittenEntry {
            name: p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            r#type: "file",
            path: p.to_string_lossy().into_owned(),
            metadata,
        })
        .collect();
    (StatusCode::OK, Json(entries)).into_response()
}

/// Sets the owner a file opened for a write already has. envd gives every file it writes to
/// its user between the open and the first byte, and clients watching the directory count
/// the attribute change that makes (a new file is CREATE, CHMOD, WRITE); the same owner set
/// again changes nothing else. Best effort, as the write does not depend on it.
fn give_to_its_owner(file: &std::fs::File) {
    if let Ok(stat) = rustix::fs::fstat(file) {
        let owner = (
            rustix::fs::Uid::from_raw(stat.st_uid),
            rustix::fs::Gid::from_raw(stat.st_gid),
        );
        if let Err(e) = rustix::fs::fchown(file, Some(owner.0), Some(owner.1)) {
            tracing::debug!(error = %e, "cannot set a written file's owner again");
        }
    }
}

/// Writes a body to `dest` on a blocking thread (gunzipping it when asked), then gives the file
/// `metadata` as its whole set and returns the set it holds. The file and its missing parents
/// are made with `user`'s permissions, so they are the user's and a path the user may not
/// write is refused.
async fn write_stream(
    dest: &Path,
    user: &User,
    groups: &[u32],
    gzip: bool,
    metadata: &Metadata,
    stream: impl Stream<Item = std::io::Result<Bytes>>,
) -> Result<Metadata, HttpError> {
    let target = dest.to_owned();
    let owner = user.clone();
    let opened = crate::identity::as_user(user, groups.to_vec(), move || {
        if let Some(parent) = target.parent() {
            ensure_dirs(parent, &owner).map_err(|e| match e {
                crate::fs::FsError::Io { source, .. } => source,
                other => std::io::Error::new(fs_kind(&other), other.to_string()),
            })?;
        }
        if crate::paths::metadata(&target).is_ok_and(|m| m.is_dir()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                format!("path '{}' is a directory", target.display()),
            ));
        }
        crate::paths::create_write(&target)
    })
    .await;
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::IsADirectory => {
            return Err(HttpError::new(
                StatusCode::BAD_REQUEST,
                format!("path '{}' is a directory", dest.display()),
            ));
        }
        Err(e) => {
            return Err(HttpError::new(
                io_status(&e),
                format!("writing '{}': {e}", dest.display()),
            ));
        }
    };
    let (tx, mut rx) = mpsc::channel::<Bytes>(8);
    let writer = tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
        give_to_its_owner(&file);
        let mut out: Box<dyn std::io::Write> = if gzip {
            Box::new(flate2::write::GzDecoder::new(std::io::BufWriter::new(
                &file,
            )))
        } else {
            Box::new(std::io::BufWriter::new(&file))
        };
        while let Some(chunk) = rx.blocking_recv() {
            out.write_all(&chunk)?;
        }
        out.flush()?;
        drop(out);
        Ok(file)
    });
    let mut stream = std::pin::pin!(stream);
    let mut body_error = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(chunk) => {
                if tx.send(chunk).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                body_error = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let result = writer
        .await
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if let Some(e) = body_error {
        return Err(HttpError::new(
            StatusCode::BAD_REQUEST,
            format!("reading upload for '{}': {e}", dest.display()),
        ));
    }
    let file = result.map_err(|e| {
        let status = if gzip
            && matches!(
                e.kind(),
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
            ) {
            StatusCode::BAD_REQUEST
        } else {
            io_status(&e)
        };
        HttpError::new(status, format!("writing '{}': {e}", dest.display()))
    })?;
    let (path, wanted) = (dest.to_owned(), metadata.clone());
    tokio::task::spawn_blocking(move || set_metadata(&file, &path, &wanted))
        .await
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

/// Gives a written file its metadata and reads back what it holds. Written on the upload's
/// own descriptor, always, even an empty set: a file written again without metadata must
/// lose what it had.
fn set_metadata(
    file: &std::fs::File,
    path: &Path,
    wanted: &Metadata,
) -> Result<Metadata, HttpError> {
    match crate::file_metadata::write(file, path, wanted) {
        Ok(()) => {}
        // The content is written; envd keeps it too and reports the file without metadata.
        Err(e @ WriteMetadataError::Unsupported(_)) => {
            if !wanted.is_empty() {
                tracing::warn!(error = %e, "metadata not kept");
            }
        }
        Err(e @ WriteMetadataError::NoSpace { .. }) => {
            return Err(HttpError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                e.to_string(),
            ));
        }
        Err(e @ WriteMetadataError::Io { .. }) => {
            return Err(HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                e.to_string(),
            ));
        }
    }
    Ok(crate::file_metadata::read(file, path).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "metadata of a written file not read back");
        Metadata::new()
    }))
}

fn fs_kind(e: &crate::fs::FsError) -> std::io::ErrorKind {
    use crate::fs::FsError;
    match e {
        FsError::NotFound(_) => std::io::ErrorKind::NotFound,
        FsError::AlreadyExists(_) => std::io::ErrorKind::AlreadyExists,
        FsError::Invalid { .. } => std::io::ErrorKind::InvalidInput,
        FsError::PermissionDenied(_) => std::io::ErrorKind::PermissionDenied,
        FsError::Io { source, .. } => source.kind(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_request_acts_as_the_user_it_was_signed_for() {
        let unnamed = Grant::Signed {
            user: String::new(),
        };
        let named = Grant::Signed {
            user: "user".into(),
        };
        // Signed without a user: the default user, not the one a Basic header names.
        assert_eq!(
            requested_user(&unnamed, None, None, "user").unwrap(),
            "user"
        );
        assert_eq!(
            requested_user(&unnamed, None, Some("user".into()), "user").unwrap(),
            "user"
        );
        let refused = requested_user(&unnamed, None, Some("root".into()), "user").unwrap_err();
        assert_eq!(refused.into_response().status(), StatusCode::UNAUTHORIZED);
        // Signed for a user: that user, whatever the default.
        assert_eq!(
            requested_user(&named, Some("user"), None, "root").unwrap(),
            "user"
        );
        let refused = requested_user(&named, Some("user"), Some("root".into()), "root")
            .expect_err("the header names another user than the signed one");
        let shown = format!("{refused:?}");
        assert!(
            shown.contains("signed for user 'user'") && shown.contains("names user 'root'"),
            "{shown}"
        );
        assert_eq!(refused.into_response().status(), StatusCode::UNAUTHORIZED);
        // The access token may act as anyone.
        assert_eq!(
            requested_user(&Grant::Token, None, Some("root".into()), "user").unwrap(),
            "root"
        );
        assert_eq!(
            requested_user(&Grant::Token, Some("alice"), Some("root".into()), "user").unwrap(),
            "alice"
        );
        assert_eq!(
            requested_user(&Grant::Token, Some(""), None, "user").unwrap(),
            "user"
        );
    }

    #[test]
    fn gzip_negotiation() {
        let mut h = HeaderMap::new();
        assert!(!accepts_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            "deflate, gzip;q=0.8".parse().unwrap(),
        );
        assert!(accepts_gzip(&h));
        h.insert(header::ACCEPT_ENCODING, "gzip;q=0".parse().unwrap());
        assert!(!accepts_gzip(&h));
    }
}
