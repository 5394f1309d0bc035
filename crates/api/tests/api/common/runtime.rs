//! The one runtime double of the handler suites: it starts nothing, records what it is asked
//! and answers the way the node does where a suite depends on it. A suite opts into what
//! only it needs: calls held at a gate until the test lets them through, or checkpoints
//! that take a while.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sandbar_core::{
    AgentLogChunk, EgressRules, Endpoint, HandlePhase, LaunchSpec, Runtime, RuntimeError,
    RuntimeHandle, SnapshotParts,
};
use tokio::sync::{Semaphore, mpsc};

/// The first line of every agent log, as a booted agent writes it.
pub const AGENT_STARTED: &str =
    "2026-01-01T00:00:00.5Z  INFO sandbar_agent: agent started version=0.5.7\n";

/// Runtime calls the test holds until it lets them through; each reports its arrival.
struct Gate {
    calls: HashSet<&'static str>,
    arrived: mpsc::UnboundedSender<(&'static str, String)>,
    permits: Semaphore,
}

#[derive(Default)]
pub struct FakeRuntime {
    /// Every launch, in order.
    pub launched: Mutex<Vec<LaunchSpec>>,
    /// The sandboxes destroyed, in order.
    pub destroyed: Mutex<Vec<String>>,
    /// Every change of a sandbox's egress rules, in order.
    pub network_updates: Mutex<Vec<(String, EgressRules)>>,
    /// Each sandbox's agent log; tests append to it with [`FakeRuntime::agent_writes`].
    pub agent_logs: Mutex<HashMap<String, Vec<u8>>>,
    /// Launches answer that the node has no memory left to grant.
    pub no_capacity: AtomicBool,
    /// Sandboxes of lost nodes whose files this runtime laid out, in order.
    /// Sandboxes taken over, with the name of the checkpoint they were given, if any.
    pub taken_over: Mutex<Vec<(String, Option<String>)>>,
    gate: Option<Gate>,
    /// How long a checkpoint takes; checkpoints are off without one.
    dump_time: Option<Duration>,
    /// Checkpoints refused as a node refuses a sandbox holding what it cannot carry.
    refuse_checkpoints: bool,
    /// Checkpoints asked for, refused or not.
    pub checkpoints_asked: std::sync::atomic::AtomicUsize,
    /// What each snapshot's checkpoint holds on disk.
    pub snapshot_bytes: AtomicU64,
}

fn endpoint() -> Endpoint {
    Endpoint {
        agent_socket: "/nonexistent/agent.sock".into(),
        address: IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

fn refuse(sandbox_id: &str, message: &str) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: sandbox_id.to_owned(),
        message: message.to_owned(),
    }
}

fn checkpointed(handle: &RuntimeHandle) -> bool {
    handle.phase == HandlePhase::Checkpointed
}

/// A handle in `phase`, as the fake hands them out.
fn in_phase(phase: HandlePhase) -> RuntimeHandle {
    RuntimeHandle {
        phase,
        ..RuntimeHandle::unstarted(0)
    }
}

impl FakeRuntime {
    /// A runtime whose `calls` (`destroy`, `pause`, `resume`, `snapshot`) report that they
    /// arrived and then wait until [`FakeRuntime::open_gate`].
    pub fn gated(
        calls: &[&'static str],
    ) -> (Self, mpsc::UnboundedReceiver<(&'static str, String)>) {
        let (arrived, arrivals) = mpsc::unbounded_channel();
        let runtime = FakeRuntime {
            gate: Some(Gate {
                calls: calls.iter().copied().collect(),
                arrived,
                permits: Semaphore::new(0),
            }),
            ..FakeRuntime::default()
        };
        (runtime, arrivals)
    }

    /// A runtime that checkpoints frozen sandboxes, each dump taking `dump_time`; the
    /// handle says whether a sandbox is checkpointed, as the node's does.
    pub fn with_checkpoints(dump_time: Duration) -> Self {
        FakeRuntime {
            dump_time: Some(dump_time),
            ..FakeRuntime::default()
        }
    }

    /// A runtime that refuses every checkpoint and memory snapshot because of what the
    /// sandbox holds.
    pub fn refusing_checkpoints() -> Self {
        FakeRuntime {
            dump_time: Some(Duration::ZERO),
            refuse_checkpoints: true,
            ..FakeRuntime::default()
        }
    }

    /// Lets every waiting and later gated call through.
    pub fn open_gate(&self) {
        if let Some(gate) = &self.gate {
            gate.permits.add_permits(1000);
        }
    }

    pub fn launches(&self) -> usize {
        self.launched.lock().expect("lock").len()
    }

    pub fn destroyed(&self) -> Vec<String> {
        self.destroyed.lock().expect("lock").clone()
    }

    /// Appends `text` to the agent log of sandbox `id`.
    pub fn agent_writes(&self, id: &str, text: &str) {
        self.agent_logs
            .lock()
            .expect("lock")
            .entry(id.to_owned())
            .or_default()
            .extend_from_slice(text.as_bytes());
    }

    async fn pass(&self, call: &'static str, sandbox_id: &str) {
        let Some(gate) = &self.gate else { return };
        if gate.calls.contains(call) {
            gate.arrived
                .send((call, sandbox_id.to_owned()))
                .expect("the test listens");
            gate.permits.acquire().await.expect("gate").forget();
        }
    }
}

#[async_trait::async_trait]
impl Runtime for FakeRuntime {
    async fn launch(&self, spec: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        if self.no_capacity.load(Ordering::SeqCst) {
            return Err(RuntimeError::NoCapacity {
                sandbox_id: spec.sandbox_id,
                message: "this node has granted all of its memory".into(),
            });
        }
        self.pass("launch", &spec.sandbox_id).await;
        self.agent_writes(&spec.sandbox_id, AGENT_STARTED);
        self.launched.lock().expect("lock").push(spec);
        Ok((in_phase(HandlePhase::Running), endpoint()))
    }

    async fn destroy(&self, sandbox_id: &str, _: &RuntimeHandle) -> Result<(), RuntimeError> {
        self.pass("destroy", sandbox_id).await;
        self.agent_logs.lock().expect("lock").remove(sandbox_id);
        self.destroyed
            .lock()
            .expect("lock")
            .push(sandbox_id.to_owned());
        Ok(())
    }

    fn is_alive(&self, _: &str, _: &RuntimeHandle) -> bool {
        true
    }

    async fn sweep(&self, _: &[String]) -> Result<usize, RuntimeError> {
        Ok(0)
    }

    async fn update_network(
        &self,
        sandbox_id: &str,
        _: &RuntimeHandle,
        rules: &EgressRules,
    ) -> Result<(), RuntimeError> {
        self.network_updates
            .lock()
            .expect("lock")
            .push((sandbox_id.to_owned(), rules.clone()));
        Ok(())
    }

    async fn adopt(&self, _: &str, _: &RuntimeHandle) -> Result<Option<Endpoint>, RuntimeError> {
        Ok(None)
    }

    async fn pause(&self, sandbox_id: &str, _: &RuntimeHandle) -> Result<(), RuntimeError> {
        self.pass("pause", sandbox_id).await;
        Ok(())
    }

    async fn adopt_released(&self, _: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        assert_eq!(
            handle.phase,
            HandlePhase::Released,
            "only released files are adopted"
        );
        Ok(())
    }

    async fn take_over_files(
        &self,
        sandbox: &sandbar_core::Sandbox,
        _files: &sandbar_core::LayerBlob,
        checkpoint: Option<&sandbar_core::LayerBlob>,
    ) -> Result<sandbar_core::TakenOver, RuntimeError> {
        self.taken_over
            .lock()
            .expect("lock")
            .push((sandbox.id.clone(), checkpoint.map(|c| c.layer.clone())));
        Ok(sandbar_core::TakenOver {
            handle: in_phase(HandlePhase::Released),
            with_memory: checkpoint.is_some(),
        })
    }

    async fn resume(&self, sandbox_id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        self.pass("resume", sandbox_id).await;
        if checkpointed(handle) {
            return Err(refuse(
                sandbox_id,
                "a checkpointed sandbox cannot be thawed",
            ));
        }
        Ok(())
    }

    async fn snapshot(
        &self,
        sandbox_id: &str,
        _: &RuntimeHandle,
        _: &str,
        _: bool,
    ) -> Result<SnapshotParts, RuntimeError> {
        self.pass("snapshot", sandbox_id).await;
        Ok(SnapshotParts {
            layer: format!("layer/snapshot-{sandbox_id}"),
            checkpoint: None,
            checkpoint_bytes: self.snapshot_bytes.load(Ordering::SeqCst),
        })
    }

    fn can_checkpoint(&self) -> bool {
        self.dump_time.is_some()
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        _: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        self.checkpoints_asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(dump_time) = self.dump_time else {
            return Err(refuse(sandbox_id, "checkpoints are off"));
        };
        if self.refuse_checkpoints {
            return Err(RuntimeError::Uncheckpointable {
                sandbox_id: sandbox_id.to_owned(),
                reason: "a process of the sandbox holds a FIFO from outside the sandbox".into(),
            });
        }
        tokio::time::sleep(dump_time).await;
        Ok(in_phase(HandlePhase::Checkpointed))
    }

    async fn restore(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        if !checkpointed(handle) {
            return Err(refuse(sandbox_id, "the sandbox is not checkpointed"));
        }
        Ok((in_phase(HandlePhase::Running), endpoint()))
    }

    fn agent_log(&self, sandbox_id: &str, offset: u64, max: usize) -> Option<AgentLogChunk> {
        let logs = self.agent_logs.lock().expect("lock");
        let log = logs.get(sandbox_id)?;
        let start = (offset as usize).min(log.len());
        Some(AgentLogChunk {
            start: offset,
            bytes: log[start..(start + max).min(log.len())].to_vec(),
        })
    }
}
