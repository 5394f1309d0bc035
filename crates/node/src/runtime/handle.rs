//! What the store keeps of a sandbox for this runtime, and how a live process is told from a
//! recycled PID.

use super::*;

/// What the store keeps about a running sandbox for this runtime.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(super) struct Handle {
    /// Host PID of the sandbox's PID 1 (the agent).
    pub(super) pid: i32,
    /// Its start time in clock ticks since boot, to tell it from a later process with a
    /// recycled PID.
    pub(super) start_ticks: u64,
    pub(super) slot: u32,
    /// Host uid and gid of the sandbox's root; absent in handles from before user
    /// namespaces, whose sandboxes ran as host root.
    #[serde(default)]
    pub(super) id_base: Option<u32>,
    /// Memory limit granted to the sandbox, counted against the node's capacity.
    #[serde(default)]
    pub(super) memory_mb: u32,
    /// Template layers the sandbox runs on: kept while it lives, whatever happens to its
    /// template.
    #[serde(default)]
    pub(super) layers: Vec<String>,
    /// The sandbox's processes ended and its slot and memory went back to the node; only its
    /// files are kept (`pid` and `slot` are from its last life).
    #[serde(default)]
    pub(super) released: bool,
    /// The sandbox's processes were checkpointed to disk and ended; it keeps its slot (its
    /// network namespace) and cgroups, and `pid` is from before the checkpoint.
    #[serde(default)]
    pub(super) checkpointed: bool,
    /// Volumes bound into the sandbox, which a checkpoint names and a restore binds again.
    #[serde(default)]
    pub(super) volumes: Vec<HandleVolume>,
    /// The id of the sandbox's current boot, shown at the kernel's boot id: new at every
    /// boot, the same after a restore of its checkpoint. Absent in handles of sandboxes
    /// booted before it existed, which see the host's.
    #[serde(default)]
    pub(super) boot_id: Option<String>,
    /// A checkpoint of the sandbox's processes made on a node that was lost, laid out here
    /// (see `carried_checkpoint_dir`) when this node took the sandbox over: the next boot
    /// restores it instead of starting the sandbox afresh on its files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) carried: Option<CarriedCheckpoint>,
}

/// What a restore needs to know of the node a carried checkpoint was made on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(super) struct CarriedCheckpoint {
    /// Host id of the sandbox's root there: its user namespace image names that range.
    pub(super) origin_id_base: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct HandleVolume {
    pub(super) team_id: String,
    pub(super) volume_id: String,
    /// Mount point inside the sandbox.
    pub(super) path: String,
}

/// State letter and start time (field 22, clock ticks since boot) of `/proc/PID/stat`.
pub(super) fn stat_of(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let mut fields = stat[stat.rfind(')')? + 2..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

pub(super) fn start_ticks(pid: i32) -> Option<u64> {
    stat_of(pid).map(|(_, ticks)| ticks)
}

/// Whether the handle's process still runs. A zombie counts as gone: it has already left its
/// namespaces and cgroups, and only waits for the host's init to reap it.
pub(super) fn is_alive(handle: &Handle) -> bool {
    stat_of(handle.pid).is_some_and(|(state, ticks)| ticks == handle.start_ticks && state != 'Z')
}

impl Handle {
    /// The handle of a warm sandbox (see [`crate::runtime::warm`]); `pid` 0 for one that never
    /// started.
    pub(super) fn warm(slot: u32, id_map: IdMap, pid: i32, start_ticks: u64) -> Self {
        Handle {
            pid,
            start_ticks,
            id_base: Some(id_map.host_base),
            ..Handle::unstarted(slot)
        }
    }

    /// The handle of a sandbox in `slot` whose boot has not started a process.
    pub(super) fn unstarted(slot: u32) -> Self {
        Handle {
            pid: 0,
            start_ticks: 0,
            slot,
            id_base: None,
            memory_mb: 0,
            layers: Vec::new(),
            released: false,
            checkpointed: false,
            volumes: Vec::new(),
            boot_id: None,
            carried: None,
        }
    }

    /// The handle of sandbox `spec` whose PID 1 is `pid`, just started in `slot` with the
    /// boot id `boot_id`.
    pub(super) fn running(
        pid: i32,
        slot: u32,
        id_map: IdMap,
        spec: &LaunchSpec,
        boot_id: Option<String>,
    ) -> Self {
        Handle {
            pid,
            start_ticks: start_ticks(pid).unwrap_or_default(),
            slot,
            id_base: Some(id_map.host_base),
            memory_mb: spec.memory_mb,
            layers: spec.image.layers.clone(),
            released: false,
            checkpointed: false,
            volumes: spec
                .volumes
                .iter()
                .map(|v| HandleVolume {
                    team_id: v.team_id.clone(),
                    volume_id: v.volume_id.clone(),
                    path: v.path.clone(),
                })
                .collect(),
            boot_id,
            carried: None,
        }
    }

    pub(super) fn to_runtime(&self, id: &str) -> Result<RuntimeHandle, RuntimeError> {
        serde_json::to_value(self)
            .map(RuntimeHandle)
            .map_err(|e| sandbox_err(id, e))
    }
}

pub(super) fn parse_handle(id: &str, handle: &RuntimeHandle) -> Result<Handle, RuntimeError> {
    serde_json::from_value(handle.0.clone()).map_err(|e| RuntimeError::BadHandle {
        sandbox_id: id.to_owned(),
        message: e.to_string(),
    })
}
