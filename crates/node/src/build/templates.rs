//! Template root filesystems on this node. The default template is a Debian root built with
//! mmdebstrap once and cached; sandboxes only ever read it through an overlay.
//!
//! mmdebstrap mounts `/proc`, `/sys` and parts of `/dev` inside the root it builds and only
//! unmounts them if it gets to finish. It runs as PID 1 of a PID namespace and in a private
//! mount namespace of its own, so whatever stops it (the server's shutdown, a kill -9 of the
//! server, a crash) takes every process of the build with it, and its mounts vanish with
//! those processes instead of staying on the host inside the half-built root.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};

/// Bump when the recipe below changes, so nodes rebuild instead of reusing a stale root. The
/// root of an earlier recipe stays while a template, tagged build or sandbox names it (see
/// [`remove_superseded_bases`]).
const BASE_RECIPE_VERSION: u32 = 2;
/// The default template's layer name (see [`crate::storage::layers::LayerStore`]); always
/// `base/v{BASE_RECIPE_VERSION}`.
pub const BASE_LAYER: &str = "base/v2";
/// `git` because the SDKs' `sandbox.git` runs it inside the sandbox.
const BASE_PACKAGES: &str = "bash,python3,ca-certificates,sudo,procps,curl,git,iproute2,coreutils";

/// Makes `/etc/profile` read `$EUID` where bash has it instead of running `id -u`.
const PROFILE_HOOK: &str =
    "--customize-hook=sed -i 's/\"$(id -u)\"/\"${EUID:-$(id -u)}\"/g' \"$1/etc/profile\"";

/// What every built-in root has: the `user` account with passwordless sudo, no package
/// caches, and the faster `/etc/profile`.
const BASE_HOOKS: [&str; 4] = [
    "--customize-hook=chroot \"$1\" useradd --create-home --shell /bin/bash --user-group user",
    "--customize-hook=echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > \"$1/etc/sudoers.d/user\" && chmod 0440 \"$1/etc/sudoers.d/user\"",
    "--customize-hook=rm -rf \"$1/var/cache/apt/archives\"/*.deb \"$1/var/lib/apt/lists\"/*_Packages",
    // Every command the SDKs run is a login shell, and Debian's /etc/profile forks
    // `id -u` to tell root (2.5 ms of a command's start here); bash knows its $EUID,
    // and sh, which does not, still asks `id`.
    PROFILE_HOOK,
];

/// A Debian root the node builds itself with mmdebstrap: the default template's, or the code
/// interpreter template's (the same root plus a Python environment).
#[derive(Debug)]
pub struct RootRecipe {
    /// The layer kind: the root lives in `<templates>/<name>-v<version>/rootfs` and is the
    /// layer `<name>/v<version>`.
    pub name: &'static str,
    /// Bump when the recipe changes.
    pub version: u32,
    /// Debian packages beyond mmdebstrap's minbase variant, comma-separated.
    pub packages: &'static str,
    /// mmdebstrap options (hooks) beyond [`BASE_HOOKS`], run in order after them.
    pub hooks: &'static [&'static str],
}

impl RootRecipe {
    pub fn layer(&self) -> String {
        format!("{}/v{}", self.name, self.version)
    }
}

/// The default template's root.
pub const BASE: RootRecipe = RootRecipe {
    name: "base",
    version: BASE_RECIPE_VERSION,
    packages: BASE_PACKAGES,
    hooks: &[],
};

#[derive(Debug, thiserror::Error)]
pub enum TemplateBuildError {
    #[error("{tool} is not installed (apt-get install {package}): {source}")]
    MissingTool {
        tool: &'static str,
        package: &'static str,
        source: std::io::Error,
    },
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot clear the mounts an interrupted build left in {path}: {source}")]
    Mounts {
        path: PathBuf,
        source: crate::storage::mounts::DetachError,
    },
    #[error("cannot wait for mmdebstrap: {0}")]
    Wait(std::io::Error),
    #[error("mmdebstrap failed with {status}; last output: {tail}")]
    Failed { status: String, tail: String },
}

/// Where the default template's root lives once built.
pub fn base_rootfs(templates_dir: &Path) -> PathBuf {
    root_path(&BASE, templates_dir)
}

/// Whether the default template is already built.
pub fn base_is_built(templates_dir: &Path) -> bool {
    root_is_built(&BASE, templates_dir)
}

/// Where a built-in root lives once built.
pub fn root_path(recipe: &RootRecipe, templates_dir: &Path) -> PathBuf {
    templates_dir
        .join(format!("{}-v{}", recipe.name, recipe.version))
        .join("rootfs")
}

/// Whether a built-in root is already built.
pub fn root_is_built(recipe: &RootRecipe, templates_dir: &Path) -> bool {
    root_path(recipe, templates_dir)
        .parent()
        .is_some_and(|d| d.join("complete").exists())
}

/// Builds the default template unless it is cached, reporting progress through `tracing`.
/// Returns the root filesystem's path.
pub async fn build_base(templates_dir: &Path, mirror: &str) -> Result<PathBuf, TemplateBuildError> {
    build_root(&BASE, templates_dir, mirror).await
}

/// Builds a built-in root unless it is cached, reporting progress through `tracing`.
/// Returns the root filesystem's path.
pub async fn build_root(
    recipe: &RootRecipe,
    templates_dir: &Path,
    mirror: &str,
) -> Result<PathBuf, TemplateBuildError> {
    let rootfs = root_path(recipe, templates_dir);
    if root_is_built(recipe, templates_dir) {
        return Ok(rootfs);
    }
    // Builds of built-in templates may run at once; one root at a time gets the machine, and
    // a second build of the same root finds it built.
    static BUILDING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _building = BUILDING.lock().await;
    if root_is_built(recipe, templates_dir) {
        return Ok(rootfs);
    }
    let name = recipe.name;
    let staging = templates_dir.join(format!(".{name}-v{}.partial", recipe.version));
    if staging.exists() {
        clear_interrupted_build(&staging, name).await?;
    }
    tokio::fs::create_dir_all(templates_dir)
        .await
        .map_err(io_error(templates_dir))?;

    tracing::info!(
        packages = recipe.packages,
        "building the root '{name}' with mmdebstrap"
    );
    let started = std::time::Instant::now();
    if !on_path("mmdebstrap") {
        return Err(TemplateBuildError::MissingTool {
            tool: "mmdebstrap",
            package: "mmdebstrap",
            source: std::io::ErrorKind::NotFound.into(),
        });
    }
    run_mmdebstrap(mmdebstrap_command(recipe, &staging, mirror), name, &staging).await?;
    install_root(&staging, &rootfs).await?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f32(),
        "the root '{name}' is ready"
    );
    Ok(rootfs)
}

/// Maps an I/O failure on `path` to the error that names it.
fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> TemplateBuildError {
    let path = path.to_owned();
    move |source| TemplateBuildError::Io { path, source }
}

/// Removes what an interrupted build left in `staging`, so the new build starts from an
/// empty directory.
async fn clear_interrupted_build(staging: &Path, name: &str) -> Result<(), TemplateBuildError> {
    // A server older than the namespaces below left its mounts on the host; they go first,
    // and the removal never walks into a mount anyway.
    let detached = crate::storage::mounts::detach_below(staging).map_err(|source| {
        TemplateBuildError::Mounts {
            path: staging.to_owned(),
            source,
        }
    })?;
    if detached > 0 {
        tracing::warn!(path = %staging.display(), mounts = detached, "unmounted what an interrupted build of '{name}' left mounted");
    }
    remove_tree_blocking(staging)
        .await
        .map_err(io_error(staging))?;
    tracing::info!(path = %staging.display(), "removed an interrupted build of '{name}'; building again");
    Ok(())
}

/// The mmdebstrap run for `recipe`, wrapped so that it and all it starts die with the server
/// and take their mounts with them.
fn mmdebstrap_command(
    recipe: &RootRecipe,
    staging: &Path,
    mirror: &str,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new("unshare");
    command
        // --kill-child: mmdebstrap (PID 1 of the new PID namespace, so every process of the
        // build dies with it) is killed when unshare is.
        .args([
            "--mount",
            "--propagation=private",
            "--pid",
            "--fork",
            "--kill-child=SIGKILL",
            "--",
            "mmdebstrap",
            "--variant=minbase",
            &format!("--include={}", recipe.packages),
        ])
        .args(BASE_HOOKS)
        .args(recipe.hooks)
        .arg("bookworm")
        .arg(staging)
        .arg(mirror)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A Ctrl-C at the server's terminal is the server's to act on, not the build's.
        .process_group(0)
        // Dropped when the build is cancelled (the server's shutdown aborts it).
        .kill_on_drop(true);
    let server = rustix::process::getpid();
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // The server dying by any means (kill -9 included) ends the build. The signal
            // goes when the forking thread exits, hence `tied_children`.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // Gone already, before the signal was armed; no allocation between fork and exec.
            if rustix::process::getppid() != Some(server) {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    command
}

/// Runs mmdebstrap to its end, showing its phases in the server's log and keeping the last
/// lines of its output for the error should it fail; a failed build's staging goes.
async fn run_mmdebstrap(
    command: tokio::process::Command,
    name: &str,
    staging: &Path,
) -> Result<(), TemplateBuildError> {
    let mut child =
        crate::tied_children::spawn(command).map_err(|source| TemplateBuildError::MissingTool {
            tool: "unshare",
            package: "util-linux",
            source,
        })?;
    let group = child.id().map(GroupKill);

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
    let tail = follow_phases(stderr, name).await;
    let _ = stdout_task.await;
    let status = child.wait().await.map_err(TemplateBuildError::Wait)?;
    // Reaped: its PID (the group's ID) may be anyone's now.
    std::mem::forget(group);
    if !status.success() {
        let _ = remove_tree_blocking(staging).await;
        return Err(TemplateBuildError::Failed {
            status: status.to_string(),
            tail: tail.join(" | "),
        });
    }
    Ok(())
}

/// Reads mmdebstrap's stderr to its end: its phases go to the server's log, and the last 20
/// lines are returned for an error message.
async fn follow_phases(stderr: Option<tokio::process::ChildStderr>, name: &str) -> Vec<String> {
    let mut tail: Vec<String> = Vec::new();
    if let Some(stderr) = stderr {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            // mmdebstrap reports its phases as "I: ..." lines on stderr.
            if line.starts_with("I: ") || line.starts_with("E: ") || line.starts_with("W: ") {
                tracing::info!(target: "sandbar::template", "{name}: {}", &line[3..]);
            }
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
    }
    tail
}

/// Moves a finished build from `staging` to `rootfs` and marks it complete; the marker
/// comes last, so a root without it is never taken for built.
async fn install_root(staging: &Path, rootfs: &Path) -> Result<(), TemplateBuildError> {
    let target_dir = rootfs.parent().map(Path::to_owned).unwrap_or_default();
    if target_dir.exists() {
        remove_tree_blocking(&target_dir)
            .await
            .map_err(io_error(&target_dir))?;
    }
    tokio::fs::create_dir_all(&target_dir)
        .await
        .map_err(io_error(&target_dir))?;
    tokio::fs::rename(staging, rootfs)
        .await
        .map_err(io_error(rootfs))?;
    let marker = target_dir.join("complete");
    tokio::fs::write(&marker, b"")
        .await
        .map_err(io_error(&marker))?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum RemoveBaseError {
    #[error("cannot list {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot clear the mounts left in {path}: {source}")]
    Mounts {
        path: PathBuf,
        source: crate::storage::mounts::DetachError,
    },
    #[error("cannot remove {path}: {source}")]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The built-in roots this node builds; any other version of theirs is an earlier recipe.
fn built_in_roots() -> [&'static RootRecipe; 3] {
    [
        &BASE,
        &crate::build::interpreter::INTERPRETER_ROOT,
        &crate::build::desktop::DESKTOP_ROOT,
    ]
}

/// The recipe of the built-in root named by the layer `layer` (`base/v2`, …).
pub fn built_in_root(layer: &str) -> Option<&'static RootRecipe> {
    built_in_roots()
        .into_iter()
        .find(|recipe| recipe.layer() == layer)
}

/// The kind and recipe version of a directory in the templates directory that holds a
/// built-in root of an earlier recipe (`base-v1`, or `.base-v1.partial` for an interrupted
/// build of one; `interpreter-v…` likewise).
fn superseded_version(name: &str) -> Option<(&'static str, u32)> {
    built_in_roots().into_iter().find_map(|recipe| {
        let complete = format!("{}-v", recipe.name);
        let partial = format!(".{}-v", recipe.name);
        let digits = name.strip_prefix(complete.as_str()).or_else(|| {
            name.strip_prefix(partial.as_str())?
                .strip_suffix(".partial")
        })?;
        if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let version: u32 = digits.parse().ok()?;
        (version != recipe.version).then_some((recipe.name, version))
    })
}

/// Removes the built-in roots of earlier recipes that no layer name in `keep` refers to, and
/// interrupted builds of them; returns the layer names removed. Only for the server's start,
/// before anything is served: `keep` must name every layer a template, tagged build or
/// recorded sandbox uses, and no create may be resolving a template meanwhile.
pub fn remove_superseded_bases(
    templates_dir: &Path,
    keep: &std::collections::BTreeSet<String>,
) -> Result<Vec<String>, RemoveBaseError> {
    let entries = match std::fs::read_dir(templates_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(RemoveBaseError::List {
                path: templates_dir.to_owned(),
                source,
            });
        }
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((kind, version)) = superseded_version(&name) else {
            continue;
        };
        let layer = format!("{kind}/v{version}");
        let complete = !name.starts_with('.');
        if complete && keep.contains(&layer) {
            continue;
        }
        let path = entry.path();
        if !complete {
            crate::storage::mounts::detach_below(&path).map_err(|source| {
                RemoveBaseError::Mounts {
                    path: path.clone(),
                    source,
                }
            })?;
        }
        crate::storage::disks::remove_tree(&path).map_err(|source| RemoveBaseError::Remove {
            path: path.clone(),
            source,
        })?;
        if complete {
            removed.push(layer);
        }
    }
    removed.sort();
    Ok(removed)
}

/// Kills a build's process group when the build is cancelled before it was reaped: anything
/// of it that escaped the PID namespace's teardown (nothing should) goes too.
struct GroupKill(u32);

impl Drop for GroupKill {
    fn drop(&mut self) {
        if let Some(pid) = i32::try_from(self.0)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

async fn remove_tree_blocking(path: &Path) -> std::io::Result<()> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || crate::storage::disks::remove_tree(&path))
        .await
        .map_err(std::io::Error::other)?
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_layer_store_knows_every_built_in_root() {
        let names: Vec<_> = built_in_roots().iter().map(|recipe| recipe.name).collect();
        assert_eq!(names, crate::storage::layers::BUILT_IN_ROOTS);
        for recipe in built_in_roots() {
            assert_eq!(
                built_in_root(&recipe.layer()).map(|r| r.name),
                Some(recipe.name)
            );
        }
        assert!(built_in_root("desktop/v0").is_none());
    }

    #[test]
    fn every_built_in_root_extends_the_default_one() {
        for recipe in built_in_roots() {
            assert!(
                recipe.packages.starts_with(BASE.packages),
                "{}",
                recipe.name
            );
            assert!(
                recipe
                    .hooks
                    .iter()
                    .all(|h| h.starts_with("--customize-hook=")),
                "{}",
                recipe.name
            );
        }
    }

    #[test]
    fn the_layer_name_follows_the_recipe_version() {
        assert_eq!(BASE_LAYER, format!("base/v{BASE_RECIPE_VERSION}"));
        assert!(BASE_PACKAGES.split(',').any(|p| p == "git"));
    }

    #[test]
    fn only_earlier_roots_nothing_names_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let current = format!("base-v{BASE_RECIPE_VERSION}");
        let interpreter = crate::build::interpreter::INTERPRETER_ROOT.version;
        let current_interpreter = format!("interpreter-v{interpreter}");
        let earlier_interpreter = format!("interpreter-v{}", interpreter - 1);
        for name in [
            "base-v0",
            "base-v1",
            ".base-v1.partial",
            current.as_str(),
            "base-vx",
            "other",
            earlier_interpreter.as_str(),
            current_interpreter.as_str(),
        ] {
            std::fs::create_dir_all(dir.join(name).join("rootfs/etc")).unwrap();
        }
        let keep = std::collections::BTreeSet::from(["base/v0".to_owned()]);
        let removed = remove_superseded_bases(dir, &keep).unwrap();
        assert_eq!(
            removed,
            vec![
                "base/v1".to_owned(),
                format!("interpreter/v{}", interpreter - 1)
            ]
        );
        let mut left: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected = vec![
            "base-v0".to_owned(),
            "base-vx".into(),
            "other".into(),
            current,
            current_interpreter.clone(),
        ];
        expected.sort();
        assert_eq!(left, expected);
        assert!(
            remove_superseded_bases(&dir.join("missing"), &keep)
                .unwrap()
                .is_empty()
        );
    }
}
