//! envd-compatible agent that runs as PID 1 inside a sandbox.
//!
//! It serves `process.Process` and `filesystem.Filesystem` over Connect-RPC (JSON and proto
//! codecs), plus plain-HTTP `/health`, `/envs` and `/files`, so the official E2B SDKs can drive
//! the sandbox. Children are reaped by one process-wide loop (see [`reaper`]).

pub mod auth;
mod exec;
pub mod file_metadata;
pub mod files;
pub mod fs;
mod http_error;
pub mod identity;
mod idle_trim;
pub mod paths;
pub mod process;
pub mod reaper;
pub mod rpc;
pub mod users;
pub mod watch;

/// Code generated from `proto/*.proto`.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod proto {
    connectrpc::include_generated!();
}

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::routing::get;
use axum::serve::ListenerExt as _;
use http::StatusCode;
pub use sandbar_jail::{AgentConfig, ENVD_VERSION};

/// State shared by every handler.
#[derive(Debug)]
pub struct AgentState {
    /// What the node configured; replaced whole by `POST /init` (a sandbox restored from
    /// another's snapshot gets its own token and environment).
    config: std::sync::RwLock<Arc<AgentConfig>>,
    /// Processes started through `process.Process`.
    pub processes: Arc<process::ProcessManager>,
    /// Polling watchers created through `CreateWatcher`.
    pub watchers: watch::Watchers,
    /// Where the sandbox's environment is written for processes that started before it was
    /// set (see [`SANDBOX_ENV_FILE`]); `None` outside a sandbox.
    env_file: Option<std::path::PathBuf>,
}

/// Inside a sandbox, the sandbox's environment variables as one JSON object, rewritten at
/// every `POST /init`. A process restored from a capture was started before its sandbox got
/// its environment; the code interpreter reads this file to give its running kernels the
/// variables a fresh start would have inherited. Readable by every user of the sandbox, as
/// the variables are in the environment of every process the agent starts.
pub const SANDBOX_ENV_FILE: &str = "/run/sandbar/env.json";

/// Writes `env` to `path` whole (a reader never sees half of it).
fn write_env_file(
    path: &std::path::Path,
    env: &std::collections::BTreeMap<String, String>,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    let staging = dir.join(".env.json.new");
    let _ = std::fs::remove_file(&staging);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&staging)?;
    file.write_all(&serde_json::to_vec(env).map_err(std::io::Error::other)?)?;
    std::fs::rename(&staging, path)
}

impl AgentState {
    /// The configuration in force now.
    pub fn config(&self) -> Arc<AgentConfig> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn publish_env(&self) {
        if let Some(path) = &self.env_file
            && let Err(e) = write_env_file(path, &self.config().env_vars)
        {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the sandbox's environment");
        }
    }

    fn replace_config(&self, config: AgentConfig) {
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
    }
}

/// `POST /init`, envd's call for a sandbox that starts from a snapshot or from a sandbox booted
/// ahead of demand: the node gives the agent the new sandbox's token, environment, defaults
/// and memory limit. The caller must hold the token in
/// force (the token check runs first); the edge never forwards this path.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitRequest {
    access_token: Option<String>,
    #[serde(default)]
    env_vars: std::collections::BTreeMap<String, String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
    memory_limit_mb: Option<u32>,
}

async fn init(
    State(state): State<Arc<AgentState>>,
    axum::Json(request): axum::Json<InitRequest>,
) -> StatusCode {
    let current = state.config();
    // A sandbox created without variables finds the file its agent wrote at boot; writing
    // it again would be a quarter of the create's time in the agent.
    let env_published = request.env_vars == current.env_vars
        && state
            .env_file
            .as_deref()
            .is_none_or(std::path::Path::exists);
    state.replace_config(AgentConfig {
        access_token: request.access_token.filter(|t| !t.is_empty()),
        default_user: request
            .default_user
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| current.default_user.clone()),
        env_vars: request.env_vars,
        default_workdir: request.default_workdir.filter(|w| !w.is_empty()),
        memory_limit_mb: request.memory_limit_mb.or(current.memory_limit_mb),
    });
    if let Some(limit_mb) = request.memory_limit_mb {
        state.processes.set_memory_limit(limit_mb);
    }
    if !env_published {
        state.publish_env();
    }
    // The first line of the new sandbox's log: the node emptied the log of the agent's time
    // before it had a sandbox.
    tracing::info!(version = ENVD_VERSION, "agent started");
    StatusCode::NO_CONTENT
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn envs(State(state): State<Arc<AgentState>>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!(state.config().env_vars))
}

/// The whole agent HTTP surface. Unknown paths answer 404 (after the token check).
pub fn router(config: AgentConfig) -> axum::Router {
    router_with(config, None, None)
}

/// [`router`], with the sandbox's out-of-memory notifications for naming the processes they
/// kill and the file the sandbox's environment is published in.
pub fn router_with(
    config: AgentConfig,
    oom: Option<Arc<process::OomEvents>>,
    env_file: Option<std::path::PathBuf>,
) -> axum::Router {
    let state = Arc::new(AgentState {
        config: std::sync::RwLock::new(Arc::new(config)),
        processes: Arc::new(process::ProcessManager::with_oom(oom)),
        watchers: watch::Watchers::default(),
        env_file,
    });
    state.publish_env();
    let services = Arc::new(rpc::Services::new(state.clone()));
    let connect = proto::process::ProcessExt::register(services.clone(), connectrpc::Router::new());
    let connect = proto::filesystem::FilesystemExt::register(services, connect);
    axum::Router::new()
        .route("/health", get(health))
        .route("/envs", get(envs))
        .route("/init", axum::routing::post(init))
        .route(
            "/files",
            get(files::download)
                .post(files::upload)
                .layer::<_, std::convert::Infallible>(axum::middleware::from_fn(
                    files::read_whole_body,
                ))
                .layer(DefaultBodyLimit::disable()),
        )
        .fallback_service(connect.into_axum_service())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .layer(axum::middleware::from_fn(noted))
        .with_state(state)
}

/// Tells the idle trim of each request, before anything else runs for it.
async fn noted(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    idle_trim::note_activity();
    next.run(request).await
}

/// Serves the agent on a Unix socket until the listener fails.
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    config: AgentConfig,
) -> std::io::Result<()> {
    axum::serve(listener, router(config)).await
}

/// Serves a booted sandbox's agent on its Unix socket until the listener fails; `oom_events`
/// is the node's out-of-memory eventfd, when it passed one.
pub async fn serve_booted(
    listener: tokio::net::UnixListener,
    config: AgentConfig,
    oom_events: Option<std::os::fd::OwnedFd>,
) -> std::io::Result<()> {
    // Started now rather than at the first command: a sandbox taken from the warm pool would
    // otherwise start a thread and its runtime, and write the trampoline, on its first
    // command's path.
    reaper::Reaper::global();
    exec::preload_trampoline();
    idle_trim::enable();
    let oom = oom_events.map(|fd| process::OomEvents::new(fd, config.memory_limit_mb));
    if let Some(oom) = &oom {
        tokio::spawn(oom.clone().watch());
    }
    let env_file = Some(std::path::PathBuf::from(SANDBOX_ENV_FILE));
    axum::serve(listener, router_with(config, oom, env_file)).await
}

/// Serves the agent on TCP until the listener fails. Nagle is disabled because streamed
/// process output is many small writes that must not be delayed.
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    config: AgentConfig,
) -> std::io::Result<()> {
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, router(config)).await
}
