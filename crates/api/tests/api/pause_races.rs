//! Races between the reaper's checkpoint of a paused sandbox and requests for it, with a real
//! SQLite store and a runtime double whose dump takes a while (the end-to-end suite covers
//! CRIU itself).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use sandbar_core::auth::TeamLimits;
use sandbar_core::{CreateSandbox, Sandboxes, SandboxesConfig, Team};

use common::{FakeRuntime, Setup};

/// A team with a sandbox paused in memory, on a real SQLite store and `runtime`, whose pause
/// grace is over at once.
async fn paused_sandbox(
    runtime: Arc<FakeRuntime>,
) -> (tempfile::TempDir, Arc<Sandboxes>, Team, String) {
    let server = common::serve(Setup {
        limits: TeamLimits {
            max_concurrent_sandboxes: 10,
            ..common::LIMITS
        },
        config: SandboxesConfig {
            pause_grace: Duration::ZERO,
            ..SandboxesConfig::default()
        },
        runtime,
        ..Setup::default()
    })
    .await;
    let team = server.team().await;
    let sandboxes = server.sandboxes;
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
    (server.dir, sandboxes, team, sandbox.id)
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
    assert_eq!(resumed.handle.phase, sandbar_core::HandlePhase::Running);
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
