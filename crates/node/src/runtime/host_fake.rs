//! A recording [`HostOps`] for unit tests of the node's sequences: it keeps what a real host
//! would have made for each sandbox (cgroups, disks, egress rules, wired slots, agents,
//! frozen sandboxes), records every call in order, and fails the calls a test asks it to.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sandbar_core::{EgressRules, Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

use super::criu_runs::CriuDump;
use super::host_ops::{DiskSource, HostOps};
use super::jailed::BootSpec;
use super::restore::SlotRestore;
use crate::checkpoint::HostSocket;
use crate::resources::cgroups::{CgroupError, Limits};

/// A namespace prepared for a slot, as the fake hands it to a boot.
#[derive(Debug)]
pub(super) struct FakeNetns(pub(super) u32);

/// What the fake host holds now, by kind.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct HostState {
    pub(super) cgroups: BTreeSet<String>,
    pub(super) disks: BTreeSet<String>,
    pub(super) egress: BTreeSet<u32>,
    pub(super) wired_slots: BTreeSet<u32>,
    pub(super) agents: BTreeSet<String>,
    pub(super) sockets: BTreeSet<String>,
    pub(super) records: BTreeSet<String>,
    pub(super) frozen: BTreeSet<String>,
}

impl HostState {
    pub(super) fn is_empty(&self) -> bool {
        *self == HostState::default()
    }
}

#[derive(Default)]
pub(super) struct RecordingHost {
    calls: Mutex<Vec<(&'static str, String)>>,
    state: Mutex<HostState>,
    /// Names of calls whose next occurrence fails.
    failing: Mutex<BTreeSet<&'static str>>,
    /// Successive answers of `host_sockets`: how many it reports (none once used up).
    held_sockets: Mutex<VecDeque<usize>>,
}

impl RecordingHost {
    pub(super) fn holding_sockets(counts: &[usize]) -> Self {
        RecordingHost {
            held_sockets: Mutex::new(counts.iter().copied().collect()),
            ..Default::default()
        }
    }

    /// The names of the calls so far, in order.
    pub(super) fn calls(&self) -> Vec<&'static str> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|(name, _)| *name)
            .collect()
    }

    pub(super) fn forget_calls(&self) {
        self.calls.lock().unwrap().clear();
    }

    pub(super) fn state(&self) -> HostState {
        self.state.lock().unwrap().clone()
    }

    /// The next call named `name` fails.
    pub(super) fn fail_next(&self, name: &'static str) {
        self.failing.lock().unwrap().insert(name);
    }

    /// Forgets failures asked for that no call met.
    pub(super) fn fail_nothing(&self) {
        self.failing.lock().unwrap().clear();
    }

    /// Prepares the namespace of `slot`, as the node's pool does before a boot claims it.
    pub(super) fn prepare_slot(&self, slot: u32) -> FakeNetns {
        assert!(
            self.state.lock().unwrap().wired_slots.insert(slot),
            "slot {slot} prepared twice"
        );
        FakeNetns(slot)
    }

    fn call(&self, name: &'static str, subject: impl ToString) -> Result<(), RuntimeError> {
        let subject = subject.to_string();
        self.calls.lock().unwrap().push((name, subject.clone()));
        if self.failing.lock().unwrap().remove(name) {
            return Err(RuntimeError::Sandbox {
                sandbox_id: subject,
                message: format!("{name} failed (injected)"),
            });
        }
        Ok(())
    }

    fn change(&self, f: impl FnOnce(&mut HostState)) {
        f(&mut self.state.lock().unwrap());
    }
}

impl HostOps for RecordingHost {
    type Netns = FakeNetns;

    fn netns_slot(netns: &FakeNetns) -> u32 {
        netns.0
    }

    async fn freeze(&self, id: &str) -> Result<(), CgroupError> {
        self.call("freeze", id)
            .map_err(|e| CgroupError::Unsupported(e.to_string()))?;
        self.change(|s| {
            s.frozen.insert(id.to_owned());
        });
        Ok(())
    }

    fn thaw(&self, id: &str) -> Result<(), CgroupError> {
        self.call("thaw", id)
            .map_err(|e| CgroupError::Unsupported(e.to_string()))?;
        self.change(|s| {
            s.frozen.remove(id);
        });
        Ok(())
    }

    fn host_sockets(&self, id: &str) -> Vec<HostSocket> {
        let _ = self.call("sockets", id);
        let count = self.held_sockets.lock().unwrap().pop_front().unwrap_or(0);
        (0..count as u64)
            .map(|inode| HostSocket {
                pid: 1,
                fd: "3".into(),
                inode,
            })
            .collect()
    }

    fn create_cgroups(&self, id: &str, _: Limits) -> Result<(), RuntimeError> {
        self.call("create_cgroups", id)?;
        self.change(|s| {
            s.cgroups.insert(id.to_owned());
        });
        Ok(())
    }

    async fn make_disk(
        &self,
        id: &str,
        source: DiskSource,
        _: u32,
    ) -> Result<PathBuf, RuntimeError> {
        self.call("make_disk", id)?;
        self.change(|s| {
            let new = s.disks.insert(id.to_owned());
            assert_eq!(
                new,
                matches!(source, DiskSource::Fresh { .. }),
                "a fresh disk for {id} must be new, a kept one must exist"
            );
        });
        Ok(PathBuf::from(format!("/disks/{id}")))
    }

    async fn apply_egress(
        &self,
        id: &str,
        slot: u32,
        _: bool,
        _: &EgressRules,
    ) -> Result<(), RuntimeError> {
        self.call("apply_egress", id)?;
        self.change(|s| {
            s.egress.insert(slot);
        });
        Ok(())
    }

    async fn spawn_agent(
        &self,
        boot: &BootSpec<'_>,
        _: &Path,
        netns: &FakeNetns,
        _: IdMap,
    ) -> Result<i32, RuntimeError> {
        self.call("spawn_agent", boot.id)?;
        let slot = netns.0;
        self.change(|s| {
            assert!(
                s.wired_slots.contains(&slot),
                "{} booted in slot {slot}, which is not prepared",
                boot.id
            );
            s.agents.insert(boot.id.to_owned());
            s.sockets.insert(boot.id.to_owned());
            s.records.insert(boot.id.to_owned());
        });
        // No process of this test has this PID's start time: nothing real is ever signalled.
        Ok(i32::MAX)
    }

    async fn restore_processes(
        &self,
        spec: &LaunchSpec,
        netns: FakeNetns,
        _: IdMap,
        _: SlotRestore,
    ) -> Result<i32, RuntimeError> {
        let id = &spec.sandbox_id;
        self.call("restore_processes", id)?;
        self.change(|s| {
            assert!(
                s.wired_slots.contains(&netns.0),
                "{id} restored in slot {}, which is not prepared",
                netns.0
            );
            assert!(
                s.cgroups.contains(id.as_str()),
                "{id} restored outside its cgroups"
            );
            s.agents.insert(id.clone());
            s.sockets.insert(id.clone());
            s.records.insert(id.clone());
        });
        Ok(i32::MAX)
    }

    async fn wait_agent(&self, id: &str, _: u32) -> Result<Endpoint, RuntimeError> {
        self.call("wait_agent", id)?;
        Ok(Endpoint {
            agent_socket: PathBuf::from(format!("/agents/{id}.sock")),
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
        })
    }

    async fn start_and_ready(&self, spec: &LaunchSpec, _: &Endpoint) -> Result<(), RuntimeError> {
        self.call("start_and_ready", &spec.sandbox_id)
    }

    async fn kill_processes(
        &self,
        id: &str,
        _: Option<&RuntimeHandle>,
    ) -> Result<(), RuntimeError> {
        self.call("kill_processes", id)?;
        self.change(|s| {
            s.agents.remove(id);
            s.frozen.remove(id);
        });
        Ok(())
    }

    async fn dump(&self, id: &str, dump: &CriuDump<'_>) -> Result<(), RuntimeError> {
        assert!(
            self.state.lock().unwrap().frozen.contains(id),
            "{id} dumped while not frozen"
        );
        self.call("dump", id)?;
        if !dump.leave_running {
            // CRIU ends the tree it dumped; the cgroup stays frozen, empty.
            self.change(|s| {
                s.agents.remove(id);
            });
        }
        Ok(())
    }

    async fn kill_leftovers(&self, id: &str) -> Result<(), CgroupError> {
        self.call("kill_leftovers", id)
            .map_err(|e| CgroupError::Unsupported(e.to_string()))?;
        self.change(|s| {
            s.agents.remove(id);
            s.frozen.remove(id);
        });
        Ok(())
    }

    fn empty_memory(&self, id: &str) {
        let _ = self.call("empty_memory", id);
    }

    async fn remove_egress(&self, slot: u32) {
        let _ = self.call("remove_egress", slot);
        self.change(|s| {
            s.egress.remove(&slot);
        });
    }

    async fn release_slot(&self, slot: u32) {
        let _ = self.call("release_slot", slot);
        self.change(|s| {
            s.wired_slots.remove(&slot);
        });
    }

    fn oom_kills(&self, id: &str) -> Option<u64> {
        let _ = self.call("oom_kills", id);
        self.state.lock().unwrap().cgroups.contains(id).then_some(0)
    }

    async fn remove_cgroups(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("remove_cgroups", id)?;
        self.change(|s| {
            assert!(
                !s.agents.contains(id),
                "cgroups of {id} removed with its agent alive"
            );
            s.cgroups.remove(id);
        });
        Ok(())
    }

    fn remove_agent_socket(&self, id: &str) {
        let _ = self.call("remove_agent_socket", id);
        self.change(|s| {
            s.sockets.remove(id);
        });
    }

    fn remove_records(&self, id: &str) {
        let _ = self.call("remove_records", id);
        self.change(|s| {
            s.records.remove(id);
        });
    }

    async fn remove_disk(&self, id: &str) -> Result<(), RuntimeError> {
        self.call("remove_disk", id)?;
        self.change(|s| {
            s.disks.remove(id);
        });
        Ok(())
    }
}
