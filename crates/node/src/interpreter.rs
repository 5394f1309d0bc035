//! The built-in `code-interpreter-v1` template, the one E2B's code interpreter SDKs create by
//! default: the default template's Debian root, a Python virtual environment with ipykernel,
//! bash_kernel and the usual data libraries (numpy, pandas, matplotlib, scipy, scikit-learn),
//! and `sandbar-interpreter` serving E2B's execution API on port 49999 as its start command.
//!
//! It is an ordinary build of the build service from a root the node makes with mmdebstrap
//! ([`INTERPRETER_ROOT`]). The two files it takes from the node (the
//! server binary and an IPython startup script) are staged as an upload of the built-in
//! namespace and placed by a `COPY` step, so the layer cache keys them by content like any
//! upload; nothing of the recipe comes from a tenant.

use std::io::Write;
use std::path::{Path, PathBuf};

use sandbar_core::builds::{BuildSource, BuildSpec, BuildStep, StepKind};
use sha2::{Digest, Sha256};

use crate::templates::RootRecipe;

/// Where the server listens inside the sandbox (the SDKs' `JUPYTER_PORT`).
pub const INTERPRETER_PORT: u16 = sandbar_core::network::CODE_INTERPRETER_PORT;
/// The upload namespace the builder reads built-in templates' files from.
pub const BUILTIN_UPLOADS: &str = "builtin";
const VENV: &str = "/opt/sandbar/interpreter";
/// Its root's layer name; always `interpreter/v{INTERPRETER_ROOT.version}`.
pub const INTERPRETER_LAYER: &str = "interpreter/v2";
const SERVER_PATH: &str = "/usr/local/bin/sandbar-interpreter";
const STARTUP_DIR: &str = "/home/user/.ipython/profile_default/startup/";
const STARTUP_NAME: &str = "00-sandbar.py";
const STARTUP_SCRIPT: &str = include_str!("interpreter/ipython_startup.py");

/// The template's root: the default template's packages plus the venv module, and a Python
/// environment owned by the sandbox's user (so `pip install` in a kernel works as on E2B) with
/// pinned packages from PyPI, taken as wheels only (no package's code runs while it
/// installs). Built on the host like the default root, so the build needs the host's network
/// and resolver, not a sandbox's. matplotlib's font cache is made now, not at a sandbox's
/// first plot.
pub const INTERPRETER_ROOT: RootRecipe = RootRecipe {
    name: "interpreter",
    version: 2,
    packages: "bash,python3,ca-certificates,sudo,procps,curl,git,iproute2,coreutils,python3-venv",
    hooks: &[
        "--customize-hook=chroot \"$1\" python3 -m venv /opt/sandbar/interpreter",
        // With the host's CA certificates, which a host behind a TLS-inspecting proxy needs
        // and which the new root does not have (gone again when pip is done), and none of the
        // host's environment: its certificate and pip settings name the host's files.
        "--customize-hook=cp /etc/ssl/certs/ca-certificates.crt \"$1/tmp/.host-ca.crt\" \
         || cp \"$1/etc/ssl/certs/ca-certificates.crt\" \"$1/tmp/.host-ca.crt\"; \
         chroot \"$1\" env -i PATH=/usr/bin:/bin HOME=/root \
         /opt/sandbar/interpreter/bin/pip install --cert /tmp/.host-ca.crt \
         --no-cache-dir --only-binary=:all: \
         --disable-pip-version-check --progress-bar off \
         ipykernel==7.4.0 ipython==9.18.1 bash_kernel==0.10.0 numpy==2.4.6 pandas==3.1.1 \
         matplotlib==3.11.2 pydantic==2.14.4 e2b-charts==1.0.0 scipy==1.17.1 \
         scikit-learn==1.9.1; \
         status=$?; rm -f \"$1/tmp/.host-ca.crt\"; exit $status",
        "--customize-hook=chroot \"$1\" chown -R user:user /opt/sandbar/interpreter",
        "--customize-hook=chroot \"$1\" su user -c '/opt/sandbar/interpreter/bin/python -c \"import matplotlib.pyplot\"'",
    ],
};

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Writes the files the recipe copies (a tar holding the server binary and the startup
/// script) into the built-in upload namespace under `uploads_dir`, removes earlier ones, and
/// returns the upload's hash.
pub fn stage_files(uploads_dir: &Path, interpreter_bin: &Path) -> Result<String, StageError> {
    let binary = std::fs::read(interpreter_bin).map_err(|source| StageError::Read {
        path: interpreter_bin.to_owned(),
        source,
    })?;
    let archive = files_archive(&binary).map_err(|source| StageError::Write {
        path: uploads_dir.to_owned(),
        source,
    })?;
    let hash = hex::encode(Sha256::digest(&archive));
    let dir = uploads_dir.join(BUILTIN_UPLOADS);
    let write_error = |path: &Path| {
        let path = path.to_owned();
        move |source| StageError::Write { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(write_error(&dir))?;
    let target = dir.join(&hash);
    if !target.is_file() {
        let staging = dir.join(format!(".staging-{hash}"));
        let mut file = std::fs::File::create(&staging).map_err(write_error(&staging))?;
        file.write_all(&archive)
            .and_then(|()| file.sync_all())
            .map_err(write_error(&staging))?;
        std::fs::rename(&staging, &target).map_err(write_error(&target))?;
    }
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        if entry.file_name() != hash.as_str() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(hash)
}

fn files_archive(binary: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut archive = tar::Builder::new(Vec::new());
    for (name, mode, body) in [
        ("sandbar-interpreter", 0o755, binary),
        (STARTUP_NAME, 0o644, STARTUP_SCRIPT.as_bytes()),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(body.len() as u64);
        header.set_mode(mode);
        // Fixed, so the same files always make the same archive and hit the layer cache.
        header.set_mtime(0);
        header.set_cksum();
        archive.append_data(&mut header, name, body)?;
    }
    archive.into_inner()
}

fn copy(src: &str, dest: &str, owner: &str, files_hash: &str) -> BuildStep {
    BuildStep {
        kind: StepKind::Copy {
            src: src.to_owned(),
            dest: dest.to_owned(),
            owner: Some(owner.to_owned()),
            mode: None,
            files_hash: files_hash.to_owned(),
        },
        force: false,
    }
}

/// The template's recipe; `files_hash` names the staged files (see [`stage_files`]).
pub fn build_spec(files_hash: &str) -> BuildSpec {
    BuildSpec {
        source: BuildSource::Builtin {
            layer: INTERPRETER_LAYER.into(),
        },
        steps: vec![
            copy("sandbar-interpreter", SERVER_PATH, "root", files_hash),
            copy(STARTUP_NAME, STARTUP_DIR, "user", files_hash),
        ],
        force: false,
        start_cmd: Some(format!(
            "{SERVER_PATH} --listen 0.0.0.0:{INTERPRETER_PORT} --python {VENV}/bin/python"
        )),
        ready_cmd: Some(format!(
            "curl -sf -o /dev/null http://127.0.0.1:{INTERPRETER_PORT}/health"
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn staging_is_deterministic_and_replaces_earlier_files() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::write(&bin, b"one").unwrap();
        let uploads = tmp.path().join("uploads");
        let first = stage_files(&uploads, &bin).unwrap();
        assert_eq!(stage_files(&uploads, &bin).unwrap(), first);
        assert!(sandbar_core::builds::valid_files_hash(&first));
        std::fs::write(&bin, b"two").unwrap();
        let second = stage_files(&uploads, &bin).unwrap();
        assert_ne!(first, second);
        let left: Vec<_> = std::fs::read_dir(uploads.join(BUILTIN_UPLOADS))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec![second.clone()]);
        let archive = std::fs::read(uploads.join(BUILTIN_UPLOADS).join(&second)).unwrap();
        let mut names = Vec::new();
        for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
            names.push(entry.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(names, vec!["sandbar-interpreter", STARTUP_NAME]);
    }

    #[test]
    fn the_root_extends_the_default_one() {
        assert_eq!(INTERPRETER_LAYER, INTERPRETER_ROOT.layer());
        assert!(
            INTERPRETER_ROOT
                .packages
                .starts_with(crate::templates::BASE.packages)
        );
        assert!(
            INTERPRETER_ROOT
                .hooks
                .iter()
                .all(|h| h.starts_with("--customize-hook="))
        );
        assert!(INTERPRETER_ROOT.hooks[1].contains("--only-binary=:all:"));
        assert!(INTERPRETER_ROOT.hooks[1].contains("rm -f"));
    }

    #[test]
    fn the_recipe_starts_the_server_and_checks_its_health() {
        let spec = build_spec(&"a".repeat(64));
        assert!(spec.start_cmd.unwrap().contains("49999"));
        assert!(spec.ready_cmd.unwrap().contains("/health"));
        assert!(spec.steps.iter().all(
            |s| !matches!(&s.kind, StepKind::Copy { files_hash, .. } if files_hash.len() != 64)
        ));
    }
}
