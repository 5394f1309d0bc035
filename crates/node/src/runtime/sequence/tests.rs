#![allow(clippy::unwrap_used)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{
    BuildStatus, EgressRules, Endpoint, LaunchSpec, RuntimeError, Template, TemplateImage,
};
use sandbar_jail::IdMap;

use super::{
    BootFailure, boot, dump_frozen, end_dumped, restore_in_slot, settle_and_freeze, stop, teardown,
    undo_failed_boot,
};
use crate::net::netns::SlotSet;
use crate::resources::cgroups::{CpuPriority, Limits};
use crate::runtime::criu_runs::CriuDump;
use crate::runtime::holdings::{Holdings, Opening, SlotHold};
use crate::runtime::host_fake::{FakeNetns, HostState, RecordingHost};
use crate::runtime::host_ops::{DiskSource, HostOps};
use crate::runtime::ledger::ResourceLedger;
use crate::runtime::restore::SlotRestore;
use crate::runtime::sandbox_err;
use sandbar_core::{HandlePhase, RuntimeHandle};

const PATIENCE: Duration = Duration::from_secs(1);

#[tokio::test]
async fn a_settled_sandbox_is_frozen_at_once() {
    let host = RecordingHost::default();
    let held = settle_and_freeze(&host, "s", PATIENCE).await.unwrap();
    assert!(held.is_empty());
    assert_eq!(host.calls(), ["sockets", "freeze"]);
}

#[tokio::test]
async fn the_freeze_waits_for_connections_from_the_host_to_close() {
    let host = RecordingHost::holding_sockets(&[2, 1]);
    let held = settle_and_freeze(&host, "s", PATIENCE).await.unwrap();
    assert!(held.is_empty());
    assert_eq!(host.calls(), ["sockets", "sockets", "sockets", "freeze"]);
}

#[tokio::test]
async fn a_connection_held_past_the_patience_is_frozen_and_reported() {
    let host = RecordingHost::holding_sockets(&[1; 1000]);
    let held = settle_and_freeze(&host, "s", Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(host.calls().last(), Some(&"freeze"));
}

/// Dumps sandbox "s" of `host` by `dump` as a pause does, a host error told as text.
async fn dump_s<Fut>(host: &RecordingHost, dump: impl FnMut() -> Fut) -> Result<u8, String>
where
    Fut: Future<Output = Result<u8, String>>,
{
    dump_frozen(host, "s", PATIENCE, |e| e.to_string(), dump).await
}

#[tokio::test]
async fn a_dump_that_works_touches_nothing_else() {
    let host = RecordingHost::default();
    let out = dump_s(&host, || async { Ok(7) }).await;
    assert_eq!(out, Ok(7));
    assert!(host.calls().is_empty());
}

#[tokio::test]
async fn a_failed_dump_without_host_connections_is_not_tried_again() {
    let host = RecordingHost::holding_sockets(&[0]);
    let tries = RefCell::new(0);
    let out = dump_s(&host, || {
        *tries.borrow_mut() += 1;
        async { Err("dump failed".to_owned()) }
    })
    .await;
    assert_eq!(out, Err("dump failed".to_owned()));
    assert_eq!(*tries.borrow(), 1);
    assert_eq!(host.calls(), ["sockets"]);
}

#[tokio::test]
async fn a_dump_failed_on_a_host_connection_thaws_settles_and_dumps_again() {
    // Held at the failure, still held at the first look after the thaw, then closed.
    let host = RecordingHost::holding_sockets(&[1, 1, 0]);
    let tries = RefCell::new(0);
    let out = dump_s(&host, || {
        *tries.borrow_mut() += 1;
        let first = *tries.borrow() == 1;
        async move {
            if first {
                Err("unix: Unix socket 0 not found".to_owned())
            } else {
                Ok(1)
            }
        }
    })
    .await;
    assert_eq!(out, Ok(1));
    assert_eq!(*tries.borrow(), 2);
    assert_eq!(
        host.calls(),
        ["sockets", "thaw", "sockets", "sockets", "freeze"]
    );
}

fn spec(id: &str, start_cmd: bool) -> LaunchSpec {
    let now = chrono::Utc::now();
    LaunchSpec {
        sandbox_id: id.to_owned(),
        template: Template {
            id: "base".into(),
            team_id: None,
            namespace: None,
            aliases: Vec::new(),
            public: true,
            build_id: "b".into(),
            build_status: BuildStatus::Ready,
            build_error: None,
            cpu_count: 1,
            memory_mb: MEMORY_MB,
            disk_size_mb: 512,
            envd_version: String::new(),
            image: None,
            created_at: now,
            updated_at: now,
            last_spawned_at: None,
            spawn_count: 0,
            build_count: 0,
        },
        image: TemplateImage {
            layers: vec!["layer/base".into()],
            env: BTreeMap::new(),
            user: "user".into(),
            workdir: "/home/user".into(),
            start_cmd: start_cmd.then(|| "server".to_owned()),
            start_user: None,
            ready_cmd: None,
            snapshot: None,
            started: None,
        },
        cpu_count: 1,
        memory_mb: MEMORY_MB,
        disk_size_mb: 512,
        disk_rates: Default::default(),
        env_vars: BTreeMap::new(),
        allow_internet_access: true,
        egress: EgressRules::default(),
        envd_access_token: "token".into(),
        volumes: Vec::new(),
        kept: None,
    }
}

const MEMORY_MB: u32 = 100;

fn limits() -> Limits {
    Limits {
        cpu_count: 1,
        memory_mb: MEMORY_MB,
        pids_max: 100,
        cpu_priority: CpuPriority::Normal,
        io: Default::default(),
    }
}

fn id_map(slot: u32) -> IdMap {
    IdMap {
        host_base: 100_000 + slot * 65_536,
        size: 65_536,
    }
}

fn slots_taken(slots: &SlotSet) -> Vec<u32> {
    slots.lock().unwrap().iter().copied().collect()
}

/// The node around the sequences: its owners, slots and memory, and the host.
struct Node {
    host: RecordingHost,
    holdings: Holdings,
    slots: SlotSet,
    ledger: Arc<ResourceLedger>,
}

impl Node {
    fn new() -> Self {
        Node {
            host: RecordingHost::default(),
            holdings: Holdings::default(),
            slots: SlotSet::default(),
            ledger: ResourceLedger::unreserved(),
        }
    }

    fn free_slot(&self) -> u32 {
        let taken = slots_taken(&self.slots);
        (0..).find(|s| !taken.contains(s)).unwrap()
    }

    /// Opens an operation on sandbox `spec` as the node does: memory granted, a slot claimed
    /// from the namespace pool (which takes it from the set), the image's layers in use.
    fn open(&self, spec: &LaunchSpec) -> (Opening<'_>, u32, FakeNetns) {
        let id = &spec.sandbox_id;
        let mut opening = self.holdings.opening(id);
        opening.hold_memory(self.ledger.regrant(id, MEMORY_MB, 0));
        let slot = self.free_slot();
        let netns = self.host.prepare_slot(slot);
        self.slots.lock().unwrap().insert(slot);
        opening.hold_slot(SlotHold::taken(&self.slots, slot));
        opening.use_layers(spec.image.layers.clone());
        (opening, slot, netns)
    }

    /// Commits the opening of a boot or restore that worked, or undoes what it left.
    async fn finish(
        &self,
        opening: Opening<'_>,
        slot: u32,
        outcome: Result<(RuntimeHandle, Endpoint), BootFailure>,
        keep_files: bool,
    ) -> Result<RuntimeHandle, RuntimeError> {
        self.host.fail_nothing();
        match outcome {
            Ok((handle, _)) => {
                opening.commit();
                Ok(handle)
            }
            Err(failure) => Err(undo_failed_boot(
                &self.host,
                &self.holdings,
                &self.slots,
                opening,
                slot,
                failure,
                keep_files,
            )
            .await),
        }
    }

    /// Launches sandbox `id` as the node does: an opening, the boot, then a commit or the
    /// undoing of what the boot left.
    async fn launch(
        &self,
        id: &str,
        kept: Option<&RuntimeHandle>,
        start_cmd: bool,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let spec = spec(id, start_cmd);
        let (opening, slot, netns) = self.open(&spec);
        let booted = boot(&self.host, &spec, netns, id_map(slot), limits(), kept).await;
        self.finish(opening, slot, booted, kept.is_some()).await
    }

    /// Restores sandbox `id` from a staged checkpoint as the node does for a snapshot
    /// (`kept`: `None`) or a checkpoint carried from a lost node (its kept handle).
    async fn restore(
        &self,
        id: &str,
        kept: Option<&RuntimeHandle>,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let spec = spec(id, false);
        let (opening, slot, netns) = self.open(&spec);
        let disk = match kept {
            None => DiskSource::Fresh { size_mb: 512 },
            Some(kept) => DiskSource::Kept {
                id_base: kept.id_base.unwrap_or(0),
            },
        };
        let restored = restore_in_slot(
            &self.host,
            &spec,
            netns,
            id_map(slot),
            limits(),
            disk,
            staged(),
        )
        .await;
        self.finish(opening, slot, restored, kept.is_some()).await
    }

    async fn stop(&self, id: &str, handle: &RuntimeHandle) {
        stop(&self.host, &self.holdings, &self.slots, id, Some(handle))
            .await
            .unwrap();
    }

    /// Launches sandbox `id` and stops it, returning the handle to its kept files as the
    /// node records it once released.
    async fn launched_and_released(&self, id: &str, start_cmd: bool) -> RuntimeHandle {
        let first = self.launch(id, None, start_cmd).await.unwrap();
        self.stop(id, &first).await;
        RuntimeHandle {
            phase: HandlePhase::Released,
            ..first
        }
    }

    async fn teardown(&self, id: &str, handle: Option<&RuntimeHandle>) {
        teardown(&self.host, &self.holdings, &self.slots, id, handle)
            .await
            .unwrap();
    }

    /// Pauses sandbox `id` to disk as the node does: frozen once settled, dumped (again after
    /// a thaw if a connection from the host was in the way), then what the dump left ended.
    async fn pause_to_disk(&self, id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        settle_and_freeze(&self.host, id, PATIENCE)
            .await
            .map_err(|e| sandbox_err(id, e))?;
        let criu = crate::checkpoint::Criu {
            path: PathBuf::from("/usr/sbin/criu"),
            version: "4.1.1".into(),
            kdat_dir: PathBuf::from("/run/criu"),
        };
        let plan = crate::checkpoint::DumpPlan {
            args: Vec::new(),
            externals: Vec::new(),
            listener_inode: 1,
            agent_digest: None,
        };
        let freezer = PathBuf::from(format!("/freezer/{id}"));
        let images = PathBuf::from(format!("/checkpoints/{id}"));
        let dump = CriuDump {
            init: handle,
            criu: &criu,
            freezer: &freezer,
            images: &images,
            plan: &plan,
            leave_running: false,
        };
        dump_frozen(
            &self.host,
            id,
            PATIENCE,
            |e| sandbox_err(id, e),
            || self.host.dump(id, &dump),
        )
        .await?;
        end_dumped(&self.host, &self.holdings, id).await;
        Ok(())
    }

    /// Nothing is held by the node or made on the host.
    fn is_empty(&self) -> bool {
        self.host.state().is_empty()
            && self.holdings.counts() == (0, 0, 0, 0)
            && slots_taken(&self.slots).is_empty()
            && self.ledger.promised_mb() == 0
    }
}

/// How a test starts a sandbox: booted from its image (running its start command or not), or
/// restored from a checkpoint.
#[derive(Debug, Clone, Copy)]
enum Start {
    Boot { start_cmd: bool },
    Restore,
}

impl Start {
    fn steps(self) -> &'static [&'static str] {
        match self {
            Start::Boot { .. } => &BOOT_STEPS,
            Start::Restore => &RESTORE_STEPS,
        }
    }

    fn start_cmd(self) -> bool {
        matches!(self, Start::Boot { start_cmd: true })
    }
}

impl Node {
    async fn start(
        &self,
        id: &str,
        kept: Option<&RuntimeHandle>,
        how: Start,
    ) -> Result<RuntimeHandle, RuntimeError> {
        match how {
            Start::Boot { start_cmd } => self.launch(id, kept, start_cmd).await,
            Start::Restore => self.restore(id, kept).await,
        }
    }

    /// Starts sandbox `s{id}` of `sandboxes` as `how` says, on its kept files if it was
    /// released, failing at its step `fail` if there is one; a started sandbox is left alone.
    async fn start_op(
        &self,
        sandboxes: &mut BTreeMap<String, RuntimeHandle>,
        id: usize,
        fail: usize,
        how: Start,
    ) {
        let id = format!("s{id}");
        let kept = match sandboxes.get(&id) {
            Some(h) if h.phase == HandlePhase::Released => Some(h.clone()),
            Some(_) => return,
            None => None,
        };
        if let Some(step) = how.steps().get(fail) {
            self.host.fail_next(step);
        }
        if let Ok(handle) = self.start(&id, kept.as_ref(), how).await {
            sandboxes.insert(id, handle);
        }
    }
}

fn staged() -> SlotRestore {
    SlotRestore {
        work: PathBuf::from("/checkpoints/staged"),
        header: crate::checkpoint::Header {
            criu_version: "4.1.1".into(),
            agent_digest: String::new(),
            listener_inode: 1,
            externals: Vec::new(),
            images: Vec::new(),
            images_crc32: 0,
        },
        machine_id: None,
        boot_id: None,
    }
}

const RESTORE_STEPS: [&str; 5] = [
    "create_cgroups",
    "make_disk",
    "apply_egress",
    "restore_processes",
    "wait_agent",
];

const BOOT_STEPS: [&str; 6] = [
    "create_cgroups",
    "make_disk",
    "apply_egress",
    "spawn_agent",
    "wait_agent",
    "start_and_ready",
];

/// A stop's steps; a teardown's begin with them.
const STOP_STEPS: [&str; 6] = [
    "kill_processes",
    "remove_egress",
    "release_slot",
    "oom_kills",
    "remove_cgroups",
    "remove_agent_socket",
];

#[tokio::test]
async fn a_boot_makes_its_parts_in_order_and_a_teardown_removes_them() {
    let node = Node::new();
    let handle = node.launch("s", None, true).await.unwrap();
    assert_eq!(node.host.calls(), BOOT_STEPS);
    let state = node.host.state();
    assert_eq!(state.agents.len(), 1);
    assert_eq!(state.egress.len(), 1);
    assert_eq!(
        node.holdings.holder_of_slot(handle.slot).as_deref(),
        Some("s")
    );
    assert_eq!(node.ledger.promised_mb(), u64::from(MEMORY_MB));

    node.host.forget_calls();
    node.teardown("s", Some(&handle)).await;
    assert_eq!(
        node.host.calls(),
        [&STOP_STEPS[..], &["remove_records", "remove_disk"]].concat()
    );
    assert!(node.is_empty(), "{:?}", node.host.state());
}

#[tokio::test]
async fn a_boot_without_a_start_command_runs_none() {
    let node = Node::new();
    node.launch("s", None, false).await.unwrap();
    assert_eq!(node.host.calls(), BOOT_STEPS[..5]);
}

/// Fails a fresh sandbox's start at each of its steps in turn: the error names the step, the
/// steps before it ran in order, and nothing is left behind.
async fn each_failed_step_leaves_nothing_behind(how: Start) {
    for &step in how.steps() {
        let node = Node::new();
        node.host.fail_next(step);
        let err = node.start("s", None, how).await.unwrap_err();
        assert!(err.to_string().contains(step), "{step}: {err}");
        let calls = node.host.calls();
        let failed_at = calls.iter().position(|c| *c == step).unwrap();
        assert_eq!(calls[..failed_at], how.steps()[..failed_at], "{step}");
        assert!(
            node.is_empty(),
            "after {step} failed: {:?}",
            node.host.state()
        );
    }
}

/// Fails a start on a released sandbox's kept files at each of its steps in turn: the files
/// stay, with the layers under them, and nothing else does until the sandbox is torn down.
async fn each_failed_step_on_kept_files_keeps_them_and_nothing_else(how: Start) {
    for &step in how.steps() {
        let node = Node::new();
        let released = node.launched_and_released("s", how.start_cmd()).await;
        node.host.fail_next(step);
        node.start("s", Some(&released), how).await.unwrap_err();
        let state = node.host.state();
        assert_eq!(
            state,
            HostState {
                disks: ["s".to_owned()].into(),
                records: ["s".to_owned()].into(),
                ..HostState::default()
            },
            "after {step} failed"
        );
        assert!(slots_taken(&node.slots).is_empty(), "{step}");
        assert_eq!(node.ledger.promised_mb(), 0, "{step}");
        // The kept files' layers are what the failed start found.
        assert_eq!(node.holdings.layers_in_use(), ["layer/base".to_owned()]);
        node.teardown("s", Some(&released)).await;
        assert!(node.is_empty(), "{step}: {:?}", node.host.state());
    }
}

#[tokio::test]
async fn a_boot_failing_at_any_step_leaves_nothing_behind() {
    each_failed_step_leaves_nothing_behind(Start::Boot { start_cmd: true }).await;
}

#[tokio::test]
async fn a_failed_boot_on_kept_files_keeps_them_and_nothing_else() {
    each_failed_step_on_kept_files_keeps_them_and_nothing_else(Start::Boot { start_cmd: true })
        .await;
}

#[tokio::test]
async fn a_pause_to_disk_freezes_dumps_then_ends_what_the_dump_left() {
    let node = Node::new();
    let handle = node.launch("s", None, false).await.unwrap();
    node.host.forget_calls();
    node.pause_to_disk("s", &handle).await.unwrap();
    assert_eq!(
        node.host.calls(),
        [
            "sockets",
            "freeze",
            "dump",
            "kill_leftovers",
            "empty_memory",
            "oom_kills",
            "remove_agent_socket",
        ]
    );
    let state = node.host.state();
    assert!(state.agents.is_empty() && state.frozen.is_empty());
    assert_eq!(node.ledger.promised_mb(), 0);
    // The restore boots in the slot, disk and cgroups the sandbox kept.
    assert_eq!(slots_taken(&node.slots).len(), 1);
    assert_eq!(state.disks.len(), 1);
    assert_eq!(state.cgroups.len(), 1);
}

#[tokio::test]
async fn a_failed_dump_leaves_the_sandbox_frozen_and_thawable() {
    let node = Node::new();
    let handle = node.launch("s", None, false).await.unwrap();
    let promised = node.ledger.promised_mb();
    node.host.forget_calls();
    node.host.fail_next("dump");
    let err = node.pause_to_disk("s", &handle).await.unwrap_err();
    assert!(err.to_string().contains("dump failed"), "{err}");
    // No connection from the host was held: the dump is not tried again.
    assert_eq!(node.host.calls(), ["sockets", "freeze", "dump", "sockets"]);
    let state = node.host.state();
    assert!(state.frozen.contains("s") && state.agents.contains("s"));
    assert_eq!(node.ledger.promised_mb(), promised);
    node.host.thaw("s").unwrap();
    assert!(node.host.state().frozen.is_empty());
}

#[tokio::test]
async fn a_stop_gives_back_slot_and_memory_and_keeps_the_disk() {
    let node = Node::new();
    let handle = node.launch("s", None, false).await.unwrap();
    node.host.forget_calls();
    node.stop("s", &handle).await;
    assert_eq!(node.host.calls(), STOP_STEPS);
    assert!(slots_taken(&node.slots).is_empty());
    assert_eq!(node.ledger.promised_mb(), 0);
    assert_eq!(node.host.state().disks.len(), 1);
}

#[tokio::test]
async fn a_stop_by_a_handle_naming_a_slot_another_sandbox_holds_leaves_its_network() {
    let node = Node::new();
    let held = node.launch("holder", None, false).await.unwrap();
    // A sandbox found after a restart, never adopted, whose handle names the same slot.
    let stale = RuntimeHandle::unstarted(held.slot);
    node.host.forget_calls();
    stop(
        &node.host,
        &node.holdings,
        &node.slots,
        "stale",
        Some(&stale),
    )
    .await
    .unwrap();
    assert!(!node.host.calls().contains(&"release_slot"));
    assert_eq!(slots_taken(&node.slots), [held.slot]);
    assert!(node.host.state().wired_slots.contains(&held.slot));
}

#[tokio::test]
async fn a_stop_whose_cgroups_cannot_go_keeps_the_disk_for_the_next_try() {
    let node = Node::new();
    let handle = node.launch("s", None, false).await.unwrap();
    node.host.fail_next("remove_cgroups");
    teardown(&node.host, &node.holdings, &node.slots, "s", Some(&handle))
        .await
        .unwrap_err();
    assert!(!node.host.calls().contains(&"remove_disk"));
    // The reaper's next try finds what is left and removes it.
    node.teardown("s", Some(&handle)).await;
    assert!(node.is_empty(), "{:?}", node.host.state());
}

#[tokio::test]
async fn a_restore_makes_its_parts_in_order_and_a_teardown_removes_them() {
    let node = Node::new();
    let handle = node.restore("s", None).await.unwrap();
    assert_eq!(node.host.calls(), RESTORE_STEPS);
    assert_eq!(node.host.state().agents.len(), 1);
    node.teardown("s", Some(&handle)).await;
    assert!(node.is_empty(), "{:?}", node.host.state());
}

#[tokio::test]
async fn a_restore_failing_at_any_step_leaves_nothing_behind() {
    each_failed_step_leaves_nothing_behind(Start::Restore).await;
}

#[tokio::test]
async fn a_carried_restore_that_fails_keeps_the_files_it_was_taken_over_with() {
    each_failed_step_on_kept_files_keeps_them_and_nothing_else(Start::Restore).await;
}

#[derive(Debug, Clone)]
enum Op {
    /// Launches sandbox `id` (on its kept files if it was released), failing at `fail` if
    /// that is a boot step.
    Launch {
        id: usize,
        fail: usize,
        start_cmd: bool,
    },
    /// Restores sandbox `id` from a snapshot (a new one) or, if it was released, from a
    /// checkpoint carried onto its kept files, failing at `fail` if that is a restore step.
    Restore {
        id: usize,
        fail: usize,
    },
    /// Ends its processes and keeps its files (pause without memory).
    Release(usize),
    /// Freezes it and thaws it again.
    FreezeThaw(usize),
    Kill(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..3usize, 0..BOOT_STEPS.len() * 2, any::<bool>())
            .prop_map(|(id, fail, start_cmd)| Op::Launch { id, fail, start_cmd }),
        2 => (0..3usize, 0..RESTORE_STEPS.len() * 2)
            .prop_map(|(id, fail)| Op::Restore { id, fail }),
        1 => (0..3usize).prop_map(Op::Release),
        1 => (0..3usize).prop_map(Op::FreezeThaw),
        1 => (0..3usize).prop_map(Op::Kill),
    ]
}

proptest::proptest! {
    /// Whatever runs and fails, the host holds exactly what the node's owners say, and once
    /// every sandbox is killed nothing is left on either.
    #[test]
    fn every_thing_made_on_the_host_is_removed(ops in proptest::collection::vec(op(), 1..30)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let node = Node::new();
            let mut sandboxes: BTreeMap<String, RuntimeHandle> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Launch { id, fail, start_cmd } => {
                        node.start_op(&mut sandboxes, id, fail, Start::Boot { start_cmd }).await;
                    }
                    Op::Restore { id, fail } => {
                        node.start_op(&mut sandboxes, id, fail, Start::Restore).await;
                    }
                    Op::Release(id) => {
                        let id = format!("s{id}");
                        if let Some(h) = sandboxes.get_mut(&id).filter(|h| h.phase == HandlePhase::Running) {
                            node.stop(&id, h).await;
                            h.phase = HandlePhase::Released;
                        }
                    }
                    Op::FreezeThaw(id) => {
                        let id = format!("s{id}");
                        if sandboxes.get(&id).is_some_and(|h| h.phase == HandlePhase::Running) {
                            settle_and_freeze(&node.host, &id, Duration::ZERO).await.unwrap();
                            node.host.thaw(&id).unwrap();
                        }
                    }
                    Op::Kill(id) => {
                        let id = format!("s{id}");
                        if let Some(h) = sandboxes.remove(&id) {
                            node.teardown(&id, Some(&h)).await;
                        }
                    }
                }
                let state = node.host.state();
                let running: BTreeSet<String> = sandboxes
                    .iter()
                    .filter(|(_, h)| h.phase == HandlePhase::Running)
                    .map(|(id, _)| id.clone())
                    .collect();
                let known: BTreeSet<String> = sandboxes.keys().cloned().collect();
                assert_eq!(state.agents, running);
                assert_eq!(state.cgroups, running);
                assert_eq!(state.disks, known);
                assert_eq!(state.wired_slots.iter().copied().collect::<Vec<_>>(), slots_taken(&node.slots));
                assert_eq!(state.egress, state.wired_slots);
                assert_eq!(node.holdings.held_slots(), slots_taken(&node.slots));
                assert_eq!(node.ledger.promised_mb(), u64::from(MEMORY_MB) * running.len() as u64);
            }
            for (id, h) in std::mem::take(&mut sandboxes) {
                node.teardown(&id, Some(&h)).await;
            }
            assert!(node.is_empty(), "{:?}", node.host.state());
        });
    }
}
