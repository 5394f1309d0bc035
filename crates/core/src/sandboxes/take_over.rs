//! Paused sandboxes outliving their node: a node with a layer store copies the files of each
//! sandbox it holds paused there, and the checkpoint of its processes once it has one; when
//! that node is lost, another takes the sandbox over from the copies, to restore its
//! processes at the resume, or, without a usable checkpoint, to boot afresh on its files.

use std::time::Duration;

use super::SandboxError;
use super::recover::Recovery;
use crate::builds::LogLevel;
use crate::lifecycle::SandboxStatus;
use crate::model::{LayerBlob, Sandbox, Team};
use crate::runtime::{RuntimeError, TakenOver};
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    #[error("sandbox {0} cannot be taken over: this server is not a node of a cluster")]
    NotInCluster(String),
    #[error("sandbox {id} is on node '{node}', which is alive")]
    NodeAlive { id: String, node: String },
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("sandbox {id} is on node '{node}' now")]
    Moved { id: String, node: String },
    #[error(
        "sandbox {id} was running on node '{node}', which was lost with its processes: only a paused sandbox can be resumed elsewhere"
    )]
    NotPaused { id: String, node: String },
    #[error(
        "sandbox {id} was paused on node '{node}', which was lost before a copy of its files reached the layer store"
    )]
    NoCopy { id: String, node: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What of a paused sandbox is copied to the layer store.
#[derive(Debug, Clone, Copy)]
enum SharedCopy {
    /// Its writable layer (`files/<id>`).
    Files,
    /// The checkpoint of its processes (`memory/<id>`), once it is paused to disk.
    Checkpoint,
}

impl Recovery {
    /// Copies, one at a time, the files of sandboxes paused here to the layer store, and the
    /// checkpoints of those paused to disk, for as long as the process runs. Does nothing where the runtime has no layer store.
    pub async fn run_file_sharing(self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let next = self.shared.live().iter().find_map(|(id, l)| {
                let files_due = l.files_shared_at != Some(l.wakes);
                let memory_due =
                    l.status == SandboxStatus::Checkpointed && l.memory_shared_at != Some(l.wakes);
                (l.status.is_paused() && (files_due || memory_due))
                    .then(|| (id.clone(), l.wakes, files_due, memory_due))
            });
            if let Some((id, wakes, files, memory)) = next {
                if files {
                    self.share_copy_of(&id, wakes, SharedCopy::Files).await;
                }
                if memory {
                    self.share_copy_of(&id, wakes, SharedCopy::Checkpoint).await;
                }
            }
        }
    }

    /// Makes one copy of paused sandbox `id` and records it, unless the sandbox woke since
    /// its `wakes`-th wake; tried once per pause (the checkpoint once it exists), whatever
    /// comes of it: a copy that fails is not retried in a loop, the next pause makes a new one.
    async fn share_copy_of(&self, id: &str, wakes: u64, copy: SharedCopy) {
        let Some(handle) = self.shared.live().get(id).map(|l| l.handle.clone()) else {
            return;
        };
        let copied = match copy {
            SharedCopy::Files => self.shared.runtime.share_files(id, &handle).await,
            SharedCopy::Checkpoint => self.shared.runtime.share_checkpoint(id, &handle).await,
        };
        let _recording = self.shared.shared_files.lock().await;
        let current = {
            let mut live = self.shared.live();
            let Some(entry) = live.get_mut(id) else {
                return;
            };
            match copy {
                SharedCopy::Files => entry.files_shared_at = Some(wakes),
                SharedCopy::Checkpoint => entry.memory_shared_at = Some(wakes),
            }
            entry.wakes == wakes && entry.status.is_paused()
        };
        match copied {
            Ok(Some(blob)) if current => {
                if let Err(err) = self
                    .shared
                    .store
                    .layer_blobs
                    .replace_layer_blob(&blob)
                    .await
                {
                    tracing::warn!(sandbox_id = %id, layer = %blob.layer, error = %err, "cannot record the copy of a paused sandbox");
                }
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(sandbox_id = %id, error = %err, "cannot copy a paused sandbox to the layer store");
            }
        }
    }

    /// Before a resume: a sandbox of `team` recorded on another node of the cluster is taken
    /// over here (see [`Self::take_over`]); the request reached this node because that node
    /// was lost.
    pub(super) async fn take_over_if_lost(
        &self,
        team: &Team,
        id: &str,
    ) -> Result<(), SandboxError> {
        if self.shared.nodes.get().is_none() || self.shared.live().contains_key(id) {
            return Ok(());
        }
        match self.shared.store.sandboxes.sandbox(id).await? {
            Some(row) if row.team_id == team.id && row.node_id != self.shared.config.node_id => {
                Ok(self.take_over(id, &row.node_id).await?)
            }
            // Not this team's, or not recorded: the resume answers not found.
            _ => Ok(()),
        }
    }

    /// Takes over sandbox `id`, paused on node `from_node` which was lost, from the copy of
    /// its files that node shared: lays the files out here, records the sandbox on this node
    /// (only if it is still recorded on `from_node`, so two nodes never both take it) and
    /// keeps it paused without memory, ready to resume. Nothing to do if it is here already.
    pub async fn take_over(&self, id: &str, from_node: &str) -> Result<(), TakeOverError> {
        let _one_at_a_time = self.shared.take_overs.lock().await;
        if self.shared.live().contains_key(id) {
            return Ok(());
        }
        let Some(nodes) = self.shared.nodes.get() else {
            return Err(TakeOverError::NotInCluster(id.to_owned()));
        };
        if nodes.is_live(from_node) {
            return Err(TakeOverError::NodeAlive {
                id: id.to_owned(),
                node: from_node.to_owned(),
            });
        }
        let sandbox = self
            .shared
            .store
            .sandboxes
            .sandbox(id)
            .await?
            .ok_or_else(|| TakeOverError::NotFound(id.to_owned()))?;
        if sandbox.node_id != from_node {
            return Err(TakeOverError::Moved {
                id: id.to_owned(),
                node: sandbox.node_id,
            });
        }
        if !sandbox.status.is_paused() {
            return Err(TakeOverError::NotPaused {
                id: id.to_owned(),
                node: from_node.to_owned(),
            });
        }
        let (files_name, memory_name) = (
            LayerBlob::sandbox_files(id),
            LayerBlob::sandbox_checkpoint(id),
        );
        let copies = self
            .shared
            .store
            .layer_blobs
            .layer_blobs(&[files_name.clone(), memory_name.clone()])
            .await?;
        let files = copies
            .iter()
            .find(|b| b.layer == files_name)
            .ok_or_else(|| TakeOverError::NoCopy {
                id: id.to_owned(),
                node: from_node.to_owned(),
            })?;
        let memory = copies.iter().find(|b| b.layer == memory_name);
        let TakenOver {
            handle,
            with_memory,
        } = self
            .shared
            .runtime
            .take_over_files(&sandbox, files, memory)
            .await?;
        let me = self.shared.config.node_id.as_str();
        let claimed = self
            .shared
            .store
            .nodes
            .move_sandbox(id, from_node, me)
            .await;
        if !matches!(claimed, Ok(true)) {
            if let Err(err) = self.shared.runtime.destroy(id, &handle).await {
                tracing::warn!(sandbox_id = %id, error = %err, "cannot remove the files of a sandbox another node took");
            }
            return match claimed {
                Err(err) => Err(err.into()),
                _ => Err(TakeOverError::Moved {
                    id: id.to_owned(),
                    node: self
                        .shared
                        .store
                        .nodes
                        .sandbox_node(id)
                        .await?
                        .unwrap_or_default(),
                }),
            };
        }
        self.shared
            .record(id, SandboxStatus::Shelved, Some(&handle))
            .await?;
        let taken = Sandbox {
            handle,
            status: SandboxStatus::Shelved,
            node_id: me.to_owned(),
            ..sandbox
        };
        self.adopt_shelved(&taken).await?;
        self.shared.activity
            .event(
                id,
                LogLevel::Warn,
                if with_memory {
                    "sandbox taken over from a lost node: its files and the checkpoint of its processes were kept, the resume restores them"
                } else {
                    "sandbox taken over from a lost node: its files were kept, its processes start afresh at the resume"
                },
                &[("fromNode", from_node.to_owned()), ("node", me.to_owned())],
            )
            .await;
        tracing::warn!(sandbox_id = %id, from_node, with_memory, "took over a paused sandbox of a lost node");
        Ok(())
    }
}
