//! `sandbar-bench pull`: an image pull with an empty cache, through `ImageCache::pull`
//! (download, digest checks, unpack of every layer) and through the equivalent external
//! tool chain, `skopeo copy` to an OCI layout followed by `umoci unpack`.
//!
//! Every iteration starts from fresh, empty directories, which are removed (untimed) after it.
//! The two tool chains alternate which goes first, so neither always runs on a machine still
//! writing back the other's files.
//!
//! `ImageCache::pull` calls `syncfs` before it renames each unpacked layer into place, so its
//! time includes writing the files to disk; skopeo and umoci do not sync. The external chain is
//! therefore also timed with a `sync -f` of its directory after `umoci unpack`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sandbar_image::{ImageCache, PulledImage};
use tokio::process::Command;

use crate::stats::{ms, summarize};

/// Tag of the image inside the OCI layout `skopeo copy` writes.
const LAYOUT_TAG: &str = "bench";

#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// Image to pull, e.g. `127.0.0.1:5000/bench/debian:1`. Registries on localhost,
    /// 127.0.0.1 and [::1] are reached over plain HTTP.
    #[arg(long)]
    image: String,
    /// Measured pulls per tool chain.
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// Untimed pulls per tool chain first, so every measured pull finds the registry's blobs
    /// in the page cache.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Where the per-iteration caches, layouts and bundles go [default: the temporary
    /// directory, `$TMPDIR` or /tmp]. Both tool chains write to the same file system.
    #[arg(long)]
    tmp_dir: Option<PathBuf>,
    /// Another registry to reach over plain HTTP (`host:port`, or `host` for any port);
    /// repeatable. `skopeo` always runs with `--src-tls-verify=false`.
    #[arg(long = "plain-http", value_name = "HOST")]
    plain_http: Vec<String>,
    /// Also time `umoci raw unpack` (the root filesystem only: no mtree manifest and no
    /// runtime config), from the same layout.
    #[arg(long)]
    raw_unpack: bool,
    /// Keep every finished step's directories until the end of the run instead of removing
    /// them right away. On ext4 without a journal, new inodes skip ones freed in the last
    /// minute, so creating thousands of files just after deleting thousands costs more.
    #[arg(long)]
    remove_at_end: bool,
}

/// CPU time in user and in kernel mode.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    user: Duration,
    sys: Duration,
}

impl Cpu {
    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_sub(before.user),
            sys: self.sys.saturating_sub(before.sys),
        }
    }
}

/// Wall-clock and CPU time of one measured step.
#[derive(Debug, Clone, Copy)]
struct Timed {
    wall: Duration,
    cpu: Cpu,
}

impl std::ops::Add for Timed {
    type Output = Timed;

    fn add(self, other: Timed) -> Timed {
        Timed {
            wall: self.wall + other.wall,
            cpu: Cpu {
                user: self.cpu.user + other.cpu.user,
                sys: self.cpu.sys + other.cpu.sys,
            },
        }
    }
}

/// The samples of one table row.
#[derive(Debug, Default)]
struct Samples {
    wall: Vec<Duration>,
    user: Vec<Duration>,
    sys: Vec<Duration>,
}

impl Samples {
    fn push(&mut self, t: Timed) {
        self.wall.push(t.wall);
        self.user.push(t.cpu.user);
        self.sys.push(t.cpu.sys);
    }
}

#[derive(Debug, Default)]
struct Results {
    ours: Samples,
    /// `skopeo copy` + `umoci unpack`.
    external: Samples,
    /// The same followed by `sync -f`.
    external_synced: Samples,
    skopeo: Samples,
    umoci: Samples,
    sync: Samples,
    raw: Samples,
}

/// What was pulled, measured once from the first pulls' output.
#[derive(Debug, Default)]
struct ImageFacts {
    /// Layers and unpacked regular files and bytes, from `ImageCache::pull`'s layers.
    unpacked: Option<(usize, u64, u64)>,
    /// Layers and compressed bytes, from the manifest in `skopeo copy`'s layout.
    compressed: Option<(usize, u64)>,
}

/// CPU time used so far by this process (`RUSAGE_SELF`, every thread) or by its waited-for
/// children (`RUSAGE_CHILDREN`). Zero if it cannot be read, which only blanks the CPU columns.
fn cpu_time(who: libc::c_int) -> Cpu {
    // SAFETY: `rusage` is plain integers, for which all zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a live, writable `rusage`; getrusage writes nothing else.
    if unsafe { libc::getrusage(who, &mut usage) } != 0 {
        return Cpu::default();
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Cpu {
        user: tv(usage.ru_utime),
        sys: tv(usage.ru_stime),
    }
}

/// Runs a tool to completion, timed; its output is kept for the error message only.
async fn run_tool(program: &str, args: &[OsString]) -> anyhow::Result<Timed> {
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Dropped on Ctrl-C: the tool must not keep writing into a directory being removed.
        .kill_on_drop(true);
    let cpu_before = cpu_time(libc::RUSAGE_CHILDREN);
    let started = Instant::now();
    let output = command
        .output()
        .await
        .with_context(|| format!("cannot run {program} (is it installed?)"))?;
    let wall = started.elapsed();
    // The child has been waited for, so its CPU time is in RUSAGE_CHILDREN now.
    let cpu = cpu_time(libc::RUSAGE_CHILDREN).since(cpu_before);
    if !output.status.success() {
        bail!(
            "{program} {} failed ({}): {}{}",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim()
        );
    }
    Ok(Timed { wall, cpu })
}

/// Whether this process runs as root (the owner of `/proc/self` is the effective user).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

async fn pull_ours(args: &PullArgs, dir: &Path) -> anyhow::Result<(Timed, PulledImage)> {
    // The operator named this image, so its registry may be contacted wherever it is.
    let registry = sandbar_image::registry::registry_of(&args.image)?.parse()?;
    let policy =
        sandbar_image::RegistryPolicy::new(vec![registry], args.plain_http.clone(), vec![])?;
    let cache = ImageCache::new(dir.join("cache"), std::sync::Arc::new(policy));
    let cpu_before = cpu_time(libc::RUSAGE_SELF);
    let started = Instant::now();
    let pulled = cache
        .pull(&args.image, None, &|_| {})
        .await
        .with_context(|| format!("ImageCache::pull {}", args.image))?;
    let wall = started.elapsed();
    let cpu = cpu_time(libc::RUSAGE_SELF).since(cpu_before);
    Ok((Timed { wall, cpu }, pulled))
}

/// Times of `skopeo copy`, `umoci unpack`, `sync -f` and, if asked for, `umoci raw unpack`.
struct External {
    skopeo: Timed,
    umoci: Timed,
    sync: Timed,
    raw: Option<Timed>,
}

async fn pull_external(args: &PullArgs, dir: &Path) -> anyhow::Result<External> {
    let layout = dir.join("layout");
    let image = |layout: &Path| {
        let mut s = layout.as_os_str().to_owned();
        s.push(format!(":{LAYOUT_TAG}"));
        s
    };
    let mut oci = OsString::from("oci:");
    oci.push(image(&layout));
    // --insecure-policy: no dependence on /etc/containers/policy.json (signature policy does
    // not apply to a plain-HTTP registry anyway); --tmpdir keeps skopeo's scratch files in
    // the iteration's directory.
    let skopeo = run_tool(
        "skopeo",
        &[
            "--insecure-policy".into(),
            "--tmpdir".into(),
            dir.as_os_str().to_owned(),
            "copy".into(),
            "--quiet".into(),
            "--src-tls-verify=false".into(),
            format!("docker://{}", args.image).into(),
            oci,
        ],
    )
    .await?;
    // Without root, umoci can only unpack as the calling user.
    let rootless: Option<OsString> = (!is_root()).then(|| "--rootless".into());
    let mut unpack: Vec<OsString> = vec!["unpack".into()];
    unpack.extend(rootless.clone());
    unpack.extend(["--image".into(), image(&layout), dir.join("bundle").into()]);
    let umoci = run_tool("umoci", &unpack).await?;
    // syncfs(2) of the file system holding the bundle, as ImageCache::pull does per layer.
    let sync = run_tool("sync", &["-f".into(), dir.as_os_str().to_owned()]).await?;
    let raw = if args.raw_unpack {
        let mut raw: Vec<OsString> = vec!["raw".into(), "unpack".into()];
        raw.extend(rootless);
        raw.extend([
            "--image".into(),
            image(&layout),
            dir.join("raw-rootfs").into(),
        ]);
        Some(run_tool("umoci", &raw).await?)
    } else {
        None
    };
    Ok(External {
        skopeo,
        umoci,
        sync,
        raw,
    })
}

/// Layer count and compressed size from the OCI layout `skopeo copy` wrote.
fn layout_facts(layout: &Path) -> anyhow::Result<(usize, u64)> {
    let read_json = |path: PathBuf| -> anyhow::Result<serde_json::Value> {
        let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parse {}", path.display()))
    };
    let index = read_json(layout.join("index.json"))?;
    let digest = index["manifests"][0]["digest"]
        .as_str()
        .context("index.json names no manifest")?;
    let hex = digest
        .strip_prefix("sha256:")
        .context("manifest digest is not sha256")?;
    let manifest = read_json(layout.join("blobs/sha256").join(hex))?;
    let layers = manifest["layers"]
        .as_array()
        .context("the manifest has no layers")?;
    let bytes = layers.iter().filter_map(|l| l["size"].as_u64()).sum();
    Ok((layers.len(), bytes))
}

/// Regular files and their bytes under `root`, symlinks not followed.
fn tree_size(root: &Path) -> anyhow::Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
            let entry = entry.with_context(|| format!("read {}", dir.display()))?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                files += 1;
                bytes += entry.metadata()?.len();
            }
        }
    }
    Ok((files, bytes))
}

/// Waits for all outstanding writeback, so the next timed step does not pay for the last
/// one's dirty pages.
async fn sync_all() -> anyhow::Result<()> {
    let status = Command::new("sync")
        .stdin(Stdio::null())
        .status()
        .await
        .context("cannot run sync")?;
    if !status.success() {
        bail!("sync failed ({status})");
    }
    Ok(())
}

async fn remove(dir: tempfile::TempDir) -> anyhow::Result<()> {
    let path = dir.path().to_owned();
    tokio::task::spawn_blocking(move || dir.close())
        .await?
        .with_context(|| format!("remove {}", path.display()))
}

fn fresh_dir(root: &Path, what: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("sandbar-bench-pull-{what}-"))
        .tempdir_in(root)
        .with_context(|| format!("create a directory in {}", root.display()))
}

/// The state of one benchmark run.
struct Bench<'a> {
    args: &'a PullArgs,
    root: PathBuf,
    results: Results,
    facts: ImageFacts,
    /// Directories of finished steps, with `--remove-at-end`; removed when dropped at the
    /// latest.
    kept: Vec<tempfile::TempDir>,
}

impl Bench<'_> {
    /// Removes (or keeps, with `--remove-at-end`) a finished step's directory, untimed.
    async fn done_with(&mut self, dir: tempfile::TempDir) -> anyhow::Result<()> {
        if self.args.remove_at_end {
            self.kept.push(dir);
        } else {
            remove(dir).await?;
        }
        sync_all().await
    }

    /// One `ImageCache::pull` into an empty cache; the facts are taken from the first.
    async fn step_ours(&mut self, measured: bool) -> anyhow::Result<()> {
        let dir = fresh_dir(&self.root, "cache")?;
        let (timed, pulled) = pull_ours(self.args, dir.path()).await?;
        eprintln!("  ImageCache::pull {:.0} ms", ms(timed.wall));
        if self.facts.unpacked.is_none() {
            let (mut files, mut bytes) = (0, 0);
            for layer in &pulled.layers {
                let (f, b) = tree_size(&layer.path)?;
                files += f;
                bytes += b;
            }
            self.facts.unpacked = Some((pulled.layers.len(), files, bytes));
        }
        if measured {
            self.results.ours.push(timed);
        }
        self.done_with(dir).await
    }

    /// One `skopeo copy` + `umoci unpack` into empty directories.
    async fn step_external(&mut self, measured: bool) -> anyhow::Result<()> {
        let dir = fresh_dir(&self.root, "skopeo")?;
        let ext = pull_external(self.args, dir.path()).await?;
        eprintln!(
            "  skopeo copy {:.0} ms + umoci unpack {:.0} ms + sync -f {:.0} ms",
            ms(ext.skopeo.wall),
            ms(ext.umoci.wall),
            ms(ext.sync.wall)
        );
        if self.facts.compressed.is_none() {
            self.facts.compressed = Some(layout_facts(&dir.path().join("layout"))?);
        }
        if measured {
            let r = &mut self.results;
            r.external.push(ext.skopeo + ext.umoci);
            r.external_synced.push(ext.skopeo + ext.umoci + ext.sync);
            r.skopeo.push(ext.skopeo);
            r.umoci.push(ext.umoci);
            r.sync.push(ext.sync);
            if let Some(raw) = ext.raw {
                r.raw.push(raw);
            }
        }
        self.done_with(dir).await
    }

    async fn run(&mut self) -> anyhow::Result<()> {
        let (warmup, iterations) = (self.args.warmup, self.args.iterations);
        for i in 0..warmup + iterations {
            let measured = i >= warmup;
            if measured {
                eprintln!("iteration {}/{iterations}", i - warmup + 1);
            } else {
                eprintln!("warm-up {}/{warmup}", i + 1);
            }
            if i % 2 == 0 {
                self.step_ours(measured).await?;
                self.step_external(measured).await?;
            } else {
                self.step_external(measured).await?;
                self.step_ours(measured).await?;
            }
        }
        Ok(())
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn report(args: &PullArgs, root: &Path, load: &str, facts: &ImageFacts, r: &Results) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(out, "## Registry pulls\n");
    let _ = write!(out, "- image: `{}`", args.image);
    if let Some((layers, bytes)) = facts.compressed {
        let _ = write!(out, ", {layers} layers, {:.1} MiB compressed", mib(bytes));
    }
    if let Some((layers, files, bytes)) = facts.unpacked {
        if facts.compressed.is_none() {
            let _ = write!(out, ", {layers} layers");
        }
        let _ = write!(out, ", {:.1} MiB unpacked in {files} files", mib(bytes));
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "- CPUs (nproc): {cpus}; load average (1 min) before the run: {load}\n- measured pulls per tool chain: {} (after {} untimed), each into new, empty directories under {}, removed {}\n",
        args.iterations,
        args.warmup,
        root.display(),
        if args.remove_at_end {
            "at the end of the run"
        } else {
            "after each step"
        }
    );
    let _ = writeln!(
        out,
        "| measurement | n | p50 ms | p90 ms | min ms | CPU user p50 ms | CPU sys p50 ms |\n|---|--:|--:|--:|--:|--:|--:|"
    );
    let mut rows = vec![
        (
            "`ImageCache::pull` (download + verify + unpack + syncfs)",
            &r.ours,
        ),
        ("`skopeo copy` + `umoci unpack`", &r.external),
        (
            "`skopeo copy` + `umoci unpack` + `sync -f`",
            &r.external_synced,
        ),
        ("  `skopeo copy docker://… oci:…`", &r.skopeo),
        ("  `umoci unpack`", &r.umoci),
        ("  `sync -f`", &r.sync),
    ];
    if args.raw_unpack {
        rows.push(("  (`umoci raw unpack`, for comparison)", &r.raw));
    }
    for (name, samples) in rows {
        let stats = (
            summarize(&samples.wall),
            summarize(&samples.user),
            summarize(&samples.sys),
        );
        if let (Some(w), Some(u), Some(k)) = stats {
            let _ = writeln!(
                out,
                "| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
                w.n, w.p50, w.p90, w.min, u.p50, k.p50
            );
        } else {
            let _ = writeln!(out, "| {name} | 0 | – | – | – | – | – |");
        }
    }
    let ours = summarize(&r.ours.wall);
    for (name, theirs) in [
        ("`skopeo copy` + `umoci unpack`", &r.external),
        (
            "`skopeo copy` + `umoci unpack` + `sync -f`",
            &r.external_synced,
        ),
    ] {
        if let (Some(a), Some(b)) = (ours, summarize(&theirs.wall)) {
            let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
            let _ = writeln!(
                out,
                "\n`ImageCache::pull` / ({name}): p50 {:.2}×, p90 {:.2}×, min {:.2}×",
                ratio(a.p50, b.p50),
                ratio(a.p90, b.p90),
                ratio(a.min, b.min)
            );
        }
    }
    out
}

pub async fn main(args: PullArgs) -> ExitCode {
    if args.iterations == 0 {
        eprintln!("error: --iterations must be at least 1");
        return ExitCode::FAILURE;
    }
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    let mut bench = Bench {
        args: &args,
        root: args.tmp_dir.clone().unwrap_or_else(std::env::temp_dir),
        results: Results::default(),
        facts: ImageFacts::default(),
        kept: Vec::new(),
    };
    let started = Instant::now();
    // On Ctrl-C the run is dropped: its tools are killed and its directories removed.
    let mut outcome = tokio::select! {
        outcome = bench.run() => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    for dir in std::mem::take(&mut bench.kept) {
        if let Err(e) = remove(dir).await {
            outcome = outcome.and(Err(e));
        }
    }
    println!(
        "{}",
        report(&args, &bench.root, &load, &bench.facts, &bench.results)
    );
    eprintln!("finished in {:.1} s", started.elapsed().as_secs_f64());
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
