//! `sandbar-bench control-plane`: how many creates per second one API host and one database
//! can place, with nodes that are never the bottleneck.
//!
//! Everything but the sandboxes is real and in this process: an API host and N nodes, each
//! the server's own router on a loopback port, sharing one store (SQLite, or the PostgreSQL
//! given), with the cluster's secret, leases, placement and forwarding. Each node's runtime
//! answers a launch at once instead of booting a sandbox: this double exists for this
//! benchmark only. A create is `POST /sandboxes` over HTTP to the API host, which places it
//! and forwards it to a node, which records it and answers; the numbers are the control
//! plane's ceiling, the rate at which more nodes stop helping.

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{TimeDelta, Utc};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sandbar_api::cluster::ClusterRouting;
use sandbar_api::{AppState, ClusterRole, EdgeConfig, router};
use sandbar_core::auth::TeamLimits;
use sandbar_core::builds::{UploadBody, UploadError};
use sandbar_core::cluster::NoLocalNode;
use sandbar_core::runtime::{Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_core::{
    Auth, BuildFailure, BuildJob, BuildLog, BuildStatus, Builder, Builds, BuildsConfig,
    NodeDirectory, NodeRecord, NodeReport, RateLimits, Runtime, Sandboxes, SandboxesConfig, Store,
    Template, TemplateImage, Templates,
};

use crate::stats::summarize;

const KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";
const SECRET: &str = "benchmark-cluster-secret-0123456789abcdef";
const TEMPLATE: &str = "base000000000000000a";

#[derive(clap::Args, Debug)]
pub struct ControlPlaneArgs {
    /// Node counts to measure, one run each (comma-separated); 0 is a single server, API and
    /// node in one, with no cluster.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4])]
    nodes: Vec<usize>,
    /// Creates per run. Sandboxes are never killed: each run adds to those already recorded,
    /// so a run's rate is also its rate next to the earlier runs' sandboxes.
    #[arg(long, default_value_t = 2000)]
    creates: usize,
    /// Creates in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// A PostgreSQL URL for the shared store, of an empty database [default: a new SQLite
    /// file].
    #[arg(long)]
    database_url: Option<String>,
}

/// A node runtime whose sandboxes exist only as records: launches answer at once.
#[derive(Debug, Default)]
struct InstantRuntime;

#[async_trait::async_trait]
impl Runtime for InstantRuntime {
    async fn launch(&self, _: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        Ok((
            RuntimeHandle::unstarted(0),
            Endpoint {
                agent_socket: "/nonexistent/agent.sock".into(),
                address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            },
        ))
    }
    async fn destroy(&self, _: &str, _: &RuntimeHandle) -> Result<(), RuntimeError> {
        Ok(())
    }
    fn is_alive(&self, _: &str, _: &RuntimeHandle) -> bool {
        true
    }
    async fn sweep(&self, _: &[String]) -> Result<usize, RuntimeError> {
        Ok(0)
    }
    async fn adopt(&self, _: &str, _: &RuntimeHandle) -> Result<Option<Endpoint>, RuntimeError> {
        Ok(None)
    }
}

/// Builds are not part of this benchmark.
struct NoBuilds;

#[async_trait::async_trait]
impl Builder for NoBuilds {
    async fn build(&self, job: BuildJob, _: BuildLog) -> Result<TemplateImage, BuildFailure> {
        Err(BuildFailure {
            message: format!(
                "build {} refused: the benchmark builds nothing",
                job.build_id
            ),
            step: None,
        })
    }
    async fn has_upload(&self, _: &str, _: &str, _: &str) -> bool {
        false
    }
    async fn store_upload(
        &self,
        _: &str,
        _: &str,
        _: &str,
        _: UploadBody,
        _: u64,
    ) -> Result<(), UploadError> {
        Ok(())
    }
    async fn collect_garbage(&self, _: &[String]) {}
}

fn state(
    store: &Arc<Store>,
    runtime: Arc<dyn Runtime>,
    node_id: &str,
    directory: &Arc<NodeDirectory>,
    cluster: Option<ClusterRole>,
) -> AppState {
    let templates = Templates::new(store.clone());
    let mut sandboxes = Sandboxes::new(
        store.clone(),
        runtime,
        templates.clone(),
        SandboxesConfig {
            node_id: node_id.into(),
            ..SandboxesConfig::default()
        },
    );
    if cluster.is_some() {
        sandboxes = sandboxes.with_cluster(directory.clone());
    }
    let builds = Builds::new(
        store.clone(),
        Arc::new(NoBuilds),
        BuildsConfig {
            default_cpu_count: 2,
            default_memory_mb: 512,
            disk_size_mb: 1024,
            max_cpu_count: 8,
            max_memory_mb: 8192,
            max_upload_bytes: 1 << 20,
            upload_link_ttl: Duration::from_secs(60),
            concurrent_builds: 1,
            builds_per_team: 1,
            step_timeout: Duration::from_secs(3600),
            envd_version: "0.5.7",
        },
        templates.build_finished(),
    );
    AppState {
        auth: Auth::new(store.clone()),
        sandboxes: Arc::new(sandboxes),
        builds,
        templates,
        rate_limits: Arc::new(RateLimits::default()),
        edge: Arc::new(EdgeConfig {
            domain: "sandbar.localhost".into(),
        }),
        cluster,
    }
}

fn base_template() -> Template {
    Template {
        aliases: vec!["base".into()],
        public: true,
        build_id: "b".into(),
        build_status: BuildStatus::Ready,
        envd_version: "0.5.7".into(),
        image: Some(TemplateImage::of_layers(vec!["base/v1".into()])),
        build_count: 1,
        ..Template::unbuilt(TEMPLATE.into(), 2, 512, 2048, Utc::now())
    }
}

async fn serve(app: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// One run's cluster: the API host's URL, and the nodes' leases kept fresh until dropped.
struct Cluster {
    api_url: String,
    _renewer: tokio::task::JoinHandle<()>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self._renewer.abort();
    }
}

/// A single server, API and node in one (no cluster).
async fn single_host(store: &Arc<Store>) -> anyhow::Result<Cluster> {
    let directory = Arc::new(NodeDirectory::new(store.clone()));
    let app = router(state(store, Arc::new(InstantRuntime), "", &directory, None));
    Ok(Cluster {
        api_url: serve(app).await?,
        _renewer: tokio::spawn(async {}),
    })
}

async fn cluster(store: &Arc<Store>, nodes: usize) -> anyhow::Result<Cluster> {
    if nodes == 0 {
        return single_host(store).await;
    }
    let directory = Arc::new(NodeDirectory::new(store.clone()));
    let secret: Arc<str> = Arc::from(SECRET);
    let run = sandbar_core::ids::new_uuid();
    let mut records = Vec::new();
    for n in 0..nodes {
        let id = format!("bench-{}-n{n}", &run[..8]);
        let app = router(state(
            store,
            Arc::new(InstantRuntime),
            &id,
            &directory,
            Some(ClusterRole::Node {
                secret: secret.clone(),
            }),
        ));
        let url = serve(app).await?;
        records.push((id, url));
    }
    let api = router(state(
        store,
        Arc::new(NoLocalNode),
        "",
        &directory,
        Some(ClusterRole::Api(Arc::new(ClusterRouting::new(
            directory.clone(),
            store.clone(),
            secret,
        )))),
    ));
    let api_url = serve(api).await?;
    let renew = {
        let store = store.clone();
        let directory = directory.clone();
        move || {
            let store = store.clone();
            let directory = directory.clone();
            let records = records.clone();
            async move {
                let now = Utc::now();
                for (id, url) in &records {
                    let record = NodeRecord {
                        id: id.clone(),
                        url: url.clone(),
                        started_at: now,
                        lease_until: now + TimeDelta::seconds(30),
                        report: NodeReport {
                            memory_total_bytes: 1 << 46,
                            memory_available_bytes: 1 << 46,
                            templates: vec![TEMPLATE.to_owned()],
                            ..NodeReport::default()
                        },
                    };
                    if let Err(e) = store.nodes.renew_node(&record).await {
                        eprintln!("warning: lease of {id} not renewed: {e}");
                    }
                }
                let _ = directory.refresh().await;
            }
        }
    };
    renew().await;
    let renewer = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            renew().await;
        }
    });
    Ok(Cluster {
        api_url,
        _renewer: renewer,
    })
}

/// Runs `creates` creates against the API host, `concurrency` at once; their latencies.
async fn hammer(
    api_url: &str,
    creates: usize,
    concurrency: usize,
) -> anyhow::Result<Vec<Duration>> {
    let client: Client<_, Full<bytes::Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let left = Arc::new(AtomicUsize::new(creates));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let left = left.clone();
        let url = format!("{api_url}/sandboxes");
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                let request = http::Request::post(&url)
                    .header("x-api-key", KEY)
                    .header("content-type", "application/json")
                    .body(Full::from(
                        r#"{"templateID":"base","timeout":3600}"#.as_bytes().to_vec(),
                    ))?;
                let started = Instant::now();
                let response = client.request(request).await?;
                let status = response.status();
                let body = response.into_body().collect().await?.to_bytes();
                latencies.push(started.elapsed());
                if status != http::StatusCode::CREATED {
                    anyhow::bail!(
                        "create answered {status}: {}",
                        String::from_utf8_lossy(&body)
                    );
                }
            }
            anyhow::Ok(latencies)
        }));
    }
    let mut all = Vec::with_capacity(creates);
    for worker in workers {
        all.extend(worker.await.context("a client task panicked")??);
    }
    Ok(all)
}

async fn open_store(
    args: &ControlPlaneArgs,
    dir: &tempfile::TempDir,
) -> anyhow::Result<Arc<Store>> {
    Ok(match &args.database_url {
        Some(url) => Arc::new(sandbar_store::PgStore::connect(url).await?),
        None => Arc::new(sandbar_store::SqliteStore::open(&dir.path().join("sandbar.db")).await?),
    })
}

async fn run(args: &ControlPlaneArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = open_store(args, &dir).await?;
    Auth::new(store.clone())
        .bootstrap(Some(KEY), TeamLimits::new(1_000_000, 24 * 3600, 0))
        .await?;
    // An empty database is expected: the key and the template are made here.
    Templates::new(store.clone())
        .register(&base_template())
        .await?;
    let database = if args.database_url.is_some() {
        "PostgreSQL"
    } else {
        "SQLite"
    };
    println!(
        "| nodes | creates | in flight | creates/s | p50 ms | p99 ms | store |\n|--:|--:|--:|--:|--:|--:|---|"
    );
    for &nodes in &args.nodes {
        let cluster = cluster(&store, nodes).await?;
        // Warms the connections and the directory; not counted.
        hammer(&cluster.api_url, args.concurrency, args.concurrency).await?;
        let started = Instant::now();
        let latencies = hammer(&cluster.api_url, args.creates, args.concurrency).await?;
        let elapsed = started.elapsed();
        let summary = summarize(&latencies).context("no creates were timed")?;
        println!(
            "| {nodes} | {} | {} | {:.0} | {:.1} | {:.1} | {database} |",
            args.creates,
            args.concurrency,
            args.creates as f64 / elapsed.as_secs_f64(),
            summary.p50,
            summary.p99,
        );
    }
    Ok(())
}

pub async fn main(args: ControlPlaneArgs) -> ExitCode {
    if args.nodes.is_empty() || args.creates == 0 || args.concurrency == 0 {
        eprintln!("error: --nodes needs a count, --creates and --concurrency at least 1");
        return ExitCode::FAILURE;
    }
    // The store's statements and their times, with RUST_LOG=sqlx=debug.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
