//! Template root filesystems on this node. The default template is a Debian root built with
//! mmdebstrap once and cached; sandboxes only ever read it through an overlay.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};

/// Bump when the recipe below changes, so nodes rebuild instead of reusing a stale root.
const BASE_RECIPE_VERSION: u32 = 1;
/// The default template's layer name (see [`crate::layers::LayerStore`]).
pub const BASE_LAYER: &str = "base/v1";
const BASE_PACKAGES: &str = "bash,python3,ca-certificates,sudo,procps,curl,iproute2,coreutils";

#[derive(Debug, thiserror::Error)]
pub enum TemplateBuildError {
    #[error("mmdebstrap is not installed (apt-get install mmdebstrap): {0}")]
    MissingTool(std::io::Error),
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mmdebstrap failed with {status}; last output: {tail}")]
    Failed { status: String, tail: String },
}

/// Where the default template's root lives once built.
pub fn base_rootfs(templates_dir: &Path) -> PathBuf {
    templates_dir
        .join(format!("base-v{BASE_RECIPE_VERSION}"))
        .join("rootfs")
}

/// Whether the default template is already built.
pub fn base_is_built(templates_dir: &Path) -> bool {
    base_rootfs(templates_dir)
        .parent()
        .is_some_and(|d| d.join("complete").exists())
}

/// Builds the default template unless it is cached, reporting progress through `tracing`.
/// Returns the root filesystem's path.
pub async fn build_base(templates_dir: &Path, mirror: &str) -> Result<PathBuf, TemplateBuildError> {
    let rootfs = base_rootfs(templates_dir);
    if base_is_built(templates_dir) {
        return Ok(rootfs);
    }
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| TemplateBuildError::Io { path, source }
    };
    let target_dir = rootfs.parent().map(Path::to_owned).unwrap_or_default();
    let staging = templates_dir.join(format!(".base-v{BASE_RECIPE_VERSION}.partial"));
    if staging.exists() {
        tokio::fs::remove_dir_all(&staging)
            .await
            .map_err(io(&staging))?;
    }
    tokio::fs::create_dir_all(templates_dir)
        .await
        .map_err(io(templates_dir))?;

    tracing::info!(
        packages = BASE_PACKAGES,
        "building the default template 'base' with mmdebstrap"
    );
    let started = std::time::Instant::now();
    let mut child = tokio::process::Command::new("mmdebstrap")
        .args([
            "--variant=minbase",
            &format!("--include={BASE_PACKAGES}"),
            "--customize-hook=chroot \"$1\" useradd --create-home --shell /bin/bash --user-group user",
            "--customize-hook=echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > \"$1/etc/sudoers.d/user\" && chmod 0440 \"$1/etc/sudoers.d/user\"",
            "--customize-hook=rm -rf \"$1/var/cache/apt/archives\"/*.deb \"$1/var/lib/apt/lists\"/*_Packages",
            "bookworm",
        ])
        .arg(&staging)
        .arg(mirror)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(TemplateBuildError::MissingTool)?;

    let mut tail: Vec<String> = Vec::new();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let forward = |pipe: Option<tokio::process::ChildStdout>| async move {
        if let Some(pipe) = pipe {
            let mut lines = BufReader::new(pipe).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::debug!(target: "sandbar::template", "{line}");
            }
        }
    };
    let stdout_task = tokio::spawn(forward(stdout));
    if let Some(stderr) = stderr {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            // mmdebstrap reports its phases as "I: ..." lines on stderr.
            if line.starts_with("I: ") || line.starts_with("E: ") || line.starts_with("W: ") {
                tracing::info!(target: "sandbar::template", "base: {}", &line[3..]);
            }
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
    }
    let _ = stdout_task.await;
    let status = child
        .wait()
        .await
        .map_err(TemplateBuildError::MissingTool)?;
    if !status.success() {
        let _ = tokio::fs::remove_dir_all(&staging).await;
        return Err(TemplateBuildError::Failed {
            status: status.to_string(),
            tail: tail.join(" | "),
        });
    }

    if target_dir.exists() {
        tokio::fs::remove_dir_all(&target_dir)
            .await
            .map_err(io(&target_dir))?;
    }
    tokio::fs::create_dir_all(&target_dir)
        .await
        .map_err(io(&target_dir))?;
    tokio::fs::rename(&staging, &rootfs)
        .await
        .map_err(io(&rootfs))?;
    let marker = target_dir.join("complete");
    tokio::fs::write(&marker, b"").await.map_err(io(&marker))?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f32(),
        "default template 'base' is ready"
    );
    Ok(rootfs)
}
