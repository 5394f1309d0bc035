//! The server every suite stands up the same way: a SQLite store in a temporary directory, a
//! bootstrapped team, the public `base` template and a router's state around them.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use chrono::Utc;
use http_body_util::BodyExt;
use sandbar_api::{AppState, EdgeConfig};
use sandbar_core::Store;
use sandbar_core::auth::{Credentials, TeamLimits, hash_secret};
use sandbar_core::store::StoredSecret;
use sandbar_core::{
    Auth, Builder, Builds, RateLimits, Runtime, Sandboxes, SandboxesConfig, Team, Templates,
    Volumes,
};
use sandbar_node::storage::volumes::HostVolumes;
use sandbar_store::SqliteStore;
use serde_json::Value;
use tempfile::TempDir;
use tower::ServiceExt;

use super::{FakeRuntime, RefusingBuilder, base_template, builds_with};

/// The bootstrapped team's API key, where a suite chooses it.
pub const KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";

/// The key of the team [`add_other_team`] adds.
pub const OTHER_KEY: &str = "e2b_1111111111111111111111111111111111111111";

/// Limits no test reaches unless it lowers one.
pub const LIMITS: TeamLimits = TeamLimits::new(100, 3600, 0);

pub async fn open_store(dir: &TempDir) -> Arc<Store> {
    Arc::new(
        SqliteStore::open(&dir.path().join("db"))
            .await
            .expect("open"),
    )
}

/// Registers the public `base` template, built now.
pub async fn register_base(templates: &Templates) {
    templates
        .register(&base_template(Utc::now()))
        .await
        .expect("template");
}

/// The sandbox service on `runtime`, before any volumes or cluster are added to it.
pub fn sandboxes(
    store: &Arc<Store>,
    runtime: Arc<dyn Runtime>,
    templates: &Templates,
    config: SandboxesConfig,
) -> Sandboxes {
    Sandboxes::new(store.clone(), runtime, templates.clone(), config)
}

/// Volumes kept on the host under `dir`.
pub fn volumes(dir: &TempDir, store: &Arc<Store>) -> Volumes {
    let host = HostVolumes::open(&dir.path().join("volumes")).expect("volumes");
    Volumes::new(store.clone(), Arc::new(host), [7; 32])
}

/// How [`serve`] builds its server; the default is the plainest one.
pub struct Setup {
    /// The bootstrapped team's API key; a random one where `None`.
    pub key: Option<&'static str>,
    pub limits: TeamLimits,
    pub config: SandboxesConfig,
    pub runtime: Arc<FakeRuntime>,
    pub builder: Arc<dyn Builder>,
    /// Volumes on the host, each team held to this many content requests a minute.
    pub volumes: Option<u32>,
    /// Adds `other-team` with [`OTHER_KEY`].
    pub other_team: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            key: None,
            limits: LIMITS,
            config: SandboxesConfig::default(),
            runtime: Arc::new(FakeRuntime::default()),
            builder: Arc::new(RefusingBuilder),
            volumes: None,
            other_team: false,
        }
    }
}

/// A single host's services on a real SQLite store, with one bootstrapped team and the
/// public `base` template.
pub struct Server {
    pub dir: TempDir,
    pub store: Arc<Store>,
    pub auth: Auth,
    pub templates: Templates,
    pub runtime: Arc<FakeRuntime>,
    pub sandboxes: Arc<Sandboxes>,
    pub builds: Builds,
    pub credentials: Credentials,
    /// The single host's router over these services.
    pub app: axum::Router,
}

pub async fn serve(setup: Setup) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open_store(&dir).await;
    let auth = Auth::new(store.clone());
    let credentials = auth
        .bootstrap(setup.key, setup.limits)
        .await
        .expect("bootstrap")
        .expect("first start");
    if setup.other_team {
        add_other_team(&store).await;
    }
    let templates = Templates::new(store.clone());
    register_base(&templates).await;
    let mut sandboxes = Sandboxes::new(
        store.clone(),
        setup.runtime.clone(),
        templates.clone(),
        setup.config,
    );
    if let Some(per_minute) = setup.volumes {
        let volumes = volumes(&dir, &store).with_content_rate(per_minute);
        sandboxes = sandboxes.with_volumes(Arc::new(volumes));
    }
    let builds = builds_with(store.clone(), &templates, setup.builder);
    let sandboxes = Arc::new(sandboxes);
    let app = sandbar_api::router(state(
        auth.clone(),
        sandboxes.clone(),
        builds.clone(),
        templates.clone(),
    ));
    Server {
        dir,
        store,
        auth,
        templates,
        runtime: setup.runtime,
        sandboxes,
        builds,
        credentials,
        app,
    }
}

impl Server {
    /// The router's state over these services.
    pub fn state(&self) -> AppState {
        state(
            self.auth.clone(),
            self.sandboxes.clone(),
            self.builds.clone(),
            self.templates.clone(),
        )
    }

    /// Sends `request` to [`Self::app`] and reads the answer as [`Answer::reply`] does.
    pub async fn send(&self, request: Request<Body>) -> Reply {
        send(&self.app, request).await.reply()
    }

    pub async fn team(&self) -> Team {
        self.store
            .teams
            .team(&self.credentials.team_id)
            .await
            .expect("read")
            .expect("the team")
    }
}

/// The router's state for a single host: no rate limits beyond the team's, no cluster.
pub fn state(
    auth: Auth,
    sandboxes: Arc<Sandboxes>,
    builds: Builds,
    templates: Templates,
) -> AppState {
    AppState {
        auth,
        sandboxes,
        builds,
        templates,
        rate_limits: Arc::new(RateLimits::default()),
        edge: Arc::new(EdgeConfig {
            domain: "sandbar.localhost".into(),
        }),
        cluster: None,
    }
}

/// Adds a second team, `other-team`, whose key is [`OTHER_KEY`].
pub async fn add_other_team(store: &Store) {
    let other = Team {
        id: "other-team".into(),
        name: "other".into(),
        slug: "other".into(),
        limits: TeamLimits {
            max_concurrent_sandboxes: 5,
            ..LIMITS
        },
    };
    store.teams.insert_team(&other).await.expect("team");
    store
        .teams
        .insert_api_key(&StoredSecret {
            id: "k2".into(),
            team_id: other.id.clone(),
            name: "k".into(),
            secret_hash: hash_secret(OTHER_KEY),
            mask_prefix: "11".into(),
            mask_suffix: "1111".into(),
            created_at: Utc::now(),
        })
        .await
        .expect("key");
}

/// What the router answered, its body read whole.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub bytes: Bytes,
}

impl Answer {
    /// The body as JSON, or null where it is empty or not JSON.
    pub fn json_or_null(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or(Value::Null)
    }

    /// The answer with its body as JSON, null where it is empty or not JSON.
    pub fn reply(self) -> Reply {
        Reply {
            status: self.status,
            body: self.json_or_null(),
            raw: self.bytes.to_vec(),
            headers: self.headers,
        }
    }

    /// The answer to `method path` with its body as JSON, null where it is empty; any other
    /// body fails the test.
    pub fn json_reply(self, method: &str, path: &str) -> Reply {
        Reply {
            status: self.status,
            body: json_body(method, path, &self.bytes),
            raw: self.bytes.to_vec(),
            headers: self.headers,
        }
    }
}

pub async fn send(app: &axum::Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.expect("call");
    let status = response.status();
    let headers = response.headers().clone();
    let collected = response.into_body().collect().await.expect("body");
    Answer {
        status,
        headers,
        bytes: collected.to_bytes(),
    }
}

/// A request to the API with `key`, if any, and a JSON `body` (empty where there is none).
pub fn json_request(
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(key) = key {
        request = request.header("X-API-Key", key);
    }
    request
        .header("content-type", "application/json")
        .body(Body::from(body.unwrap_or("").to_owned()))
        .expect("request")
}

/// How a request authenticates.
#[derive(Clone, Copy)]
pub enum Cred<'a> {
    None,
    Key(&'a str),
    Bearer(&'a str),
    BearerTeam(&'a str, &'a str),
}

/// A request authenticated by `cred`, with a JSON `body` where there is one.
pub fn request(method: &str, path: &str, cred: Cred<'_>, body: Option<String>) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(path);
    match cred {
        Cred::None => {}
        Cred::Key(k) => request = request.header("X-API-Key", k),
        Cred::Bearer(t) => request = request.header("Authorization", format!("Bearer {t}")),
        Cred::BearerTeam(t, team) => {
            request = request
                .header("Authorization", format!("Bearer {t}"))
                .header("X-Team-ID", team);
        }
    }
    if body.is_some() {
        request = request.header("content-type", "application/json");
    }
    request
        .body(Body::from(body.unwrap_or_default()))
        .expect("request")
}

/// An answer whose body is JSON where there is one.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    /// The body as it came.
    pub raw: Vec<u8>,
}

/// Calls `method path` on `app` as [`request`] makes it, and reads the answer; a body that
/// is not JSON fails the test.
pub async fn call(
    app: &axum::Router,
    method: &str,
    path: &str,
    cred: Cred<'_>,
    body: Option<&str>,
) -> Reply {
    send(app, request(method, path, cred, body.map(str::to_owned)))
        .await
        .json_reply(method, path)
}

/// Checks that `body` is the API's error answer for `expected` (its status and its `code`),
/// and gives its message.
pub fn error_message(status: StatusCode, body: &Value, expected: StatusCode) -> Option<&str> {
    assert_eq!(status, expected, "{body:?}");
    assert_eq!(body["code"].as_u64(), Some(u64::from(expected.as_u16())));
    body["message"].as_str()
}

/// The body of the answer to `method path` as JSON, null where it is empty; any other body
/// fails the test.
fn json_body(method: &str, path: &str, bytes: &Bytes) -> Value {
    if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(bytes)
            .unwrap_or_else(|_| panic!("{method} {path}: body is not JSON: {bytes:?}"))
    }
}

/// The seconds of the answer's `Retry-After`, which it must have.
pub fn retry_after(headers: &HeaderMap) -> u64 {
    headers
        .get("retry-after")
        .expect("Retry-After")
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds")
}

/// The template and build IDs of an accepted build request's answer.
pub fn requested_build(status: StatusCode, body: &Value) -> (String, String) {
    assert_eq!(status, StatusCode::ACCEPTED, "{body:?}");
    let id = |field: &str| {
        body[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field} in {body:?}"))
            .to_owned()
    };
    (id("templateID"), id("buildID"))
}
