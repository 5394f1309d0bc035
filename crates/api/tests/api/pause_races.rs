//! Races between the reaper's checkpoint of a paused sandbox and requests for it, with a real
//! SQLite store and a runtime double whose dump takes a while (the end-to-end suite covers
//! CRIU itself).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sandbar_core::auth::TeamLimits;
use sandbar_core::store::TeamRecords;
use sandbar_core::{Auth, CreateSandbox, Sandboxes, SandboxesConfig, Team, Templates};
use sandbar_store::SqliteStore;
use serde_json::json;

use common::FakeRuntime;

/// A team with a sandbox paused in memory, on a real SQLite store and `runtime`, whose pause
/// grace is over at once.
async fn paused_sandbox(
    runtime: Arc<FakeRuntime>,
) -> (tempfile::TempDir, Arc<Sandboxes>, Team, String) {
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
        caps: sandbar_core::TeamCaps::DEFAULT,
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
        runtime,
        templates,
        SandboxesConfig {
            pause_grace: Duration::ZERO,
            ..SandboxesConfig::default()
        },
    ));
    let sandbox = sandboxes
        .registry()
        .create(
            &team,
            CreateSandbox {
                template: "base".into(),
                timeout_secs: 300,
                allow_internet_access: true,
                ..CreateSandbox::default()
            },
        )
        .await
        .expect("create");
    sandboxes
        .lifecycle()
        .pause(&team, &sandbox.id, true)
        .await
        .expect("pause");
    (dir, sandboxes, team, sandbox.id)
}

#[tokio::test]
async fn a_resume_during_a_checkpoint_restores_from_it() {
    let (_dir, sandboxes, team, id) = paused_sandbox(Arc::new(FakeRuntime::with_checkpoints(
        Duration::from_millis(300),
    )))
    .await;
    let reaper = {
        let sandboxes = sandboxes.clone();
        tokio::spawn(async move { sandboxes.lifecycle().checkpoint_paused().await })
    };
    // The resume arrives while the dump runs: it waits for it, then restores from what the
    // dump left rather than thawing processes that are gone.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (resumed, woke) = sandboxes
        .lifecycle()
        .resume(&team, &id, 300, true, true)
        .await
        .expect("resume");
    assert!(woke);
    assert_eq!(resumed.handle.0["checkpointed"], json!(false));
    reaper.await.expect("the reaper ran to its end");
}

#[tokio::test]
async fn a_refused_checkpoint_leaves_the_sandbox_paused_in_memory_and_is_not_tried_again() {
    let runtime = Arc::new(FakeRuntime::refusing_checkpoints());
    let (_dir, sandboxes, team, id) = paused_sandbox(runtime.clone()).await;
    assert!(sandboxes.health().health_problems().is_empty());
    for _ in 0..5 {
        sandboxes.lifecycle().checkpoint_paused().await;
    }
    // Asked once: what the sandbox holds does not change while it is frozen.
    assert_eq!(
        runtime
            .checkpoints_asked
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let kept = sandboxes.registry().get(&team, &id).await.expect("get");
    assert_eq!(kept.status.name(), "paused");
    assert_eq!(
        sandboxes.health().health_problems(),
        [
            "1 paused sandbox stays in memory: its checkpoint to disk was refused or did not finish; each sandbox's log says why"
        ]
    );
    // Resumed from memory, it no longer counts.
    sandboxes
        .lifecycle()
        .resume(&team, &id, 300, true, true)
        .await
        .expect("resume");
    assert!(sandboxes.health().health_problems().is_empty());
}
