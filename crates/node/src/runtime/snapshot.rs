//! Snapshots: a running sandbox copied (memory and files) into a template image, and
//! sandboxes restored from one.

use std::path::Path;
use std::time::Duration;

use sandbar_core::{Endpoint, LaunchSpec, RuntimeError, RuntimeHandle, SnapshotParts};

use crate::net::netns::PreparedNetns;

use super::carried::stage_checkpoint;
use super::criu_runs::{SNAPSHOT_ORIGIN, SnapshotOrigin, check_criu_version};
use super::handle::{is_alive, launched};
use super::host::LinuxHost;
use super::jailed::default_workdir;
use super::launch::Launcher;
use super::layers::is_snapshot_key;
use super::pausing::{HOST_SOCKETS_PATIENCE, Pauser};
use super::restore::SlotRestore;
use super::{SANDBOX_IDS, agent_client, host_ops, ns_inode, run_blocking, sandbox_err, sequence};

node_part! {
    /// Makes and discards snapshots of sandboxes: their files and, when asked, their memory.
    pub(super) struct Snapshotter;
}

/// A new snapshot's name: unique to this sandbox, moment and process.
fn new_snapshot_key(id: &str) -> String {
    use sha2::Digest;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hex::encode(sha2::Sha256::digest(format!(
        "{id}/{nanos}/{}",
        std::process::id()
    )))[..32]
        .to_owned()
}

impl Snapshotter {
    /// Copies sandbox `id` into a snapshot: frozen, its processes dumped (left running) and
    /// its writable layer snapshotted, then thawed; the copies are made into a layer and a
    /// checkpoint after it runs again.
    pub(super) async fn snapshot(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        agent_token: &str,
        memory: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        let h = launched(id, handle)?;
        let criu = self.node.criu.get();
        let criu = match (criu.as_deref(), memory) {
            (Some(criu), true) => Some(criu),
            (None, true) => {
                return Err(sandbox_err(
                    id,
                    "this node cannot snapshot memory (no usable CRIU); a snapshot with memory: false copies the files only",
                ));
            }
            (_, false) => None,
        };
        if !is_alive(h) {
            return Err(sandbox_err(id, "the sandbox's processes are gone"));
        }
        let base = h
            .id_base
            .ok_or_else(|| sandbox_err(id, "the sandbox runs without its own user namespace"))?;
        let key = new_snapshot_key(id);
        let mut parts = SnapshotParts {
            layer: crate::storage::layers::LayerStore::step_layer_name(&key),
            checkpoint: memory.then(|| format!("checkpoint/{key}")),
            checkpoint_bytes: 0,
        };
        self.keep_from_collector(&parts);
        let images = self.node.places.snapshots_dir().join(&key);
        let layer_dir = self.node.layers.steps_dir().join(&key);
        let discard = || {
            let _ = crate::storage::disks::remove_tree(&images);
            let _ = self
                .node
                .disks
                .remove_at(self.node.layers.steps_dir(), &key);
        };
        if memory {
            std::fs::create_dir_all(&images)
                .map_err(|e| sandbox_err(id, format!("create {}: {e}", images.display())))?;
        }
        let (copied, held) = self.copy_held_still(id, h, criu, &images, &key).await;
        sandbar_core::faults::crash_point("snapshot.copied");
        let plan = match copied {
            Ok(plan) => plan,
            Err(e) => {
                discard();
                return Err(e);
            }
        };
        let with_memory = plan.zip(criu.map(|c| c.version.clone()));
        let origin = SnapshotOrigin {
            id_base: base,
            access_token: agent_token.to_owned(),
            log: self.node.places.log_path(id),
        };
        match self
            .seal_snapshot(id, &layer_dir, &images, base, origin, with_memory)
            .await
        {
            Ok(bytes) => parts.checkpoint_bytes = bytes,
            Err(e) => {
                discard();
                return Err(e);
            }
        }
        if memory {
            self.node.set_verified(&images, true);
        }
        tracing::info!(
            sandbox_id = %id,
            held_ms = held.as_millis() as u64,
            layer = %parts.layer,
            "sandbox snapshotted"
        );
        Ok(parts)
    }

    /// Keeps the collector off a new snapshot's parts until a template holds them.
    fn keep_from_collector(&self, parts: &SnapshotParts) {
        self.node
            .fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(
                std::iter::once(parts.layer.clone())
                    .chain(parts.checkpoint.clone())
                    .map(|name| (name, std::time::Instant::now())),
            );
    }

    /// Freezes sandbox `id` (settled first when its memory is dumped), copies it and thaws
    /// it again unless it was frozen before; returns the dump's plan when memory was dumped,
    /// and how long the sandbox was held still.
    async fn copy_held_still(
        &self,
        id: &str,
        h: &RuntimeHandle,
        criu: Option<&crate::checkpoint::Criu>,
        images: &Path,
        key: &str,
    ) -> (
        Result<Option<crate::checkpoint::DumpPlan>, RuntimeError>,
        Duration,
    ) {
        let Some(freezer) = self.node.cgroups.freezer_dir(id) else {
            return (
                Err(sandbox_err(id, "the freezer controller is not mounted")),
                Duration::ZERO,
            );
        };
        let was_frozen = self.node.cgroups.is_frozen(id);
        let host = LinuxHost(&self.node);
        if criu.is_some() && !was_frozen {
            // A dump cannot hold the agent's end of a connection from the host.
            if let Err(e) = sequence::settle_and_freeze(&host, id, HOST_SOCKETS_PATIENCE).await {
                return (Err(sandbox_err(id, e)), Duration::ZERO);
            }
        } else if !was_frozen && let Err(e) = self.node.cgroups.freeze(id).await {
            return (Err(sandbox_err(id, e)), Duration::ZERO);
        }
        let held_since = std::time::Instant::now();
        let copied = sequence::dump_frozen(
            &host,
            id,
            HOST_SOCKETS_PATIENCE,
            |e| sandbox_err(id, e),
            || self.copy_frozen(id, h, criu, &freezer, images, key),
        )
        .await;
        if !was_frozen && let Err(e) = self.node.cgroups.thaw(id) {
            tracing::error!(sandbox_id = %id, error = %e, "cannot thaw after a snapshot");
        }
        (copied, held_since.elapsed())
    }

    /// Seals a snapshot's copies: its layer in `layer_dir`, and with memory its images with
    /// the header and where it came from; returns the images' bytes, which the team's
    /// snapshot cap counts.
    async fn seal_snapshot(
        &self,
        id: &str,
        layer_dir: &Path,
        images: &Path,
        base: u32,
        origin: SnapshotOrigin,
        with_memory: Option<(crate::checkpoint::DumpPlan, String)>,
    ) -> Result<u64, RuntimeError> {
        let agent_digest = self.node.agent_digest.clone();
        let (layer_dir, images) = (layer_dir.to_owned(), images.to_owned());
        tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
            crate::storage::layers::seal_layer(&layer_dir, base, SANDBOX_IDS)?;
            let Some((plan, criu_version)) = with_memory else {
                return Ok(0);
            };
            std::fs::write(
                images.join(SNAPSHOT_ORIGIN),
                serde_json::to_vec(&origin).map_err(std::io::Error::other)?,
            )?;
            crate::checkpoint::seal(&images, criu_version, agent_digest, plan)?;
            Ok(crate::storage::image_layers::disk_usage(&images))
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot finish the snapshot: {e}")))
    }

    /// The frozen part of a snapshot: CRIU dumps the processes and leaves them running, and
    /// the sandbox's directory is snapshotted at the same moment.
    pub(super) async fn copy_frozen(
        &self,
        id: &str,
        h: &RuntimeHandle,
        criu: Option<&crate::checkpoint::Criu>,
        freezer: &Path,
        images: &Path,
        key: &str,
    ) -> Result<Option<crate::checkpoint::DumpPlan>, RuntimeError> {
        let plan = match criu {
            Some(criu) => {
                // Empty, also when a dump that failed is tried again.
                let _ = std::fs::remove_dir_all(images);
                std::fs::create_dir_all(images)
                    .map_err(|e| sandbox_err(id, format!("create {}: {e}", images.display())))?;
                let netns_inode = ns_inode(Path::new(&format!("/proc/{}/ns/net", h.pid)))
                    .ok_or_else(|| sandbox_err(id, "its network namespace is gone"))?;
                Some(
                    Pauser::of(&self.node)
                        .dump_into(id, h, criu, freezer, images, netns_inode, true)
                        .await?,
                )
            }
            None => None,
        };
        let disks = self.node.disks.clone();
        let (owned_id, steps, owned_key) = (
            id.to_owned(),
            self.node.layers.steps_dir().to_owned(),
            key.to_owned(),
        );
        run_blocking(id, move || {
            disks
                .snapshot(&owned_id, &steps, &owned_key)
                .map_err(|e| format!("cannot copy its files: {e}"))
        })
        .await?;
        Ok(plan)
    }
}

impl Launcher {
    /// Starts sandbox `spec` from the snapshot `snapshot`: a fresh writable layer on the
    /// snapshot's layers, and the snapshot's processes restored into it with the new
    /// sandbox's id range, network, cgroups, token and environment.
    pub(super) async fn launch_restored(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        checkpoint: &str,
    ) -> Result<(RuntimeHandle, Endpoint), (Option<RuntimeHandle>, RuntimeError)> {
        let id = &spec.sandbox_id;
        let slot = netns.slot;
        let started = std::time::Instant::now();
        let id_map = self.node.id_map(slot);
        let bare = |e: RuntimeError| (None, e);
        let criu = self.node.criu_for_restore(id).await.map_err(bare)?;
        let key = checkpoint
            .strip_prefix("checkpoint/")
            .filter(|k| is_snapshot_key(k))
            .ok_or_else(|| {
                bare(sandbox_err(
                    id,
                    format!("'{checkpoint}' names no snapshot checkpoint"),
                ))
            })?
            .to_owned();
        let source = self.node.places.snapshots_dir().join(&key);
        let work = self.node.places.checkpoint_dir(id);
        let verify = !self.node.is_verified(&source);
        let prepared = {
            let (source, work) = (source.clone(), work.clone());
            let to = id_map.host_base;
            run_blocking(id, move || -> Result<_, String> {
                let origin: SnapshotOrigin = serde_json::from_slice(
                    &std::fs::read(source.join(SNAPSHOT_ORIGIN))
                        .map_err(|e| format!("the snapshot has no origin: {e}"))?,
                )
                .map_err(|e| format!("the snapshot's origin is unreadable: {e}"))?;
                // The images are shared by every sandbox made from the snapshot: each restore
                // gets links to them in a directory of its own, with its own id range.
                let header = stage_checkpoint(&source, &work, verify, origin.id_base, to)
                    .map_err(|e| e.to_string())?;
                Ok((header, origin))
            })
            .await
            .map_err(bare)?
        };
        let (header, origin) = prepared;
        self.node.set_verified(&source, true);
        // Its restore is the new sandbox's first boot.
        let boot_id = header
            .externals
            .iter()
            .any(|e| matches!(e, crate::checkpoint::External::BootId { .. }))
            .then(sandbar_core::ids::new_uuid);
        check_criu_version(id, &criu, &header).map_err(bare)?;
        if header.agent_digest != self.node.agent_digest {
            tracing::debug!(sandbox_id = %id, "the snapshot runs an older agent build");
        }
        let (handle, endpoint) = sequence::restore_in_slot(
            &LinuxHost(&self.node),
            spec,
            netns,
            id_map,
            self.node.limits_of(spec),
            host_ops::DiskSource::Fresh {
                size_mb: spec.disk_size_mb,
            },
            SlotRestore {
                work,
                header,
                // A new sandbox is a new machine; what its restored processes read before
                // stays in their memory.
                machine_id: Some(sandbar_core::ids::new_machine_id()),
                boot_id,
            },
        )
        .await?;
        let restored = started.elapsed();
        let fail = |e: RuntimeError| (Some(handle.clone()), e);
        let workdir = default_workdir(&spec.image.user, &spec.image.workdir);
        agent_client::init(
            &endpoint.agent_socket,
            &origin.access_token,
            &agent_client::Init {
                access_token: &spec.envd_access_token,
                env_vars: &spec.env_vars,
                default_user: &spec.image.user,
                default_workdir: workdir,
                memory_limit_mb: spec.memory_mb,
            },
        )
        .await
        .map_err(|e| {
            fail(sandbox_err(
                id,
                format!("cannot hand the agent its sandbox: {e}"),
            ))
        })?;
        tracing::debug!(
            sandbox_id = %id,
            restored_us = restored.as_micros() as u64,
            ready_us = started.elapsed().as_micros() as u64,
            "sandbox restored from a snapshot"
        );
        Ok((handle, endpoint))
    }
}

impl Snapshotter {
    pub(super) fn snapshot_recorded(&self, parts: &SnapshotParts) {
        let names: Vec<&String> = std::iter::once(&parts.layer)
            .chain(parts.checkpoint.as_ref())
            .collect();
        self.node
            .fresh_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(name, _)| !names.contains(&name));
        // Recorded: other nodes may start it once its parts are in the layer store. Until
        // then it starts only here.
        if let Some(shared) = self.node.shared_layers.get().cloned() {
            let names: Vec<String> = names.into_iter().cloned().collect();
            tokio::spawn(async move {
                if let Err(e) = shared.publish(&names).await {
                    tracing::warn!(error = %e, "cannot publish a snapshot to the layer store; it starts only on this node");
                }
            });
        }
    }

    pub(super) async fn discard_snapshot(&self, parts: &SnapshotParts) {
        self.snapshot_recorded(parts);
        if let Some(key) = parts
            .checkpoint
            .as_deref()
            .and_then(|c| c.strip_prefix("checkpoint/"))
            && is_snapshot_key(key)
        {
            let dir = self.node.places.snapshots_dir().join(key);
            self.node.set_verified(&dir, false);
            let _ =
                tokio::task::spawn_blocking(move || crate::storage::disks::remove_tree(&dir)).await;
        }
    }
}
