//! Checkpoints carried from a lost node: a node that takes over a sandbox paused to disk
//! elsewhere fetches the checkpoint of its processes, checks that it can restore it here, and
//! restores it into a slot of its own at the sandbox's next boot.

use std::path::Path;

use sandbar_core::{CarriedCheckpoint, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};

use crate::net::netns::PreparedNetns;

use super::criu_runs::{SnapshotOrigin, check_criu_version};
use super::host::LinuxHost;
use super::launch::Launcher;
use super::restore::SlotRestore;
use super::{SANDBOX_IDS, host_ops, run_blocking, sandbox_err, sequence};

impl Launcher {
    /// Fetches the checkpoint `blob` of sandbox `id` and checks that this node can restore
    /// it: its images intact, the CRIU that made it, the agent its processes ran present
    /// here, and no volume (volumes stay with the node that was lost).
    pub(super) async fn carry_checkpoint(
        &self,
        id: &str,
        blob: &sandbar_core::LayerBlob,
    ) -> Result<CarriedCheckpoint, RuntimeError> {
        let Some(shared) = self.node.shared_layers.get() else {
            return Err(sandbox_err(id, "this node has no layer store"));
        };
        let criu = self.node.criu_for_restore(id).await?;
        let dir = self.node.places.carried_checkpoint_dir(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", dir.display())))?;
        shared
            .fetch_sandbox_files(blob, &dir)
            .await
            .map_err(|e| sandbox_err(id, e))?;
        let checked = {
            let dir = dir.clone();
            let agents = self.node.places.agents_dir();
            let libraries = self.node.library_sources();
            run_blocking(id, move || -> Result<_, String> {
                // Everything below is read by path: a checkpoint is regular files only, so
                // no entry of the archive can lead a read anywhere else.
                for entry in
                    std::fs::read_dir(&dir).map_err(|e| format!("read {}: {e}", dir.display()))?
                {
                    let entry = entry.map_err(|e| format!("read {}: {e}", dir.display()))?;
                    if !entry.file_type().is_ok_and(|t| t.is_file()) {
                        return Err(format!(
                            "the checkpoint holds {}, which is not a regular file",
                            entry.file_name().to_string_lossy()
                        ));
                    }
                }
                let header = crate::checkpoint::read_header(&dir, true)
                    .map_err(|e| format!("the checkpoint is not usable: {e}"))?;
                let origin: SnapshotOrigin = serde_json::from_slice(
                    &std::fs::read(dir.join(crate::checkpoint::CARRY_ORIGIN))
                        .map_err(|e| format!("the checkpoint has no origin: {e}"))?,
                )
                .map_err(|e| format!("the checkpoint's origin is unreadable: {e}"))?;
                if header
                    .externals
                    .iter()
                    .any(|e| matches!(e, crate::checkpoint::External::Volume { .. }))
                {
                    return Err("its processes hold volumes, which were on the lost node".into());
                }
                // Only to see that this node has the agent the checkpoint's processes ran
                // (by its digest, whichever node copied it when); the restore opens it again.
                crate::checkpoint::open_externals(
                    &header,
                    crate::checkpoint::PlacedSources {
                        agents: &agents,
                        log: None,
                        layers: None,
                        libraries: &libraries,
                    },
                )
                .map_err(|e| e.to_string())?;
                Ok((header, origin))
            })
            .await?
        };
        let (header, origin) = checked;
        check_criu_version(id, &criu, &header)?;
        self.node.set_verified(&dir, true);
        Ok(CarriedCheckpoint {
            origin_id_base: origin.id_base,
        })
    }

    /// Boots sandbox `spec`, taken over from a lost node, by restoring the checkpoint carried
    /// from there into `netns`, on its kept files (`kept`), with this node's ids, network,
    /// cgroups and log. Its token, environment, machine id and boot id stay what they were.
    pub(super) async fn launch_carried(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        kept: &RuntimeHandle,
        carried: &CarriedCheckpoint,
    ) -> Result<(RuntimeHandle, Endpoint), (Option<RuntimeHandle>, RuntimeError)> {
        let id = &spec.sandbox_id;
        let slot = netns.slot;
        let started = std::time::Instant::now();
        let id_map = self.node.id_map(slot);
        let bare = |e: RuntimeError| (None, e);
        let source = self.node.places.carried_checkpoint_dir(id);
        let work = self.node.places.checkpoint_dir(id);
        let verify = !self.node.is_verified(&source);
        let header = {
            let (source, work) = (source.clone(), work.clone());
            let (from, to) = (carried.origin_id_base, id_map.host_base);
            run_blocking(id, move || {
                stage_checkpoint(&source, &work, verify, from, to)
            })
            .await
            .map_err(bare)?
        };
        let restored = sequence::restore_in_slot(
            &LinuxHost(&self.node),
            spec,
            netns,
            id_map,
            self.node.limits_of(spec),
            host_ops::DiskSource::Kept {
                id_base: kept.id_base.unwrap_or(0),
            },
            SlotRestore {
                work,
                header,
                // The same machine on another network: only its name server moves.
                machine_id: None,
                boot_id: kept.boot_id.clone(),
            },
        )
        .await;
        let _ = crate::storage::disks::remove_tree(&source);
        self.node.set_verified(&source, false);
        let (handle, endpoint) = restored?;
        tracing::info!(
            sandbox_id = %id,
            ms = started.elapsed().as_millis() as u64,
            "sandbox restored from a checkpoint carried from a lost node"
        );
        Ok((handle, endpoint))
    }
}

/// Why a checkpoint could not be laid out for a restore.
#[derive(Debug, thiserror::Error)]
pub(super) enum StageError {
    #[error("the checkpoint is not usable: {0}")]
    Unusable(#[from] crate::checkpoint::HeaderError),
    #[error("the checkpoint has {0} user namespace images, not one")]
    UserNamespaces(usize),
    #[error("the checkpoint's user namespace image is not one this node reads")]
    UnknownUserNamespace,
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn stage_io(
    what: &'static str,
    path: impl std::fmt::Display,
) -> impl FnOnce(std::io::Error) -> StageError {
    let path = path.to_string();
    move |source| StageError::Io { what, path, source }
}

/// Lays the checkpoint images of `source` out in `work` for one restore: links to them, but
/// the user namespace image rewritten from the host ids at `from` to those at `to` (restored
/// with the ids it was dumped with, a sandbox could touch another's files). Returns the
/// checkpoint's header, its images checked when `verify`.
pub(super) fn stage_checkpoint(
    source: &Path,
    work: &Path,
    verify: bool,
    from: u32,
    to: u32,
) -> Result<crate::checkpoint::Header, StageError> {
    let header = crate::checkpoint::read_header(source, verify)?;
    let _ = crate::storage::disks::remove_tree(work);
    std::fs::create_dir_all(work).map_err(stage_io("create", work.display()))?;
    let user_namespaces = header
        .images
        .iter()
        .filter(|i| crate::checkpoint::is_userns_image(&i.name))
        .count();
    if user_namespaces != 1 {
        return Err(StageError::UserNamespaces(user_namespaces));
    }
    for image in &header.images {
        if crate::checkpoint::is_userns_image(&image.name) {
            let bytes =
                std::fs::read(source.join(&image.name)).map_err(stage_io("read", &image.name))?;
            let moved = crate::checkpoint::remap_userns_image(&bytes, from, to, SANDBOX_IDS)
                .ok_or(StageError::UnknownUserNamespace)?;
            std::fs::write(work.join(&image.name), moved)
                .map_err(stage_io("write", &image.name))?;
        } else {
            std::fs::hard_link(source.join(&image.name), work.join(&image.name))
                .map_err(stage_io("link", &image.name))?;
        }
    }
    Ok(header)
}
