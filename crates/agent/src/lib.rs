//! envd-compatible agent that runs as PID 1 inside a sandbox.
//!
//! It serves `process.Process` and `filesystem.Filesystem` over Connect-RPC (JSON and proto
//! codecs), plus plain-HTTP `/health`, `/envs` and `/files`, so the official E2B SDKs can drive
//! the sandbox. Children are reaped by one process-wide loop (see [`reaper`]).

pub mod auth;
pub mod files;
pub mod fs;
mod http_error;
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
    /// What the node configured.
    pub config: AgentConfig,
    /// Processes started through `process.Process`.
    pub processes: Arc<process::ProcessManager>,
    /// Polling watchers created through `CreateWatcher`.
    pub watchers: watch::Watchers,
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn envs(State(state): State<Arc<AgentState>>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!(state.config.env_vars))
}

/// The whole agent HTTP surface. Unknown paths answer 404 (after the token check).
pub fn router(config: AgentConfig) -> axum::Router {
    let state = Arc::new(AgentState {
        config,
        processes: Arc::new(process::ProcessManager::default()),
        watchers: watch::Watchers::default(),
    });
    let services = Arc::new(rpc::Services::new(state.clone()));
    let connect = proto::process::ProcessExt::register(services.clone(), connectrpc::Router::new());
    let connect = proto::filesystem::FilesystemExt::register(services, connect);
    axum::Router::new()
        .route("/health", get(health))
        .route("/envs", get(envs))
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
        .with_state(state)
}

/// Serves the agent on a Unix socket until the listener fails.
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    config: AgentConfig,
) -> std::io::Result<()> {
    axum::serve(listener, router(config)).await
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
