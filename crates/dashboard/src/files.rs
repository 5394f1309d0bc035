//! A sandbox's file browser: list, download, upload and delete through the agent's file API,
//! as the sandbox's default user.

use axum::body::Body;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{HeaderValue, Request, header};
use axum::response::{IntoResponse, Response};
use maud::Markup;
use serde::Deserialize;

use crate::Dashboard;
use crate::agent::{AgentError, AgentLink, read_all};
use crate::error::PageError;
use crate::session::{Mutating, Signed};
use crate::views;
use crate::views::Entry;

#[derive(Debug, Deserialize)]
pub(crate) struct PathQuery {
    #[serde(default)]
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    #[serde(default)]
    path: Option<String>,
    /// How many listings of this panel failed in a row before this one.
    #[serde(default)]
    failed: u32,
}

/// How often the panel tries again by itself after the agent could not be reached, before
/// it leaves the next try to the user.
const LISTING_RETRIES: u32 = 5;

fn query_path(path: Option<String>) -> String {
    match path.as_deref().map(str::trim) {
        None | Some("") => "/home/user".to_owned(),
        Some(p) => p.to_owned(),
    }
}

fn agent_files_uri(path: &str) -> String {
    let query: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("path", path)
        .finish();
    format!("/files?{query}")
}

/// The directory's entries, directories first.
pub(crate) async fn entries(link: &mut AgentLink, dir: &str) -> Result<Vec<Entry>, AgentError> {
    let answer = link
        .call(
            "/filesystem.Filesystem/ListDir",
            &serde_json::json!({ "path": dir, "depth": 1 }),
        )
        .await?;
    let mut entries: Vec<Entry> = answer
        .get("entries")
        .and_then(|e| e.as_array())
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let text = |key: &str| e.get(key).and_then(|v| v.as_str()).unwrap_or("").to_owned();
            // int64 is a string in protobuf's JSON.
            let size = match e.get("size") {
                Some(serde_json::Value::String(s)) => s.parse().unwrap_or(0),
                Some(v) => v.as_u64().unwrap_or(0),
                None => 0,
            };
            Entry {
                name: text("name"),
                path: text("path"),
                is_dir: text("type") == "FILE_TYPE_DIRECTORY",
                size,
            }
        })
        .collect();
    entries.sort_by(|a, b| b.is_dir.cmp(&a.is_dir).then_with(|| a.name.cmp(&b.name)));
    Ok(entries)
}

async fn listing(
    state: &Dashboard,
    signed: &Signed,
    id: &str,
    dir: &str,
) -> Result<Markup, AgentError> {
    let mut link = AgentLink::open(&state.inner.sandboxes, &signed.team, id).await?;
    let entries = entries(&mut link, dir).await?;
    Ok(views::file_list(id, dir, &entries))
}

/// `GET /sandboxes/{id}/files?path=`: the listing fragment. A listing the agent could not
/// give (unreachable, slow, between a pause and a resume) is said in the panel itself, which
/// tries again a few times, rather than leaving the panel loading.
pub(crate) async fn list(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(query): Query<ListQuery>,
) -> Result<Markup, PageError> {
    let dir = query_path(query.path);
    match listing(&state, &signed, &id, &dir).await {
        Ok(listed) => Ok(listed),
        Err(e) if e.may_pass() => {
            tracing::warn!(sandbox_id = %id, error = %e, failed = query.failed, "dashboard: files not listed");
            let again = (query.failed < LISTING_RETRIES).then_some(query.failed + 1);
            Ok(views::file_list_failed(&id, &dir, &e.to_string(), again))
        }
        Err(e) => Err(e.into()),
    }
}

/// `GET /sandboxes/{id}/files/download?path=`: the file, always as an attachment of no
/// particular type, so that nothing a tenant wrote renders in the dashboard's origin.
pub(crate) async fn download(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<Response, PageError> {
    let path = query_path(query.path);
    let mut link = AgentLink::open(&state.inner.sandboxes, &signed.team, &id).await?;
    let request = Request::get(agent_files_uri(&path))
        .body(Body::empty())
        .map_err(|e| PageError::bad_request(format!("invalid path '{path}': {e}")))?;
    let answer = link.answer_to(request).await?;
    let status = answer.status();
    if !status.is_success() {
        let body = read_all(answer, &id).await?;
        let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        return Err(link.refused(status, &json).into());
    }
    Ok(attachment(Body::new(answer.into_body()), &path))
}

/// `body` as a download of the file at `path`: an attachment of no particular type, named
/// after the path's last part.
pub(crate) fn attachment(body: Body, path: &str) -> Response {
    let name = path.rsplit('/').next().unwrap_or("download");
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    // The name is the tenant's: sent only percent-encoded, never as raw header text.
    let encoded = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
    if let Ok(value) = HeaderValue::from_str(&format!("attachment; filename*=UTF-8''{encoded}")) {
        headers.insert(header::CONTENT_DISPOSITION, value);
    }
    response
}

/// `POST /sandboxes/{id}/files/upload` (multipart: `dir`, then `file`): streams the file to
/// the agent and answers the directory's new listing.
pub(crate) async fn upload(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
    mut multipart: Multipart,
) -> Result<Markup, PageError> {
    let bad = |e: axum::extract::multipart::MultipartError| PageError::bad_request(e.body_text());
    let mut dir = None;
    let mut link = AgentLink::open(&state.inner.sandboxes, &signed.team, &id).await?;
    while let Some(mut field) = multipart.next_field().await.map_err(bad)? {
        match field.name() {
            Some("dir") => dir = Some(field.text().await.map_err(bad)?),
            Some("file") => {
                let dir = query_path(dir.take());
                let name = field.file_name().unwrap_or_default().to_owned();
                if name.is_empty() || name.contains('/') || name == "." || name == ".." {
                    return Err(PageError::bad_request(format!(
                        "choose a file to upload (got the name '{name}')"
                    )));
                }
                let dest = format!("{}/{name}", dir.trim_end_matches('/'));
                let (tx, rx) =
                    tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
                let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|item| (item, rx))
                });
                let request = Request::post(agent_files_uri(&dest))
                    .header(header::CONTENT_TYPE, "application/octet-stream")
                    .body(Body::from_stream(stream))
                    .map_err(|e| PageError::bad_request(format!("invalid path '{dest}': {e}")))?;
                // The file is read from the browser while the agent writes it, in this task.
                let pump = async move {
                    loop {
                        match field.chunk().await {
                            Ok(Some(chunk)) => {
                                if tx.send(Ok(chunk)).await.is_err() {
                                    return Ok(());
                                }
                            }
                            Ok(None) => return Ok(()),
                            Err(e) => {
                                let message = e.body_text();
                                let _ = tx.send(Err(std::io::Error::other(message.clone()))).await;
                                return Err(PageError::bad_request(message));
                            }
                        }
                    }
                };
                let (sent, pumped) = tokio::join!(link.send(request), pump);
                pumped?;
                let answer = sent?;
                let status = answer.status();
                if !status.is_success() {
                    let body = read_all(answer, &id).await?;
                    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                    return Err(link.refused(status, &json).into());
                }
                read_all(answer, &id).await?;
                let entries = entries(&mut link, &dir).await?;
                return Ok(views::file_list(&id, &dir, &entries));
            }
            _ => {}
        }
    }
    Err(PageError::bad_request("choose a file to upload"))
}

#[derive(Debug, Deserialize)]
pub(crate) struct DeleteForm {
    path: String,
}

/// `POST /sandboxes/{id}/files/delete` (form: `path`): removes it and answers its
/// directory's listing.
pub(crate) async fn delete(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
    axum::Form(form): axum::Form<DeleteForm>,
) -> Result<Markup, PageError> {
    let path = form.path.trim();
    if path.is_empty() || path == "/" {
        return Err(PageError::bad_request("name a file or directory to delete"));
    }
    let mut link = AgentLink::open(&state.inner.sandboxes, &signed.team, &id).await?;
    link.call(
        "/filesystem.Filesystem/Remove",
        &serde_json::json!({ "path": path }),
    )
    .await?;
    let dir = match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/".to_owned(),
        Some((parent, _)) => parent.to_owned(),
    };
    let entries = entries(&mut link, &dir).await?;
    Ok(views::file_list(&id, &dir, &entries))
}
