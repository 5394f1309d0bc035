//! Conflicting calls on one sandbox, with a real SQLite store and a runtime double whose chosen
//! calls stop at a gate until the test lets them through: the reaper against an extend, two
//! connects on one paused sandbox, a kill against a pause, a resume or a snapshot.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use sandbar_core::Store;
use sandbar_core::auth::TeamLimits;
use sandbar_core::{Builds, CreateSandbox, SandboxError, SandboxState, Sandboxes, Team};
use tokio::sync::mpsc;
use tower::ServiceExt;

use common::{Cred, FakeRuntime, KEY, Setup};

struct Harness {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    team: Team,
    sandboxes: Arc<Sandboxes>,
    builds: Builds,
    runtime: Arc<FakeRuntime>,
    arrived: mpsc::UnboundedReceiver<(&'static str, String)>,
    app: axum::Router,
}

async fn harness(gated: &[&'static str]) -> Harness {
    let (runtime, arrived) = FakeRuntime::gated(gated);
    let server = common::serve(Setup {
        key: Some(KEY),
        limits: TeamLimits {
            max_concurrent_sandboxes: 20,
            ..common::LIMITS
        },
        runtime: Arc::new(runtime),
        ..Setup::default()
    })
    .await;
    Harness {
        team: server.team().await,
        app: server.app,
        _dir: server.dir,
        store: server.store,
        sandboxes: server.sandboxes,
        builds: server.builds,
        runtime: server.runtime,
        arrived,
    }
}

impl Harness {
    async fn create(&self, timeout_secs: u64, auto_pause: bool) -> String {
        self.sandboxes
            .registry()
            .create(
                &self.team,
                CreateSandbox {
                    template: "base".into(),
                    timeout_secs,
                    allow_internet_access: true,
                    auto_pause,
                    ..CreateSandbox::default()
                },
            )
            .await
            .expect("create")
            .id
    }

    /// The next gated call to arrive.
    async fn arrival(&mut self) -> (&'static str, String) {
        tokio::time::timeout(Duration::from_secs(10), self.arrived.recv())
            .await
            .expect("a gated call arrives")
            .expect("the runtime lives")
    }

    /// Lets every waiting and later gated call through.
    fn open_gate(&self) {
        self.runtime.open_gate();
    }

    async fn state(&self, id: &str) -> Option<SandboxState> {
        self.sandboxes
            .registry()
            .get(&self.team, id)
            .await
            .ok()
            .map(|s| s.state())
    }

    async fn call(&self, method: &str, uri: &str, body: Option<&str>) -> common::Answer {
        let request = common::request(method, uri, Cred::Key(KEY), body.map(str::to_owned));
        common::send(&self.app, request).await
    }

    /// Starts three sandboxes that expire as soon as they start and a reaper round over them,
    /// and waits until the round holds the first it reached at the gate.
    async fn reaper_holding_one_of_three(&mut self, auto_pause: bool) -> HeldRound {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(self.create(0, auto_pause).await);
        }
        let reaper = tokio::spawn({
            let sandboxes = self.sandboxes.clone();
            async move { sandboxes.reaper().reap_expired().await }
        });
        let (_, first) = self.arrival().await;
        let rest = ids.iter().filter(|id| **id != first).cloned().collect();
        HeldRound {
            ids,
            first,
            rest,
            reaper,
        }
    }

    /// Gives `rest[0]` a new timeout and connects to `rest[1]`; whether the connect resumed.
    async fn extend_one_and_connect_to_another(&self, rest: &[String]) -> bool {
        self.sandboxes
            .lifecycle()
            .set_timeout(&self.team, &rest[0], 300)
            .await
            .expect("a new timeout");
        let (_, resumed) = self
            .sandboxes
            .lifecycle()
            .resume(&self.team, &rest[1], 300, false, true)
            .await
            .expect("a connect");
        resumed
    }
}

/// A reaper round stopped at the gate on `first`; the `rest` were picked with it but not yet
/// reached.
struct HeldRound {
    ids: Vec<String>,
    first: String,
    rest: Vec<String>,
    reaper: tokio::task::JoinHandle<()>,
}

/// Waits a moment and checks that `task` is still waiting.
async fn still_waiting<T>(task: &tokio::task::JoinHandle<T>, what: &str) {
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!task.is_finished(), "{what} did not wait");
}

#[tokio::test]
async fn a_create_whose_request_goes_away_mid_launch_gives_its_team_slot_back() {
    let mut h = harness(&["launch"]).await;
    let mut one_at_a_time = h.team.clone();
    one_at_a_time.limits.max_concurrent_sandboxes = 1;
    let sandboxes = h.sandboxes.clone();
    let create = |team: sandbar_core::Team| {
        let sandboxes = sandboxes.clone();
        async move {
            sandboxes
                .registry()
                .create(
                    &team,
                    CreateSandbox {
                        template: "base".into(),
                        timeout_secs: 60,
                        ..CreateSandbox::default()
                    },
                )
                .await
        }
    };
    let abandoned = tokio::spawn(create(one_at_a_time.clone()));
    let (call, _) = h.arrival().await;
    assert_eq!(call, "launch");
    // The client hung up: the request's future is dropped where it waits on the node.
    abandoned.abort();
    assert!(abandoned.await.expect_err("aborted").is_cancelled());
    h.open_gate();
    let second = create(one_at_a_time)
        .await
        .expect("the team's one slot is free again");
    assert_eq!(h.state(&second.id).await, Some(SandboxState::Running));
}

#[tokio::test]
async fn an_extend_wins_over_a_reaper_that_has_not_reached_its_sandbox() {
    let mut h = harness(&["destroy"]).await;
    let HeldRound {
        first,
        rest,
        reaper,
        ..
    } = h.reaper_holding_one_of_three(false).await;
    let resumed = h.extend_one_and_connect_to_another(&rest).await;
    assert!(!resumed, "a running sandbox is connected to, not resumed");
    // The one it reached is gone for every caller already.
    assert!(matches!(
        h.sandboxes
            .lifecycle()
            .set_timeout(&h.team, &first, 300)
            .await,
        Err(SandboxError::NotFound(_))
    ));
    h.open_gate();
    reaper.await.expect("reaper");

    assert_eq!(h.runtime.destroyed(), vec![first.clone()]);
    assert_eq!(h.state(&first).await, None);
    for id in &rest {
        assert_eq!(h.state(id).await, Some(SandboxState::Running), "{id}");
        assert!(
            h.sandboxes.routes().route(id).is_some(),
            "{id} is routed to"
        );
    }
    // And they stay: the next round finds nothing due.
    h.sandboxes.reaper().reap_expired().await;
    assert_eq!(h.runtime.destroyed().len(), 1);
}

#[tokio::test]
async fn a_pause_at_the_timeout_leaves_alone_a_sandbox_extended_first() {
    let mut h = harness(&["pause"]).await;
    let HeldRound {
        ids,
        first,
        rest,
        reaper,
    } = h.reaper_holding_one_of_three(true).await;
    h.extend_one_and_connect_to_another(&rest).await;
    // A connect to the one being paused waits for the pause, then resumes it.
    let connect = tokio::spawn({
        let (sandboxes, team, id) = (h.sandboxes.clone(), h.team.clone(), first.clone());
        async move {
            sandboxes
                .lifecycle()
                .resume(&team, &id, 300, false, true)
                .await
        }
    });
    still_waiting(&connect, "a connect during a pause").await;
    h.open_gate();
    reaper.await.expect("reaper");
    let (_, resumed) = connect.await.expect("connect").expect("connected");
    assert!(resumed, "the paused sandbox was resumed (201)");
    for id in ids.iter() {
        assert_eq!(h.state(id).await, Some(SandboxState::Running), "{id}");
    }
}

#[tokio::test]
async fn two_connects_to_a_paused_sandbox_both_succeed() {
    let mut h = harness(&["resume"]).await;
    let id = h.create(300, false).await;
    h.sandboxes
        .lifecycle()
        .pause(&h.team, &id, true)
        .await
        .expect("pause");
    let connect = |h: &Harness| {
        let (sandboxes, team, id) = (h.sandboxes.clone(), h.team.clone(), id.clone());
        tokio::spawn(async move {
            sandboxes
                .lifecycle()
                .resume(&team, &id, 120, false, true)
                .await
        })
    };
    let first = connect(&h);
    assert_eq!(h.arrival().await, ("resume", id.clone()));
    let second = connect(&h);
    still_waiting(&second, "a connect during a resume").await;
    h.open_gate();
    let (_, first_resumed) = first.await.expect("first").expect("first connect");
    let (sandbox, second_resumed) = second.await.expect("second").expect("second connect");
    // 201 for the one that resumed it, 200 for the one that found it running.
    assert!(first_resumed && !second_resumed);
    assert_eq!(sandbox.state(), SandboxState::Running);
    assert!(h.sandboxes.routes().route(&id).is_some());
}

/// Starts `transition` on a fresh sandbox whose runtime stops it at `gate`, kills the sandbox
/// meanwhile, and checks that the kill waited for it and won.
async fn kill_during(gate: &'static str) {
    let mut h = harness(&[gate]).await;
    let id = h.create(300, false).await;
    if gate == "resume" {
        h.sandboxes
            .lifecycle()
            .pause(&h.team, &id, true)
            .await
            .expect("pause");
    }
    let transition = {
        let (sandboxes, team, id) = (h.sandboxes.clone(), h.team.clone(), id.clone());
        tokio::spawn(async move {
            match gate {
                "pause" => sandboxes
                    .lifecycle()
                    .pause(&team, &id, true)
                    .await
                    .map(|_| ()),
                "resume" => sandboxes
                    .lifecycle()
                    .resume(&team, &id, 60, false, true)
                    .await
                    .map(|_| ()),
                _ => sandboxes
                    .snapshots()
                    .snapshot(&team, &id, None, false)
                    .await
                    .map(|_| ())
                    .map_err(|e| SandboxError::NotFound(e.to_string())),
            }
        })
    };
    assert_eq!(h.arrival().await, (gate, id.clone()));
    let kill = {
        let (sandboxes, team, id) = (h.sandboxes.clone(), h.team.clone(), id.clone());
        tokio::spawn(async move { sandboxes.lifecycle().kill(&team, &id).await })
    };
    still_waiting(&kill, &format!("a kill during a {gate}")).await;
    h.open_gate();
    transition
        .await
        .expect("transition")
        .unwrap_or_else(|e| panic!("{gate}: {e}"));
    kill.await
        .expect("kill")
        .unwrap_or_else(|e| panic!("kill during a {gate}: {e}"));
    assert_eq!(h.state(&id).await, None, "killed during a {gate}");
    assert_eq!(h.runtime.destroyed(), vec![id.clone()]);
    assert!(
        h.store
            .sandboxes
            .sandbox(&id)
            .await
            .expect("read")
            .is_none()
    );
}

#[tokio::test]
async fn a_kill_waits_for_a_pause_and_wins() {
    kill_during("pause").await;
}

#[tokio::test]
async fn a_kill_waits_for_a_resume_and_wins() {
    kill_during("resume").await;
}

#[tokio::test]
async fn a_kill_waits_for_a_snapshot_and_wins() {
    kill_during("snapshot").await;
}

#[tokio::test]
async fn a_kill_on_the_wire_answers_204_during_a_pause() {
    let mut h = harness(&["pause"]).await;
    let id = h.create(300, false).await;
    let pause = {
        let (sandboxes, team, id) = (h.sandboxes.clone(), h.team.clone(), id.clone());
        tokio::spawn(async move { sandboxes.lifecycle().pause(&team, &id, true).await })
    };
    h.arrival().await;
    let app = h.app.clone();
    let uri = format!("/sandboxes/{id}");
    let kill = tokio::spawn(async move {
        let request = common::request("DELETE", &uri, Cred::Key(KEY), None);
        app.oneshot(request).await.expect("call").status()
    });
    still_waiting(&kill, "DELETE during a pause").await;
    h.open_gate();
    pause.await.expect("pause").expect("paused");
    assert_eq!(kill.await.expect("kill"), StatusCode::NO_CONTENT);
    let gone = h.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn snapshots_are_deleted_by_their_snapshot_id() {
    let h = harness(&[]).await;
    let id = h.create(300, false).await;
    let unnamed = h
        .sandboxes
        .snapshots()
        .snapshot(&h.team, &id, None, false)
        .await
        .expect("snapshot");
    assert_eq!(
        unnamed.snapshot_id,
        format!("{}:default", unnamed.template_id)
    );
    let named = h
        .sandboxes
        .snapshots()
        .snapshot(&h.team, &id, Some("kept"), false)
        .await
        .expect("named snapshot");
    // Named in the team's namespace, as E2B names snapshots.
    assert_eq!(named.snapshot_id, format!("{}/kept:default", h.team.slug));
    assert_eq!(named.names, vec![named.snapshot_id.clone()]);

    // As the SDK sends it: the whole snapshot ID, its colon encoded.
    let uri = format!("/templates/{}", unnamed.snapshot_id.replace(':', "%3A"));
    let deleted = h.call("DELETE", &uri, None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    assert!(
        h.store
            .templates
            .template(&unnamed.template_id)
            .await
            .expect("read")
            .is_none()
    );
    h.builds
        .delete_template(&h.team, &named.snapshot_id)
        .await
        .expect("delete the named snapshot");
    assert!(
        h.store
            .templates
            .template(&named.template_id)
            .await
            .expect("read")
            .is_none()
    );
    // A template that is not a snapshot is not deleted through a tag.
    let refused = h.call("DELETE", "/templates/base:default", None).await;
    assert_eq!(refused.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn capacity_refusals_say_when_to_retry() {
    let h = harness(&[]).await;
    h.create(30, false).await;
    h.runtime.no_capacity.store(true, Ordering::SeqCst);
    let refused = h
        .call("POST", "/v2/sandboxes", Some(r#"{"templateID": "base"}"#))
        .await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    let wait = common::retry_after(&refused.headers);
    // The running sandbox ends within 30 s; a client may retry then.
    assert!((1..=30).contains(&wait), "{wait}");
    assert!(
        refused.headers.get("should-retry").is_none(),
        "a capacity refusal may be retried"
    );
    let body: serde_json::Value = serde_json::from_slice(&refused.bytes).expect("json");
    assert_eq!(body["code"], 503);
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("memory")),
        "{body}"
    );
}
