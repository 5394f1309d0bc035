//! What the store keeps of a sandbox for this runtime, and how a live process is told from a
//! recycled PID.

use sandbar_core::{LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;
use serde::{Deserialize, Serialize};

use super::sandbox_err;

/// Where a sandbox's processes are, as this node last left them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) enum Phase {
    /// Its processes run (or are frozen in memory) in its slot.
    #[default]
    Running,
    /// Its processes were checkpointed to disk and ended; it keeps its slot (its network
    /// namespace) and cgroups, and `pid` is from before the checkpoint.
    Checkpointed,
    /// Its processes ended and its slot and memory went back to the node; only its files are
    /// kept (`pid` and `slot` are from its last life).
    Released,
}

/// What the store keeps about a sandbox for this runtime (see [`Handle::to_runtime`] and
/// [`parse_handle`] for its versions).
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
    pub(super) phase: Phase,
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

/// The layout of the handles this release writes, as their `v`. Version 1 (no `v`) said the
/// phase with two flags, `released` and `checkpointed`, which are read, never written.
const HANDLE_VERSION: u32 = 2;

/// Turns a version-1 handle into the current layout: its flags become its phase.
fn upgrade(stored: &mut serde_json::Value) {
    let Some(fields) = stored.as_object_mut() else {
        return;
    };
    let flag = |fields: &mut serde_json::Map<String, serde_json::Value>, name: &str| {
        fields.remove(name) == Some(serde_json::Value::Bool(true))
    };
    let (released, checkpointed) = (flag(fields, "released"), flag(fields, "checkpointed"));
    if !fields.contains_key("phase") {
        let phase = if released {
            Phase::Released
        } else if checkpointed {
            Phase::Checkpointed
        } else {
            Phase::Running
        };
        fields.insert("phase".into(), serde_json::json!(phase));
    }
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
            phase: Phase::Running,
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
            phase: Phase::Running,
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

    /// The handle as the store keeps it, with its version.
    pub(super) fn to_runtime(&self, id: &str) -> Result<RuntimeHandle, RuntimeError> {
        let mut stored = serde_json::to_value(self).map_err(|e| sandbox_err(id, e))?;
        if let Some(fields) = stored.as_object_mut() {
            fields.insert("v".into(), HANDLE_VERSION.into());
        }
        Ok(RuntimeHandle(stored))
    }
}

/// The handle the store keeps for sandbox `id`, of any version.
pub(super) fn parse_handle(id: &str, handle: &RuntimeHandle) -> Result<Handle, RuntimeError> {
    let mut stored = handle.0.clone();
    upgrade(&mut stored);
    serde_json::from_value(stored).map_err(|e| RuntimeError::BadHandle {
        sandbox_id: id.to_owned(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use sandbar_core::RuntimeHandle;

    use super::{HANDLE_VERSION, Handle, Phase, parse_handle};

    #[test]
    fn handles_written_with_flags_read_as_their_phase() {
        let old = |flags: &str| {
            let json =
                format!(r#"{{"pid": 7, "start_ticks": 9, "slot": 3, "memory_mb": 512{flags}}}"#);
            let stored = RuntimeHandle(serde_json::from_str(&json).expect("json"));
            parse_handle("s", &stored).map(|h| h.phase)
        };
        assert_eq!(old("").ok(), Some(Phase::Running));
        assert_eq!(old(r#", "released": true"#).ok(), Some(Phase::Released));
        assert_eq!(
            old(r#", "checkpointed": true"#).ok(),
            Some(Phase::Checkpointed)
        );
    }

    #[test]
    fn a_handle_is_written_with_its_version_and_phase_only() {
        let handle = Handle {
            phase: Phase::Checkpointed,
            ..Handle::unstarted(4)
        };
        let json = handle.to_runtime("s").expect("serialises").0;
        assert_eq!(json["v"], HANDLE_VERSION);
        assert_eq!(json["phase"], "checkpointed");
        assert!(json.get("released").is_none() && json.get("checkpointed").is_none());
        let back = parse_handle("s", &RuntimeHandle(json)).expect("reads back");
        assert_eq!(back, handle);
    }
}
