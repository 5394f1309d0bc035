//! Where the node keeps each sandbox's files on the host: its agent's socket and log, its
//! checkpoint and the namespaces kept for it, snapshots, and the mount points a restore
//! makes. Only paths: nothing here touches the filesystem.

use std::path::PathBuf;

/// The node's places, under its data directory and the restore mount directory.
#[derive(Debug, Clone)]
pub(super) struct NodePlaces {
    pub(super) data_dir: PathBuf,
    /// Mount points a restore needs that the sandbox's host uid must reach (outside the
    /// data directory, which only root may traverse).
    pub(super) mount_dir: PathBuf,
}

impl NodePlaces {
    /// The node's content-addressed agent copies.
    pub(super) fn agents_dir(&self) -> PathBuf {
        self.data_dir.join("agents")
    }

    /// The sandbox's agent log (rotated copies sit beside it).
    pub(super) fn log_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("logs").join(format!("{id}.log"))
    }

    /// The Unix socket the sandbox's agent serves on.
    pub(super) fn socket_path(&self, id: &str) -> PathBuf {
        self.data_dir.join("run").join(format!("{id}.sock"))
    }

    /// The sandbox's checkpoint images while it is paused to disk.
    pub(super) fn checkpoint_dir(&self, id: &str) -> PathBuf {
        self.data_dir.join("checkpoints").join(id)
    }

    /// A namespace of the sandbox kept (bind-mounted) while its processes are checkpointed.
    pub(super) fn kept_ns(&self, id: &str, kind: &str) -> PathBuf {
        self.data_dir
            .join("checkpoints")
            .join(format!("{id}.{kind}"))
    }

    /// Where a checkpoint carried from another node waits for the sandbox's next boot.
    pub(super) fn carried_checkpoint_dir(&self, id: &str) -> PathBuf {
        self.data_dir
            .join("checkpoints")
            .join(format!("{id}.carried"))
    }

    /// The images of snapshots taken with memory, by key.
    pub(super) fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join("snapshots")
    }

    /// Where a restore of sandbox `id` mounts a sysfs of its network namespace on the host.
    pub(super) fn restored_sysfs(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.sys"))
    }

    /// Where a restore of sandbox `id` mounts the filesystem of its boot id on the host, for
    /// CRIU to bind the file back.
    pub(super) fn restored_boot_id_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.boot"))
    }

    /// Where a restore of sandbox `id` mounts its volumes on the host, for CRIU to bind back.
    pub(super) fn restored_volumes_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.volumes"))
    }
}
