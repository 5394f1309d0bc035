//! Sandbar's HTTP surface on one listener: E2B's REST API, and the edge that forwards agent
//! and user-port traffic to sandboxes.
//!
//! Handlers only parse and validate; every decision is a typed call into `sandbar-core`, and
//! [`error::ApiError`] is the one place where domain errors become HTTP statuses.

mod activity;
mod dto;
mod edge;
mod error;
mod extract;
mod keys;
mod sandboxes;
mod telemetry;
mod templates;
mod traffic;
mod volumes;

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, patch, post, put};
use sandbar_core::{Auth, Builds, RateLimits, Sandboxes, Templates};

pub use edge::EdgeConfig;

/// Everything handlers need, cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    pub auth: Auth,
    pub sandboxes: Arc<Sandboxes>,
    pub templates: Templates,
    pub builds: Builds,
    pub rate_limits: Arc<RateLimits>,
    pub edge: Arc<EdgeConfig>,
}

/// The complete application: edge routing in front of the REST API.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/health", get(health))
        .route(
            "/sandboxes",
            get(sandboxes::list_v1).post(sandboxes::create_v1),
        )
        .route(
            "/v2/sandboxes",
            get(sandboxes::list_v2).post(sandboxes::create_v2),
        )
        .route(
            "/sandboxes/{sandbox_id}",
            get(sandboxes::detail).delete(sandboxes::kill),
        )
        .route(
            "/sandboxes/{sandbox_id}/timeout",
            post(sandboxes::set_timeout),
        )
        .route(
            "/sandboxes/{sandbox_id}/refreshes",
            post(sandboxes::refresh),
        )
        .route(
            "/sandboxes/{sandbox_id}/connect",
            post(sandboxes::connect_v1),
        )
        .route(
            "/v2/sandboxes/{sandbox_id}/connect",
            post(sandboxes::connect_v2),
        )
        .route(
            "/sandboxes/{sandbox_id}/network",
            put(sandboxes::update_network),
        )
        .route("/sandboxes/{sandbox_id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{sandbox_id}/metrics", get(sandboxes::metrics))
        .route("/sandboxes/metrics", get(sandboxes::batch_metrics))
        .route("/sandboxes/{sandbox_id}/resume", post(sandboxes::resume))
        .route(
            "/templates",
            get(templates::list).post(templates::create_from_dockerfile),
        )
        .route("/templates/aliases/{alias}", get(templates::alias))
        .route("/v3/templates", post(templates::request_build))
        .route(
            "/templates/tags",
            post(templates::assign_tags).delete(templates::delete_tags),
        )
        .route("/templates/{template_id}/tags", get(templates::tags))
        .route("/v2/templates", post(templates::request_build))
        .route(
            "/templates/{template_id}",
            get(templates::detail)
                .post(templates::rebuild_from_dockerfile)
                .delete(templates::delete)
                .patch(templates::update),
        )
        .route("/v2/templates/{template_id}", patch(templates::update))
        .route(
            "/templates/{template_id}/files/{hash}",
            get(templates::file_link),
        )
        .route(
            "/upload/templates/{template_id}/files/{hash}",
            put(templates::upload),
        )
        .route(
            "/templates/{template_id}/builds/{build_id}",
            post(templates::start_dockerfile_build),
        )
        .route(
            "/v2/templates/{template_id}/builds/{build_id}",
            post(templates::start_build),
        )
        .route(
            "/templates/{template_id}/builds/{build_id}/status",
            get(templates::build_status),
        )
        .route(
            "/templates/{template_id}/builds/{build_id}/logs",
            get(templates::build_logs),
        )
        .merge(keys::routes())
        .merge(volumes::routes())
        .merge(activity::routes())
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::method_not_allowed);
    let telemetry = Arc::new(telemetry::Telemetry::new(state.sandboxes.clone()));
    let operator = Router::new()
        .route("/metrics", get(telemetry::metrics))
        .with_state(telemetry.clone());
    // Route layers run after routing, so `observe` sees the matched route template; it is
    // outermost so that it also counts what the edge answers.
    api.merge(operator)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            edge::route_to_sandbox,
        ))
        .layer(axum::middleware::from_fn_with_state(
            telemetry,
            telemetry::observe,
        ))
        .with_state(state)
}

async fn health() -> axum::http::StatusCode {
    axum::http::StatusCode::NO_CONTENT
}
