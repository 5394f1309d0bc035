//! The content-addressed copies of the agent binary that sandboxes run.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::NodeError;

/// Copies the agent binary to `<data>/agents/<sha256>` (once) and returns that path and the
/// digest: sandboxes run the copy, so a checkpoint's processes map a file that stays as it was
/// when the server's own binary is replaced.
pub(super) fn keep_agent(
    agent_bin: &Path,
    data_dir: &Path,
) -> Result<(PathBuf, String), NodeError> {
    use sha2::Digest;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| NodeError::Io { path, source }
    };
    let bytes = std::fs::read(agent_bin).map_err(io(agent_bin))?;
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let dir = data_dir.join("agents");
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let kept = dir.join(&digest);
    if !kept.exists() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = dir.join(format!(".{digest}.tmp"));
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &kept).map_err(io(&kept))?;
    }
    Ok((kept, digest))
}

/// Removes the agent copies under `<data>/agents/` that neither this server runs (`current`),
/// nor a checkpoint or snapshot names, nor a live process maps (a sandbox started by an
/// earlier build, which a later checkpoint would name); returns what it removed.
pub(super) fn collect_agent_copies(data_dir: &Path, current: &str) -> Vec<PathBuf> {
    let agents = data_dir.join("agents");
    let Ok(entries) = std::fs::read_dir(&agents) else {
        return Vec::new();
    };
    let copies: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.len() == 64 && name.bytes().all(|c| c.is_ascii_hexdigit()))
        .filter(|name| name != current)
        .collect();
    if copies.is_empty() {
        return Vec::new();
    }
    let mut used = BTreeSet::new();
    for kind in ["checkpoints", "snapshots"] {
        let Ok(dirs) = std::fs::read_dir(data_dir.join(kind)) else {
            continue;
        };
        for dir in dirs
            .flatten()
            .filter(|d| d.file_type().is_ok_and(|t| t.is_dir()))
        {
            // Incomplete ones too: a dump under way names the copy it is dumping.
            match crate::checkpoint::read_header(&dir.path(), false) {
                Ok(header) => {
                    used.insert(header.agent_digest);
                }
                Err(_) => {
                    used.extend(copies.iter().cloned());
                }
            }
        }
    }
    let prefix = agents.to_string_lossy().into_owned();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for process in procs.flatten() {
            let Ok(maps) = std::fs::read_to_string(process.path().join("maps")) else {
                continue;
            };
            for line in maps.lines().filter(|l| l.contains(&prefix)) {
                if let Some(name) = line.rsplit('/').next() {
                    used.insert(name.trim_end_matches(" (deleted)").to_owned());
                }
            }
        }
    }
    copies
        .into_iter()
        .filter(|name| !used.contains(name))
        .map(|name| agents.join(name))
        .filter(|path| std::fs::remove_file(path).is_ok())
        .collect()
}

/// The agent copies under `<data>/agents/`, each by identity and digest (its name).
pub(super) fn kept_agent_copies(data_dir: &Path) -> Vec<(crate::checkpoint::FileIdentity, String)> {
    let Ok(entries) = std::fs::read_dir(data_dir.join("agents")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_owned();
            if name.len() != 64 || !name.bytes().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            let identity = crate::checkpoint::FileIdentity::of_path(&entry.path()).ok()?;
            Some((identity, name))
        })
        .collect()
}

/// A shared library the agent binary is linked against, as this host's loader resolves it.
#[derive(Debug, Clone)]
pub(super) struct AgentLibrary {
    pub(super) identity: crate::checkpoint::FileIdentity,
    /// SHA-256 of its content: a checkpoint names the library by it.
    pub(super) digest: String,
    pub(super) path: PathBuf,
}

/// The shared libraries `agent` maps from the host. The dynamic loader lists them without
/// running the program when `LD_TRACE_LOADED_OBJECTS` is set (what `ldd` does); empty for a
/// static binary or when the list cannot be had, in which case a checkpoint of a sandbox
/// that maps one is refused rather than trusted.
pub(super) fn agent_libraries(agent: &Path) -> Vec<AgentLibrary> {
    use sha2::Digest;
    let Ok(output) = std::process::Command::new(agent)
        .env_clear()
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .filter_map(|line| {
            let before_address = line.rsplit_once(" (0x")?.0;
            let path = before_address.rsplit("=> ").next()?.trim();
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .filter_map(|path| {
            let path = std::fs::canonicalize(&path).ok()?;
            let identity = crate::checkpoint::FileIdentity::of_path(&path).ok()?;
            let digest = hex::encode(sha2::Sha256::digest(std::fs::read(&path).ok()?));
            Some(AgentLibrary {
                identity,
                digest,
                path,
            })
        })
        .collect()
}
