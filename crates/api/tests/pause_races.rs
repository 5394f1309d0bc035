//! Races between the reaper's checkpoint of a paused sandbox and requests for it, with a real
//! SQLite store and a runtime double whose dump takes a while (the end-to-end suite covers
//! CRIU itself).

// Shared with the other suites, which use more of it.
#[allow(dead_code)]
mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sandbar_core::auth::TeamLimits;
use sandbar_core::store::TeamRecords;
use sandbar_core::{
    Auth, CreateSandbox, Endpoint, LaunchSpec, Runtime, RuntimeError, RuntimeHandle, Sandboxes,
    SandboxesConfig, Templates,
};
use sandbar_store::SqliteStore;
use serde_json::json;

/// Sandboxes whose handle says whether they are checkpointed, as the node's does.
struct SlowDumps;

fn refuse(sandbox_id: &str, message: &str) -> RuntimeError {
    RuntimeError::Sandbox {
        sandbox_id: sandbox_id.to_owned(),
        message: message.to_owned(),
    }
}

fn endpoint() -> Endpoint {
    Endpoint {
        agent_socket: "/nonexistent/agent.sock".into(),
        address: IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

#[async_trait::async_trait]
impl Runtime for SlowDumps {
    async fn launch(&self, _: LaunchSpec) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        Ok((RuntimeHandle(json!({"checkpointed": false})), endpoint()))
    }

    async fn destroy(&self, _: &str, _: &RuntimeHandle) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn is_alive(&self, _: &str, _: &RuntimeHandle) -> bool {
        true
    }

    async fn sweep(&self, _: &[String]) -> Result<usize, RuntimeError> {
        Ok(0)
    }

    async fn adopt(&self, _: &str, _: &RuntimeHandle) -> Result<Option<Endpoint>, RuntimeError> {
        Ok(None)
    }

    async fn pause(&self, _: &str, _: &RuntimeHandle) -> Result<(), RuntimeError> {
        Ok(())
    }

    async fn resume(&self, id: &str, handle: &RuntimeHandle) -> Result<(), RuntimeError> {
        if handle.0["checkpointed"] == json!(true) {
            return Err(refuse(id, "a checkpointed sandbox cannot be thawed"));
        }
        Ok(())
    }

    fn can_checkpoint(&self) -> bool {
        true
    }

    async fn checkpoint(&self, _: &str, _: &RuntimeHandle) -> Result<RuntimeHandle, RuntimeError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(RuntimeHandle(json!({"checkpointed": true})))
    }

    async fn restore(
        &self,
        id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        if handle.0["checkpointed"] != json!(true) {
            return Err(refuse(id, "the sandbox is not checkpointed"));
        }
        Ok((RuntimeHandle(json!({"checkpointed": false})), endpoint()))
    }
}

#[tokio::test]
async fn a_resume_during_a_checkpoint_restores_from_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(
        SqliteStore::open(&dir.path().join("db"))
            .await
            .expect("open"),
    );
    let limits = TeamLimits {
        max_concurrent_sandboxes: 10,
        max_sandbox_timeout_secs: 3600,
        requests_per_minute: 0,
        max_vcpu: 0,
        max_memory_mb: 0,
        max_disk_mb: 0,
    };
    let credentials = Auth::new(store.clone())
        .bootstrap(None, limits)
        .await
        .expect("bootstrap")
        .expect("a new team");
    let team = store
        .team(&credentials.team_id)
        .await
        .expect("read")
        .expect("the team");
    let templates = Templates::new(store.clone());
    templates
        .register(&common::base_template(Utc::now()))
        .await
        .expect("template");
    let sandboxes = Arc::new(Sandboxes::new(
        store.clone(),
        Arc::new(SlowDumps),
        templates,
        SandboxesConfig {
            pause_grace: Duration::ZERO,
            ..SandboxesConfig::default()
        },
    ));
    let sandbox = sandboxes
        .create(
            &team,
            CreateSandbox {
                template: "base".into(),
                timeout_secs: 300,
                metadata: Default::default(),
                env_vars: Default::default(),
                allow_internet_access: true,
                network: Default::default(),
                auto_pause: false,
                auto_resume: false,
                auto_pause_files_only: false,
                volume_mounts: Vec::new(),
            },
        )
        .await
        .expect("create");
    sandboxes
        .pause(&team, &sandbox.id, true)
        .await
        .expect("pause");
    let reaper = {
        let sandboxes = sandboxes.clone();
        tokio::spawn(async move { sandboxes.checkpoint_paused().await })
    };
    // The resume arrives while the dump runs: it waits for it, then restores from what the
    // dump left rather than thawing processes that are gone.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (resumed, woke) = sandboxes
        .resume(&team, &sandbox.id, 300, true, true)
        .await
        .expect("resume");
    assert!(woke);
    assert_eq!(resumed.handle.0["checkpointed"], json!(false));
    reaper.await.expect("the reaper ran to its end");
}
