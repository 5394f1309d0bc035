//! Reference points on the same host: a bare `runc run` of `/bin/true` on the template's root
//! filesystem, `unshare` into fresh namespaces, and a plain fork+exec.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::Command;

/// Prefix of the runc container IDs this benchmark creates.
const RUNC_PREFIX: &str = "sandbar-bench-";

/// Runs `command` to completion with no input and discarded output, returning how long it took.
async fn time_command(command: &mut Command) -> anyhow::Result<Duration> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let output = command
        .output()
        .await
        .with_context(|| format!("cannot run {command:?}"))?;
    let elapsed = started.elapsed();
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(elapsed)
}

/// Times `make()`'s command `warmup + n` times and returns the last `n` durations.
async fn repeat(
    warmup: usize,
    n: usize,
    mut make: impl FnMut(usize) -> Command,
) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let elapsed = time_command(&mut make(i)).await?;
        if i >= warmup {
            samples.push(elapsed);
        }
    }
    Ok(samples)
}

/// Writes an OCI bundle into `bundle` whose process is `/bin/true` on `rootfs`, read-only.
async fn write_bundle(bundle: &Path, rootfs: &Path) -> anyhow::Result<()> {
    let mut spec = Command::new("runc");
    spec.arg("spec").arg("--bundle").arg(bundle);
    time_command(&mut spec).await?;
    let config_path = bundle.join("config.json");
    let text = tokio::fs::read_to_string(&config_path)
        .await
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).context("runc spec wrote invalid JSON")?;
    let process = config
        .get_mut("process")
        .and_then(serde_json::Value::as_object_mut)
        .context("runc spec has no process")?;
    process.insert("args".into(), serde_json::json!(["/bin/true"]));
    process.insert("terminal".into(), serde_json::Value::Bool(false));
    let root = config
        .get_mut("root")
        .and_then(serde_json::Value::as_object_mut)
        .context("runc spec has no root")?;
    root.insert(
        "path".into(),
        serde_json::Value::String(rootfs.display().to_string()),
    );
    root.insert("readonly".into(), serde_json::Value::Bool(true));
    tokio::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)
        .await
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    Ok(())
}

/// `runc run` of `/bin/true`, `warmup + n` times; leftovers are deleted whatever happens.
pub async fn runc(rootfs: &Path, warmup: usize, n: usize) -> anyhow::Result<Vec<Duration>> {
    let rootfs = rootfs
        .canonicalize()
        .with_context(|| format!("root filesystem {} not found", rootfs.display()))?;
    if !rootfs.join("bin/true").exists() && !rootfs.join("usr/bin/true").exists() {
        bail!("{} has no /bin/true", rootfs.display());
    }
    let bundle = tempfile::Builder::new()
        .prefix("sandbar-bench-runc.")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let outcome = async {
        write_bundle(bundle.path(), &rootfs).await?;
        let pid = std::process::id();
        repeat(warmup, n, |i| {
            let mut command = Command::new("runc");
            command
                .arg("run")
                .arg("--bundle")
                .arg(bundle.path())
                .arg(format!("{RUNC_PREFIX}{pid}-{i}"));
            command
        })
        .await
    }
    .await;
    delete_runc_leftovers().await;
    outcome
}

/// Force-deletes any runc container this benchmark left behind.
pub async fn delete_runc_leftovers() {
    let Ok(output) = Command::new("runc")
        .args(["list", "-q"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await
    else {
        return;
    };
    for id in String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|id| id.starts_with(RUNC_PREFIX))
    {
        let _ = Command::new("runc")
            .args(["delete", "-f", id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
    }
}

/// `unshare -muinpf --mount-proc /bin/true`: namespaces alone, no cgroups or root filesystem.
fn unshare_command() -> Command {
    let mut command = Command::new("unshare");
    command.args(["-muinpf", "--mount-proc", "/bin/true"]);
    command
}

/// [`unshare_command`] `warmup + n` times; the last `n` durations.
pub async fn unshare(warmup: usize, n: usize) -> anyhow::Result<Vec<Duration>> {
    repeat(warmup, n, |_| unshare_command()).await
}

/// One [`unshare_command`], timed; for series that interleave it with creates.
pub async fn unshare_once() -> anyhow::Result<Duration> {
    time_command(&mut unshare_command()).await
}

/// A plain fork+exec of `/bin/true`: the floor of starting any process from this benchmark.
pub async fn fork_exec(warmup: usize, n: usize) -> anyhow::Result<Vec<Duration>> {
    repeat(warmup, n, |_| Command::new("/bin/true")).await
}
