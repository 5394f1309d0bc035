//! What the store keeps about a sandbox's processes on its node: one typed value, written
//! as versioned JSON only where it enters or leaves the store.
//!
//! The core never reads its fields; it keeps the value, hands it back to the runtime, and
//! compares two for equality (to tell whether a sandbox changed under a reader). The
//! persisted [`crate::model::SandboxStatus`] stays the sandbox's one state: the phase here
//! only says where its node left the processes.

use serde::{Deserialize, Serialize};

use crate::runtime::LaunchSpec;

/// Where a sandbox's processes are, as its node last left them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HandlePhase {
    /// Nothing was launched yet: the handle names no process and no slot, and a runtime
    /// refuses every operation on it.
    #[default]
    Unlaunched,
    /// Its processes run (or are frozen in memory) in its slot.
    Running,
    /// Its processes were checkpointed to disk and ended; it keeps its slot (its network
    /// namespace) and cgroups, and `pid` is from before the checkpoint.
    Checkpointed,
    /// Its processes ended and its slot and memory went back to the node; only its files are
    /// kept (`pid` and `slot` are from its last life).
    Released,
}

/// A volume bound into a sandbox, which a checkpoint names and a restore binds again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandleVolume {
    pub team_id: String,
    pub volume_id: String,
    /// Mount point inside the sandbox.
    pub path: String,
}

/// What a restore needs to know of the node a carried checkpoint was made on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarriedCheckpoint {
    /// Host id of the sandbox's root there: its user namespace image names that range.
    pub origin_id_base: u32,
}

/// Runtime facts about a sandbox (process, network slot, id range, layers), kept in the store
/// so a restarted server can find, resume or clean up the sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeHandle {
    /// Host PID of the sandbox's PID 1 (the agent).
    pub pid: i32,
    /// Its start time in clock ticks since boot, to tell it from a later process with a
    /// recycled PID.
    pub start_ticks: u64,
    pub slot: u32,
    /// Host uid and gid of the sandbox's root; absent in handles from before user
    /// namespaces, whose sandboxes ran as host root.
    #[serde(default)]
    pub id_base: Option<u32>,
    /// Memory limit granted to the sandbox, counted against the node's capacity.
    #[serde(default)]
    pub memory_mb: u32,
    /// Template layers the sandbox runs on: kept while it lives, whatever happens to its
    /// template.
    #[serde(default)]
    pub layers: Vec<String>,
    pub phase: HandlePhase,
    #[serde(default)]
    pub volumes: Vec<HandleVolume>,
    /// The id of the sandbox's current boot, shown at the kernel's boot id: new at every
    /// boot, the same after a restore of its checkpoint. Absent in handles of sandboxes
    /// booted before it existed, which see the host's.
    #[serde(default)]
    pub boot_id: Option<String>,
    /// A checkpoint of the sandbox's processes made on a node that was lost, laid out on
    /// this node when it took the sandbox over: the next boot restores it instead of
    /// starting the sandbox afresh on its files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried: Option<CarriedCheckpoint>,
}

/// The layout of the handles this release writes, as their `v`. Version 1 (no `v`) said the
/// phase with two flags, `released` and `checkpointed`; the store's migrations rewrote
/// those rows.
pub const HANDLE_VERSION: u32 = 2;

/// A stored handle this release cannot read.
#[derive(Debug, thiserror::Error)]
pub enum StoredHandleError {
    #[error("stored handle has layout version {found}, this release reads {HANDLE_VERSION}")]
    Version { found: u32 },
    #[error("stored handle is not valid: {0}")]
    Malformed(#[from] serde_json::Error),
}

#[derive(Serialize)]
struct StoredRef<'a> {
    v: u32,
    #[serde(flatten)]
    handle: &'a RuntimeHandle,
}

#[derive(Deserialize)]
struct Stored {
    v: u32,
    #[serde(flatten)]
    handle: RuntimeHandle,
}

impl RuntimeHandle {
    /// The handle of a sandbox in `slot` whose boot has not started a process.
    pub fn unstarted(slot: u32) -> Self {
        RuntimeHandle {
            slot,
            phase: HandlePhase::Running,
            ..RuntimeHandle::default()
        }
    }

    /// The handle of a warm sandbox in `slot` with root mapped to host id `id_base`; `pid` 0
    /// for one that never started.
    pub fn warm(slot: u32, id_base: u32, pid: i32, start_ticks: u64) -> Self {
        RuntimeHandle {
            pid,
            start_ticks,
            id_base: Some(id_base),
            ..RuntimeHandle::unstarted(slot)
        }
    }

    /// The handle of sandbox `spec` whose PID 1 is `pid` (started at `start_ticks`), just
    /// booted in `slot` with root at host id `id_base` and the boot id `boot_id`.
    pub fn running(
        pid: i32,
        start_ticks: u64,
        slot: u32,
        id_base: u32,
        spec: &LaunchSpec,
        boot_id: Option<String>,
    ) -> Self {
        RuntimeHandle {
            pid,
            start_ticks,
            slot,
            id_base: Some(id_base),
            memory_mb: spec.memory_mb,
            layers: spec.image.layers.clone(),
            phase: HandlePhase::Running,
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

    /// Whether a runtime launched anything for this handle.
    pub fn is_launched(&self) -> bool {
        self.phase != HandlePhase::Unlaunched
    }

    /// The handle as the store writes it: JSON with its layout version.
    pub fn to_stored(&self) -> String {
        // A struct of strings, numbers and enums of unit variants always serialises.
        serde_json::to_string(&StoredRef {
            v: HANDLE_VERSION,
            handle: self,
        })
        .unwrap_or_default()
    }

    /// A handle as the store wrote it.
    pub fn from_stored(text: &str) -> Result<Self, StoredHandleError> {
        let stored: Stored = serde_json::from_str(text)?;
        if stored.v != HANDLE_VERSION {
            return Err(StoredHandleError::Version { found: stored.v });
        }
        Ok(stored.handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_is_stored_with_its_version_and_read_back_whole() {
        let handle = RuntimeHandle {
            phase: HandlePhase::Checkpointed,
            volumes: vec![HandleVolume {
                team_id: "t".into(),
                volume_id: "v".into(),
                path: "/data".into(),
            }],
            carried: Some(CarriedCheckpoint { origin_id_base: 7 }),
            ..RuntimeHandle::warm(4, 100_000, 12, 34)
        };
        let text = handle.to_stored();
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["v"], HANDLE_VERSION);
        assert_eq!(json["phase"], "checkpointed");
        assert_eq!(RuntimeHandle::from_stored(&text).expect("reads"), handle);
    }

    #[test]
    fn a_handle_of_another_layout_is_refused_with_its_version() {
        let old = r#"{"pid": 7, "start_ticks": 9, "slot": 3, "released": true}"#;
        let err = RuntimeHandle::from_stored(old).expect_err("no version");
        assert!(err.to_string().contains("missing field `v`"), "{err}");
        let newer = r#"{"v": 3, "pid": 7, "start_ticks": 9, "slot": 3, "phase": "running"}"#;
        let err = RuntimeHandle::from_stored(newer).expect_err("newer layout");
        assert!(
            matches!(err, StoredHandleError::Version { found: 3 }),
            "{err}"
        );
    }

    #[test]
    fn only_a_launched_handle_says_so() {
        assert!(!RuntimeHandle::default().is_launched());
        assert!(RuntimeHandle::unstarted(0).is_launched());
        assert_eq!(RuntimeHandle::unstarted(5).slot, 5);
    }
}
