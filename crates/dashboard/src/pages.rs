//! Page and action handlers: each parses its input, makes one typed call into the core with
//! the session's team, and renders the answer.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::Markup;
use sandbar_core::sandboxes::{ForkResult, Page, SnapshotQuery};
use sandbar_core::{
    BuildStatus, CreateSandbox, ListQuery, NetworkConfig, SandboxEventQuery, SandboxLogQuery,
};
use serde::Deserialize;

use crate::Dashboard;
use crate::error::PageError;
use crate::files;
use crate::session::{self, Credential, Mutating, Signed};
use crate::views::{self, Nav};

/// Snapshots listed at most on one page; the list is for people, not for scripts.
const LIST_LIMIT: usize = 500;
/// Sandboxes on one page of the list, as the API's own largest page.
const LIST_PAGE: usize = 100;
/// Sandboxes the Overview shows.
const RECENT: usize = 10;
/// Log lines shown on a sandbox's page.
const LOG_TAIL: u32 = 200;

fn full_page_error(signed: &Signed, nav: Nav, error: PageError) -> Response {
    (
        error.status,
        views::error_page(Some((&signed.csrf, nav)), &error.message),
    )
        .into_response()
}

/// Tells htmx to load `to` as a new page.
fn go_to(to: &str) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    if let Ok(value) = HeaderValue::from_str(to) {
        response.headers_mut().insert("hx-redirect", value);
    }
    response
}

pub(crate) async fn login_form() -> Markup {
    views::login(None)
}

#[derive(Debug, Deserialize)]
pub(crate) struct LoginForm {
    key: String,
}

/// `POST /login`: checks the key or token with the core's auth and starts a session.
pub(crate) async fn login(
    State(state): State<Dashboard>,
    axum::Form(form): axum::Form<LoginForm>,
) -> Response {
    let credential = Credential::parse(&form.key);
    match credential.team(&state.inner.auth).await {
        Ok(_) => {
            let id = state.sessions().start(credential);
            let mut response = Redirect::to("/dashboard/").into_response();
            response
                .headers_mut()
                .insert(header::SET_COOKIE, session::cookie(&id));
            response
        }
        Err(sandbar_core::AuthError::Store(e)) => {
            tracing::error!(error = %e, "dashboard: cannot check a sign-in");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                views::login(Some("the server cannot check keys now; try again")),
            )
                .into_response()
        }
        Err(e) => (StatusCode::UNAUTHORIZED, views::login(Some(&e.to_string()))).into_response(),
    }
}

/// `POST /logout`.
pub(crate) async fn logout(State(state): State<Dashboard>, Mutating(signed): Mutating) -> Response {
    state.sessions().end(&signed.session_id);
    let mut response = go_to("/dashboard/login");
    response
        .headers_mut()
        .insert(header::SET_COOKIE, session::cleared_cookie());
    response
}

/// One page of the team's sandboxes matching `metadata`, newest first, after `next` (a page
/// token as the API gives them; empty for the first page).
async fn sandbox_page(
    state: &Dashboard,
    signed: &Signed,
    metadata: BTreeMap<String, String>,
    next: &str,
    limit: usize,
) -> Result<Page<sandbar_core::Sandbox>, PageError> {
    let query = ListQuery {
        metadata,
        states: None,
        limit,
        next_token: Some(next.to_owned()).filter(|t| !t.is_empty()),
        ascending: false,
        started_after: None,
        template: None,
    };
    state
        .inner
        .sandboxes
        .registry()
        .list(&signed.team, &query)
        .await
        .map_err(|e| match e {
            sandbar_core::ListSandboxesError::BadToken(_) => PageError::bad_request(e.to_string()),
            other => PageError::logged("sandbox list", &other),
        })
}

/// `GET /`: the Overview.
pub(crate) async fn overview(State(state): State<Dashboard>, signed: Signed) -> Response {
    let recent = match sandbox_page(&state, &signed, BTreeMap::new(), "", RECENT).await {
        Ok(page) => page,
        Err(e) => return full_page_error(&signed, Nav::Overview, e),
    };
    let templates = match state.inner.templates.list(&signed.team).await {
        Ok(t) => t,
        Err(e) => {
            return full_page_error(&signed, Nav::Overview, PageError::logged("templates", &e));
        }
    };
    // The team's start rate is kept in buckets of a few seconds: their mean over the last
    // minute, in starts a minute.
    let now = chrono::Utc::now().timestamp();
    let creates_per_minute = match state
        .inner
        .sandboxes
        .activity()
        .team_metrics(&signed.team, &signed.team.id, Some(now - 60), Some(now))
        .await
    {
        Ok(points) if !points.is_empty() => {
            points.iter().map(|p| p.sandbox_start_rate).sum::<f64>() * 60.0 / points.len() as f64
        }
        Ok(_) => 0.0,
        Err(e) => {
            return full_page_error(
                &signed,
                Nav::Overview,
                PageError::logged("team metrics", &e),
            );
        }
    };
    let overview = views::Overview {
        creates_per_minute,
        running: recent.running_total,
        paused: recent.total - recent.running_total,
        memory: state.inner.sandboxes.health().memory(),
        disks: state.inner.sandboxes.health().disks(),
        failed_builds: templates
            .into_iter()
            .filter(|t| {
                t.team_id.as_deref() == Some(&signed.team.id)
                    && t.build_status == BuildStatus::Error
            })
            .collect(),
        recent: recent.items,
    };
    views::overview(&signed.csrf, &overview).into_response()
}

#[derive(Debug, Deserialize)]
pub(crate) struct FilterQuery {
    #[serde(default)]
    metadata: String,
    /// The page token of the page shown; empty for the first.
    #[serde(default)]
    next: String,
}

/// `key=value` pairs separated by `separator`; blanks skipped.
fn parse_pairs(text: &str, separator: char) -> Result<BTreeMap<String, String>, PageError> {
    let mut out = BTreeMap::new();
    for part in text
        .split(separator)
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let (k, v) = part.split_once('=').ok_or_else(|| {
            PageError::bad_request(format!("metadata '{part}' is not of the form key=value"))
        })?;
        out.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    Ok(out)
}

/// `GET /sandboxes`: the first rows come with the page; the page then polls them.
pub(crate) async fn sandboxes(
    State(state): State<Dashboard>,
    signed: Signed,
    Query(filter): Query<FilterQuery>,
) -> Response {
    let listed = match parse_pairs(&filter.metadata, ',') {
        Ok(metadata) => sandbox_page(&state, &signed, metadata, &filter.next, LIST_PAGE).await,
        Err(e) => Err(e),
    };
    match listed {
        Ok(page) => {
            views::sandboxes(&signed.csrf, &filter.metadata, &filter.next, &page).into_response()
        }
        Err(e) => full_page_error(&signed, Nav::Sandboxes, e),
    }
}

/// `GET /sandboxes/rows?metadata=`: the table, polled by the list page.
pub(crate) async fn sandbox_rows(
    State(state): State<Dashboard>,
    signed: Signed,
    Query(filter): Query<FilterQuery>,
) -> Result<Markup, PageError> {
    let metadata = parse_pairs(&filter.metadata, ',')?;
    let page = sandbox_page(&state, &signed, metadata, &filter.next, LIST_PAGE).await?;
    Ok(views::sandbox_rows(&filter.metadata, &filter.next, &page))
}

#[derive(Debug, Deserialize)]
pub(crate) struct CreateForm {
    template: String,
    #[serde(default)]
    timeout: String,
    #[serde(default)]
    metadata: String,
}

fn timeout_secs(text: &str, default: u64) -> Result<u64, PageError> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(default);
    }
    text.parse::<u64>()
        .ok()
        .filter(|t| *t <= i32::MAX as u64)
        .ok_or_else(|| {
            PageError::bad_request(format!(
                "timeout must be a whole number of seconds, got '{text}'"
            ))
        })
}

/// `POST /sandboxes`: creates one and opens its page.
pub(crate) async fn create_sandbox(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    axum::Form(form): axum::Form<CreateForm>,
) -> Result<Response, PageError> {
    let metadata = parse_pairs(&form.metadata.replace('\r', ""), '\n')?;
    sandbar_core::inputs::check_metadata(&metadata)
        .map_err(|e| PageError::bad_request(e.to_string()))?;
    let request = CreateSandbox {
        template: form.template.trim().to_owned(),
        timeout_secs: timeout_secs(&form.timeout, 300)?,
        metadata,
        env_vars: BTreeMap::new(),
        allow_internet_access: true,
        network: NetworkConfig::default(),
        auto_pause: false,
        auto_resume: false,
        auto_pause_files_only: false,
        volume_mounts: Vec::new(),
    };
    let sandbox = state
        .inner
        .sandboxes
        .registry()
        .create(&signed.team, request)
        .await?;
    Ok(go_to(&format!("/dashboard/sandboxes/{}", sandbox.id)))
}

/// `GET /sandboxes/{id}`.
pub(crate) async fn sandbox(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
) -> Response {
    let sandboxes = &state.inner.sandboxes;
    let sandbox = match sandboxes.registry().get(&signed.team, &id).await {
        Ok(s) => s,
        Err(e) => return full_page_error(&signed, Nav::Sandboxes, e.into()),
    };
    let metrics = sandboxes
        .activity()
        .metrics(&signed.team, &id, None, None)
        .await
        .unwrap_or_default();
    let logs = log_tail(&state, &signed, &id, &LogFilter::default())
        .await
        .unwrap_or_default();
    views::sandbox(&signed.csrf, &sandbox, &metrics, &logs).into_response()
}

/// `GET /sandboxes/{id}/chart`: the chart, polled by the sandbox's page.
pub(crate) async fn sandbox_chart(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    let metrics = state
        .inner
        .sandboxes
        .activity()
        .metrics(&signed.team, &id, None, None)
        .await?;
    Ok(views::live_chart(&id, &metrics))
}

/// The log filters of a sandbox's page; blank fields filter nothing.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LogFilter {
    #[serde(default)]
    level: String,
    #[serde(default)]
    search: String,
}

/// The newest [`LOG_TAIL`] lines that pass `filter`, oldest first.
async fn log_tail(
    state: &Dashboard,
    signed: &Signed,
    id: &str,
    filter: &LogFilter,
) -> Result<Vec<sandbar_core::SandboxLogEntry>, PageError> {
    let min_level = match filter.level.trim() {
        "" => None,
        level => Some(sandbar_core::LogLevel::parse(level).ok_or_else(|| {
            PageError::bad_request(format!(
                "log level '{level}' is not one of debug, info, warn, error"
            ))
        })?),
    };
    let query = SandboxLogQuery {
        forward: false,
        limit: LOG_TAIL,
        min_level,
        search: Some(filter.search.clone()).filter(|s| !s.is_empty()),
        ..SandboxLogQuery::default()
    };
    let mut logs = state
        .inner
        .sandboxes
        .activity()
        .logs(&signed.team, id, &query)
        .await?;
    logs.reverse();
    Ok(logs)
}

/// `GET /sandboxes/{id}/log?level=&search=`: the log, polled by the sandbox's page.
pub(crate) async fn sandbox_log(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(filter): Query<LogFilter>,
) -> Result<Markup, PageError> {
    let logs = log_tail(&state, &signed, &id, &filter).await?;
    Ok(views::live_log(&id, &logs))
}

/// `GET /sandboxes/{id}/state`: the state fragment; a sandbox gone sends the page back to
/// the list.
pub(crate) async fn sandbox_state(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    match state
        .inner
        .sandboxes
        .registry()
        .get(&signed.team, &id)
        .await
    {
        Ok(s) => Ok(views::sandbox_state(&s).into_response()),
        Err(sandbar_core::SandboxError::NotFound(_)) => Ok(go_to("/dashboard/sandboxes")),
        Err(e) => Err(e.into()),
    }
}

async fn state_after(state: &Dashboard, signed: &Signed, id: &str) -> Result<Markup, PageError> {
    let sandbox = state
        .inner
        .sandboxes
        .registry()
        .get(&signed.team, id)
        .await?;
    Ok(views::sandbox_state(&sandbox))
}

/// `POST /sandboxes/{id}/pause`: keeps memory, as the SDK's `pause()` does.
pub(crate) async fn pause(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    state
        .inner
        .sandboxes
        .lifecycle()
        .pause(&signed.team, &id, true)
        .await?;
    state_after(&state, &signed, &id).await
}

#[derive(Debug, Deserialize)]
pub(crate) struct TimeoutForm {
    #[serde(default)]
    timeout: String,
}

/// `POST /sandboxes/{id}/resume`.
pub(crate) async fn resume(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    state
        .inner
        .sandboxes
        .lifecycle()
        .resume(&signed.team, &id, 300, true, true)
        .await?;
    state_after(&state, &signed, &id).await
}

/// `POST /sandboxes/{id}/extend` (form: `timeout`, seconds from now).
pub(crate) async fn extend(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
    axum::Form(form): axum::Form<TimeoutForm>,
) -> Result<Markup, PageError> {
    let secs = timeout_secs(&form.timeout, 300)?;
    state
        .inner
        .sandboxes
        .lifecycle()
        .set_timeout(&signed.team, &id, secs)
        .await?;
    state_after(&state, &signed, &id).await
}

/// `POST /sandboxes/{id}/kill`: back to the list.
pub(crate) async fn kill(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    state
        .inner
        .sandboxes
        .lifecycle()
        .kill(&signed.team, &id)
        .await?;
    Ok(go_to("/dashboard/sandboxes"))
}

/// `POST /sandboxes/{id}/snapshot`: a snapshot of the running sandbox, which runs on; the
/// snapshots page opens.
pub(crate) async fn snapshot(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    state
        .inner
        .sandboxes
        .snapshots()
        .snapshot(&signed.team, &id, None, true)
        .await?;
    Ok(go_to("/dashboard/snapshots"))
}

/// Seconds a fork started from the dashboard lives, as a sandbox created there.
const FORK_TIMEOUT_SECS: u64 = 300;

/// `POST /sandboxes/{id}/fork`: one fork of the running sandbox, opened.
pub(crate) async fn fork(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    let forks = state
        .inner
        .sandboxes
        .snapshots()
        .fork(&signed.team, &id, FORK_TIMEOUT_SECS, 1)
        .await?;
    match forks.into_iter().next() {
        Some(ForkResult::Started(fork)) => Ok(go_to(&format!("/dashboard/sandboxes/{}", fork.id))),
        Some(ForkResult::Failed(e)) => Err(e.into()),
        None => Err(PageError::logged(
            "fork",
            &format!("sandbox {id}: no fork was attempted"),
        )),
    }
}

/// `GET /snapshots`: the team's snapshots, newest first.
pub(crate) async fn snapshots(State(state): State<Dashboard>, signed: Signed) -> Response {
    let query = SnapshotQuery {
        sandbox_id: None,
        name: None,
        limit: LIST_LIMIT,
        next_token: None,
    };
    match state
        .inner
        .sandboxes
        .snapshots()
        .list_snapshots(&signed.team, &query)
        .await
    {
        Ok((list, _)) => views::snapshots(&signed.csrf, &list).into_response(),
        Err(e) => full_page_error(&signed, Nav::Snapshots, e.into()),
    }
}

/// `POST /snapshots/{template}/delete`: sandboxes started from it keep running.
pub(crate) async fn delete_snapshot(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(template): Path<String>,
) -> Result<Response, PageError> {
    state
        .inner
        .builds
        .delete_template(&signed.team, &template)
        .await?;
    Ok(go_to("/dashboard/snapshots"))
}

/// Events shown on the events page.
const EVENTS_SHOWN: u32 = 100;

/// `GET /events`: the team's latest sandbox lifecycle events, newest first.
pub(crate) async fn events(State(state): State<Dashboard>, signed: Signed) -> Response {
    let events = state
        .inner
        .sandboxes
        .activity()
        .events(
            &signed.team,
            &SandboxEventQuery {
                limit: EVENTS_SHOWN,
                ..SandboxEventQuery::default()
            },
        )
        .await;
    match events {
        Ok(events) => views::events(&signed.csrf, &events).into_response(),
        Err(e) => full_page_error(&signed, Nav::Events, PageError::logged("events", &e)),
    }
}

/// Attempts shown under each webhook.
const DELIVERIES_SHOWN: u32 = 10;

fn webhooks_of(state: &Dashboard) -> Result<&sandbar_core::webhooks::Webhooks, PageError> {
    state.inner.sandboxes.webhooks().ok_or_else(|| {
        PageError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "webhooks are not set up on this server",
        )
    })
}

/// `GET /webhooks`: the team's webhooks, each with its latest delivery attempts.
pub(crate) async fn webhooks(State(state): State<Dashboard>, signed: Signed) -> Response {
    match webhook_list(&state, &signed).await {
        Ok(list) => views::webhooks(&signed.csrf, &list).into_response(),
        Err(e) => full_page_error(&signed, Nav::Webhooks, e),
    }
}

async fn webhook_list(
    state: &Dashboard,
    signed: &Signed,
) -> Result<
    Vec<(
        sandbar_core::webhooks::Webhook,
        Vec<sandbar_core::webhooks::WebhookDelivery>,
    )>,
    PageError,
> {
    let webhooks = webhooks_of(state)?;
    let mut list = Vec::new();
    for hook in webhooks.list(&signed.team).await? {
        let log = webhooks
            .deliveries(&signed.team, &hook.id, DELIVERIES_SHOWN)
            .await?;
        list.push((hook, log));
    }
    Ok(list)
}

/// The registration form: one checkbox per event type.
#[derive(Debug, Deserialize)]
pub(crate) struct WebhookForm {
    name: String,
    url: String,
    secret: String,
    created: Option<String>,
    updated: Option<String>,
    paused: Option<String>,
    resumed: Option<String>,
    checkpointed: Option<String>,
    killed: Option<String>,
}

/// `POST /webhooks`: registers one; the page is shown again.
pub(crate) async fn create_webhook(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    axum::Form(form): axum::Form<WebhookForm>,
) -> Result<Response, PageError> {
    use sandbar_core::SandboxEventType as T;
    let events = [
        (T::Created, &form.created),
        (T::Updated, &form.updated),
        (T::Paused, &form.paused),
        (T::Resumed, &form.resumed),
        (T::Checkpointed, &form.checkpointed),
        (T::Killed, &form.killed),
    ]
    .into_iter()
    .filter(|(_, ticked)| ticked.is_some())
    .map(|(t, _)| t)
    .collect();
    let change = sandbar_core::webhooks::WebhookChange {
        name: Some(form.name.trim().to_owned()),
        url: Some(form.url.trim().to_owned()),
        enabled: Some(true),
        events: Some(events),
        secret: Some(form.secret),
    };
    webhooks_of(&state)?.create(&signed.team, change).await?;
    Ok(go_to("/dashboard/webhooks"))
}

/// `POST /webhooks/{id}/delete`.
pub(crate) async fn delete_webhook(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    webhooks_of(&state)?.delete(&signed.team, &id).await?;
    Ok(go_to("/dashboard/webhooks"))
}

fn volumes_of(state: &Dashboard) -> Result<&std::sync::Arc<sandbar_core::Volumes>, PageError> {
    state.inner.sandboxes.volumes().ok_or_else(|| {
        PageError::new(
            StatusCode::NOT_IMPLEMENTED,
            "volumes are not offered by this server",
        )
    })
}

/// `GET /volumes`: the team's volumes.
pub(crate) async fn volumes(State(state): State<Dashboard>, signed: Signed) -> Response {
    let listed = match volumes_of(&state) {
        Ok(volumes) => volumes
            .list(&signed.team)
            .await
            .map_err(|e| PageError::logged("volumes", &e)),
        Err(e) => Err(e),
    };
    match listed {
        Ok(list) => views::volumes(&signed.csrf, &list).into_response(),
        Err(e) => full_page_error(&signed, Nav::Volumes, e),
    }
}

/// `POST /volumes`: a new volume, then the list.
pub(crate) async fn create_volume(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    axum::Form(form): axum::Form<NameForm>,
) -> Result<Response, PageError> {
    volumes_of(&state)?
        .create(&signed.team, form.name.trim())
        .await?;
    Ok(go_to("/dashboard/volumes"))
}

/// `POST /volumes/{id}/delete`: refused while a sandbox mounts it.
pub(crate) async fn delete_volume(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(id): Path<String>,
) -> Result<Response, PageError> {
    volumes_of(&state)?.delete(&signed.team, &id).await?;
    Ok(go_to("/dashboard/volumes"))
}

#[derive(Debug, Deserialize)]
pub(crate) struct VolumePathQuery {
    #[serde(default)]
    path: Option<String>,
}

/// `GET /volumes/{id}?path=`: a directory of the volume.
pub(crate) async fn volume(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(query): Query<VolumePathQuery>,
) -> Response {
    let dir = query.path.unwrap_or_else(|| "/".to_owned());
    let listed = async {
        let volumes = volumes_of(&state)?;
        let volume = volumes.get(&signed.team, &id).await?;
        let path = sandbar_core::Volumes::parse_path(&volume, &dir)?;
        let entries = volumes.list_dir(&volume, path, 1).await?;
        Ok::<_, PageError>((volume, entries))
    }
    .await;
    match listed {
        Ok((volume, mut entries)) => {
            entries.sort_by(|a, b| a.name.cmp(&b.name));
            views::volume(&signed.csrf, &volume, &dir, &entries).into_response()
        }
        Err(e) => full_page_error(&signed, Nav::Volumes, e),
    }
}

/// Bytes read from a volume file per chunk of a download.
const DOWNLOAD_CHUNK: usize = 64 * 1024;

/// `GET /volumes/{id}/download?path=`: one file, streamed as it is read.
pub(crate) async fn volume_download(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(query): Query<VolumePathQuery>,
) -> Result<Response, PageError> {
    let raw = query
        .path
        .ok_or_else(|| PageError::bad_request("path is required"))?;
    let volumes = volumes_of(&state)?;
    let volume = volumes.get(&signed.team, &id).await?;
    let path = sandbar_core::Volumes::parse_path(&volume, &raw)?;
    let file = volumes.read(&volume, path).await?;
    let chunks = futures_util::stream::unfold(file.reader, |mut reader| async move {
        use tokio::io::AsyncReadExt;
        let mut chunk = vec![0u8; DOWNLOAD_CHUNK];
        match reader.read(&mut chunk).await {
            Ok(0) => None,
            Ok(n) => {
                chunk.truncate(n);
                Some((Ok::<_, std::io::Error>(bytes::Bytes::from(chunk)), reader))
            }
            Err(e) => Some((Err(e), reader)),
        }
    });
    let mut response = files::attachment(axum::body::Body::from_stream(chunks), &raw);
    if let Ok(length) = HeaderValue::from_str(&file.size.to_string()) {
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, length);
    }
    Ok(response)
}

/// How far back the usage page looks.
const USAGE_DAYS: i64 = 7;

/// `GET /usage`: the team's concurrent sandboxes and starts over the last week.
pub(crate) async fn usage(State(state): State<Dashboard>, signed: Signed) -> Response {
    let end = chrono::Utc::now().timestamp();
    let start = end - USAGE_DAYS * 24 * 3600;
    let points = state
        .inner
        .sandboxes
        .activity()
        .team_metrics(&signed.team, &signed.team.id, Some(start), Some(end))
        .await;
    match points {
        Ok(points) => views::usage(&signed.csrf, &signed.team, USAGE_DAYS, &points).into_response(),
        Err(e) => full_page_error(&signed, Nav::Usage, PageError::logged("usage", &e)),
    }
}

/// `GET /nodes`: the cluster's nodes with their leases and gauges, or this host alone.
pub(crate) async fn nodes(State(state): State<Dashboard>, signed: Signed) -> Response {
    let health = state.inner.sandboxes.health();
    let Some(records) = health.cluster_nodes() else {
        let row = views::NodeRow {
            id: "this host".to_owned(),
            lease_until: None,
            started_at: None,
            report: health.report(),
            templates: None,
        };
        return views::nodes(&signed.csrf, false, &[row]).into_response();
    };
    // Another team's private template on a node is that team's business: only the ones this
    // team can use are named.
    let usable: BTreeMap<String, String> = match state.inner.templates.list(&signed.team).await {
        Ok(list) => list
            .into_iter()
            .map(|t| {
                let name = t.aliases.first().cloned().unwrap_or_else(|| t.id.clone());
                (t.id, name)
            })
            .collect(),
        Err(e) => return full_page_error(&signed, Nav::Nodes, PageError::logged("templates", &e)),
    };
    let rows: Vec<views::NodeRow> = records
        .into_iter()
        .map(|n| views::NodeRow {
            templates: Some(
                n.report
                    .templates
                    .iter()
                    .filter_map(|id| usable.get(id).cloned())
                    .collect(),
            ),
            id: n.id,
            lease_until: Some(n.lease_until),
            started_at: Some(n.started_at),
            report: n.report,
        })
        .collect();
    views::nodes(&signed.csrf, true, &rows).into_response()
}

/// `GET /templates`: the team's templates and the built-in ones, with their builds.
pub(crate) async fn templates(State(state): State<Dashboard>, signed: Signed) -> Response {
    let list = match state.inner.templates.list(&signed.team).await {
        Ok(list) => list,
        Err(e) => {
            return full_page_error(&signed, Nav::Templates, PageError::logged("templates", &e));
        }
    };
    let mut with_builds = Vec::with_capacity(list.len());
    for t in list {
        // Builds of another team's public template are that team's business.
        let own = t.team_id.as_deref().is_none_or(|o| o == signed.team.id);
        let mut builds = if own {
            state
                .inner
                .builds
                .builds_of(&t.id)
                .await
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        builds.sort_by_key(|b| std::cmp::Reverse(b.created_at));
        with_builds.push((t, builds));
    }
    views::templates(&signed.csrf, &with_builds).into_response()
}

/// The Dockerfile form of the templates page.
#[derive(Debug, Deserialize)]
pub(crate) struct DockerfileForm {
    name: String,
    dockerfile: String,
}

/// `POST /templates`: a new template from a pasted Dockerfile (no build context: a `COPY`
/// is refused with the reason), built at once; its build's page opens.
pub(crate) async fn create_template(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    axum::Form(form): axum::Form<DockerfileForm>,
) -> Result<Response, PageError> {
    let name = form.name.trim();
    let builds = &state.inner.builds;
    let requested = builds
        .request_dockerfile(
            &signed.team,
            None,
            sandbar_core::builds::DockerfileRequest {
                dockerfile: form.dockerfile.replace('\r', ""),
                alias: (!name.is_empty()).then(|| name.to_owned()),
                start_cmd: None,
                ready_cmd: None,
                cpu_count: None,
                memory_mb: None,
            },
        )
        .await?;
    let template_id = &requested.template.id;
    let started = builds
        .start_dockerfile(&signed.team, template_id, &requested.build_id)
        .await;
    if let Err(refused) = started {
        // Nothing to build it from: the template registered a moment ago goes too.
        if let Err(err) = builds.delete_template(&signed.team, template_id).await {
            tracing::warn!(template_id = %template_id, error = %err, "cannot remove a template whose build was refused");
        }
        return Err(refused.into());
    }
    Ok(go_to(&format!(
        "/dashboard/templates/{template_id}/builds/{}",
        requested.build_id
    )))
}

async fn build_and_log(
    state: &Dashboard,
    signed: &Signed,
    template: &str,
    build: &str,
) -> Result<(sandbar_core::BuildRecord, Vec<sandbar_core::BuildLogEntry>), PageError> {
    state
        .inner
        .builds
        .status(&signed.team, template, build, 0, 10_000, None)
        .await
        .map_err(|e| PageError::new(StatusCode::NOT_FOUND, e.to_string()))
}

/// `GET /templates/{template}/builds/{build}`.
pub(crate) async fn build(
    State(state): State<Dashboard>,
    signed: Signed,
    Path((template, build)): Path<(String, String)>,
) -> Response {
    match build_and_log(&state, &signed, &template, &build).await {
        Ok((record, logs)) => views::build(&signed.csrf, &record, &logs).into_response(),
        Err(e) => full_page_error(&signed, Nav::Templates, e),
    }
}

/// `GET /templates/{template}/builds/{build}/log`: polled while the build runs.
pub(crate) async fn build_log(
    State(state): State<Dashboard>,
    signed: Signed,
    Path((template, build)): Path<(String, String)>,
) -> Result<Markup, PageError> {
    let (record, logs) = build_and_log(&state, &signed, &template, &build).await?;
    Ok(views::build_log(&record, &logs))
}

/// `GET /keys`.
pub(crate) async fn keys(State(state): State<Dashboard>, signed: Signed) -> Response {
    match state.inner.auth.list_api_keys(&signed.team).await {
        Ok(list) => views::keys(&signed.csrf, &list, None).into_response(),
        Err(e) => full_page_error(&signed, Nav::Keys, PageError::logged("api keys", &e)),
    }
}

/// A form that only names what it makes (an API key, a volume).
#[derive(Debug, Deserialize)]
pub(crate) struct NameForm {
    name: String,
}

/// `POST /keys`: the new key is in this answer only.
pub(crate) async fn create_key(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    axum::Form(form): axum::Form<NameForm>,
) -> Result<Markup, PageError> {
    let auth = &state.inner.auth;
    let created = auth
        .create_api_key(&signed.team, &form.name, None)
        .await
        .map_err(|e| match e {
            sandbar_core::CreateCredentialError::BadName(_) => {
                PageError::bad_request(e.to_string())
            }
            other => PageError::new(StatusCode::BAD_REQUEST, other.to_string()),
        })?;
    let list = auth
        .list_api_keys(&signed.team)
        .await
        .map_err(|e| PageError::logged("api keys", &e))?;
    Ok(views::key_list(
        &list,
        Some((&created.info.name, &created.key)),
    ))
}

/// `POST /keys/{key}/revoke`.
pub(crate) async fn revoke_key(
    State(state): State<Dashboard>,
    Mutating(signed): Mutating,
    Path(key): Path<String>,
) -> Result<Markup, PageError> {
    let auth = &state.inner.auth;
    auth.delete_api_key(&signed.team, &key)
        .await
        .map_err(|e| match e {
            sandbar_core::DeleteApiKeyError::NotFound(_) => {
                PageError::new(StatusCode::NOT_FOUND, e.to_string())
            }
            other => PageError::logged("api key revoke", &other),
        })?;
    let list = auth
        .list_api_keys(&signed.team)
        .await
        .map_err(|e| PageError::logged("api keys", &e))?;
    Ok(views::key_list(&list, None))
}

/// Any other path: a page for a browser, the JSON error otherwise.
pub(crate) async fn not_found(headers: HeaderMap, uri: axum::http::Uri) -> Response {
    let message = format!("no dashboard page at '{}'", uri.path());
    let wants_page = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if wants_page {
        (StatusCode::NOT_FOUND, views::error_page(None, &message)).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({ "code": 404, "message": message })),
        )
            .into_response()
    }
}

pub(crate) async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        axum::Json(serde_json::json!({
            "code": 405,
            "message": format!("{method} is not allowed on '{}'", uri.path()),
        })),
    )
        .into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn metadata_pairs_parse_and_refuse_malformed() {
        let pairs = parse_pairs("a=1, b = two ,", ',').unwrap();
        assert_eq!(pairs.get("a").map(String::as_str), Some("1"));
        assert_eq!(pairs.get("b").map(String::as_str), Some("two"));
        let refused = parse_pairs("nokey", ',').unwrap_err();
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(refused.message.contains("'nokey'"), "{}", refused.message);
        let refused = timeout_secs("abc", 1).unwrap_err();
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(refused.message.contains("'abc'"), "{}", refused.message);
        assert_eq!(timeout_secs("", 7).unwrap(), 7);
    }
}
