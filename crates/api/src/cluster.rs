//! The two ends of the node API. On a node, every request must carry the cluster's shared
//! secret ([`require_node_secret`]). On an API host, requests that concern a sandbox, a new
//! sandbox, a build or a volume are forwarded to the node that holds it or should
//! ([`forward_to_nodes`]), with the secret added; the rest (keys, teams, listings, logs,
//! metrics of the team, build status and logs) are answered from the shared store like on a
//! single host.
//!
//! A template build runs on the node with the most build room, not on one node for the whole
//! cluster. Its files go there too: the build is given its node as soon as it is requested,
//! and its upload links, uploads, start and cancel all follow the record to that node. This
//! keeps the files a build copies on the disk of the node that builds, with no copy between
//! nodes: no new path by which a node reads another's files, no second size cap or hash to
//! check, and the single-use upload tokens and the Dockerfile build's context, which a node
//! keeps in memory, are used by the node that issued them. The request itself is still
//! recorded by the keeper, whose lock per team counts the team's templates and tags against
//! its caps.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, TimeDelta, Utc};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sandbar_core::cluster::{TemplateReach, build_placement_order, placement_order};
use sandbar_core::{NodeDirectory, NodeRecord, Store};

use sandbar_dashboard::{Dashboard, VouchedSession};

use crate::AppState;
use crate::dto::NewSandbox;
use crate::error::ApiError;

/// The header that carries the cluster's shared secret from API hosts to nodes.
pub const NODE_SECRET_HEADER: &str = "x-sandbar-node-secret";

/// The largest answer of a node that an API host reads to learn from it (the new sandbox's or
/// build's id; E2B's answers are a few KiB).
const NODE_ANSWER_LIMIT: usize = 2 << 20;
/// How long an API host trusts what it read of a sandbox's node: ownership changes only when
/// a sandbox moves, and a stale answer costs one failed hop.
const OWNER_TTL: Duration = Duration::from_secs(2);

/// A node's guard: answers 401 to any request without the secret, and removes the secret
/// from the ones it lets through, so it never travels further (into a sandbox's port).
pub(crate) async fn require_node_secret(
    State(secret): State<Arc<str>>,
    mut request: Request,
    next: Next,
) -> Response {
    if !crate::extract::carries_secret(request.headers(), NODE_SECRET_HEADER, &secret) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this is a node of a sandbar cluster: it answers its API hosts only",
        )
        .into_response();
    }
    request.headers_mut().remove(NODE_SECRET_HEADER);
    if let Some(vouched) = VouchedSession::take_from(request.headers_mut()) {
        request.extensions_mut().insert(vouched);
    }
    next.run(request).await
}

/// What an API host does with a request.
#[derive(Debug, PartialEq, Eq)]
enum Destination {
    /// Answer it here, from the store.
    Here,
    /// Forward it to the node that holds the sandbox.
    Sandbox(String),
    /// Place a new sandbox on a node.
    NewSandbox,
    /// Forward it to the node that keeps volumes, records requested builds and administers
    /// templates.
    Keeper,
    /// A build request: recorded by the keeper, then given to a node with build room.
    NewBuild,
    /// An upload link or upload of a template's files: to the node given its waiting build.
    TemplateFiles(String),
    /// A build's start or cancel: to the node its record names.
    Build(String),
    /// Ask each node for the latest metrics of its sandboxes among those named.
    LatestMetrics,
    /// A dashboard request that acts on a node, once the API host checked its session.
    Dashboard(DashboardTo),
}

/// Where a dashboard request goes in a cluster: what it acts on lives on a node, as for the
/// API request it stands for. Pages that only read the store are answered here.
#[derive(Debug, PartialEq, Eq)]
enum DashboardTo {
    /// A sandbox's page, state, actions, files and terminal: to the node that holds it.
    Sandbox(String),
    /// A new sandbox: placed like an API create.
    NewSandbox,
    /// Volumes, a template built from a pasted Dockerfile, a snapshot's removal: to the keeper.
    Keeper,
}

fn destination(method: &Method, path: &str, edge_sandbox: Option<String>) -> Destination {
    if let Some(id) = edge_sandbox {
        return Destination::Sandbox(id);
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    if let ["dashboard", page @ ..] = segments.as_slice() {
        return match page {
            ["sandboxes"] if method == Method::POST => {
                Destination::Dashboard(DashboardTo::NewSandbox)
            }
            ["sandboxes", "rows"] => Destination::Here,
            ["sandboxes", id, ..] => Destination::Dashboard(DashboardTo::Sandbox((*id).to_owned())),
            ["volumes", ..] => Destination::Dashboard(DashboardTo::Keeper),
            ["templates"] | ["snapshots", _, "delete"] if method == Method::POST => {
                Destination::Dashboard(DashboardTo::Keeper)
            }
            _ => Destination::Here,
        };
    }
    let rest = match segments.as_slice() {
        ["v2", "sandboxes", rest @ ..] | ["sandboxes", rest @ ..] => Some(rest),
        _ => None,
    };
    if let Some(rest) = rest {
        return match rest {
            [] if method == Method::POST => Destination::NewSandbox,
            [] => Destination::Here,
            ["metrics"] if method == Method::GET => Destination::LatestMetrics,
            ["metrics"] => Destination::Here,
            [id, ..] => Destination::Sandbox((*id).to_owned()),
        };
    }
    let files_of = |id: &str| Destination::TemplateFiles(id.to_owned());
    match segments.as_slice() {
        ["templates", id, "files", _] | ["upload", "templates", id, "files", _] => files_of(id),
        ["volumes", ..] | ["volumecontent", ..] | ["upload", ..] => Destination::Keeper,
        ["v2", "templates", _, "builds", build] if method == Method::POST => {
            Destination::Build((*build).to_owned())
        }
        ["templates", _, "builds", build] if method == Method::POST || method == Method::DELETE => {
            Destination::Build((*build).to_owned())
        }
        ["v3" | "v2", "templates"] | ["templates"] if method == Method::POST => {
            Destination::NewBuild
        }
        // A new Dockerfile build of the template (`/templates/tags` assigns tags).
        ["templates", id] if method == Method::POST && *id != "tags" => Destination::NewBuild,
        ["templates" | "v2" | "v3", ..] if method != Method::GET => Destination::Keeper,
        _ => Destination::Here,
    }
}

/// How an API host reaches the cluster's nodes.
pub struct ClusterRouting {
    nodes: Arc<NodeDirectory>,
    store: Arc<Store>,
    secret: Arc<str>,
    client: Client<HttpConnector, Body>,
    owners: Mutex<HashMap<String, (String, Instant)>>,
    /// Creates sent to each node, and when: counted against its headroom until a report
    /// measured after them shows them.
    pending: InFlight,
    /// Builds given to each node: counted against its build slots until its report can show
    /// them, which is only once the client started the build (after its uploads).
    pending_builds: InFlight,
    /// The template a credential's create named, as resolved for placement, for
    /// [`OWNER_TTL`]: a hint only, since the node authenticates and resolves again.
    templates: Mutex<HashMap<u64, (String, TemplateReach, Instant)>>,
    /// The recorded sandboxes' ids and agent tokens, for finding the signer of a signed
    /// file URL, read again at most every [`SIGNERS_TTL`] and only when none matches.
    signers: tokio::sync::Mutex<Signers>,
}

/// A copy of which sandbox holds which agent token.
#[derive(Default)]
struct Signers {
    tokens: Arc<Vec<(String, String)>>,
    read_at: Option<Instant>,
}

/// How long a copy of the recorded tokens answers a signature that matches none of them:
/// a sandbox created since is found once it is older than this.
const SIGNERS_TTL: Duration = Duration::from_secs(1);

/// How long a build given to a node counts against its slots before the node's report shows
/// it: the client uploads its files between the request and the start, which takes seconds
/// for most builds. Longer uploads are undercounted; placement is a best effort.
const BUILD_START_WINDOW: Duration = Duration::from_secs(30);

/// Work this API host sent each node recently, which the node's report may not show yet:
/// each sending counts for `window`, then is forgotten.
struct InFlight {
    window: TimeDelta,
    sent: Mutex<HashMap<String, VecDeque<DateTime<Utc>>>>,
}

impl InFlight {
    fn new(window: Duration) -> Self {
        Self {
            window: TimeDelta::from_std(window).unwrap_or(TimeDelta::MAX),
            sent: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<DateTime<Utc>>>> {
        self.sent.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn window_start(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        now.checked_sub_signed(self.window)
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// What was sent to `node` within the window and, when the node says when it measured
    /// its report, after that: a report already counts what came before it.
    fn on(&self, node: &str, measured_at: Option<DateTime<Utc>>) -> u64 {
        let start = self.window_start(Utc::now());
        let since = measured_at.map_or(start, |measured| measured.max(start));
        self.lock().get(node).map_or(0, |sent| {
            // Oldest first, so the recent ones are at the back.
            let recent = sent.iter().rev().take_while(|at| **at > since).count();
            u64::try_from(recent).unwrap_or(u64::MAX)
        })
    }

    fn count(&self, node: &str) {
        let now = Utc::now();
        let start = self.window_start(now);
        let mut sent = self.lock();
        let times = sent.entry(node.to_owned()).or_default();
        while times.front().is_some_and(|at| *at <= start) {
            times.pop_front();
        }
        times.push_back(now);
    }
}

impl std::fmt::Debug for ClusterRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterRouting")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

impl ClusterRouting {
    /// The template a create of `name` by `team` places, and how its layers reach a node. A
    /// name that resolves to nothing is placed as itself: the node gives the answer a single
    /// host gives.
    async fn template_to_place(
        &self,
        state: &AppState,
        team: &sandbar_core::Team,
        name: String,
    ) -> (String, TemplateReach) {
        match state.templates.resolve_to_start(team, &name).await {
            Ok(template) => {
                let reach = self.reach_of(&template).await;
                (template.id, reach)
            }
            Err(_) => (name, TemplateReach::Local),
        }
    }

    /// Whether any node can start `template`: every layer published, and the checkpoint of
    /// a snapshot or capture too.
    async fn reach_of(&self, template: &sandbar_core::Template) -> TemplateReach {
        let Some(image) = &template.image else {
            return TemplateReach::Local;
        };
        let parts = image.parts();
        match self.store.layer_blobs.layer_blobs(&parts).await {
            Ok(published) if published.len() == parts.len() => TemplateReach::Shared,
            Ok(_) => TemplateReach::Local,
            Err(e) => {
                tracing::warn!(template_id = %template.id, error = %e, "cannot read which layers are published");
                TemplateReach::Local
            }
        }
    }

    pub fn new(nodes: Arc<NodeDirectory>, store: Arc<Store>, secret: Arc<str>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self {
            nodes,
            store,
            secret,
            client,
            owners: Mutex::new(HashMap::new()),
            pending: InFlight::new(sandbar_core::cluster::LEASE_RENEWAL * 2),
            pending_builds: InFlight::new(BUILD_START_WINDOW),
            templates: Mutex::new(HashMap::new()),
            signers: tokio::sync::Mutex::new(Signers::default()),
        }
    }

    /// The sandbox whose agent token signed `signed`, if a recorded one did. Signatures
    /// cannot be looked up, only checked against each token: the tokens are kept here,
    /// checked on a copy taken under the lock (so concurrent requests check at once), and
    /// read again only when none matches and the copy is older than [`SIGNERS_TTL`] (one read
    /// at a time; the requests that waited for it use it).
    async fn signer_of(
        &self,
        signed: &crate::edge::SignedFileRequest,
    ) -> Result<Option<String>, ApiError> {
        let check = signed.check();
        let find = |tokens: &[(String, String)]| {
            tokens
                .iter()
                .find(|(_, token)| check.made_with(token))
                .map(|(id, _)| id.clone())
        };
        let (tokens, read_at) = {
            let signers = self.signers.lock().await;
            (Arc::clone(&signers.tokens), signers.read_at)
        };
        if let Some(id) = find(&tokens) {
            return Ok(Some(id));
        }
        let mut signers = self.signers.lock().await;
        if signers.read_at != read_at {
            // Read again by another request while this one searched.
            let tokens = Arc::clone(&signers.tokens);
            drop(signers);
            return Ok(find(&tokens));
        }
        if signers.read_at.is_some_and(|at| at.elapsed() < SIGNERS_TTL) {
            return Ok(None);
        }
        let sandboxes = self
            .store
            .sandboxes
            .all_sandboxes()
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        signers.tokens = Arc::new(
            sandboxes
                .into_iter()
                .map(|s| (s.id, s.envd_access_token))
                .collect(),
        );
        signers.read_at = Some(Instant::now());
        let tokens = Arc::clone(&signers.tokens);
        drop(signers);
        Ok(find(&tokens))
    }

    /// The node a sandbox is recorded on; `None` if no such sandbox is recorded.
    async fn owner(&self, sandbox_id: &str) -> Result<Option<String>, ApiError> {
        if let Some((node, at)) = self.lock_owners().get(sandbox_id)
            && at.elapsed() < OWNER_TTL
        {
            return Ok(Some(node.clone()));
        }
        let node = self
            .store
            .nodes
            .sandbox_node(sandbox_id)
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let mut owners = self.lock_owners();
        owners.retain(|_, (_, at)| at.elapsed() < OWNER_TTL);
        if let Some(node) = &node {
            owners.insert(sandbox_id.to_owned(), (node.clone(), Instant::now()));
        }
        Ok(node)
    }

    fn remember_owner(&self, sandbox_id: &str, node_id: &str) {
        self.lock_owners()
            .insert(sandbox_id.to_owned(), (node_id.to_owned(), Instant::now()));
    }

    fn lock_owners(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates sent to `node` recently enough that its report may not show them yet.
    fn pending_on(&self, node: &NodeRecord) -> u64 {
        self.pending.on(&node.id, node.report.measured_at)
    }

    fn count_pending(&self, node: &str) {
        self.pending.count(node);
    }

    /// The node that keeps volumes and records build requests: the live node first by id, so
    /// every API host picks the same one.
    fn keeper(&self) -> Option<NodeRecord> {
        self.nodes.live().into_iter().min_by(|a, b| a.id.cmp(&b.id))
    }

    fn live_node(&self, id: &str) -> Option<NodeRecord> {
        self.nodes.node(id).filter(|n| n.is_live(Utc::now()))
    }

    /// Where a build's start or cancel goes: the node its record names while that node is
    /// live; otherwise the keeper, which answers for a build nobody runs (a start there finds
    /// no files the lost node held, a cancel of a build never started ends it).
    async fn build_node(&self, build_id: &str) -> Result<NodeRecord, ApiError> {
        let build = self
            .store
            .builds
            .build(build_id)
            .await
            .map_err(store_failed)?;
        build
            .and_then(|b| b.node_id)
            .and_then(|id| self.live_node(&id))
            .or_else(|| self.keeper())
            .ok_or_else(no_nodes)
    }

    /// Where a template's upload links and uploads go: the node given its waiting build, so
    /// the files are where that build will read them; otherwise the keeper.
    async fn files_node(&self, template_id: &str) -> Result<NodeRecord, ApiError> {
        let waiting = match self
            .store
            .templates
            .template(template_id)
            .await
            .map_err(store_failed)?
        {
            Some(template) if !template.build_id.is_empty() => self
                .store
                .builds
                .build(&template.build_id)
                .await
                .map_err(store_failed)?
                .filter(|b| b.status == sandbar_core::BuildStatus::Waiting),
            _ => None,
        };
        waiting
            .and_then(|b| b.node_id)
            .and_then(|id| self.live_node(&id))
            .or_else(|| self.keeper())
            .ok_or_else(no_nodes)
    }

    /// Gives requested build `build_id`, recorded on `keeper`, to the live node with the most
    /// build room. When none reports its slots, or the record cannot be changed, the keeper
    /// keeps it: the build still runs, only not spread.
    async fn place_build(&self, build_id: &str, keeper: &NodeRecord) {
        let order = build_placement_order(
            &self.nodes.live(),
            // A build shows in a node's report only once its files are uploaded and it
            // starts, so the report's time says nothing of it: the window alone counts.
            |node| self.pending_builds.on(node, None),
            Utc::now(),
        );
        let Some(node) = order.into_iter().next() else {
            self.pending_builds.count(&keeper.id);
            return;
        };
        if node.id != keeper.id {
            match self
                .store
                .builds
                .assign_waiting_build(build_id, &node.id)
                .await
            {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(%build_id, node_id = %node.id, error = %e, "cannot give a build to a node; its keeper builds it");
                    self.pending_builds.count(&keeper.id);
                    return;
                }
            }
        }
        tracing::debug!(%build_id, node_id = %node.id, "build given to a node");
        self.pending_builds.count(&node.id);
    }

    /// Sends `request` to `node` with the secret added; the Host header stays the client's,
    /// which host-based routing on the node reads.
    async fn send(&self, node: &NodeRecord, request: Request) -> Result<Response, ApiError> {
        self.send_as(node, request, None).await
    }

    /// [`Self::send`], handing the node a dashboard session this host checked. Whatever
    /// vouched-session headers the client sent are removed first, so only this host's reach
    /// the node. A WebSocket upgrade (the dashboard's terminal) is carried through: once the
    /// node switches protocols, the two upgraded connections are joined.
    async fn send_as(
        &self,
        node: &NodeRecord,
        mut request: Request,
        vouched: Option<&VouchedSession>,
    ) -> Result<Response, ApiError> {
        let client_upgrade =
            crate::upgrade::is_upgrade(request.headers()).then(|| hyper::upgrade::on(&mut request));
        let (mut parts, body) = request.into_parts();
        for name in VouchedSession::HEADERS {
            parts.headers.remove(name);
        }
        if let Some(vouched) = vouched {
            vouched.write_to(&mut parts.headers);
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let uri: Uri = format!("{}{path}", node.url.trim_end_matches('/'))
            .parse()
            .map_err(|_| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("node '{}' has an unusable address '{}'", node.id, node.url),
                )
            })?;
        if !parts.headers.contains_key(header::HOST)
            && let Some(authority) = parts.uri.authority()
            && let Ok(host) = HeaderValue::from_str(authority.as_str())
        {
            parts.headers.insert(header::HOST, host);
        }
        parts.uri = uri;
        parts.headers.insert(
            NODE_SECRET_HEADER,
            HeaderValue::from_str(&self.secret).map_err(|_| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the cluster secret is not a header value",
                )
            })?,
        );
        let hop_by_hop = if client_upgrade.is_some() {
            [header::TE, header::TRAILER].as_slice()
        } else {
            [
                header::CONNECTION,
                header::TE,
                header::TRAILER,
                header::UPGRADE,
            ]
            .as_slice()
        };
        for name in hop_by_hop {
            parts.headers.remove(name);
        }
        let mut response = self
            .client
            .request(Request::from_parts(parts, body))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("cannot reach node '{}' at {}: {e}", node.id, node.url),
                )
            })?;
        if let Some(client_upgrade) = client_upgrade
            && response.status() == StatusCode::SWITCHING_PROTOCOLS
        {
            let node_upgrade = hyper::upgrade::on(&mut response);
            tokio::spawn(crate::upgrade::join_upgraded(client_upgrade, node_upgrade));
            let (parts, _) = response.into_parts();
            return Ok(Response::from_parts(parts, Body::empty()));
        }
        let (mut parts, body) = response.into_parts();
        parts.headers.remove(header::CONNECTION);
        parts.headers.remove(header::TRANSFER_ENCODING);
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

/// An API host's router in front of the edge and the REST API (see the module's comment).
pub(crate) async fn forward_to_nodes(
    State((state, dashboard)): State<(AppState, Dashboard)>,
    request: Request,
    next: Next,
) -> Response {
    let Some(crate::ClusterRole::Api(cluster)) = state.cluster.clone() else {
        return next.run(request).await;
    };
    let edge_sandbox = crate::edge::sandbox_named_by(&state, &request);
    if edge_sandbox.is_none()
        && let Some(signed) = crate::edge::signed_file_request(request.method(), request.uri())
    {
        return signed_to_node(&cluster, &signed, request, next)
            .await
            .unwrap_or_else(IntoResponse::into_response);
    }
    match destination(request.method(), request.uri().path(), edge_sandbox) {
        Destination::Here => next.run(request).await,
        Destination::Sandbox(id) => to_sandbox(&cluster, &id, request, next)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Destination::NewSandbox => place(&state, &cluster, request)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Destination::LatestMetrics => latest_metrics(&cluster, request, next)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Destination::Keeper => match cluster.keeper() {
            Some(node) => cluster
                .send(&node, request)
                .await
                .unwrap_or_else(IntoResponse::into_response),
            None => no_nodes().into_response(),
        },
        Destination::NewBuild => new_build(&cluster, request)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        Destination::TemplateFiles(template_id) => match cluster.files_node(&template_id).await {
            Ok(node) => cluster.send(&node, request).await,
            Err(e) => Err(e),
        }
        .unwrap_or_else(IntoResponse::into_response),
        Destination::Build(build_id) => match cluster.build_node(&build_id).await {
            Ok(node) => cluster.send(&node, request).await,
            Err(e) => Err(e),
        }
        .unwrap_or_else(IntoResponse::into_response),
        Destination::Dashboard(to) => {
            dashboard_to_nodes(&state, &dashboard, &cluster, to, request, next).await
        }
    }
}

/// A dashboard request whose work is on a node: its session is checked here, where sessions
/// live, and the node is handed the session with the request. Errors come in the dashboard's
/// form, for its error box.
async fn dashboard_to_nodes(
    state: &AppState,
    dashboard: &Dashboard,
    cluster: &ClusterRouting,
    to: DashboardTo,
    request: Request,
    next: Next,
) -> Response {
    let (vouched, team) = match dashboard.vouch(request.method(), request.headers()).await {
        Ok(checked) => checked,
        Err(answer) => return answer,
    };
    let sent = match to {
        DashboardTo::Sandbox(id) => match cluster.owner(&id).await {
            Ok(Some(node_id)) => match cluster.live_node(&node_id) {
                Some(node) => cluster.send_as(&node, request, Some(&vouched)).await,
                None => Err(node_lost(cluster, &id, &node_id)),
            },
            // Unknown to the store too: the dashboard here says so.
            Ok(None) => return next.run(request).await,
            Err(e) => Err(e),
        },
        DashboardTo::Keeper => match cluster.keeper() {
            Some(node) => cluster.send_as(&node, request, Some(&vouched)).await,
            None => Err(no_nodes()),
        },
        DashboardTo::NewSandbox => {
            place_from_dashboard(state, cluster, &team, &vouched, request).await
        }
    };
    sent.unwrap_or_else(|e| sandbar_dashboard::error_answer(e.status, e.message))
}

/// A sandbox created from the dashboard's form, placed as an API create of its template.
async fn place_from_dashboard(
    state: &AppState,
    cluster: &ClusterRouting,
    team: &sandbar_core::Team,
    vouched: &VouchedSession,
    request: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let body = crate::extract::read_bounded_body(body).await?;
    let name = url::form_urlencoded::parse(&body)
        .find(|(field, _)| field == "template")
        .map(|(_, value)| value.trim().to_owned())
        .filter(|value| !value.is_empty())
        .unwrap_or_else(|| sandbar_core::DEFAULT_TEMPLATE_ALIAS.to_owned());
    let (template, reach) = cluster.template_to_place(state, team, name).await;
    let order = placement_order(
        &cluster.nodes.live(),
        &template,
        reach,
        |node| cluster.pending_on(node),
        Utc::now(),
    );
    send_create_in_order(cluster, order, &parts, &body, Some(vouched)).await
}

fn no_nodes() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "no node of the cluster is alive to take this request",
    )
}

fn store_failed(e: sandbar_core::StoreError) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// A build request: the keeper records it (and answers what a single host would), then the
/// build is given to a node with build room before the client hears its ID, so the upload
/// links it asks for next already go there.
async fn new_build(cluster: &ClusterRouting, request: Request) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Requested {
        #[serde(rename = "buildID")]
        build_id: String,
    }
    let keeper = cluster.keeper().ok_or_else(no_nodes)?;
    let response = cluster.send(&keeper, request).await?;
    if !response.status().is_success() {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, NODE_ANSWER_LIMIT)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "node '{}' cut its answer to a build request short: {e}",
                    keeper.id
                ),
            )
        })?;
    if let Ok(requested) = serde_json::from_slice::<Requested>(&bytes) {
        cluster.place_build(&requested.build_id, &keeper).await;
    }
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// A signed `/files` URL that names no sandbox (what `download_url()` and `upload_url()` give
/// out when the SDK has one URL for every sandbox): sent to the node of the sandbox whose
/// agent token made the signature, found among the recorded ones. One that matches none is
/// left to the local edge, which answers as a single host does.
async fn signed_to_node(
    cluster: &ClusterRouting,
    signed: &crate::edge::SignedFileRequest,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(refused) = signed.refused_unsearched(Utc::now().timestamp()) {
        return Err(refused);
    }
    match cluster.signer_of(signed).await? {
        // Its node is looked up as for any request naming it: it may have moved.
        Some(sandbox_id) => to_sandbox(cluster, &sandbox_id, request, next).await,
        None => Ok(next.run(request).await),
    }
}

async fn to_sandbox(
    cluster: &ClusterRouting,
    sandbox_id: &str,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let Some(node_id) = cluster.owner(sandbox_id).await? else {
        // Unknown here too: the local handlers give the answer a single host gives.
        return Ok(next.run(request).await);
    };
    let node = cluster
        .nodes
        .node(&node_id)
        .filter(|n| n.is_live(Utc::now()));
    match node {
        Some(node) => cluster.send(&node, request).await,
        // A lost node's sandbox still has its logs in the store.
        None if request.method() == Method::GET && request.uri().path().ends_with("/logs") => {
            Ok(next.run(request).await)
        }
        // Killing it forgets its record here; if the node comes back, it finds the sandbox
        // unrecorded and removes it, so it never runs again.
        None if request.method() == Method::DELETE
            && request.uri().path().trim_matches('/') == format!("sandboxes/{sandbox_id}") =>
        {
            Ok(next.run(request).await)
        }
        // A paused sandbox may be resumed on another node, from the copy of its files its
        // node shared; that node takes it over (or says why it cannot).
        None if request.method() == Method::POST && is_resume(request.uri().path(), sandbox_id) => {
            let order = placement_order(
                &cluster.nodes.live(),
                "",
                TemplateReach::Shared,
                |node| cluster.pending_on(node),
                Utc::now(),
            );
            let node = order.into_iter().next().ok_or_else(no_nodes)?;
            let response = cluster.send(&node, request).await?;
            if response.status().is_success() {
                cluster.remember_owner(sandbox_id, &node.id);
            }
            Ok(response)
        }
        None => Err(node_lost(cluster, sandbox_id, &node_id)),
    }
}

/// The answer for a sandbox whose node holds no lease.
fn node_lost(cluster: &ClusterRouting, sandbox_id: &str, node_id: &str) -> ApiError {
    let since = cluster
        .nodes
        .node(node_id)
        .map(|n| format!(" since {}", n.lease_until.to_rfc3339()))
        .unwrap_or_default();
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!(
            "The sandbox was not found: sandbox '{sandbox_id}' is on node '{node_id}', which has not answered{since}"
        ),
    )
}

/// `GET /sandboxes/metrics?sandbox_ids=…`: the IDs split by the node that holds each, one
/// request per node, the answers' `sandboxes` maps merged. What the handler would refuse
/// (no IDs, too many) is left to it.
async fn latest_metrics(
    cluster: &ClusterRouting,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let ids: Vec<String> = request
        .uri()
        .query()
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .filter(|(k, _)| k == "sandbox_ids")
                .flat_map(|(_, v)| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|v| !v.is_empty())
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect()
        })
        .unwrap_or_default();
    if ids.is_empty() || ids.len() > 100 {
        return Ok(next.run(request).await);
    }
    let mut by_node: HashMap<String, Vec<String>> = HashMap::new();
    for id in ids {
        if let Some(node) = cluster.owner(&id).await? {
            by_node.entry(node).or_default().push(id);
        }
    }
    let mut merged = serde_json::Map::new();
    let (parts, _) = request.into_parts();
    for (node_id, ids) in by_node {
        let Some(node) = cluster
            .nodes
            .node(&node_id)
            .filter(|n| n.is_live(Utc::now()))
        else {
            continue;
        };
        let query: String = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("sandbox_ids", &ids.join(","))
            .finish();
        let mut ask = Request::new(Body::empty());
        *ask.method_mut() = Method::GET;
        *ask.uri_mut() = format!("/sandboxes/metrics?{query}")
            .parse()
            .map_err(|_| ApiError::bad_request("invalid sandbox IDs"))?;
        *ask.headers_mut() = parts.headers.clone();
        let response = cluster.send(&node, ask).await?;
        if !response.status().is_success() {
            return Ok(response);
        }
        let bytes = axum::body::to_bytes(response.into_body(), 16 << 20)
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("node '{node_id}' sent unreadable metrics: {e}"),
                )
            })?;
        let answer: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("node '{node_id}' sent unreadable metrics: {e}"),
            )
        })?;
        if let Some(serde_json::Value::Object(sandboxes)) = answer.get("sandboxes") {
            merged.extend(sandboxes.clone());
        }
    }
    Ok(axum::Json(serde_json::json!({ "sandboxes": merged })).into_response())
}

/// Tries the live nodes in placement order until one takes the sandbox; a node that has no
/// room (503) or cannot be reached passes it on to the next.
async fn place(
    state: &AppState,
    cluster: &ClusterRouting,
    request: Request,
) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let body = crate::extract::read_bounded_body(body).await?;
    let create = match crate::sandboxes::checked_create(&body) {
        Ok(create) => create,
        Err(refused) => {
            // A single host authenticates before it reads the body: so does this one.
            crate::extract::team_of(state, &parts.headers).await?;
            return Err(refused);
        }
    };
    let forwarded = Bytes::from(serde_json::to_vec(&create).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "cannot encode the create of template {}: {e}",
                create.template_id
            ),
        )
    })?);
    // The length of what the client sent, not of what goes on.
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let name = create.template_id.clone();
    let remembered = placement_key(&parts.headers, &name);
    let cached = cluster
        .templates
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&remembered)
        .filter(|(_, _, at)| at.elapsed() < OWNER_TTL)
        .map(|(id, reach, _)| (id.clone(), *reach));
    let (template, reach) = match cached {
        Some(known) => known,
        None => {
            // Checked here too, so nothing unauthenticated costs a node anything.
            let team = crate::extract::team_of(state, &parts.headers).await?;
            let (id, reach) = cluster.template_to_place(state, &team, name).await;
            let mut templates = cluster.templates.lock().unwrap_or_else(|e| e.into_inner());
            templates.retain(|_, (_, _, at)| at.elapsed() < OWNER_TTL);
            templates.insert(remembered, (id.clone(), reach, Instant::now()));
            (id, reach)
        }
    };
    let now = Utc::now();
    let live = cluster.nodes.live();
    // Volumes live on the keeper: a sandbox that mounts one can start only there.
    let order = if mounts_volumes(&create) {
        cluster.keeper().into_iter().collect()
    } else {
        placement_order(
            &live,
            &template,
            reach,
            |node| cluster.pending_on(node),
            now,
        )
    };
    send_create_in_order(cluster, order, &parts, &forwarded, None).await
}

/// Offers a create to each node of `order` in turn until one takes it or refuses it for a
/// reason other than room.
async fn send_create_in_order(
    cluster: &ClusterRouting,
    order: Vec<NodeRecord>,
    parts: &axum::http::request::Parts,
    body: &Bytes,
    vouched: Option<&VouchedSession>,
) -> Result<Response, ApiError> {
    let mut last = None;
    for node in order {
        let mut attempt = Request::new(Body::from(body.clone()));
        *attempt.method_mut() = parts.method.clone();
        *attempt.uri_mut() = parts.uri.clone();
        *attempt.version_mut() = parts.version;
        *attempt.headers_mut() = parts.headers.clone();
        cluster.count_pending(&node.id);
        match cluster.send_as(&node, attempt, vouched).await {
            Ok(response) if response.status() == StatusCode::SERVICE_UNAVAILABLE => {
                last = Some(Ok(response));
            }
            Ok(response) if response.status() == StatusCode::CREATED => {
                return Ok(remember_created(cluster, &node.id, response).await);
            }
            Ok(response) => return Ok(response),
            Err(e) => {
                tracing::warn!(node_id = %node.id, error = %e.message, "a node did not take a create");
                last = Some(Err(e));
            }
        }
    }
    last.unwrap_or_else(|| Err(no_nodes()))
}

/// Whether `path` resumes (or connects to, which resumes a paused one) `sandbox_id`.
fn is_resume(path: &str, sandbox_id: &str) -> bool {
    let path = path.trim_matches('/');
    let segments: Vec<&str> = path
        .strip_prefix("v2/")
        .unwrap_or(path)
        .split('/')
        .collect();
    matches!(segments.as_slice(), ["sandboxes", id, "resume" | "connect"] if *id == sandbox_id)
}

fn mounts_volumes(create: &NewSandbox) -> bool {
    create
        .volume_mounts
        .as_ref()
        .is_some_and(|mounts| !mounts.is_empty())
}

/// What a resolved template is remembered under: the request's credentials and the name.
fn placement_key(headers: &axum::http::HeaderMap, name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for header in ["x-api-key", "authorization"] {
        headers
            .get(header)
            .map(HeaderValue::as_bytes)
            .hash(&mut hasher);
    }
    name.hash(&mut hasher);
    hasher.finish()
}

/// Notes which node took a new sandbox, so its first calls need no store lookup; the answer
/// is passed on as it came.
async fn remember_created(cluster: &ClusterRouting, node_id: &str, response: Response) -> Response {
    #[derive(serde::Deserialize)]
    struct Created {
        #[serde(rename = "sandboxID")]
        sandbox_id: String,
    }
    let (parts, body) = response.into_parts();
    match axum::body::to_bytes(body, NODE_ANSWER_LIMIT).await {
        Ok(bytes) => {
            if let Ok(created) = serde_json::from_slice::<Created>(&bytes) {
                cluster.remember_owner(&created.sandbox_id, node_id);
            }
            Response::from_parts(parts, Body::from(bytes))
        }
        Err(e) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("node '{node_id}' cut its answer to a create short: {e}"),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest(method: Method, path: &str) -> Destination {
        destination(&method, path, None)
    }

    /// Checks each request's destination, naming the request that goes astray.
    fn assert_destinations(cases: &[(Method, &str, Destination)]) {
        for (method, path, expected) in cases {
            assert_eq!(&dest(method.clone(), path), expected, "{method} {path}");
        }
    }

    #[test]
    fn sandbox_paths_go_to_the_sandbox_s_node() {
        for path in [
            "/sandboxes/abc",
            "/sandboxes/abc/pause",
            "/sandboxes/abc/connect",
            "/v2/sandboxes/abc/logs",
            "/sandboxes/abc/snapshots",
        ] {
            assert_eq!(
                dest(Method::POST, path),
                Destination::Sandbox("abc".into()),
                "{path}"
            );
        }
        assert_eq!(
            destination(&Method::GET, "/files", Some("xyz".into())),
            Destination::Sandbox("xyz".into())
        );
    }

    #[test]
    fn creates_are_placed_and_listings_answered_here() {
        assert_destinations(&[
            (Method::POST, "/sandboxes", Destination::NewSandbox),
            (Method::POST, "/v2/sandboxes", Destination::NewSandbox),
            (Method::GET, "/v2/sandboxes", Destination::Here),
            (
                Method::GET,
                "/sandboxes/metrics",
                Destination::LatestMetrics,
            ),
            (Method::GET, "/templates", Destination::Here),
            (Method::GET, "/api-keys", Destination::Here),
            (Method::GET, "/health", Destination::Here),
        ]);
    }

    #[test]
    fn creates_with_volume_mounts_are_told_apart() {
        let checked =
            |body: &str| crate::sandboxes::checked_create(body.as_bytes()).expect("a valid create");
        let with = r#"{"templateID":"base","volumeMounts":[{"name":"v","path":"/data"}]}"#;
        assert!(mounts_volumes(&checked(with)));
        assert!(!mounts_volumes(&checked(
            r#"{"templateID":"base","volumeMounts":[]}"#
        )));
        assert!(!mounts_volumes(&checked(r#"{"templateID":"base"}"#)));
        let refused = crate::sandboxes::checked_create(b"not json").expect_err("not json");
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn resumes_and_connects_are_told_apart() {
        assert!(is_resume("/sandboxes/abc/resume", "abc"));
        assert!(is_resume("/sandboxes/abc/connect", "abc"));
        assert!(is_resume("/v2/sandboxes/abc/connect", "abc"));
        assert!(!is_resume("/sandboxes/abc/pause", "abc"));
        assert!(!is_resume("/sandboxes/abc/resume", "other"));
        assert!(!is_resume("/sandboxes/abc", "abc"));
    }

    #[test]
    fn template_writes_follow_their_build_and_volumes_go_to_the_keeper() {
        let files = || Destination::TemplateFiles("t".into());
        let build = || Destination::Build("b".into());
        assert_destinations(&[
            (Method::POST, "/v3/templates", Destination::NewBuild),
            (Method::POST, "/v2/templates", Destination::NewBuild),
            (Method::POST, "/templates", Destination::NewBuild),
            (Method::POST, "/templates/t", Destination::NewBuild),
            (Method::GET, "/templates/t/files/h", files()),
            (Method::PUT, "/upload/templates/t/files/h", files()),
            (Method::POST, "/v2/templates/t/builds/b", build()),
            // A Dockerfile build's start, and a cancel of either kind.
            (Method::POST, "/templates/t/builds/b", build()),
            (Method::DELETE, "/templates/t/builds/b", build()),
            // Status and logs are in the store.
            (
                Method::GET,
                "/templates/t/builds/b/status",
                Destination::Here,
            ),
            (Method::GET, "/templates/t/builds/b/logs", Destination::Here),
            (Method::GET, "/templates/t", Destination::Here),
            // Administration stays with the keeper.
            (Method::POST, "/templates/tags", Destination::Keeper),
            (Method::DELETE, "/templates/tags", Destination::Keeper),
            (Method::DELETE, "/templates/t", Destination::Keeper),
            (Method::PATCH, "/templates/t", Destination::Keeper),
            (Method::PATCH, "/v2/templates/t", Destination::Keeper),
            (Method::PUT, "/upload/other", Destination::Keeper),
            (Method::GET, "/volumes", Destination::Keeper),
            (Method::GET, "/volumecontent/v/file", Destination::Keeper),
        ]);
    }

    #[test]
    fn work_in_flight_counts_within_its_window_only() {
        let sent = InFlight::new(Duration::from_secs(60));
        sent.count("a");
        sent.count("a");
        assert_eq!(sent.on("a", None), 2);
        assert_eq!(sent.on("b", None), 0);
        let gone = InFlight::new(Duration::ZERO);
        gone.count("a");
        assert_eq!(gone.on("a", None), 0);
    }

    #[test]
    fn work_in_flight_counts_only_what_came_after_the_report() {
        let sent = InFlight::new(Duration::from_secs(60));
        let before = Utc::now() - TimeDelta::seconds(1);
        sent.count("a");
        let between = Utc::now();
        std::thread::sleep(Duration::from_millis(2));
        sent.count("a");
        assert_eq!(sent.on("a", Some(before)), 2, "a report older than both");
        assert_eq!(
            sent.on("a", Some(between)),
            1,
            "a report that counted the first"
        );
        assert_eq!(
            sent.on("a", Some(Utc::now())),
            0,
            "a report that counted both"
        );
        // A report from before the window does not bring back what the window forgot.
        let gone = InFlight::new(Duration::ZERO);
        gone.count("a");
        assert_eq!(gone.on("a", Some(before)), 0);
    }
}
