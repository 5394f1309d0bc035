//! What the core needs from the machine that runs sandboxes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use crate::builds::TemplateImage;
use crate::model::Template;
use crate::network::EgressRules;

mod handle;

pub use handle::{
    CarriedCheckpoint, HANDLE_VERSION, HandlePhase, HandleVolume, RuntimeHandle, StoredHandleError,
};

/// A sandbox laid out on this node from what a lost node shared.
#[derive(Debug, Clone)]
pub struct TakenOver {
    /// The handle of the sandbox, released: its next launch boots it.
    pub handle: RuntimeHandle,
    /// Whether that launch restores its processes from a carried checkpoint, rather than
    /// starting them afresh.
    pub with_memory: bool,
}

/// How the edge reaches a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Unix socket the sandbox's agent serves envd's protocol on.
    pub agent_socket: PathBuf,
    /// Address of the sandbox inside the node's private network, for user ports.
    pub address: IpAddr,
}

/// Everything a runtime needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub sandbox_id: String,
    pub template: Template,
    /// The layers, environment, user and start command the sandbox starts from.
    pub image: TemplateImage,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    /// The team's rates for the sandbox's disk I/O (0: the node's own).
    pub disk_rates: crate::model::DiskRates,
    pub env_vars: BTreeMap<String, String>,
    /// Whether the sandbox may reach anything outside; false isolates it entirely.
    pub allow_internet_access: bool,
    /// Per-sandbox egress rules; empty for the node's default egress.
    pub egress: EgressRules,
    pub envd_access_token: String,
    /// Volumes bind-mounted read-write into the sandbox.
    pub volumes: Vec<crate::volumes::VolumeMount>,
    /// Boot on the files an earlier [`Runtime::release`] of this sandbox kept (its handle)
    /// instead of a fresh writable layer.
    pub kept: Option<RuntimeHandle>,
}

/// What a restart found of a sandbox recorded as checkpointed (or being checkpointed).
#[derive(Debug, Clone)]
pub enum AdoptedCheckpoint {
    /// Its checkpoint is complete and it is paused on disk, with this handle.
    Checkpointed(RuntimeHandle),
    /// A restore the server died in the middle of ran to its end: it runs, with this handle,
    /// reached at this endpoint; its checkpoint is spent.
    Restored(RuntimeHandle, Endpoint),
}

/// What a snapshot of a running sandbox is made of on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotParts {
    /// A read-only layer with the sandbox's files, to stack on the layers it ran on.
    pub layer: String,
    /// The checkpoint of its processes ([`crate::builds::SnapshotImage::checkpoint`]);
    /// `None` when only the files were copied.
    pub checkpoint: Option<String>,
    /// What the checkpoint holds on the node's data disk; 0 without one.
    pub checkpoint_bytes: u64,
}

/// Bytes of a sandbox's agent log and where they start: past the offset asked for when the
/// bytes before were rotated away unread.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentLogChunk {
    pub start: u64,
    pub bytes: Vec<u8>,
}

/// A sandbox's resource use at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuntimeStats {
    /// CPU time used since the sandbox started, in nanoseconds.
    pub cpu_ns: u64,
    pub memory_used: u64,
    pub memory_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// Processes the kernel killed in the sandbox for lack of memory (at its limit or with
    /// the host short) since its cgroups were made.
    pub oom_kills: u64,
}

/// Sandboxes' disk I/O on this node: the rates each is held to and what all running ones
/// have done so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskIoReport {
    /// Per-sandbox limits per second; 0 where not limited.
    pub read_bytes_limit: u64,
    pub write_bytes_limit: u64,
    pub read_ops_limit: u64,
    pub write_ops_limit: u64,
    /// Cumulative, over the sandboxes whose cgroups exist now.
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
}

/// The host's memory and what sandboxes may use of it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MemoryReport {
    pub total_bytes: u64,
    pub available_bytes: u64,
    /// Memory limits of running sandboxes together.
    pub promised_bytes: u64,
    /// How far those limits may add up (the overcommit limit).
    pub promise_limit_bytes: u64,
    pub overcommit: u32,
    /// PSI `full avg10`, percent; `None` without PSI.
    pub stalled_percent: Option<f64>,
}

/// Sandboxes a node keeps booted ahead of demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WarmPoolReport {
    /// How many it keeps ready for the image last asked for.
    pub target: u64,
    pub waiting: u64,
    /// Creates a waiting sandbox served, and creates that could have been served but found
    /// none, since the server started.
    pub taken: u64,
    pub missed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The template's start command did not become ready.
    #[error("sandbox {sandbox_id}: {message}")]
    NotReady { sandbox_id: String, message: String },
    #[error("template {template_id} has no root filesystem on this node")]
    TemplateMissing { template_id: String },
    #[error("sandbox {sandbox_id}: {message}")]
    Sandbox { sandbox_id: String, message: String },
    /// The node would grant more than it has: refused before the host runs short.
    #[error("no capacity for sandbox {sandbox_id}: {message}")]
    NoCapacity { sandbox_id: String, message: String },
    #[error("sandbox {sandbox_id} has a runtime handle this node cannot read: {message}")]
    BadHandle { sandbox_id: String, message: String },
    /// The sandbox holds something a checkpoint cannot carry: its own doing, not the host's,
    /// so trying again changes nothing. `reason` names the kind of object, never a host path.
    #[error("sandbox {sandbox_id} cannot be checkpointed: {reason}")]
    Uncheckpointable { sandbox_id: String, reason: String },
    /// Processes outlived a kill for longer than the node waits; the sandbox stays as it
    /// was, and killing it again may succeed.
    #[error(
        "sandbox {sandbox_id}: {processes} processes still remain after being killed; kill it again"
    )]
    StillRunning {
        sandbox_id: String,
        processes: usize,
    },
}

#[async_trait::async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// Starts a sandbox and returns once its agent answers.
    async fn launch(&self, spec: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError>;

    /// Stops a sandbox and releases everything it held; succeeds if it is already gone.
    async fn destroy(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError>;

    /// Whether the sandbox's processes still run (cheap; called periodically).
    fn is_alive(&self, sandbox_id: &str, handle: &RuntimeHandle) -> bool;

    /// Stops and removes every sandbox of this runtime that is not in `recorded`: leftovers of
    /// a crash between starting a sandbox and recording it. Returns how many it removed.
    async fn sweep(&self, recorded: &[String]) -> Result<usize, RuntimeError>;

    /// Replaces the egress rules of a running sandbox (also called after `adopt` for sandboxes
    /// that have rules, since a restarted node starts from its default firewall).
    async fn update_network(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
        _rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        Err(unsupported(sandbox_id, "enforce egress rules"))
    }

    /// What the sandbox uses now: cumulative CPU time, memory, disk.
    fn stats(&self, _sandbox_id: &str, _handle: &RuntimeHandle) -> Option<RuntimeStats> {
        None
    }

    /// Processes the kernel killed because their sandbox reached its memory limit, in
    /// sandboxes alive now or ended since this server started.
    fn oom_kills(&self) -> u64 {
        0
    }

    /// The node's memory as measured now, against what is promised to sandboxes.
    fn memory(&self) -> Option<MemoryReport> {
        None
    }

    /// Sandboxes kept booted ahead of demand; `None` where the runtime keeps none.
    fn warm_pool(&self) -> Option<WarmPoolReport> {
        None
    }

    /// Sandboxes' disk rates and what they read and wrote; `None` where not measured.
    fn disk_io(&self) -> Option<DiskIoReport> {
        None
    }

    /// The data disk (database, checkpoints, uploads, logs) as measured now: the one check
    /// before every write request, so it measures nothing else.
    fn data_disk(&self) -> Option<crate::disks::DiskSpace> {
        None
    }

    /// The node's disks as measured now; empty where the runtime has none to report.
    fn disks(&self) -> crate::disks::DiskReport {
        crate::disks::DiskReport {
            data: self.data_disk(),
            ..crate::disks::DiskReport::default()
        }
    }

    /// Freezes every process of the sandbox in place, memory kept.
    async fn pause(&self, sandbox_id: &str, _handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        Err(unsupported(sandbox_id, "pause sandboxes"))
    }

    /// Lets a paused sandbox run again.
    async fn resume(&self, sandbox_id: &str, _handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        Err(unsupported(sandbox_id, "resume sandboxes"))
    }

    /// Ends the sandbox's processes and releases its memory, network slot and cgroups, but
    /// keeps its files; returns the handle a later [`LaunchSpec::kept`] boots on again.
    async fn release(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        Err(unsupported(
            sandbox_id,
            "pause sandboxes without their memory",
        ))
    }

    /// After a restart: takes back the kept files of a released sandbox (see
    /// [`Runtime::release`]); an error when they are gone.
    async fn adopt_released(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Sandbox {
            sandbox_id: sandbox_id.to_owned(),
            message: "this runtime keeps no files of released sandboxes".into(),
        })
    }

    /// Copies a paused sandbox's files (it is frozen, released or checkpointed, so they hold
    /// still) to the cluster's layer store; returns the record of the copy for the caller to
    /// keep, `None` where there is no layer store.
    async fn share_files(
        &self,
        _sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<Option<crate::model::LayerBlob>, RuntimeError> {
        Ok(None)
    }

    /// Copies the checkpoint of a sandbox paused to disk to the cluster's layer store, as
    /// [`Runtime::share_files`] its files; `None` where there is no layer store or the
    /// sandbox has no checkpoint.
    async fn share_checkpoint(
        &self,
        _sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<Option<crate::model::LayerBlob>, RuntimeError> {
        Ok(None)
    }

    /// Lays out on this node the files of a paused sandbox whose node was lost, from the copy
    /// `files` that node shared, and the checkpoint of its processes from `checkpoint` when
    /// that node shared one and this node can restore it; returns the handle of a released
    /// sandbox that a launch with [`LaunchSpec::kept`] boots on (restoring the checkpoint,
    /// where one was carried).
    async fn take_over_files(
        &self,
        sandbox: &crate::model::Sandbox,
        _files: &crate::model::LayerBlob,
        _checkpoint: Option<&crate::model::LayerBlob>,
    ) -> Result<TakenOver, RuntimeError> {
        Err(unsupported(
            &sandbox.id,
            "take over sandboxes of other nodes",
        ))
    }

    /// Copies a running sandbox's files and, with `memory`, its processes into a snapshot
    /// (`agent_token` is the one its agent holds, which a restore must present to hand
    /// over), holding it still
    /// meanwhile; it runs on afterwards, whether the snapshot succeeded or not. A launch whose
    /// image names the parts (see [`crate::builds::SnapshotImage`]) restores those processes
    /// in the new sandbox.
    async fn snapshot(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
        _agent_token: &str,
        _memory: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        Err(unsupported(sandbox_id, "snapshot sandboxes"))
    }

    /// A template now keeps the snapshot's parts: until then the node keeps them from its
    /// layer collector.
    fn snapshot_recorded(&self, _parts: &SnapshotParts) {}

    /// Removes the checkpoint of a snapshot no template keeps (a fork's, once its sandboxes
    /// started); its layer is left to the layer collector, since those sandboxes run on it.
    async fn discard_snapshot(&self, _parts: &SnapshotParts) {}

    /// Whether frozen sandboxes can be checkpointed to disk on this node.
    fn can_checkpoint(&self) -> bool {
        false
    }

    /// Whether frozen sandboxes can be checkpointed to disk on this node, for a caller about
    /// to need it: a node whose checkpoints are off may look again (a CRIU installed since).
    async fn checkpoints_ready(&self) -> bool {
        self.can_checkpoint()
    }

    /// Checkpoints a frozen sandbox to disk and ends its processes, freeing their memory;
    /// returns the handle [`Runtime::restore`] takes. On failure the sandbox stays frozen.
    async fn checkpoint(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        Err(unsupported(sandbox_id, "checkpoint sandboxes"))
    }

    /// Restores a checkpointed sandbox, running, and says how to reach it. On failure it
    /// stays checkpointed.
    async fn restore(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        Err(unsupported(sandbox_id, "restore checkpoints"))
    }

    /// After a restart: takes back a sandbox recorded as checkpointed, or as being
    /// checkpointed with its processes gone. A dump or restore the server died in is waited
    /// for and finished: the sandbox is checkpointed (its checkpoint valid, what it needs
    /// kept) or, if a restore completed, running. An error says why it cannot be restored.
    async fn adopt_checkpointed(
        &self,
        sandbox_id: &str,
        _handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        Err(RuntimeError::Sandbox {
            sandbox_id: sandbox_id.to_owned(),
            message: "this runtime keeps no checkpoints".into(),
        })
    }

    /// Removes what an unfinished checkpoint of a sandbox left; nothing if there is none.
    async fn discard_checkpoint(&self, _sandbox_id: &str) {}

    /// Whether the sandbox's processes are frozen (after a restart: to settle a pause or
    /// resume the server did not see through).
    fn is_paused(&self, _sandbox_id: &str, _handle: &RuntimeHandle) -> bool {
        false
    }

    /// Up to `max` bytes of the sandbox's agent log from byte `offset` on (counted from the
    /// log's first byte, whatever the node rotated away since); `None` when the runtime keeps
    /// no such log or it cannot be read.
    fn agent_log(&self, _sandbox_id: &str, _offset: u64, _max: usize) -> Option<AgentLogChunk> {
        None
    }

    /// Called once on the thread that reads every sandbox's liveness, usage and agent log,
    /// before its first read. A runtime may lower that thread's CPU priority: a round over a
    /// thousand sandboxes then takes only the cycles requests leave.
    fn prepare_sampling_thread(&self) {}

    /// After a restart: whether the sandbox still runs, and if so how to reach it.
    async fn adopt(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<Option<Endpoint>, RuntimeError>;
}

/// The error of an operation a runtime does not offer: `what` completes "this runtime cannot".
fn unsupported(sandbox_id: &str, what: &str) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: sandbox_id.to_owned(),
        message: format!("this runtime cannot {what}"),
    }
}
