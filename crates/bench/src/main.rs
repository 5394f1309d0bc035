//! `sandbar-bench`: measures a running Sandbar server the way a client sees it.
//!
//! 1. create→first-command-output latency (`POST /v2/sandboxes`, then `echo ready` through
//!    `process.Process/Start` on the edge), sequentially and with concurrent clients;
//! 2. host memory per idle sandbox;
//! 3. reference points on the same host: `runc run /bin/true` on the template's root
//!    filesystem, `unshare … /bin/true`, and a plain fork+exec.
//!
//! Every sandbox it creates is killed before it exits, on failure too.
//!
//! `sandbar-bench tls` times TLS handshakes and what HTTPS adds to a request (see `tls.rs`).
//!
//! `sandbar-bench pull` instead times an image pull into an empty cache against
//! `skopeo copy` + `umoci unpack` of the same image (see `pull.rs`); it needs no server.

mod baseline;
mod client;
mod control_plane;
mod first_commands;
mod layers;
mod memory;
mod pull;
mod stats;
mod tls;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

use crate::client::Api;
use crate::memory::{CgroupVersion, IdleMemory};
use crate::stats::{Summary, ms, summarize};

#[derive(Parser, Debug)]
#[command(
    name = "sandbar-bench",
    version,
    about = "Latency and memory benchmark of a running Sandbar server",
    // `pull` needs no server, so the server's flags (the API key among them) are neither
    // required nor accepted with it.
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Mode>,
    /// Base URL of the server (API and edge alike).
    #[arg(long, env = "SANDBAR_API_URL", default_value = "http://127.0.0.1:3000")]
    api_url: String,
    /// API key (`e2b_…`) of the server's team.
    #[arg(long, env = "SANDBAR_API_KEY", required = true)]
    api_key: Option<String>,
    /// The server's data directory; locates the template root filesystem.
    #[arg(long, env = "SANDBAR_DATA_DIR", default_value = "/var/lib/sandbar")]
    data_dir: PathBuf,
    /// Root filesystem of the runc baseline [default: <data-dir>/templates/base-v2/rootfs].
    #[arg(long)]
    rootfs: Option<PathBuf>,
    /// Sequential create→first-output iterations (also the runc/unshare repetitions).
    #[arg(long, default_value_t = 30)]
    iterations: usize,
    /// Rounds of simultaneous create→first-output requests.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Simultaneous requests per round.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Idle sandboxes for the memory measurement (0: skip it, e.g. against a cluster, whose
    /// sandboxes' cgroups are on other hosts).
    #[arg(long, default_value_t = 20)]
    idle: usize,
    /// Untimed iterations before each latency series.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Times the idle memory measurement is repeated (medians are reported).
    #[arg(long, default_value_t = 3)]
    idle_cycles: usize,
    /// Pause before and after creating the idle sandboxes, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    settle_ms: u64,
    /// Pause after each round's sandboxes are killed, in milliseconds: the time a client
    /// spends with its sandbox before it creates the next one. Work the server does in the
    /// background (refilling the warm pool, the disk's deferred clean-up) then happens
    /// between creates rather than during them.
    #[arg(long, default_value_t = 0)]
    think_ms: u64,
    /// Skip the runc/unshare baselines.
    #[arg(long)]
    no_baseline: bool,
    /// Also measure create→first output sequentially while this many sandboxes each burn
    /// CPU in a busy loop (0: skip).
    #[arg(long, default_value_t = 2)]
    cpu_hogs: usize,
    /// Also measure create→first output sequentially while this many idle sandboxes run,
    /// once per number given (comma-separated; the server's team limit must allow them).
    #[arg(long, value_delimiter = ',')]
    crowd: Vec<usize>,
    /// Seconds to wait after a crowd is made before measuring next to it: the server refills
    /// its warm pool after the burst that made the crowd, and those boots are not the
    /// crowd's cost (0: measure at once).
    #[arg(long, default_value_t = 15)]
    crowd_settle_secs: u64,
    /// Appends every round trip of the crowd series to this CSV file (series, index, round
    /// began, total, create, first output, kill; ms), to place a tail in time.
    #[arg(long)]
    samples_csv: Option<PathBuf>,
    /// Instead of the latency series: this many create→first command→kill cycles next to
    /// `--first-commands-next-to` idle sandboxes, every command's output compared byte for
    /// byte (the crowd's first commands included); fails on any difference.
    #[arg(long, default_value_t = 0)]
    first_commands: usize,
    /// Idle sandboxes kept running during `--first-commands`.
    #[arg(long, default_value_t = 1000)]
    first_commands_next_to: usize,
    /// Cycles of `--first-commands` run at once.
    #[arg(long, default_value_t = 8)]
    first_commands_concurrency: usize,
    /// A header (`Name: value`) sent with every request, e.g. a cluster node's
    /// `X-Sandbar-Node-Secret` to time the node without its API host; repeatable.
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

impl Args {
    fn think(&self) -> Duration {
        Duration::from_millis(self.think_ms)
    }
}

fn parse_header(text: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("header '{text}' must look like 'Name: value'"))?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|e| format!("bad header name in '{text}': {e}"))?;
    let value = http::HeaderValue::from_str(value.trim())
        .map_err(|e| format!("bad header value in '{text}': {e}"))?;
    Ok((name, value))
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Time an image pull into an empty cache (`ImageCache::pull`) against `skopeo copy` +
    /// `umoci unpack` of the same image.
    Pull(pull::PullArgs),
    /// Time one template layer through a cluster's layer store: archive and push (what a
    /// node does after a build), download and unpack (what another does before a create).
    Layers(layers::LayersArgs),
    /// Creates per second one API host and one database place, with nodes whose runtime
    /// answers launches at once (no sandbox boots), for 1, 2, 4… nodes.
    ControlPlane(control_plane::ControlPlaneArgs),
    /// What HTTPS costs against a server with --listen and --tls-listen: TLS handshakes, and
    /// each request on a kept-alive connection, plain HTTP/1.1 against HTTPS over HTTP/1.1
    /// and HTTP/2.
    Tls(tls::TlsArgs),
}

/// Latencies of one create→first-output request, split into its parts.
#[derive(Debug, Default)]
struct Series {
    total: Vec<Duration>,
    create: Vec<Duration>,
    start: Vec<Duration>,
    /// Per round trip, its round's start (since the Unix epoch) and how long killing the
    /// round's sandboxes took (not part of the timed rows).
    began: Vec<Duration>,
    kill: Vec<Duration>,
}

impl Series {
    fn extend(&mut self, other: Series) {
        self.total.extend(other.total);
        self.create.extend(other.create);
        self.start.extend(other.start);
        self.began.extend(other.began);
        self.kill.extend(other.kill);
    }

    /// One line per round trip: when its round began (Unix time), the create→first output,
    /// the create, the first output and the round's kill, all in ms.
    fn write_samples(&self, name: &str, path: &std::path::Path) -> std::io::Result<()> {
        use std::io::Write;
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        for i in 0..self.total.len() {
            writeln!(
                out,
                "{name},{i},{:.3},{:.3},{:.3},{:.3},{:.3}",
                ms(self.began[i]),
                ms(self.total[i]),
                ms(self.create[i]),
                ms(self.start[i]),
                ms(self.kill[i]),
            )?;
        }
        Ok(())
    }
}

/// One full client round trip; the sandbox is left for the caller to kill.
async fn create_then_echo(api: &Api) -> anyhow::Result<(String, [Duration; 3])> {
    let started = Instant::now();
    let sandbox = api.create().await?;
    let create = started.elapsed();
    let start = api
        .first_output(&sandbox)
        .await
        .with_context(|| format!("sandbox {}", sandbox.id))?;
    Ok((sandbox.id, [create + start, create, start]))
}

/// `rounds` rounds of `concurrency` simultaneous round trips; sandboxes are killed (untimed)
/// after each round. The first `warmup` rounds are not recorded.
async fn latency(
    api: &Api,
    warmup: usize,
    rounds: usize,
    concurrency: usize,
    think: Duration,
) -> anyhow::Result<(Series, Vec<Duration>)> {
    let mut series = Series::default();
    let mut walls = Vec::with_capacity(rounds);
    for round in 0..warmup + rounds {
        let mut tasks = tokio::task::JoinSet::new();
        let began = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let started = Instant::now();
        for _ in 0..concurrency {
            let api = api.clone();
            tasks.spawn(async move { create_then_echo(&api).await });
        }
        let mut this = Series::default();
        let mut failure = None;
        while let Some(joined) = tasks.join_next().await {
            match joined.map_err(anyhow::Error::from).and_then(|r| r) {
                Ok((_, [total, create, start])) => {
                    this.total.push(total);
                    this.create.push(create);
                    this.start.push(start);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        let wall = started.elapsed();
        let killing = Instant::now();
        let leftovers = api.kill_all().await;
        let killed = killing.elapsed();
        for _ in 0..this.total.len() {
            this.began.push(began);
            this.kill.push(killed);
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some((id, e)) = leftovers.into_iter().next() {
            return Err(e.context(format!("cannot kill sandbox {id}")));
        }
        if round >= warmup {
            series.extend(this);
            walls.push(wall);
        }
        tokio::time::sleep(think).await;
    }
    Ok((series, walls))
}

/// `unshare` and a create→first output taken by turns, `warmup + n` pairs: on a host whose
/// speed drifts from minute to minute (a VM with noisy neighbours), both halves of the
/// comparison then see the same host. The sandbox is killed (untimed) and the server's work
/// in the background (its clean-up, the warm pool's refill) given [`PAIR_SETTLE`] before the
/// next pair, so that it lands on neither half.
async fn paired_with_unshare(
    api: &Api,
    warmup: usize,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let (mut unshare, mut create) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..warmup + n {
        tokio::time::sleep(PAIR_SETTLE).await;
        // Which half goes first alternates: the second finds the host just woken by the first.
        let (namespaces, (id, [total, _, _])) = if i % 2 == 0 {
            let namespaces = baseline::unshare_once().await?;
            (namespaces, create_then_echo(api).await?)
        } else {
            let created = create_then_echo(api).await?;
            (baseline::unshare_once().await?, created)
        };
        api.kill(&id)
            .await
            .with_context(|| format!("cannot kill sandbox {id}"))?;
        if i >= warmup {
            unshare.push(namespaces);
            create.push(total);
        }
    }
    Ok((unshare, create))
}

/// Sequential create→first output while neighbours run. `setup` makes them on a client of
/// their own, so the series' clean-up leaves them alone; they are killed afterwards.
async fn latency_next_to<F, Fut>(api: &Api, args: &Args, setup: F) -> anyhow::Result<Series>
where
    F: FnOnce(Api) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let neighbours = api.detached();
    let measured = async {
        setup(neighbours.clone()).await?;
        latency(api, args.warmup, args.iterations, 1, args.think()).await
    }
    .await;
    let leftovers = neighbours.kill_all().await;
    let (series, _) = measured?;
    if let Some((id, e)) = leftovers.into_iter().next() {
        return Err(e.context(format!("cannot kill sandbox {id}")));
    }
    Ok(series)
}

const PAIR_SETTLE: Duration = Duration::from_millis(200);
const PAIRED_UNSHARE: &str = "by turns: `unshare -muinpf --mount-proc /bin/true`";
const PAIRED_CREATE: &str = "by turns: create→first output, c=1";

#[derive(Debug, Default)]
struct Results {
    rows: Vec<(String, Option<Summary>)>,
    idle: Option<IdleMemory>,
    idle_cycles: Vec<IdleMemory>,
}

impl Results {
    fn row(&mut self, name: impl Into<String>, samples: &[Duration]) {
        self.rows.push((name.into(), summarize(samples)));
    }

    fn find(&self, prefix: &str) -> Option<Summary> {
        self.rows
            .iter()
            .find(|(name, _)| name.starts_with(prefix))
            .and_then(|(_, s)| *s)
    }
}

async fn run(
    args: &Args,
    api: &Api,
    cgroups: CgroupVersion,
    results: &mut Results,
) -> anyhow::Result<()> {
    ensure_base_template_ready(api).await?;
    if !args.no_baseline {
        measure_baselines(args, results).await?;
    }
    measure_sequential(args, api, results).await?;
    if !args.no_baseline {
        measure_paired_with_unshare(args, api, results).await;
    }
    if args.cpu_hogs > 0 {
        measure_next_to_cpu_hogs(args, api, results).await?;
    }
    for &crowd in &args.crowd {
        measure_next_to_idle_crowd(args, api, crowd, results).await?;
    }
    measure_concurrent(args, api, results).await?;
    if args.idle == 0 {
        return Ok(());
    }
    measure_idle_memory(args, api, cgroups, results).await
}

async fn ensure_base_template_ready(api: &Api) -> anyhow::Result<()> {
    if !api
        .base_template_ready()
        .await
        .context("the server is not reachable")?
    {
        bail!("the server has no ready template aliased 'base' yet");
    }
    Ok(())
}

async fn measure_baselines(args: &Args, results: &mut Results) -> anyhow::Result<()> {
    let rootfs = args
        .rootfs
        .clone()
        .unwrap_or_else(|| args.data_dir.join("templates/base-v2/rootfs"));
    eprintln!(
        "baseline: fork+exec, unshare and runc run of /bin/true, {} times each",
        args.iterations
    );
    let fork = baseline::fork_exec(args.warmup, args.iterations).await?;
    results.row("fork+exec `/bin/true`", &fork);
    match baseline::unshare(args.warmup, args.iterations).await {
        Ok(samples) => results.row("`unshare -muinpf --mount-proc /bin/true`", &samples),
        Err(e) => eprintln!("warning: unshare baseline skipped: {e:#}"),
    }
    let runc = baseline::runc(&rootfs, args.warmup, args.iterations).await?;
    results.row("`runc run` `/bin/true` (template rootfs, read-only)", &runc);
    Ok(())
}

async fn measure_sequential(args: &Args, api: &Api, results: &mut Results) -> anyhow::Result<()> {
    eprintln!(
        "latency: {} sequential create→first output",
        args.iterations
    );
    let (seq, _) = latency(api, args.warmup, args.iterations, 1, args.think()).await?;
    results.row("create→first output, c=1", &seq.total);
    results.row("  create (`POST /v2/sandboxes` → 201), c=1", &seq.create);
    results.row("  Start → first stdout, c=1", &seq.start);
    Ok(())
}

/// A failed paired series only leaves its rows out: the other series still stand.
async fn measure_paired_with_unshare(args: &Args, api: &Api, results: &mut Results) {
    eprintln!(
        "latency: {} pairs of unshare and create→first output, by turns",
        args.iterations
    );
    match paired_with_unshare(api, args.warmup, args.iterations).await {
        Ok((unshare, create)) => {
            results.row(PAIRED_UNSHARE, &unshare);
            results.row(PAIRED_CREATE, &create);
        }
        Err(e) => eprintln!("warning: paired series skipped: {e:#}"),
    }
}

async fn measure_next_to_cpu_hogs(
    args: &Args,
    api: &Api,
    results: &mut Results,
) -> anyhow::Result<()> {
    eprintln!(
        "latency: {} sequential create→first output next to {} CPU-burning sandboxes",
        args.iterations, args.cpu_hogs
    );
    let loaded = latency_next_to(api, args, |hogs| async move {
        for _ in 0..args.cpu_hogs {
            let sandbox = hogs.create().await?;
            hogs.start_cpu_hog(&sandbox)
                .await
                .with_context(|| format!("start a busy loop in {}", sandbox.id))?;
        }
        // Let the loops reach full speed before measuring.
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok(())
    })
    .await?;
    results.row(
        format!(
            "create→first output, c=1, next to {} CPU-burning sandboxes",
            args.cpu_hogs
        ),
        &loaded.total,
    );
    Ok(())
}

async fn measure_next_to_idle_crowd(
    args: &Args,
    api: &Api,
    crowd: usize,
    results: &mut Results,
) -> anyhow::Result<()> {
    eprintln!(
        "latency: {} sequential create→first output next to {crowd} idle sandboxes",
        args.iterations
    );
    let settle_secs = args.crowd_settle_secs;
    let crowded = latency_next_to(api, args, |idle| async move {
        let started = Instant::now();
        let mut made = 0;
        while made < crowd {
            let batch = (crowd - made).min(16);
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..batch {
                let idle = idle.clone();
                tasks.spawn(async move { idle.create().await });
            }
            while let Some(joined) = tasks.join_next().await {
                joined.map_err(anyhow::Error::from).and_then(|r| r)?;
            }
            made += batch;
        }
        eprintln!("  {crowd} idle sandboxes made in {:.1?}", started.elapsed());
        tokio::time::sleep(Duration::from_secs(settle_secs)).await;
        Ok(())
    })
    .await?;
    if let Some(path) = &args.samples_csv {
        crowded
            .write_samples(&format!("next to {crowd}"), path)
            .with_context(|| format!("cannot write samples to {}", path.display()))?;
    }
    results.row(
        format!("create→first output, c=1, next to {crowd} idle sandboxes"),
        &crowded.total,
    );
    results.row(
        format!("  create (`POST /v2/sandboxes` → 201), next to {crowd}"),
        &crowded.create,
    );
    results.row(
        format!("  Start → first stdout, next to {crowd}"),
        &crowded.start,
    );
    Ok(())
}

async fn measure_concurrent(args: &Args, api: &Api, results: &mut Results) -> anyhow::Result<()> {
    let c = args.concurrency;
    eprintln!(
        "latency: {} rounds of {c} simultaneous create→first output",
        args.rounds
    );
    let (par, walls) = latency(api, args.warmup.min(1), args.rounds, c, args.think()).await?;
    results.row(format!("create→first output, c={c}"), &par.total);
    results.row(
        format!("  create (`POST /v2/sandboxes` → 201), c={c}"),
        &par.create,
    );
    results.row(format!("  Start → first stdout, c={c}"), &par.start);
    results.row(format!("  wall time of a round of {c}"), &walls);
    Ok(())
}

async fn measure_idle_memory(
    args: &Args,
    api: &Api,
    cgroups: CgroupVersion,
    results: &mut Results,
) -> anyhow::Result<()> {
    eprintln!(
        "memory: {} idle sandboxes, {} times",
        args.idle, args.idle_cycles
    );
    let (idle, cycles) = memory::idle_cycles(
        api,
        cgroups,
        args.idle,
        args.concurrency,
        Duration::from_millis(args.settle_ms),
        args.idle_cycles,
    )
    .await?;
    results.idle = Some(idle);
    results.idle_cycles = cycles;
    Ok(())
}

fn machine(cgroups: CgroupVersion) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let total = memory::mem_total().map_or_else(
        |_| "unknown".into(),
        |b| format!("{:.1} GiB", b as f64 / (1024.0 * 1024.0 * 1024.0)),
    );
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    format!(
        "- CPUs (nproc): {cpus}\n- kernel: {kernel}\n- cgroups: {}\n- memory: {total}\n- load average (1 min) before the run: {load}\n",
        cgroups.describe()
    )
}

fn report(args: &Args, machine: &str, results: &Results) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "## Machine\n\n{machine}");
    write_latency_table(&mut out, results);
    if let Some(m) = &results.idle {
        write_idle_memory(&mut out, m, &results.idle_cycles);
    }
    write_latency_goals(&mut out, results);
    if let Some(m) = &results.idle {
        write_idle_memory_goals(&mut out, m);
    }
    write_parameters(&mut out, args);
    out
}

fn write_latency_table(out: &mut String, results: &Results) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "## Latency (ms)\n\n| measurement | n | p50 | p95 | p99 | mean | min | max |\n|---|--:|--:|--:|--:|--:|--:|--:|"
    );
    for (name, summary) in &results.rows {
        match summary {
            Some(s) => {
                let _ = writeln!(
                    out,
                    "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                    s.n, s.p50, s.p95, s.p99, s.mean, s.min, s.max
                );
            }
            None => {
                let _ = writeln!(out, "| {name} | 0 | – | – | – | – | – | – |");
            }
        }
    }
}

fn write_idle_memory(out: &mut String, m: &IdleMemory, idle_cycles: &[IdleMemory]) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "\n## Idle memory ({} sandboxes, MiB per sandbox, median of {} cycles)\n\n| measurement | MiB |\n|---|--:|",
        m.n,
        idle_cycles.len()
    );
    for (name, value) in [
        (
            "estimate: kernel growth + memory cgroup usage, / N",
            m.kernel + m.cgroup_usage,
        ),
        ("host MemAvailable drop / N", m.host_available_drop),
        (
            "kernel SUnreclaim+KernelStack+PageTables+Percpu growth / N",
            m.kernel,
        ),
        (
            "memory cgroup usage / N (page cache included)",
            m.cgroup_usage,
        ),
        ("memory cgroup anonymous (rss) / N", m.cgroup_anon),
        ("agent (PID 1) VmRSS, mean", m.agent_rss),
        ("agent (PID 1) PSS, mean", m.agent_pss),
        ("VmRSS of all sandbox processes, mean", m.all_processes_rss),
    ] {
        let _ = writeln!(out, "| {name} | {value:.2} |");
    }
    if let Some(regained) = m.host_available_regained {
        let _ = writeln!(
            out,
            "| host MemAvailable regained after killing them / N | {regained:.2} |"
        );
    }
    let _ = writeln!(out, "| processes per idle sandbox | {:.1} |", m.processes);
    let cycles: Vec<String> = idle_cycles
        .iter()
        .map(|c| {
            format!(
                "{:.2}/{}",
                c.host_available_drop,
                c.host_available_regained
                    .map_or_else(|| "–".into(), |r| format!("{r:.2}"))
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "\nMemAvailable drop/regained per sandbox in each cycle (MiB): {}",
        cycles.join(", ")
    );
}

fn write_latency_goals(out: &mut String, results: &Results) {
    use std::fmt::Write;
    let _ = writeln!(out, "\n## Goals\n");
    let create = results.find("create→first output, c=1");
    let runc = results.find("`runc run`");
    match (create, runc) {
        (Some(s), Some(r)) => {
            let _ = writeln!(
                out,
                "- create→first output p50 {:.1} ms vs `runc run /bin/true` p50 {:.1} ms: {}",
                s.p50,
                r.p50,
                verdict(s.p50 <= r.p50)
            );
        }
        _ => {
            let _ = writeln!(out, "- create→first output vs runc: not measured");
        }
    }
    match (results.find(PAIRED_CREATE), results.find(PAIRED_UNSHARE)) {
        (Some(c), Some(u)) => {
            let _ = writeln!(
                out,
                "- create→first output p50 {:.1} ms vs 2 × `unshare` p50 {:.1} ms, taken by turns: {} ({:.2}×)",
                c.p50,
                2.0 * u.p50,
                verdict(c.p50 <= 2.0 * u.p50),
                c.p50 / u.p50
            );
        }
        _ => {
            let _ = writeln!(out, "- create→first output vs unshare: not measured");
        }
    }
    let loaded = results.find("create→first output, c=1, next to");
    if let (Some(idle), Some(busy)) = (create, loaded) {
        let _ = writeln!(
            out,
            "- create→first output next to CPU-burning sandboxes p50 {:.1} ms vs 2 × idle p50 {:.1} ms: {}",
            busy.p50,
            2.0 * idle.p50,
            verdict(busy.p50 <= 2.0 * idle.p50)
        );
    }
}

fn write_idle_memory_goals(out: &mut String, m: &IdleMemory) {
    use std::fmt::Write;
    let estimate = m.kernel + m.cgroup_usage;
    let _ = writeln!(
        out,
        "- host memory per idle sandbox (kernel growth + cgroup usage) {estimate:.2} MiB vs 5 MiB: {}",
        verdict(estimate < 5.0)
    );
    let _ = writeln!(
        out,
        "- host MemAvailable drop per idle sandbox {:.2} MiB vs 5 MiB: {} (host-wide: disturbed by anything else running)",
        m.host_available_drop,
        verdict(m.host_available_drop < 5.0)
    );
}

/// How a goal reads in the report.
fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "not met" }
}

fn write_parameters(out: &mut String, args: &Args) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "\nParameters: --iterations {} --rounds {} --concurrency {} --idle {} --idle-cycles {} --warmup {} --think-ms {}",
        args.iterations,
        args.rounds,
        args.concurrency,
        args.idle,
        args.idle_cycles,
        args.warmup,
        args.think_ms
    );
}

async fn first_commands_main(args: &Args, api: &Api) -> ExitCode {
    let (crowd, commands) = (args.first_commands_next_to, args.first_commands);
    eprintln!("first commands: {commands} next to {crowd} idle sandboxes, every byte compared");
    let outcome = tokio::select! {
        outcome = first_commands::run(api, crowd, commands, args.first_commands_concurrency) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    let leftovers = api.kill_all().await;
    for (id, e) in &leftovers {
        eprintln!("warning: sandbox {id} may still be running: {e:#}");
    }
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    for line in outcome.mismatched.iter().chain(&outcome.failed) {
        println!("- {line}");
    }
    println!(
        "{} commands: {} whole, {} with other output, {} failed; churn of {commands} in {:.1} s ({:.1}/s, {} at once)",
        crowd + commands,
        outcome.matched,
        outcome.mismatched.len(),
        outcome.failed.len(),
        outcome.wall.as_secs_f64(),
        commands as f64 / outcome.wall.as_secs_f64().max(1e-9),
        args.first_commands_concurrency,
    );
    if let Some(s) = summarize(&outcome.first_output) {
        println!(
            "request→first stdout (ms): n {} p50 {:.1} p95 {:.1} p99 {:.1} max {:.1}",
            s.n, s.p50, s.p95, s.p99, s.max
        );
    }
    if outcome.mismatched.is_empty() && outcome.failed.is_empty() && leftovers.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = Args::parse();
    match args.command.take() {
        Some(Mode::Pull(pull)) => return pull::main(pull).await,
        Some(Mode::Layers(layers)) => return layers::main(layers).await,
        Some(Mode::ControlPlane(plane)) => return control_plane::main(plane).await,
        Some(Mode::Tls(tls)) => return tls::main(tls).await,
        None => {}
    }
    let Some(api_key) = args.api_key.as_deref() else {
        eprintln!("error: --api-key (or SANDBAR_API_KEY) is required");
        return ExitCode::FAILURE;
    };
    if args.iterations == 0 || args.rounds == 0 || args.concurrency == 0 {
        eprintln!("error: --iterations, --rounds and --concurrency must be at least 1");
        return ExitCode::FAILURE;
    }
    let api = Api::with_headers(&args.api_url, api_key, args.headers.clone());
    if args.first_commands > 0 {
        return first_commands_main(&args, &api).await;
    }
    let cgroups = CgroupVersion::detect();
    let machine = machine(cgroups);
    let mut results = Results::default();
    let started = Instant::now();
    let outcome = tokio::select! {
        outcome = run(&args, &api, cgroups, &mut results) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Whatever happened, leave no sandbox or container behind.
    let leftovers = api.kill_all().await;
    baseline::delete_runc_leftovers().await;
    for (id, e) in &leftovers {
        eprintln!("warning: sandbox {id} may still be running: {e:#}");
    }
    println!("{}", report(&args, &machine, &results));
    eprintln!("finished in {:.1} s", started.elapsed().as_secs_f64());
    match outcome {
        Ok(()) if leftovers.is_empty() => ExitCode::SUCCESS,
        Ok(()) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
