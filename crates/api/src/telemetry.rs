//! Operators' view of the server: Prometheus metrics on `GET /metrics`.
//!
//! One explicit registry per router (no process globals, so tests can build many). Request
//! metrics are labelled by the matched route template, never by the raw path, so sandbox and
//! template ids cannot blow up the number of series.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use sandbar_core::Sandboxes;
use tracing::Instrument;

use crate::error::ApiError;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    method: String,
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// `data` (the data directory's filesystem) or `pool` (the sandbox disk pool).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DiskLabels {
    disk: &'static str,
}

/// What `/metrics` says of each disk.
#[derive(Default)]
struct DiskGauges {
    size: Family<DiskLabels, Gauge>,
    free: Family<DiskLabels, Gauge>,
    reserve: Family<DiskLabels, Gauge>,
    read_only: Family<DiskLabels, Gauge>,
    promised: Gauge,
    promise_limit: Gauge,
}

impl DiskGauges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "disk_size_bytes",
            "Size of the data disk and of the sandbox disk pool",
            self.size.clone(),
        );
        registry.register(
            "disk_free_bytes",
            "Free space of the data disk and of the sandbox disk pool",
            self.free.clone(),
        );
        registry.register(
            "disk_reserve_bytes",
            "Space kept free: below it the data disk refuses writes (507) and the pool refuses \
             new sandboxes (503)",
            self.reserve.clone(),
        );
        registry.register(
            "disk_read_only",
            "1 while the disk is read-only (for the pool: its filesystem failed)",
            self.read_only.clone(),
        );
        registry.register(
            "disk_pool_promised_bytes",
            "Disk sizes of all sandboxes on the pool together",
            self.promised.clone(),
        );
        registry.register(
            "disk_pool_promise_limit_bytes",
            "How far the disk sizes of all sandboxes may add up (the pool's overcommit limit)",
            self.promise_limit.clone(),
        );
    }

    fn set(&self, report: &sandbar_core::DiskReport) {
        let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
        for (disk, space) in [("data", &report.data), ("pool", &report.pool)] {
            let Some(space) = space else { continue };
            let labels = DiskLabels { disk };
            self.size
                .get_or_create(&labels)
                .set(gauge(space.size_bytes));
            self.free
                .get_or_create(&labels)
                .set(gauge(space.free_bytes));
            self.reserve
                .get_or_create(&labels)
                .set(gauge(space.reserve_bytes));
            self.read_only
                .get_or_create(&labels)
                .set(i64::from(space.read_only));
        }
        if report.pool.is_some() {
            self.promised.set(gauge(report.pool_promised_bytes));
            self.promise_limit
                .set(gauge(report.pool_promise_limit_bytes));
        }
    }
}

/// What `/metrics` says of the host's memory and the sandboxes' share of it.
#[derive(Default)]
struct MemoryGauges {
    total: Gauge,
    available: Gauge,
    promised: Gauge,
    promise_limit: Gauge,
    overcommit: Gauge,
    stalled: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl MemoryGauges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "memory_total_bytes",
            "The host's memory",
            self.total.clone(),
        );
        registry.register(
            "memory_available_bytes",
            "Memory the host can give without swapping (MemAvailable); a sandbox starts only \
             while the reserve and a start's cost are available",
            self.available.clone(),
        );
        registry.register(
            "memory_promised_bytes",
            "Memory limits (memoryMB) of running sandboxes together; what they use is far less",
            self.promised.clone(),
        );
        registry.register(
            "memory_promise_limit_bytes",
            "How far the memory limits of running sandboxes may add up",
            self.promise_limit.clone(),
        );
        registry.register(
            "memory_overcommit_ratio",
            "How many times the host's memory (less the reserve) the limits may add up to",
            self.overcommit.clone(),
        );
        registry.register(
            "memory_pressure_full_avg10_percent",
            "Share of the last 10 s in which every task waited for memory (PSI); new \
             sandboxes are refused above the configured limit",
            self.stalled.clone(),
        );
    }

    fn set(&self, report: &sandbar_core::MemoryReport) {
        let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
        self.total.set(gauge(report.total_bytes));
        self.available.set(gauge(report.available_bytes));
        self.promised.set(gauge(report.promised_bytes));
        self.promise_limit.set(gauge(report.promise_limit_bytes));
        self.overcommit.set(i64::from(report.overcommit));
        if let Some(stalled) = report.stalled_percent {
            self.stalled.set(stalled);
        }
    }
}

/// What `/metrics` says of sandboxes' disk I/O: each one's rates, and what all did.
#[derive(Default)]
struct DiskIoGauges {
    limits: Family<DirectionLabels, Gauge>,
    op_limits: Family<DirectionLabels, Gauge>,
    bytes: Family<DirectionLabels, Gauge>,
    ops: Family<DirectionLabels, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

impl DiskIoGauges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "sandbox_disk_limit_bytes_per_second",
            "What each sandbox may read or write per second on the disks under the data \
             directory; 0 for no limit",
            self.limits.clone(),
        );
        registry.register(
            "sandbox_disk_limit_ops_per_second",
            "Read or write operations each sandbox may make per second; 0 for no limit",
            self.op_limits.clone(),
        );
        registry.register(
            "sandbox_disk_bytes",
            "Bytes the sandboxes running now have read or written since they started",
            self.bytes.clone(),
        );
        registry.register(
            "sandbox_disk_ops",
            "Read or write operations of the sandboxes running now since they started",
            self.ops.clone(),
        );
    }

    fn set(&self, report: &sandbar_core::DiskIoReport) {
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        for (direction, limit, op_limit, bytes, ops) in [
            (
                "read",
                report.read_bytes_limit,
                report.read_ops_limit,
                report.read_bytes,
                report.read_ops,
            ),
            (
                "write",
                report.write_bytes_limit,
                report.write_ops_limit,
                report.write_bytes,
                report.write_ops,
            ),
        ] {
            let labels = DirectionLabels { direction };
            self.limits.get_or_create(&labels).set(gauge(limit));
            self.op_limits.get_or_create(&labels).set(gauge(op_limit));
            self.bytes.get_or_create(&labels).set(gauge(bytes));
            self.ops.get_or_create(&labels).set(gauge(ops));
        }
    }
}

#[derive(Default)]
struct WarmPoolGauges {
    target: Gauge,
    waiting: Gauge,
    taken: Counter,
    missed: Counter,
}

impl WarmPoolGauges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "warm_sandboxes_target",
            "Sandboxes the node keeps booted ahead of demand for the image creates last asked for",
            self.target.clone(),
        );
        registry.register(
            "warm_sandboxes",
            "Sandboxes booted ahead of demand and waiting for a create",
            self.waiting.clone(),
        );
        registry.register(
            "warm_sandbox_takes",
            "Creates served by a sandbox booted ahead of demand",
            self.taken.clone(),
        );
        registry.register(
            "warm_sandbox_misses",
            "Creates a sandbox booted ahead of demand could have served but that found none",
            self.missed.clone(),
        );
    }

    /// Called under the scrape lock: counters only grow, by what happened since the last.
    fn set(&self, report: &sandbar_core::WarmPoolReport) {
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.target.set(gauge(report.target));
        self.waiting.set(gauge(report.waiting));
        for (counter, total) in [(&self.taken, report.taken), (&self.missed, report.missed)] {
            let counted = counter.get();
            if total > counted {
                counter.inc_by(total - counted);
            }
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EdgeLabels {
    target: &'static str,
    status: u16,
}

/// Set on responses the edge produced, so they are counted as sandbox traffic and not as
/// API requests.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EdgeResponse {
    pub to_agent: bool,
}

pub(crate) struct Telemetry {
    registry: Registry,
    sandboxes: Arc<Sandboxes>,
    requests: Family<RequestLabels, Counter>,
    durations: Family<RouteLabels, Histogram>,
    creates: Histogram,
    edge: Family<EdgeLabels, Counter>,
    by_state: Family<StateLabels, Gauge>,
    oom_kills: Counter,
    disks: DiskGauges,
    memory: MemoryGauges,
    warm: WarmPoolGauges,
    disk_io: DiskIoGauges,
    /// Two scrapes at once must not both add the same kills or takes.
    oom_sync: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry").finish_non_exhaustive()
    }
}

/// 0.5 ms to ~16 s: a hot create or resume is a few milliseconds, a build poll or a slow
/// upload many seconds.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0005, 2.0, 16)
}

/// Creates whose route answers this are the ones the create histogram describes.
fn is_sandbox_create(method: &Method, route: &str) -> bool {
    method == Method::POST && matches!(route, "/sandboxes" | "/v2/sandboxes")
}

impl Telemetry {
    pub(crate) fn new(sandboxes: Arc<Sandboxes>) -> Self {
        let mut registry = Registry::with_prefix("sandbar");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "API requests answered, by method, route template and status",
            requests.clone(),
        );
        let durations = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "http_request_duration_seconds",
            "Time from request to response headers, by method and route template",
            durations.clone(),
        );
        let creates = Histogram::new(latency_buckets());
        registry.register(
            "sandbox_create_duration_seconds",
            "Time to create a sandbox whose agent answers (successful creates only)",
            creates.clone(),
        );
        let edge = Family::<EdgeLabels, Counter>::default();
        registry.register(
            "edge_requests",
            "Requests forwarded to sandboxes, by target (agent or a user port) and status; \
             502 means the sandbox or its agent did not answer",
            edge.clone(),
        );
        let by_state = Family::<StateLabels, Gauge>::default();
        registry.register(
            "sandboxes",
            "Sandboxes on this server by state",
            by_state.clone(),
        );
        let oom_kills = Counter::default();
        registry.register(
            "sandbox_oom_kills",
            "Processes the kernel killed because their sandbox reached its memory limit, in \
             sandboxes alive or ended since the server started",
            oom_kills.clone(),
        );
        let disks = DiskGauges::default();
        disks.register(&mut registry);
        let memory = MemoryGauges::default();
        memory.register(&mut registry);
        let warm = WarmPoolGauges::default();
        warm.register(&mut registry);
        let disk_io = DiskIoGauges::default();
        disk_io.register(&mut registry);
        Self {
            registry,
            sandboxes,
            requests,
            durations,
            creates,
            edge,
            by_state,
            oom_kills,
            disks,
            memory,
            warm,
            disk_io,
            oom_sync: std::sync::Mutex::new(()),
        }
    }

    fn record(&self, method: &Method, route: &str, status: StatusCode, started: Instant) {
        let elapsed = started.elapsed().as_secs_f64();
        self.requests
            .get_or_create(&RequestLabels {
                method: method.as_str().to_owned(),
                route: route.to_owned(),
                status: status.as_u16(),
            })
            .inc();
        self.durations
            .get_or_create(&RouteLabels {
                method: method.as_str().to_owned(),
                route: route.to_owned(),
            })
            .observe(elapsed);
        if status == StatusCode::CREATED && is_sandbox_create(method, route) {
            self.creates.observe(elapsed);
        }
    }

    fn render(&self) -> Result<String, std::fmt::Error> {
        for (status, count) in self.sandboxes.health().count_by_status() {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            self.by_state
                .get_or_create(&StateLabels {
                    state: status.name(),
                })
                .set(count);
        }
        // The runtime's count only grows; a scrape adds what happened since the last.
        {
            let _one_at_a_time = self.oom_sync.lock().unwrap_or_else(|e| e.into_inner());
            let kills = self.sandboxes.health().oom_kills();
            let counted = self.oom_kills.get();
            if kills > counted {
                self.oom_kills.inc_by(kills - counted);
            }
            if let Some(warm) = self.sandboxes.health().warm_pool() {
                self.warm.set(&warm);
            }
        }
        self.disks.set(&self.sandboxes.health().disks());
        if let Some(memory) = self.sandboxes.health().memory() {
            self.memory.set(&memory);
        }
        if let Some(io) = self.sandboxes.health().disk_io() {
            self.disk_io.set(&io);
        }
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Counts every response: edge traffic by target, everything else by its route template
/// (`unmatched` for paths no route knows).
pub(crate) async fn observe(
    State(telemetry): State<Arc<Telemetry>>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    // Whatever a handler logs carries the request it serves.
    let span = tracing::info_span!(
        "request",
        method = %method,
        route = route.as_deref().unwrap_or("unmatched")
    );
    let response = next.run(request).instrument(span).await;
    match response.extensions().get::<EdgeResponse>() {
        Some(edge) => {
            telemetry
                .edge
                .get_or_create(&EdgeLabels {
                    target: if edge.to_agent { "agent" } else { "port" },
                    status: response.status().as_u16(),
                })
                .inc();
        }
        None => telemetry.record(
            &method,
            route.as_deref().unwrap_or("unmatched"),
            response.status(),
            started,
        ),
    }
    response
}

/// `GET /metrics` in Prometheus' text format.
/// What `GET /metrics` answers from: the registry, and the token a scrape must send.
#[derive(Debug)]
pub(crate) struct Scrapes {
    pub(crate) telemetry: Arc<Telemetry>,
    pub(crate) token: Option<Arc<str>>,
}

impl Scrapes {
    /// Whether `headers` carry `Authorization: Bearer <token>` (compared in constant time),
    /// or no token is asked.
    fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, given) = v.split_once(' ')?;
                scheme
                    .eq_ignore_ascii_case("bearer")
                    .then_some(given.trim())
            })
            .is_some_and(|given| sandbar_envd::secrets_equal(given, token))
    }
}

/// `GET /metrics` where it is served: to a scrape with the token, if one is asked.
pub(crate) async fn metrics(State(scrapes): State<Arc<Scrapes>>, headers: HeaderMap) -> Response {
    if !scrapes.admits(&headers) {
        let mut refused = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "/metrics needs the operator's metrics token as 'Authorization: Bearer <token>'",
        )
        .into_response();
        refused.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static("Bearer realm=\"metrics\""),
        );
        return refused;
    }
    match scrapes.telemetry.render() {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}"),
        )
        .into_response(),
    }
}

/// `GET /metrics` on the main listener when it is not served there: without a token, or
/// with a listener of its own.
pub(crate) async fn metrics_elsewhere() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "/metrics is not served on this listener: the operator serves it with --metrics-token, or on --metrics-listen",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sandbox_creates_feed_the_create_histogram() {
        assert!(is_sandbox_create(&Method::POST, "/v2/sandboxes"));
        assert!(is_sandbox_create(&Method::POST, "/sandboxes"));
        assert!(!is_sandbox_create(&Method::GET, "/v2/sandboxes"));
        assert!(!is_sandbox_create(
            &Method::POST,
            "/sandboxes/{sandboxID}/pause"
        ));
    }
}
