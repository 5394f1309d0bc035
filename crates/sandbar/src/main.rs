//! `sandbar serve`: the REST API, the edge and a node in one process.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use axum::serve::ListenerExt;
use chrono::Utc;
use clap::{Parser, Subcommand};
use sandbar_api::{AppState, EdgeConfig};
use sandbar_core::auth::TeamLimits;
use sandbar_core::{
    Auth, BuildStatus, Builds, BuildsConfig, DEFAULT_TEMPLATE_ALIAS, Sandboxes, SandboxesConfig,
    Template, TemplateImage, Templates,
};
use sandbar_node::{LinuxRuntime, NodeConfig};
mod admin;
mod cluster;
mod database;
mod https;
mod session;

#[derive(Parser, Debug)]
#[command(
    name = "sandbar",
    version,
    about = "Self-hosted sandboxes behind E2B's API"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the API, the edge and a sandbox node on this host.
    Serve(Box<ServeArgs>),
    /// Manage teams and their limits (works while the server runs).
    #[command(subcommand)]
    Team(admin::TeamCommand),
    /// Manage a team's API keys (works while the server runs).
    #[command(subcommand)]
    Key(admin::KeyCommand),
    /// Make a local CA and a wildcard certificate for a domain, for trials of HTTPS
    /// (--tls-listen) where no public CA vouches for the domain.
    Cert(https::CertArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Address for API and agent traffic alike.
    #[arg(long, env = "SANDBAR_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Database, credentials, templates and sandbox layers live here.
    #[arg(long, env = "SANDBAR_DATA_DIR", default_value = "/var/lib/sandbar")]
    data_dir: PathBuf,
    #[command(flatten)]
    database: database::DatabaseArgs,
    #[command(flatten)]
    cluster: cluster::ClusterArgs,
    #[command(flatten)]
    tls: https::TlsArgs,
    /// Domain for Host-based routing: `{port}-{sandboxID}.{domain}`.
    #[arg(long, env = "SANDBAR_DOMAIN", default_value = "sandbar.localhost")]
    domain: String,
    /// The in-sandbox agent; defaults to `sandbar-agent` next to this executable.
    #[arg(long, env = "SANDBAR_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// The code interpreter server baked into the built-in `code-interpreter-v1` template;
    /// defaults to `sandbar-interpreter` next to this executable. Without it that template is
    /// not offered.
    #[arg(long, env = "SANDBAR_INTERPRETER_BIN")]
    interpreter_bin: Option<PathBuf>,
    /// Do not offer the built-in `desktop` template (E2B's Desktop SDKs' default), whose root
    /// takes about 1.1 GB of disk and a few minutes to build on first start.
    #[arg(long, env = "SANDBAR_WITHOUT_DESKTOP")]
    without_desktop: bool,
    /// Private IPv4 range sandboxes are numbered from, one /30 each.
    #[arg(long, env = "SANDBAR_NETWORK", default_value = "10.213.0.0/16")]
    network: String,
    /// Name servers written into sandboxes' /etc/resolv.conf.
    #[arg(
        long = "nameserver",
        env = "SANDBAR_NAMESERVERS",
        value_delimiter = ','
    )]
    nameservers: Vec<String>,
    /// Debian mirror the default template is built from.
    #[arg(
        long,
        env = "SANDBAR_DEBIAN_MIRROR",
        default_value = "http://deb.debian.org/debian"
    )]
    debian_mirror: String,
    /// Concurrent sandboxes allowed to the default team created on first start.
    #[arg(long, env = "SANDBAR_MAX_SANDBOXES", default_value_t = 100)]
    max_sandboxes: u32,
    /// Longest sandbox lifetime, in seconds, for the default team created on first start.
    #[arg(long, env = "SANDBAR_MAX_TIMEOUT", default_value_t = 86_400)]
    max_timeout: u64,
    /// API requests per minute for the default team created on first start; 0 for no limit.
    #[arg(long, env = "SANDBAR_RATE_LIMIT", default_value_t = 6000)]
    rate_limit: u32,
    /// Cap on processes and threads in each sandbox.
    #[arg(long, env = "SANDBAR_PIDS_MAX", default_value_t = 1024)]
    pids_max: u32,
    /// Disk size, in MiB, of sandboxes of the default template 'base' (their writable layer,
    /// data and inodes alike).
    #[arg(long, env = "SANDBAR_BASE_DISK_MB", default_value_t = 2048, value_parser = clap::value_parser!(u32).range(64..))]
    base_disk_mb: u32,
    /// Registries (host or host:port) pulled from over plain HTTP besides localhost and
    /// 127.0.0.1, which always are. Naming one also allows it as --allow-registry does.
    #[arg(
        long = "plain-http-registry",
        env = "SANDBAR_PLAIN_HTTP_REGISTRIES",
        value_delimiter = ','
    )]
    plain_http_registries: Vec<String>,
    /// Registries (HOST for every port, or HOST:PORT) that image pulls may contact although
    /// they resolve to an address pulls never reach otherwise: loopback, link-local,
    /// unspecified, multicast or broadcast addresses, this host's own addresses, and the
    /// sandbox network.
    #[arg(
        long = "allow-registry",
        env = "SANDBAR_ALLOW_REGISTRY",
        value_delimiter = ','
    )]
    allow_registry: Vec<sandbar_image::AllowedRegistry>,
    /// Serves the Prometheus metrics (`GET /metrics`) to scrapes that send
    /// `Authorization: Bearer <token>`. Without it and without --metrics-listen, /metrics is
    /// not served. Prefer the environment variable: arguments show in the process list.
    #[arg(long, env = "SANDBAR_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// Serves /metrics on this address only (say a private or loopback one), not on --listen;
    /// with --metrics-token, scrapes there need the token too.
    #[arg(long, env = "SANDBAR_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Largest build-context upload accepted, in MiB.
    #[arg(long, env = "SANDBAR_MAX_UPLOAD_MB", default_value_t = 1024)]
    max_upload_mb: u64,
    /// Build-context uploads one team may keep at once, in GiB all together.
    #[arg(long, env = "SANDBAR_MAX_UPLOAD_GB_PER_TEAM", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_upload_gb_per_team: u64,
    /// Build-context uploads one team may keep at once.
    #[arg(long, env = "SANDBAR_MAX_UPLOADS_PER_TEAM", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_uploads_per_team: u64,
    /// Seconds an upload is kept once nothing wrote it or read it for a build; a build's
    /// uploads also go when it ends, unless another build still needs them.
    #[arg(long, env = "SANDBAR_UPLOAD_TTL_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    upload_ttl_secs: u64,
    /// Requests to the volume content API (`/volumecontent/…`) one team may make per minute,
    /// over all its volumes; 0 for no limit.
    #[arg(long, env = "SANDBAR_VOLUME_REQUESTS_PER_MINUTE", default_value_t = sandbar_core::volumes::DEFAULT_CONTENT_REQUESTS_PER_MINUTE)]
    volume_requests_per_minute: u32,
    /// Size, in GiB, of the unpacked registry image layers kept (on the disk pool) for all
    /// templates; layers nothing uses are evicted least recently used first, and a pull that
    /// finds no room fails.
    #[arg(long, env = "SANDBAR_IMAGE_CACHE_GB", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    image_cache_gb: u64,
    /// Private IPv4 ranges (CIDR) that sandboxes with internet access may reach; all private,
    /// shared, link-local and metadata destinations are refused otherwise.
    #[arg(
        long = "allow-private",
        env = "SANDBAR_ALLOW_PRIVATE",
        value_delimiter = ','
    )]
    allow_private: Vec<String>,
    /// Memory, in MiB, kept for the host and the server: a new sandbox is refused (503) when
    /// less than this (plus 64 MiB for its start) is available.
    #[arg(long, env = "SANDBAR_MEMORY_RESERVE_MB", default_value_t = 1024)]
    memory_reserve_mb: u64,
    /// Memory, in MiB, all sandboxes together may use: the limit of the cgroup they all live
    /// in, so that memory pressure stays among their processes (the kernel reclaims, then
    /// kills inside sandboxes) and new sandboxes are refused while it lasts. Default: the
    /// host's memory less --memory-reserve-mb.
    #[arg(long, env = "SANDBAR_SANDBOX_MEMORY_LIMIT_MB", value_parser = clap::value_parser!(u64).range(256..))]
    sandbox_memory_limit_mb: Option<u64>,
    /// How many times the host's memory (less the reserve) the memory limits (memoryMB) of
    /// all running sandboxes may add up to. Limits are ceilings, not reservations: an idle
    /// sandbox uses about 1 MiB, what is really free decides each start, and pressure stays
    /// inside the sandboxes' own cgroup. 50 lets a 24 GiB host run about 2,200 sandboxes of
    /// 512 MiB.
    #[arg(long, env = "SANDBAR_MEMORY_OVERCOMMIT", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
    memory_overcommit: u32,
    /// Memory pressure at which new sandboxes are refused: the share of the last 10 s, in
    /// percent, in which every task waited for memory (PSI `full avg10`).
    #[arg(long, env = "SANDBAR_MEMORY_PRESSURE_LIMIT", default_value_t = 10.0)]
    memory_pressure_limit: f64,
    /// Days a sandbox's logs stay readable after it ended, and team metrics are kept.
    #[arg(long, env = "SANDBAR_LOG_RETENTION_DAYS", default_value_t = 7, value_parser = clap::value_parser!(u64).range(1..=3650))]
    log_retention_days: u64,
    /// Log lines kept per sandbox; the oldest are dropped first.
    #[arg(long, env = "SANDBAR_LOG_LINES_PER_SANDBOX", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..))]
    log_lines_per_sandbox: u64,
    /// Cap on pseudo-terminals open at once in each sandbox.
    #[arg(long, env = "SANDBAR_PTY_MAX", default_value_t = 256)]
    pty_max: u32,
    /// Network namespaces kept wired ahead of demand, so a new sandbox's network costs no
    /// time when it starts; 0 makes each one as its sandbox starts.
    #[arg(long, env = "SANDBAR_NETNS_POOL", default_value_t = 4, value_parser = clap::value_parser!(u64).range(0..=256))]
    netns_pool: u64,
    /// Sandboxes kept booted ahead of demand for the image creates last asked for (the
    /// default template, usually): a create that finds one takes it instead of booting. Each
    /// waiting sandbox holds a network slot and about a MiB of memory. The pool grows past
    /// this for images whose creates come in larger bursts (see --warm-pool-max) and shrinks
    /// back when they stop; 0 boots every sandbox when it is created.
    #[arg(long, env = "SANDBAR_WARM_POOL", default_value_t = 16, value_parser = clap::value_parser!(u64).range(0..=1024))]
    warm_pool: u64,
    /// The most sandboxes the warm pool keeps, all images together, when creates come in
    /// bursts: each image asked for in the last minute keeps its busiest second of creates
    /// and a quarter more.
    #[arg(long, env = "SANDBAR_WARM_POOL_MAX", default_value_t = 64, value_parser = clap::value_parser!(u64).range(0..=4096))]
    warm_pool_max: u64,
    /// Size, in MiB, at which a sandbox's agent log on the host is rotated: each sandbox keeps
    /// at most twice this on the host (the current file and the one before it).
    #[arg(long, env = "SANDBAR_AGENT_LOG_ROTATE_MB", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    agent_log_rotate_mb: u64,
    /// Seconds a template's ready command may take to succeed after its start command
    /// started (at the build and, where templates cannot be captured, at each create).
    #[arg(long, env = "SANDBAR_READY_TIMEOUT_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    ready_timeout_secs: u64,
    /// Template builds of teams that run at once on this host, all teams together (the
    /// server's own builds of its built-in templates aside); further builds wait
    /// for a slot. Default: max(2, min(CPU cores / 4, memory GiB / 4)).
    #[arg(long, env = "SANDBAR_CONCURRENT_BUILDS", value_parser = clap::value_parser!(u64).range(1..=1024))]
    concurrent_builds: Option<u64>,
    /// Template builds of one team that run at once; its further builds wait for them, and
    /// teams with waiting builds take turns for free slots.
    #[arg(long, env = "SANDBAR_BUILDS_PER_TEAM", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    builds_per_team: u64,
    /// Seconds one RUN step of a template build may take; past them the step's sandbox is
    /// removed and the build fails saying so.
    #[arg(long, env = "SANDBAR_BUILD_STEP_TIMEOUT_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=7 * 24 * 3600))]
    build_step_timeout_secs: u64,
    /// Bandwidth of each sandbox's network in each direction, in Mbit/s (every packet counted
    /// as at least 1500 bytes, which also bounds packets per second); 0 for no limit. Sandboxes
    /// adopted after a restart keep the limit they started with.
    #[arg(long, env = "SANDBAR_SANDBOX_BANDWIDTH_MBIT", default_value_t = 100)]
    sandbox_bandwidth_mbit: u32,
    /// What each sandbox may read from the disks under the data directory (its disk, layers
    /// and volumes), in MiB/s; 0 for no limit. Direct I/O and the writes an fsync flushes are
    /// held to the write rates; on cgroup v1 the kernel's background writeback is not.
    #[arg(long, env = "SANDBAR_SANDBOX_DISK_READ_MBPS", default_value_t = 200)]
    sandbox_disk_read_mbps: u64,
    /// What each sandbox may write to those disks, in MiB/s; 0 for no limit.
    #[arg(long, env = "SANDBAR_SANDBOX_DISK_WRITE_MBPS", default_value_t = 100)]
    sandbox_disk_write_mbps: u64,
    /// Read operations per second each sandbox may make on those disks; 0 for no limit.
    #[arg(long, env = "SANDBAR_SANDBOX_DISK_READ_IOPS", default_value_t = 4000)]
    sandbox_disk_read_iops: u64,
    /// Write operations per second each sandbox may make on those disks; 0 for no limit.
    #[arg(long, env = "SANDBAR_SANDBOX_DISK_WRITE_IOPS", default_value_t = 2000)]
    sandbox_disk_write_iops: u64,
    /// The CRIU binary that checkpoints paused sandboxes to disk (4.1.1 with the patches of
    /// scripts/criu, installed by scripts/install-criu.sh); "" turns checkpoints off. When it
    /// is missing or fails its checks, pauses keep sandboxes frozen in memory until it passes
    /// them: the node looks again (at most every --criu-reprobe-secs) when a checkpoint,
    /// snapshot or fork needs it.
    #[arg(long, env = "SANDBAR_CRIU", default_value = "/usr/local/sbin/criu")]
    criu: String,
    /// Seconds between two probes of a CRIU that failed its probe (see --criu).
    #[arg(long, env = "SANDBAR_CRIU_REPROBE_SECS", default_value_t = 30)]
    criu_reprobe_secs: u64,
    /// Seconds a sandbox paused with its memory stays frozen in memory (a resume within them
    /// takes milliseconds) before it is checkpointed to disk and its memory freed.
    #[arg(long, env = "SANDBAR_PAUSE_GRACE_SECS", default_value_t = 10)]
    pause_grace_secs: u64,
    /// Seconds between the attempts to deliver an event to a webhook that failed (3 retries).
    #[arg(long, env = "SANDBAR_WEBHOOK_RETRY_SECS", default_value_t = 10)]
    webhook_retry_secs: u64,
    /// Let webhooks deliver to loopback and private addresses (a receiver on this host or
    /// its network); by default only public addresses are reached.
    #[arg(long, env = "SANDBAR_WEBHOOK_ALLOW_PRIVATE", default_value_t = false)]
    webhook_allow_private: bool,
    /// Enforce each sandbox's diskSizeMB (inodes included) with a btrfs pool in
    /// `<data-dir>/sandboxes.img`; without it, sandbox disks are unbounded.
    #[arg(long, env = "SANDBAR_DISK_QUOTAS", default_value_t = true, action = clap::ArgAction::Set)]
    disk_quotas: bool,
    /// Size of the disk pool image in GiB, allocated in full so the host filesystem filling
    /// up cannot starve it. Default, when it is first made: a quarter of the free space of
    /// the data directory's filesystem, at most 64 GiB. A larger value grows an existing
    /// pool in place, its sandboxes running; a pool is never shrunk. The server refuses to
    /// start with a pool that cannot hold one sandbox of --base-disk-mb beside the reserve.
    #[arg(long, env = "SANDBAR_DISK_POOL_GB")]
    disk_pool_gb: Option<u64>,
    /// Space, in MiB, of the disk pool no new sandbox may count on: a sandbox is admitted
    /// only if it could fill its whole disk and leave this much free for its neighbours.
    #[arg(long, env = "SANDBAR_DISK_POOL_RESERVE_MB", default_value_t = 512)]
    disk_pool_reserve_mb: u64,
    /// How many times the disk pool (less its reserve) the disk sizes of all sandboxes may
    /// add up to; real use is what admits a sandbox, this bounds the promises. 250 lets 1,000
    /// sandboxes of 2 GiB share an 8.5 GiB pool (an idle one writes a few hundred KiB).
    #[arg(long, env = "SANDBAR_DISK_OVERCOMMIT", default_value_t = 250, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    disk_overcommit: u32,
    /// Space, in MiB, kept free on the data directory's filesystem (database, checkpoints,
    /// uploads, volumes, logs): below it, requests that would write there answer 507 and
    /// paused sandboxes stay in memory instead of being checkpointed.
    #[arg(long, env = "SANDBAR_DATA_DISK_RESERVE_MB", default_value_t = 1024)]
    data_disk_reserve_mb: u64,
    /// First host uid/gid of sandbox id ranges: each sandbox maps its ids 0-65535 to a range
    /// of its own from here on, so no host user may own ids in
    /// [id-base, id-base + 65536 * sandbox slots).
    #[arg(long, env = "SANDBAR_ID_BASE", default_value_t = 1 << 30)]
    id_base: u32,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_)) {
        // Before any thread starts: it may fork.
        session::serve_outside_session_leadership()?;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // One JSON object per line for log collectors; the human format otherwise.
    if std::env::var("SANDBAR_LOG_FORMAT").is_ok_and(|f| f == "json") {
        tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Team(command) => admin::team(command).await,
        Command::Key(command) => admin::key(command).await,
        Command::Cert(args) => https::cert(&args),
    }
}

fn parse_network(cidr: &str) -> anyhow::Result<(Ipv4Addr, u8)> {
    let (addr, len) = cidr
        .split_once('/')
        .with_context(|| format!("network '{cidr}' must look like 10.213.0.0/16"))?;
    let addr: Ipv4Addr = addr
        .parse()
        .with_context(|| format!("bad address in '{cidr}'"))?;
    let len: u8 = len
        .parse()
        .with_context(|| format!("bad prefix length in '{cidr}'"))?;
    if !(8..=28).contains(&len) || !addr.is_private() {
        bail!("network '{cidr}' must be a private range between /8 and /28");
    }
    Ok((addr, len))
}

/// Name servers of the host that a sandbox can reach (not loopback ones).
fn host_nameservers() -> Vec<String> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .map(|s| s.trim().to_owned())
        // The resolver runs on the host, so a loopback resolver (systemd-resolved) works too.
        .filter(|s| s.parse::<std::net::IpAddr>().is_ok())
        .collect()
}

fn write_credentials(path: &Path, credentials: &sandbar_core::Credentials) -> anyhow::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    file.write_all(serde_json::to_string_pretty(credentials)?.as_bytes())?;
    Ok(())
}

/// The lock one server per host holds.
const HOST_LOCK: &str = "/run/sandbar/server.lock";

/// Takes the host's server lock at `path`, which the kernel releases when this process ends
/// by any means, and writes this server's pid into it for whoever finds it taken.
fn lock_host(path: &Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    if let Err(e) = rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim();
        anyhow::bail!(
            "another sandbar server{} runs on this host ({} is locked: {e}); stop it first: \
             two servers would share sandbox cgroup and firewall names",
            if holder.is_empty() {
                String::new()
            } else {
                format!(" (pid {holder})")
            },
            path.display()
        );
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    Ok(file)
}

/// The key volume tokens are derived from, made on first start and kept with the database:
/// with another key, the tokens handed out would no longer match the hashes in the store.
fn volume_token_key(data_dir: &Path) -> anyhow::Result<[u8; 32]> {
    use std::io::{Read, Write};
    let path = data_dir.join("volume-token.key");
    let mut key = [0u8; 32];
    match std::fs::File::open(&path) {
        Ok(mut file) => {
            file.read_exact(&mut key)
                .with_context(|| format!("cannot read {}", path.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::File::open("/dev/urandom")
                .and_then(|mut r| r.read_exact(&mut key))
                .context("cannot read /dev/urandom")?;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("cannot create {}", path.display()))?;
            file.write_all(&key)?;
            file.sync_all()?;
        }
        Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
    }
    Ok(key)
}

/// What registering the built-in templates needs.
struct Builtins<'a> {
    templates: &'a Templates,
    builds: &'a Builds,
    store: &'a sandbar_core::Store,
    layers: &'a sandbar_node::storage::layers::LayerStore,
    disk_size_mb: u32,
    /// A node of a cluster: a built-in template another node built is not rebuilt here.
    in_cluster: bool,
}

/// Registers the default template and, unless it already has an image, builds it through the
/// build service like any template (the Debian root is cached on disk across data resets).
async fn ensure_base_template(b: &Builtins<'_>, envd_version: &str) -> anyhow::Result<()> {
    let Builtins {
        templates,
        builds,
        store,
        layers,
        disk_size_mb,
        in_cluster,
    } = *b;
    let existing = store
        .templates
        .template_by_name(None, DEFAULT_TEMPLATE_ALIAS)
        .await?;
    let template = builtin_template(
        existing,
        DEFAULT_TEMPLATE_ALIAS,
        512,
        disk_size_mb,
        envd_version,
    );
    // A record alone is not enough: a root removed by hand must be built again, or every
    // create would fail on the missing layer.
    if template.image.as_ref() == Some(&base_image()) && image_on_disk(&template, layers) {
        templates.register(&template).await?;
        tracing::info!(template_id = %template.id, "default template 'base' is cached");
        return Ok(());
    }
    if in_cluster && template.image.as_ref() == Some(&base_image()) {
        // Built by another node of the cluster: a rebuild here would mark the shared record
        // as building for all of them. Its layer is fetched from the layer store at the first
        // create here, if there is one; without, its sandboxes go to nodes that hold it.
        tracing::info!(template_id = %template.id, "default template 'base' is not on this node's disk yet");
        return Ok(());
    }
    templates.register(&template).await?;
    let build_id = builds
        .start_builtin(
            &template,
            sandbar_core::BuildSpec {
                source: sandbar_core::BuildSource::Builtin {
                    layer: sandbar_node::build::templates::BASE_LAYER.into(),
                },
                steps: Vec::new(),
                force: false,
                start_cmd: None,
                start_user: None,
                ready_cmd: None,
            },
            None,
        )
        .await?;
    tracing::info!(template_id = %template.id, %build_id, "building the default template 'base'");
    Ok(())
}

/// Publishes the layers of every ready template this node holds that the layer store lacks:
/// templates built before the store was configured, or whose publication was interrupted.
async fn publish_templates_on_disk(
    store: Arc<sandbar_core::Store>,
    shared: Arc<sandbar_node::cluster::shared_layers::SharedLayers>,
) {
    let templates = match store.templates.templates().await {
        Ok(templates) => templates,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list templates to publish their layers");
            return;
        }
    };
    for template in templates {
        if template.build_status != BuildStatus::Ready {
            continue;
        }
        let Some(image) = template.image else {
            continue;
        };
        if let Err(e) = shared.ensure_published_if_here(&image.parts()).await {
            tracing::warn!(template_id = %template.id, error = %e, "cannot publish the template's layers");
        }
    }
}

/// Whether every layer of `template`'s image is on this node's disk.
fn image_on_disk(template: &Template, layers: &sandbar_node::storage::layers::LayerStore) -> bool {
    template
        .image
        .as_ref()
        .is_some_and(|image| image.parts().iter().all(|layer| layers.exists(layer)))
}

/// A built-in template as it is registered at start: the recorded one, or a new public one
/// named `alias`, with the disk and agent version of this start.
fn builtin_template(
    existing: Option<Template>,
    alias: &str,
    memory_mb: u32,
    disk_size_mb: u32,
    envd_version: &str,
) -> Template {
    let now = Utc::now();
    let mut template = existing.unwrap_or_else(|| Template {
        aliases: vec![alias.into()],
        public: true,
        build_id: sandbar_core::ids::new_uuid(),
        ..Template::unbuilt(
            sandbar_core::ids::new_template_id(),
            2,
            memory_mb,
            disk_size_mb,
            now,
        )
    });
    template.envd_version = envd_version.into();
    template.disk_size_mb = disk_size_mb;
    template.memory_mb = memory_mb;
    template.updated_at = now;
    template
}

/// A built-in template the server builds from a recipe of its own and captures once started:
/// the code interpreter and the desktop.
struct CapturedBuiltin {
    alias: &'static str,
    /// A ceiling, so an idle sandbox costs no more than it uses.
    memory_mb: u32,
    spec: sandbar_core::BuildSpec,
}

/// The captured built-in templates this server offers, their files staged for their builds;
/// staged files of earlier recipes are removed. The interpreter is left out, with the reason
/// logged, when its server binary cannot be read; the desktop when `without_desktop`.
fn captured_builtins(
    data_dir: &Path,
    interpreter_bin: &Path,
    without_desktop: bool,
) -> Vec<CapturedBuiltin> {
    use sandbar_node::build::{builtin_files, desktop, interpreter};
    let uploads = data_dir.join("uploads");
    let mut recipes = vec![(
        sandbar_core::INTERPRETER_TEMPLATE_ALIAS,
        interpreter::stage_files(&uploads, interpreter_bin),
        interpreter::build_spec as fn(&str) -> sandbar_core::BuildSpec,
    )];
    if !without_desktop {
        recipes.push((
            sandbar_core::DESKTOP_TEMPLATE_ALIAS,
            desktop::stage_files(&uploads),
            desktop::build_spec,
        ));
    }
    let mut staged = Vec::new();
    let mut offered = Vec::new();
    for (alias, files, spec) in recipes {
        match files {
            Ok(files_hash) => {
                offered.push(CapturedBuiltin {
                    alias,
                    // The interpreter's Python, two Node.js kernels, R and a JVM reach about
                    // 1 GiB; an idle desktop takes about 100 MiB and a browser the rest.
                    memory_mb: 2048,
                    spec: spec(&files_hash),
                });
                staged.push(files_hash);
            }
            Err(e) => tracing::warn!(error = %e, "the built-in template '{alias}' is not offered"),
        }
    }
    let staged: Vec<&str> = staged.iter().map(String::as_str).collect();
    builtin_files::remove_all_but(&uploads, &staged);
    offered
}

/// Makes sure each captured built-in template (the interpreter's, the desktop's) is offered;
/// one that cannot be is left out with a warning, and the server starts without it.
async fn offer_captured_builtins(
    builtins: &Builtins<'_>,
    data_dir: &Path,
    interpreter_bin: PathBuf,
    without_desktop: bool,
) -> anyhow::Result<()> {
    let captured = tokio::task::spawn_blocking({
        let data_dir = data_dir.to_owned();
        move || captured_builtins(&data_dir, &interpreter_bin, without_desktop)
    })
    .await?;
    for builtin in captured {
        let alias = builtin.alias;
        if let Err(e) = ensure_captured_template(builtins, builtin).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "the built-in template '{alias}' is not offered"
            );
        }
    }
    Ok(())
}

/// Registers a captured built-in template and builds it in the background unless its last
/// good build followed the same recipe with the same files.
async fn ensure_captured_template(
    b: &Builtins<'_>,
    builtin: CapturedBuiltin,
) -> anyhow::Result<()> {
    let Builtins {
        templates,
        builds,
        store,
        layers,
        disk_size_mb,
        in_cluster,
    } = *b;
    let CapturedBuiltin {
        alias,
        memory_mb,
        spec,
    } = builtin;
    let existing = store.templates.template_by_name(None, alias).await?;
    let template = builtin_template(
        existing,
        alias,
        memory_mb,
        disk_size_mb,
        sandbar_jail::ENVD_VERSION,
    );
    let last = store.builds.build(&template.build_id).await?;
    let built =
        last.is_some_and(|b| b.status == BuildStatus::Ready && b.spec.as_ref() == Some(&spec));
    if in_cluster && built && !image_on_disk(&template, layers) {
        tracing::info!(template_id = %template.id, "built-in template '{alias}' is not on this node's disk yet");
        return Ok(());
    }
    let current = built && image_on_disk(&template, layers);
    templates.register(&template).await?;
    if current {
        tracing::info!(template_id = %template.id, "built-in template '{alias}' is cached");
        return Ok(());
    }
    let build_id = builds.start_builtin(&template, spec, None).await?;
    tracing::info!(template_id = %template.id, %build_id, "building the built-in template '{alias}' in the background");
    Ok(())
}

/// Removes the roots of earlier `base` recipes once nothing names them: templates built on
/// an old root, sandboxes running or paused on it and tagged builds keep it. Runs at start,
/// before anything is served, so no create can be resolving a template that names one.
async fn remove_superseded_bases(store: &sandbar_core::Store, templates_dir: &Path) {
    let keep: std::collections::BTreeSet<String> = match store.templates.layers_in_use().await {
        Ok(layers) => layers.into_iter().collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list layers in use; earlier built-in roots are kept");
            return;
        }
    };
    let dir = templates_dir.to_owned();
    let removed = tokio::task::spawn_blocking(move || {
        sandbar_node::build::templates::remove_superseded_bases(&dir, &keep)
    })
    .await;
    match removed {
        Ok(Ok(layers)) => {
            for layer in layers {
                tracing::info!(%layer, "removed the root of an earlier built-in recipe");
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot remove an earlier base root"),
        Err(e) => tracing::warn!(error = %e, "cannot remove earlier base roots"),
    }
}

/// The default template: one Debian layer, the `user` account, its home as working directory.
fn base_image() -> TemplateImage {
    TemplateImage::of_layers(vec![sandbar_node::build::templates::BASE_LAYER.into()])
}

/// The binary `name` beside the server's own, unless `given`.
fn sibling_binary(given: Option<&PathBuf>, name: &str) -> anyhow::Result<PathBuf> {
    match given {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("executable has no directory")?
            .join(name)),
    }
}

/// The records: PostgreSQL at `postgres_url`, else SQLite in the data directory.
async fn open_store(
    postgres_url: Option<&str>,
    data_dir: &Path,
) -> anyhow::Result<Arc<sandbar_core::Store>> {
    match postgres_url {
        Some(url) => {
            let store = database::connect_postgres(url).await?;
            tracing::info!(database = %sandbar_store::redacted_url(url), "records are kept in PostgreSQL");
            Ok(store)
        }
        None => database::open_sqlite(&data_dir.join("sandbar.db")).await,
    }
}

/// Shares the node's template layers through the cluster's layer store, where one is
/// configured: a collector of what nobody uses, the prefetch of what the cluster runs (on a
/// node of a cluster) and the publication of what this node holds.
fn share_layers(
    args: &ServeArgs,
    store: &Arc<sandbar_core::Store>,
    runtime: &Arc<LinuxRuntime>,
    node_id: Option<&str>,
) -> anyhow::Result<()> {
    let Some(blobs) = args.cluster.layer_store()? else {
        return Ok(());
    };
    let shared = Arc::new(sandbar_node::cluster::shared_layers::SharedLayers::new(
        blobs,
        store.layer_blobs.clone(),
        runtime.layers().layer_store().clone(),
        node_id.unwrap_or("local").to_owned(),
    ));
    shared.sweep_staging();
    tracing::info!(layer_store = %shared.location(), "template layers are shared through the layer store");
    runtime.layers().use_shared_layers(shared.clone());
    if args.cluster.layer_store_collect_secs > 0 {
        let every = std::time::Duration::from_secs(args.cluster.layer_store_collect_secs);
        let collector = sandbar_node::cluster::shared_collector::SharedCollector::new(
            shared.clone(),
            store.clone(),
            every,
        );
        tokio::spawn(collector.run(every));
    }
    if let Some(node_id) = node_id {
        // So that placement finds this node holding what the cluster runs, rather than
        // sending every create of a template to the nodes that made it.
        tokio::spawn(sandbar_node::cluster::prefetch::run(
            store.clone(),
            runtime.clone(),
            shared.clone(),
            node_id.to_owned(),
        ));
    }
    tokio::spawn(publish_templates_on_disk(store.clone(), shared));
    Ok(())
}

/// The node's builds: the builder and its queue, builds an earlier stop interrupted marked
/// failed, unused layers collected, and the sweeper of expired uploads.
async fn start_builds(
    args: &ServeArgs,
    store: &Arc<sandbar_core::Store>,
    runtime: &Arc<LinuxRuntime>,
    templates: &Templates,
    data_dir: &Path,
    node_id: Option<&str>,
    sandbox_network: ipnet::Ipv4Net,
) -> anyhow::Result<Builds> {
    let registry_policy = Arc::new(
        sandbar_image::RegistryPolicy::new(
            args.allow_registry.clone(),
            args.plain_http_registries.clone(),
            vec![sandbox_network.into()],
        )
        .context("bad --plain-http-registry")?,
    );
    let upload_ttl = std::time::Duration::from_secs(args.upload_ttl_secs);
    let builder = Arc::new(sandbar_node::NodeBuilder::new(
        runtime.clone(),
        data_dir,
        registry_policy.clone(),
        args.debian_mirror.clone(),
        sandbar_node::storage::uploads::UploadLimits {
            max_bytes_per_team: args.max_upload_gb_per_team << 30,
            max_count_per_team: usize::try_from(args.max_uploads_per_team).unwrap_or(usize::MAX),
            ttl: upload_ttl,
        },
        args.image_cache_gb << 30,
    ));
    let builds = Builds::new(
        store.clone(),
        builder,
        BuildsConfig {
            default_cpu_count: 2,
            default_memory_mb: 512,
            disk_size_mb: args.base_disk_mb,
            max_cpu_count: 8,
            max_memory_mb: 8192,
            max_upload_bytes: args.max_upload_mb << 20,
            upload_link_ttl: std::time::Duration::from_secs(3600),
            concurrent_builds: args
                .concurrent_builds
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or_else(|| {
                    sandbar_core::build_queue::default_concurrent_builds(
                        std::thread::available_parallelism().map_or(1, |n| n.get()),
                        sandbar_node::resources::memory::HostMemory::read()
                            .map_or(0, |m| m.total_mb),
                    )
                }),
            builds_per_team: usize::try_from(args.builds_per_team).unwrap_or(1),
            step_timeout: std::time::Duration::from_secs(args.build_step_timeout_secs),
            envd_version: sandbar_jail::ENVD_VERSION,
        },
        templates.build_finished(),
    )
    .with_registry_check(Arc::new(RegistryRule(registry_policy)));
    let builds = match node_id {
        Some(node_id) => builds.on_node(node_id.to_owned()),
        None => builds,
    };
    // In a cluster, builds of other nodes are under way in the same store: a node fails its
    // own unfinished builds and those of nodes that are gone; builds recorded before builds
    // named their node, only when no other node is live.
    let live: Vec<String> = match node_id {
        None => Vec::new(),
        Some(node_id) => store
            .nodes
            .nodes()
            .await?
            .into_iter()
            .filter(|n| n.id != node_id && n.is_live(Utc::now()))
            .map(|n| n.id)
            .collect(),
    };
    let interrupted = builds
        .recover(|node| match node {
            Some(node) => !live.iter().any(|n| n == node),
            None => live.is_empty(),
        })
        .await?;
    if interrupted > 0 {
        tracing::warn!(
            count = interrupted,
            "builds interrupted by the last stop were marked failed"
        );
    }
    builds.collect_garbage().await;
    remove_superseded_bases(store.as_ref(), &data_dir.join("templates")).await;
    // Often enough that an upload outlives its time to live by a quarter of it at most.
    let sweep_every = (upload_ttl / 4).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(60),
    );
    tokio::spawn(builds.clone().run_upload_sweeper(sweep_every));
    Ok(builds)
}

/// The node's sandboxes: volumes, the cluster's directory of nodes on a node of a cluster,
/// and the sandboxes an earlier server left adopted (or swept).
async fn start_sandboxes(
    args: &ServeArgs,
    store: &Arc<sandbar_core::Store>,
    runtime: &Arc<LinuxRuntime>,
    templates: &Templates,
    data_dir: &Path,
    node_id: Option<&str>,
) -> anyhow::Result<Arc<Sandboxes>> {
    let volume_host = sandbar_node::storage::volumes::HostVolumes::open(
        &sandbar_node::storage::volumes::volumes_root(data_dir),
    )
    .context("cannot prepare the volumes directory")?;
    let volumes = Arc::new(
        sandbar_core::Volumes::new(
            store.clone(),
            Arc::new(volume_host),
            volume_token_key(data_dir)?,
        )
        .with_content_rate(args.volume_requests_per_minute),
    );
    let mut sandboxes = Sandboxes::new(
        store.clone(),
        runtime.clone(),
        templates.clone(),
        SandboxesConfig {
            activity: sandbar_core::ActivityConfig {
                log_lines_per_sandbox: args.log_lines_per_sandbox,
                retention: std::time::Duration::from_secs(args.log_retention_days * 86_400),
            },
            pause_grace: std::time::Duration::from_secs(args.pause_grace_secs),
            node_id: node_id.unwrap_or_default().to_owned(),
            ..SandboxesConfig::default()
        },
    )
    .with_volumes(volumes);
    if node_id.is_some() {
        let nodes = Arc::new(sandbar_core::NodeDirectory::new(store.clone()));
        nodes.refresh().await?;
        tokio::spawn(
            nodes
                .clone()
                .run_refresher(std::time::Duration::from_secs(1)),
        );
        sandboxes = sandboxes.with_cluster(nodes);
    }
    sandboxes.deliver_events_to(sandbar_core::webhooks::Webhooks::new(
        store.clone(),
        Arc::new(sandbar_api::HttpWebhookTransport::new(
            args.webhook_allow_private,
        )),
        sandbar_core::webhooks::WebhookConfig {
            backoff: std::time::Duration::from_secs(args.webhook_retry_secs),
            ..Default::default()
        },
    ));
    let sandboxes = Arc::new(sandboxes);
    let adopted = sandboxes.recovery().recover().await?;
    if adopted > 0 {
        tracing::info!(count = adopted, "adopted running sandboxes");
    }
    Ok(sandboxes)
}

/// The node's configuration from the command line.
fn node_config(args: &ServeArgs, data_dir: &Path) -> anyhow::Result<NodeConfig> {
    let (network_base, network_prefix_len) = parse_network(&args.network)?;
    let nameservers = if args.nameservers.is_empty() {
        host_nameservers()
    } else {
        args.nameservers.clone()
    };
    Ok(NodeConfig {
        data_dir: data_dir.to_owned(),
        agent_bin: sibling_binary(args.agent_bin.as_ref(), "sandbar-agent")?,
        network_base,
        network_prefix_len,
        pids_max: args.pids_max,
        nameservers,
        allowed_private: args.allow_private.clone(),
        disk_quotas: args.disk_quotas,
        disk_pool_bytes: args.disk_pool_gb.map(|gb| gb << 30),
        default_disk_mb: args.base_disk_mb,
        disk_pool_reserve_bytes: args.disk_pool_reserve_mb << 20,
        disk_overcommit: args.disk_overcommit,
        data_reserve_bytes: args.data_disk_reserve_mb << 20,
        id_base: args.id_base,
        pty_max: args.pty_max,
        netns_pool: args.netns_pool as usize,
        warm_pool: args.warm_pool as usize,
        warm_pool_max: args.warm_pool_max as usize,
        agent_log_rotate_bytes: args.agent_log_rotate_mb << 20,
        ready_timeout: std::time::Duration::from_secs(args.ready_timeout_secs),
        sandbox_bandwidth_mbit: args.sandbox_bandwidth_mbit,
        sandbox_io: sandbar_node::resources::io::IoRates::from_flags(
            args.sandbox_disk_read_mbps,
            args.sandbox_disk_write_mbps,
            args.sandbox_disk_read_iops,
            args.sandbox_disk_write_iops,
        ),
        memory_reserve_mb: args.memory_reserve_mb,
        sandboxes_memory_limit_mb: args.sandbox_memory_limit_mb,
        memory_overcommit: args.memory_overcommit,
        memory_pressure_limit_percent: args.memory_pressure_limit,
        criu: Some(PathBuf::from(&args.criu)).filter(|p| !p.as_os_str().is_empty()),
        criu_reprobe: std::time::Duration::from_secs(args.criu_reprobe_secs),
    })
}

/// Makes the data directory private to the server's user (the store holds every sandbox's
/// envd access token; the database files are private too, in case the directory is ever
/// opened up) and says where the records are: PostgreSQL's URL, or `None` for SQLite there.
fn prepare_data_dir(args: &ServeArgs) -> anyhow::Result<Option<&str>> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data directory {}", args.data_dir.display()))?;
    std::fs::set_permissions(&args.data_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot restrict {}", args.data_dir.display()))?;
    let postgres_url = args.database.postgres_url()?;
    if postgres_url.is_none() {
        if args.cluster.role != cluster::Role::All {
            bail!("a cluster shares its records: --role api and node need --database-url");
        }
        restrict_database_files(&args.data_dir)?;
    }
    Ok(postgres_url)
}

/// What runs beside the requests: the reaper, and on a node of a cluster the sharing of
/// paused sandboxes' files and the renewal of the node's lease.
fn start_background_work(
    store: &Arc<sandbar_core::Store>,
    runtime: &Arc<LinuxRuntime>,
    sandboxes: &Arc<Sandboxes>,
    builds: &Builds,
    node_lease: Option<&sandbar_core::cluster::NodeLease>,
) {
    tokio::spawn(sandboxes.reaper().clone().run());
    if node_lease.is_some() && runtime.layers().shared_layers().is_some() {
        // So that a paused sandbox can be resumed on another node if this one is lost.
        tokio::spawn(sandboxes.recovery().clone().run_file_sharing());
    }
    if let Some(lease) = node_lease {
        // Renewed once before serving, so API hosts can place sandboxes here at once.
        tokio::spawn(sandbar_node::cluster::lease::renew_forever(
            store.clone(),
            lease.clone(),
            runtime.clone(),
            sandboxes.clone(),
            builds.clone(),
        ));
        tracing::info!(node_id = %lease.id, url = %lease.url, "serving as a node of a cluster");
    }
}

/// The lease a node of a cluster holds in the store, with the cluster's secret; `None` for
/// a server on its own.
fn node_lease(
    args: &ServeArgs,
) -> anyhow::Result<Option<(sandbar_core::cluster::NodeLease, Arc<str>)>> {
    Ok(match args.cluster.role {
        cluster::Role::Node => Some((
            sandbar_core::cluster::NodeLease {
                id: args.cluster.node_id()?,
                url: args
                    .cluster
                    .advertise_url
                    .clone()
                    .unwrap_or_else(|| format!("http://{}", args.listen)),
                started_at: Utc::now(),
            },
            args.cluster.secret()?,
        )),
        _ => None,
    })
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Before the long start (a template build may come first): a bad certificate is told at
    // once, and a SIGHUP meanwhile must not end the server.
    let https = args.tls.load()?;
    https::reload_on_hangup(https.as_ref().map(|h| h.certificate.clone()))?;
    let metrics = metrics_access(&args)?;
    if let Some(point) = sandbar_core::faults::check_armed().map_err(anyhow::Error::msg)? {
        tracing::warn!(point, "armed to abort at a crash point (a testing aid)");
    }
    if let Err(e) = sandbar_node::protect_server_from_oom_killer() {
        tracing::warn!(error = %e, "cannot protect the server from the OOM killer");
    }
    let postgres_url = prepare_data_dir(&args)?;
    if args.cluster.role == cluster::Role::Api {
        return serve_api(args, https).await;
    }
    check_asked_pool(&args)?;
    let node_lease = node_lease(&args)?;
    // Held until the server has stopped. Sandboxes' cgroups and firewall tables have the same
    // names whatever the data directory, so a second server on the host would sweep the
    // first one's sandboxes as unrecorded; on the same directory it would also mount the
    // same pool and unmount it under the first.
    let _host_lock = lock_host(Path::new(HOST_LOCK))?;
    warn_about_core_pipe();
    let data_dir = args
        .data_dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", args.data_dir.display()))?;
    let interpreter_bin = sibling_binary(args.interpreter_bin.as_ref(), "sandbar-interpreter")?;
    let store = open_store(postgres_url, &data_dir).await?;
    let shared_database = postgres_url.is_some();
    let auth = Auth::new(store.clone());
    bootstrap_first_team(&auth, &args, &data_dir).await?;
    let node_config = node_config(&args, &data_dir)?;
    let sandbox_network =
        ipnet::Ipv4Net::new(node_config.network_base, node_config.network_prefix_len)
            .with_context(|| format!("bad network '{}'", args.network))?;
    let runtime = Arc::new(LinuxRuntime::new(node_config).await?);
    let node_id = node_lease.as_ref().map(|(lease, _)| lease.id.clone());
    share_layers(&args, &store, &runtime, node_id.as_deref())?;

    let templates = Templates::new(store.clone());
    let builds = start_builds(
        &args,
        &store,
        &runtime,
        &templates,
        &data_dir,
        node_id.as_deref(),
        sandbox_network,
    )
    .await?;
    let builtins = Builtins {
        templates: &templates,
        builds: &builds,
        store: store.as_ref(),
        layers: runtime.layers().layer_store(),
        disk_size_mb: args.base_disk_mb,
        in_cluster: node_lease.is_some(),
    };
    ensure_base_template(&builtins, sandbar_jail::ENVD_VERSION).await?;

    let sandboxes = start_sandboxes(
        &args,
        &store,
        &runtime,
        &templates,
        &data_dir,
        node_id.as_deref(),
    )
    .await?;
    // After the sweep of unrecorded sandboxes, which would take their build sandboxes for
    // ones of its own.
    offer_captured_builtins(&builtins, &data_dir, interpreter_bin, args.without_desktop).await?;
    runtime.start_warm_pool();
    start_background_work(
        &store,
        &runtime,
        &sandboxes,
        &builds,
        node_lease.as_ref().map(|(lease, _)| lease),
    );

    let routers = sandbar_api::routers(
        AppState {
            auth,
            sandboxes,
            templates,
            builds: builds.clone(),
            rate_limits: rate_limits(shared_database, &store),
            edge: Arc::new(EdgeConfig {
                domain: args.domain,
            }),
            cluster: node_lease.map(|(_, secret)| sandbar_api::ClusterRole::Node { secret }),
        },
        &metrics,
    );
    let metrics_listener = args.metrics_listen.zip(routers.metrics);
    serve_until_stopped(
        Listeners {
            plain: args.listen,
            https,
            metrics: metrics_listener,
        },
        routers.main,
        "sandbar is serving",
    )
    .await?;
    builds.shutdown().await;
    runtime.release().await;
    tracing::info!("stopped; sandboxes keep running and are adopted at the next start");
    Ok(())
}

/// Refuses a disk pool size asked for that cannot hold one default sandbox and the reserve.
fn check_asked_pool(args: &ServeArgs) -> anyhow::Result<()> {
    if args.disk_quotas
        && let Some(gb) = args.disk_pool_gb
    {
        sandbar_node::storage::disks::check_asked_pool_size(
            &args.data_dir.join("sandboxes"),
            gb << 30,
            u64::from(args.base_disk_mb) << 20,
            args.disk_pool_reserve_mb << 20,
        )?;
    }
    Ok(())
}

/// The teams' request rates: held across every process that shares the database when it is
/// shared, else in this process.
fn rate_limits(
    shared_database: bool,
    store: &Arc<sandbar_core::Store>,
) -> Arc<sandbar_core::RateLimits> {
    if shared_database {
        sandbar_core::RateLimits::shared_through(store.request_counts.clone())
    } else {
        Arc::new(sandbar_core::RateLimits::default())
    }
}

/// An API host: no sandboxes, no builds, no host lock (several may share a machine).
async fn serve_api(args: ServeArgs, https: Option<https::Https>) -> anyhow::Result<()> {
    let metrics = metrics_access(&args)?;
    let url = args
        .database
        .postgres_url()?
        .context("--role api needs --database-url")?;
    let store = database::connect_postgres(url).await?;
    tracing::info!(database = %sandbar_store::redacted_url(url), "records are kept in PostgreSQL");
    let auth = Auth::new(store.clone());
    let data_dir = args
        .data_dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", args.data_dir.display()))?;
    bootstrap_first_team(&auth, &args, &data_dir).await?;
    let routers = cluster::api_router(cluster::ApiHost {
        store,
        auth,
        secret: args.cluster.secret()?,
        domain: args.domain,
        max_upload_bytes: args.max_upload_mb << 20,
        base_disk_mb: args.base_disk_mb,
        metrics,
    })
    .await?;
    serve_until_stopped(
        Listeners {
            plain: args.listen,
            https,
            metrics: args.metrics_listen.zip(routers.metrics),
        },
        routers.main,
        "sandbar is serving as an API host of a cluster",
    )
    .await
}

/// Who may read `/metrics`, from --metrics-token and --metrics-listen.
fn metrics_access(args: &ServeArgs) -> anyhow::Result<sandbar_api::MetricsAccess> {
    let token = match args.metrics_token.as_deref().map(str::trim) {
        Some("") => bail!("--metrics-token is empty; leave it out to serve no metrics"),
        Some(token) => Some(Arc::<str>::from(token)),
        None => None,
    };
    match (&token, args.metrics_listen) {
        (None, None) => tracing::info!(
            "/metrics is not served: give --metrics-token or --metrics-listen to serve it"
        ),
        (_, Some(address)) => {
            tracing::info!(%address, token = token.is_some(), "/metrics is served on its own listener")
        }
        (Some(_), None) => tracing::info!("/metrics is served to scrapes with the metrics token"),
    }
    Ok(sandbar_api::MetricsAccess {
        own_listener: args.metrics_listen.is_some(),
        token,
    })
}

/// Makes the first team and its key on an empty store and writes them to
/// `credentials.json` in the data directory; nothing once a team exists.
async fn bootstrap_first_team(
    auth: &Auth,
    args: &ServeArgs,
    data_dir: &Path,
) -> anyhow::Result<()> {
    let requested_key = std::env::var("SANDBAR_API_KEY")
        .ok()
        .filter(|k| !k.is_empty());
    let limits = TeamLimits::new(args.max_sandboxes, args.max_timeout, args.rate_limit);
    let credentials_path = data_dir.join("credentials.json");
    if let Some(credentials) = auth.bootstrap(requested_key.as_deref(), limits).await? {
        write_credentials(&credentials_path, &credentials)?;
        tracing::info!(path = %credentials_path.display(), team_id = %credentials.team_id, "first start: credentials written");
    }
    Ok(())
}

/// Where a server listens.
struct Listeners {
    /// Plain HTTP, for the API, the edge and the dashboard.
    plain: SocketAddr,
    /// The same over HTTPS.
    https: Option<https::Https>,
    /// `/metrics` on its own address.
    metrics: Option<(SocketAddr, axum::Router)>,
}

/// Serves `app` on the plain address and, if asked, over HTTPS, and the metrics router on
/// its own address if there is one, until SIGTERM or SIGINT.
async fn serve_until_stopped(
    listeners: Listeners,
    app: axum::Router,
    serving: &'static str,
) -> anyhow::Result<()> {
    let Listeners {
        plain: address,
        https,
        metrics,
    } = listeners;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?
        .tap_io(|tcp| {
            // Small request/response exchanges stall ~40 ms on Nagle + delayed ACK otherwise.
            let _ = tcp.set_nodelay(true);
        });
    let metrics = match metrics {
        Some((metrics_address, router)) => {
            let listener = tokio::net::TcpListener::bind(metrics_address)
                .await
                .with_context(|| format!("cannot listen on {metrics_address} for /metrics"))?;
            Some(tokio::spawn(async move {
                axum::serve(listener, router)
                    .with_graceful_shutdown(shutdown_signal())
                    .await
            }))
        }
        None => None,
    };
    let https = match https {
        Some(https) => Some(https.start(app.clone(), shutdown_signal()).await?),
        None => None,
    };
    tracing::info!(%address, "{serving}");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    if let Some(https) = https {
        https.await.context("the HTTPS listener failed")?;
    }
    if let Some(metrics) = metrics {
        metrics.await.context("the metrics listener failed")??;
    }
    Ok(())
}

/// The pulls' registry rule, asked again when a build is requested so a refused registry is a
/// 400 then rather than a failed build later.
#[derive(Debug)]
struct RegistryRule(Arc<sandbar_image::RegistryPolicy>);

#[async_trait::async_trait]
impl sandbar_core::RegistryCheck for RegistryRule {
    async fn refusal(&self, reference: &str) -> Option<String> {
        let refused = self.0.check_reference(reference).await.err()?;
        Some(refused.to_string())
    }
}

/// Creates the database file owner-only if it is new (SQLite gives its WAL and shared-memory
/// files the database file's mode) and narrows the mode of existing ones.
fn restrict_database_files(data_dir: &Path) -> anyhow::Result<()> {
    let db = data_dir.join("sandbar.db");
    if !db.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&db)
            .with_context(|| format!("cannot create {}", db.display()))?;
    }
    for suffix in ["", "-wal", "-shm"] {
        let path = data_dir.join(format!("sandbar.db{suffix}"));
        if path.exists() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("cannot restrict {}", path.display()))?;
        }
    }
    Ok(())
}

/// A core pattern that pipes to a helper makes the kernel run that helper as host root for
/// a crashing process; sandboxes start with the core limit that stops it, but a sandbox can
/// lower its own limit, so the operator should know.
fn warn_about_core_pipe() {
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    if pattern.starts_with('|') {
        tracing::warn!(
            core_pattern = pattern.trim(),
            "the host pipes core dumps to a helper that runs as root for crashes inside sandboxes too; consider a file pattern"
        );
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
