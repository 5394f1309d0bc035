//! Sandbar's HTTP surface on one listener: E2B's REST API, and the edge that forwards agent
//! and user-port traffic to sandboxes.
//!
//! Handlers only parse and validate; every decision is a typed call into `sandbar-core`, and
//! [`error::ApiError`] is the one place where domain errors become HTTP statuses.

mod activity;
mod body_stream;
pub mod cluster;
mod disk_guard;
mod dto;
mod edge;
mod error;
mod events;
mod extract;
mod keys;
mod openapi;
mod sandboxes;
mod snapshots;
mod stream_end;
mod telemetry;
mod templates;
mod traffic;
mod upgrade;
mod volumes;
mod webhook_transport;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use sandbar_core::{Auth, Builds, RateLimits, Sandboxes, Templates};
use utoipa::OpenApi;
use utoipa::openapi::path::HttpMethod;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use edge::EdgeConfig;
use openapi::{OtherVersion, RouteOtherVersion};
pub use webhook_transport::HttpWebhookTransport;

/// Everything handlers need, cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    pub auth: Auth,
    pub sandboxes: Arc<Sandboxes>,
    pub templates: Templates,
    pub builds: Builds,
    pub rate_limits: Arc<RateLimits>,
    pub edge: Arc<EdgeConfig>,
    /// Where this host plays a part in a cluster; `None` on a single host.
    pub cluster: Option<ClusterRole>,
}

/// A host's part in a cluster.
#[derive(Clone, Debug)]
pub enum ClusterRole {
    /// Serves the API and forwards sandbox work to the nodes.
    Api(Arc<cluster::ClusterRouting>),
    /// Runs sandboxes and answers only requests that carry the cluster's secret.
    Node { secret: Arc<str> },
}

/// The REST API with its description: every route here is registered from its handler's
/// `#[utoipa::path]`, or as another version of a route that is, so the router and
/// `/openapi.json` cannot disagree.
fn rest_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(health))
        .routes(routes!(openapi::serve))
        .routes(routes!(sandboxes::list_v1))
        .routes(routes!(sandboxes::list_v2, sandboxes::create_v2))
        .other_version(
            sandboxes::create_v1,
            OtherVersion {
                method: HttpMethod::Post,
                documented_at: "/v2/sandboxes",
                path: "/sandboxes",
                operation_id: "postSandboxes",
                summary: Some(
                    "The 429 of a full team carries `Retry-After` with when its next sandbox ends.",
                ),
            },
        )
        .routes(routes!(sandboxes::detail, sandboxes::kill))
        .routes(routes!(sandboxes::set_timeout))
        .routes(routes!(sandboxes::refresh))
        .routes(routes!(sandboxes::connect_v1))
        .routes(routes!(sandboxes::connect_v2))
        .routes(routes!(sandboxes::update_network))
        .routes(routes!(sandboxes::pause))
        .routes(routes!(sandboxes::metrics))
        .routes(routes!(sandboxes::batch_metrics))
        .routes(routes!(sandboxes::resume))
        .routes(routes!(snapshots::create))
        .routes(routes!(snapshots::list))
        .routes(routes!(snapshots::fork))
        .routes(routes!(templates::list, templates::create_from_dockerfile))
        .routes(routes!(templates::alias))
        .routes(routes!(templates::request_build))
        .other_version(
            templates::request_build,
            OtherVersion {
                method: HttpMethod::Post,
                documented_at: "/v3/templates",
                path: "/v2/templates",
                operation_id: "postV2Templates",
                summary: Some("`POST /v2/templates`: as v3, with the template named by `alias`."),
            },
        )
        .routes(routes!(templates::assign_tags, templates::delete_tags))
        .routes(routes!(templates::tags))
        .routes(routes!(
            templates::detail,
            templates::rebuild_from_dockerfile,
            templates::delete,
            templates::update
        ))
        .other_version(
            templates::update,
            OtherVersion {
                method: HttpMethod::Patch,
                documented_at: "/templates/{templateID}",
                path: "/v2/templates/{templateID}",
                operation_id: "patchV2Template",
                summary: None,
            },
        )
        .routes(routes!(templates::file_link))
        .routes(routes!(templates::upload))
        .routes(routes!(
            templates::start_dockerfile_build,
            templates::cancel_build
        ))
        .routes(routes!(templates::start_build))
        .routes(routes!(templates::build_status))
        .routes(routes!(templates::build_logs))
        .merge(keys::routes())
        .merge(volumes::routes())
        .merge(activity::routes())
        .merge(events::routes())
        .merge(webhooks::routes())
}

/// The OpenAPI document of the REST API, as `GET /openapi.json` serves it.
pub fn openapi() -> utoipa::openapi::OpenApi {
    rest_routes().into_openapi()
}

/// Who may read the Prometheus metrics (`GET /metrics`), and on which listener. They tell
/// anyone who reads them how busy the server is and how it fails, so by default nobody does:
/// the operator gives a token, a listener of their own, or both.
#[derive(Clone, Debug, Default)]
pub struct MetricsAccess {
    /// A scrape must send `Authorization: Bearer <token>`.
    pub token: Option<Arc<str>>,
    /// Served by [`Routers::metrics`] on a listener of its own, not on the main one.
    pub own_listener: bool,
}

/// What a server's listeners serve.
#[derive(Debug)]
pub struct Routers {
    /// The main listener: the API and the edge, and `/metrics` when it has a token and no
    /// listener of its own.
    pub main: Router,
    /// The metrics listener, when [`MetricsAccess::own_listener`].
    pub metrics: Option<Router>,
}

/// The complete application, with `/metrics` off: see [`routers`].
pub fn router(state: AppState) -> Router {
    routers(state, &MetricsAccess::default()).main
}

/// The complete application (edge routing in front of the REST API), and the metrics
/// listener's router if `metrics` asks for one.
pub fn routers(state: AppState, metrics: &MetricsAccess) -> Routers {
    let (api, _) = rest_routes().split_for_parts();
    let api = api
        .merge(volumes::content_routes())
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            disk_guard::refuse_writes_without_room,
        ))
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::method_not_allowed)
        // Around the fallbacks too: a 404 or 405 is an answer given before the body is read.
        .layer(axum::middleware::from_fn(extract::read_small_bodies_first));
    let telemetry = Arc::new(telemetry::Telemetry::new(state.sandboxes.clone()));
    let scrapes = Arc::new(telemetry::Scrapes {
        telemetry: telemetry.clone(),
        token: metrics.token.clone(),
    });
    let operator = match (&metrics.token, metrics.own_listener) {
        (Some(_), false) => Router::new()
            .route("/metrics", get(telemetry::metrics))
            .with_state(scrapes.clone()),
        _ => Router::new().route("/metrics", get(telemetry::metrics_elsewhere)),
    };
    let metrics_router = metrics.own_listener.then(|| {
        Router::new()
            .route("/metrics", get(telemetry::metrics))
            .fallback(error::no_route)
            .with_state(scrapes)
    });
    // Route layers run after routing, so `observe` sees the matched route template; it is
    // outermost so that it also counts what the edge answers.
    // The dashboard sits behind the edge like the API: a request addressed to a sandbox
    // (by header or Host) goes to the sandbox whatever its path.
    let dashboard = sandbar_dashboard::Dashboard::new(
        state.auth.clone(),
        state.sandboxes.clone(),
        state.templates.clone(),
        state.builds.clone(),
    );
    let app = api
        .merge(operator)
        .nest_service("/dashboard", dashboard.clone().router())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            edge::route_to_sandbox,
        ));
    let app = match &state.cluster {
        None => app,
        Some(ClusterRole::Api(_)) => app.layer(axum::middleware::from_fn_with_state(
            (state.clone(), dashboard),
            cluster::forward_to_nodes,
        )),
        Some(ClusterRole::Node { secret }) => app.layer(axum::middleware::from_fn_with_state(
            secret.clone(),
            cluster::require_node_secret,
        )),
    };
    let main = app
        .layer(axum::middleware::from_fn_with_state(
            telemetry,
            telemetry::observe,
        ))
        .with_state(state);
    Routers {
        main,
        metrics: metrics_router,
    }
}

/// Liveness of the server, and what ails it: 204 when all is well; 200 with the problems
/// named (a disk short of space or read-only, paused sandboxes kept in memory because their
/// checkpoint was refused) while it serves with some work refused. With `detail=true`, always
/// 200 with the report, the sandbox disk pool's size and what it holds included.
#[utoipa::path(
    get,
    path = "/health",
    tag = "service",
    operation_id = "getHealth",
    security(()),
    params(HealthQuery),
    responses(
        (status = 204, description = "The server is up and nothing ails it"),
        (status = 200, description = "The server is up, with problems that refuse some work, or the report asked for with `detail=true`", body = HealthReport),
    )
)]
async fn health(
    axum::extract::State(state): axum::extract::State<AppState>,
    query: Result<axum::extract::Query<HealthQuery>, axum::extract::rejection::QueryRejection>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let detail = query.is_ok_and(|q| q.detail);
    let problems = state.sandboxes.health().health_problems();
    if problems.is_empty() && !detail {
        return axum::http::StatusCode::NO_CONTENT.into_response();
    }
    let disk_pool = if detail {
        DiskPoolReport::of(&state.sandboxes.health().disks())
    } else {
        None
    };
    axum::Json(HealthReport {
        status: if problems.is_empty() {
            "ok"
        } else {
            "degraded"
        },
        problems,
        disk_pool,
    })
    .into_response()
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
struct HealthQuery {
    /// Answer 200 with the whole report, also when all is well.
    #[serde(default)]
    detail: bool,
}

/// What `/health` says when something ails the server, or when asked for detail.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct HealthReport {
    /// `degraded` when some work is refused, otherwise `ok`.
    status: &'static str,
    /// One sentence per problem, naming the disk or the sandboxes and what is refused.
    problems: Vec<String>,
    /// The sandbox disk pool, with `detail=true` on a node that has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    disk_pool: Option<DiskPoolReport>,
}

/// The sandbox disk pool's size and what it holds, in MiB.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct DiskPoolReport {
    #[serde(rename = "sizeMB")]
    size_mb: u64,
    #[serde(rename = "freeMB")]
    free_mb: u64,
    #[serde(rename = "reserveMB")]
    reserve_mb: u64,
    /// Quotas of the sandbox disks on the pool, together.
    #[serde(rename = "promisedMB")]
    promised_mb: u64,
    /// How far those quotas may add up (`--disk-overcommit` times the pool less its reserve).
    #[serde(rename = "promiseLimitMB")]
    promise_limit_mb: u64,
    /// Disk of a sandbox of the default template.
    #[serde(rename = "defaultDiskMB")]
    default_disk_mb: u64,
    /// Sandboxes of the default disk the pool holds each filled to its quota.
    holds_filled: u64,
    /// Sandboxes of the default disk admitted while their disks are mostly empty.
    holds_admitted: u64,
}

impl DiskPoolReport {
    fn of(report: &sandbar_core::DiskReport) -> Option<Self> {
        let (pool, holds) = (report.pool.as_ref()?, report.pool_holds?);
        Some(Self {
            size_mb: pool.size_bytes >> 20,
            free_mb: pool.free_bytes >> 20,
            reserve_mb: pool.reserve_bytes >> 20,
            promised_mb: report.pool_promised_bytes >> 20,
            promise_limit_mb: report.pool_promise_limit_bytes >> 20,
            default_disk_mb: holds.default_disk_bytes >> 20,
            holds_filled: holds.filled,
            holds_admitted: holds.admitted,
        })
    }
}
