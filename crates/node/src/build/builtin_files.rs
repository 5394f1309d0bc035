//! Files the node gives its built-in templates (a server binary, scripts, settings): staged as
//! uploads of the built-in namespace and placed by `COPY` steps, so the layer cache keys them
//! by content like any tenant's upload, and a changed file rebuilds only the layers above it.

use std::io::Write;
use std::path::{Path, PathBuf};

use sandbar_core::builds::{BuildStep, StepKind};
use sha2::{Digest, Sha256};

/// The upload namespace the builder reads built-in templates' files from.
pub const BUILTIN_UPLOADS: &str = "builtin";

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

/// One file of a staged upload: its name in the archive, its mode and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct StagedFile<'a> {
    name: &'a str,
    mode: u32,
    body: &'a [u8],
}

impl<'a> StagedFile<'a> {
    pub fn new(name: &'a str, mode: u32, body: &'a [u8]) -> Self {
        Self { name, mode, body }
    }
}

/// Writes `files` as one archive into the built-in upload namespace under `uploads_dir`
/// (unless the same archive is there already) and returns the upload's hash.
pub fn stage(uploads_dir: &Path, files: &[StagedFile<'_>]) -> Result<String, StageError> {
    let archive = archive(files).map_err(|source| StageError::Write {
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
    Ok(hash)
}

/// Removes every staged upload of the built-in namespace but those in `keep`: what earlier
/// versions of the built-in templates staged. Builds copy an upload while they run, so this is
/// for the server's start, before any built-in build is started.
pub fn remove_all_but(uploads_dir: &Path, keep: &[&str]) {
    let dir = uploads_dir.join(BUILTIN_UPLOADS);
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name();
        if !keep.iter().any(|kept| name == **kept) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn archive(files: &[StagedFile<'_>]) -> std::io::Result<Vec<u8>> {
    let mut archive = tar::Builder::new(Vec::new());
    for file in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(file.body.len() as u64);
        header.set_mode(file.mode);
        // Fixed, so the same files always make the same archive and hit the layer cache.
        header.set_mtime(0);
        header.set_cksum();
        archive.append_data(&mut header, file.name, file.body)?;
    }
    archive.into_inner()
}

/// A `COPY` of the staged file `src` to `dest`, owned by `owner`.
pub fn copy(src: &str, dest: &str, owner: &str, files_hash: &str) -> BuildStep {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn staged_names(uploads: &Path) -> Vec<String> {
        let mut names: Vec<_> = std::fs::read_dir(uploads.join(BUILTIN_UPLOADS))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn staging_is_deterministic_and_only_the_kept_uploads_stay() {
        let tmp = tempfile::tempdir().unwrap();
        let uploads = tmp.path().join("uploads");
        let one = [
            StagedFile::new("a", 0o755, b"one"),
            StagedFile::new("b", 0o644, b"x"),
        ];
        let first = stage(&uploads, &one).unwrap();
        assert_eq!(stage(&uploads, &one).unwrap(), first);
        assert!(sandbar_core::builds::valid_files_hash(&first));
        let second = stage(&uploads, &[StagedFile::new("a", 0o755, b"two")]).unwrap();
        let third = stage(&uploads, &[StagedFile::new("c", 0o644, b"three")]).unwrap();
        assert_ne!(first, second);
        let mut both = vec![second.clone(), third.clone()];
        both.sort();
        remove_all_but(&uploads, &[&second, &third]);
        assert_eq!(staged_names(&uploads), both);

        let archive = std::fs::read(uploads.join(BUILTIN_UPLOADS).join(&first));
        assert!(archive.is_err(), "the upload no template names is gone");
        let archive = std::fs::read(uploads.join(BUILTIN_UPLOADS).join(&second)).unwrap();
        let entries: Vec<_> = tar::Archive::new(archive.as_slice())
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().display().to_string(),
                    e.header().mode().unwrap(),
                )
            })
            .collect();
        assert_eq!(entries, vec![("a".to_owned(), 0o755)]);
    }
}
