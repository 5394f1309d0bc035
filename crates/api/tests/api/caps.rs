//! Caps on what a team keeps, in-process: each reached through the API and answered 429 (a
//! count) or 507 (bytes) with a body naming the team, the limit and its value; racing
//! creates never pass the last slot.

use crate::common;

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use sandbar_core::TeamCaps;
use sandbar_core::auth::TeamLimits;
use sandbar_core::volumes::DEFAULT_CONTENT_REQUESTS_PER_MINUTE;
use serde_json::{Value, json};

use common::{Cred, Reply, Server, Setup};

const MIB: u64 = 1 << 20;

/// Caps no test reaches unless it lowers one.
const ROOMY: TeamCaps = TeamCaps {
    max_snapshots: 100,
    max_snapshot_mb: 100,
    max_templates: 100,
    max_volumes: 100,
    max_volume_mb: 100,
    max_tags_per_template: 100,
    max_api_keys: 100,
};

struct Harness {
    server: Server,
}

async fn harness(caps: TeamCaps) -> Harness {
    let server = common::serve(Setup {
        limits: TeamLimits {
            caps,
            ..common::LIMITS
        },
        volumes: Some(DEFAULT_CONTENT_REQUESTS_PER_MINUTE),
        ..Setup::default()
    })
    .await;
    Harness { server }
}

async fn send(app: axum::Router, request: Request<Body>) -> Reply {
    common::send(&app, request).await.reply()
}

impl Harness {
    fn request(&self, method: &str, path: &str, body: Option<Value>) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(path)
            .header("X-API-Key", &self.server.credentials.api_key)
            .header("content-type", "application/json")
            .body(Body::from(body.map(|b| b.to_string()).unwrap_or_default()))
            .expect("request")
    }

    async fn api(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.server.send(self.request(method, path, body)).await
    }

    /// Sends all `requests` at once; their statuses, sorted.
    async fn race(&self, requests: impl IntoIterator<Item = Request<Body>>) -> Vec<StatusCode> {
        let racing: Vec<_> = requests
            .into_iter()
            .map(|request| tokio::spawn(send(self.server.app.clone(), request)))
            .collect();
        let mut statuses = Vec::new();
        for task in racing {
            statuses.push(task.await.expect("task").status);
        }
        statuses.sort();
        statuses
    }

    fn new_key_request(&self) -> Request<Body> {
        common::request(
            "POST",
            "/api-keys",
            Cred::Bearer(&self.server.credentials.access_token),
            Some(r#"{"name":"more"}"#.to_owned()),
        )
    }

    async fn sandbox(&self) -> String {
        let made = self
            .api("POST", "/sandboxes", Some(json!({"templateID": "base"})))
            .await;
        assert_eq!(made.status, StatusCode::CREATED, "{:?}", made.body);
        made.body["sandboxID"].as_str().expect("id").to_owned()
    }

    async fn snapshot(&self, sandbox_id: &str, name: Option<&str>) -> Reply {
        self.api(
            "POST",
            &format!("/sandboxes/{sandbox_id}/snapshots"),
            Some(json!({"name": name, "memory": false})),
        )
        .await
    }

    async fn volume(&self, name: &str) -> Reply {
        self.api("POST", "/volumes", Some(json!({"name": name})))
            .await
    }

    async fn write(&self, volume: &Reply, path: &str, bytes: usize) -> Reply {
        let id = volume.body["volumeID"].as_str().expect("id");
        let token = volume.body["token"].as_str().expect("token");
        let request = Request::builder()
            .method("PUT")
            .uri(format!("/volumecontent/{id}/file?path={path}"))
            .header("Authorization", format!("Bearer {token}"))
            .body(Body::from(vec![b'x'; bytes]))
            .expect("request");
        self.server.send(request).await
    }

    /// The team's reply at a cap: the status, and the message naming the limit.
    fn assert_refused(&self, reply: &Reply, status: StatusCode, limit: &str) {
        let message = common::error_message(reply.status, &reply.body, status).unwrap_or_default();
        let expected = format!(
            "team {} has reached its limit of {limit}",
            self.server.credentials.team_id
        );
        assert!(
            message.starts_with(&expected),
            "{message:?} is not {expected:?}…"
        );
    }
}

#[tokio::test]
async fn snapshots_past_the_count_answer_429_and_a_named_one_is_retaken() {
    let h = harness(TeamCaps {
        max_snapshots: 2,
        ..ROOMY
    })
    .await;
    let id = h.sandbox().await;
    assert_eq!(h.snapshot(&id, None).await.status, StatusCode::CREATED);
    assert_eq!(
        h.snapshot(&id, Some("kept")).await.status,
        StatusCode::CREATED
    );
    let third = h.snapshot(&id, None).await;
    h.assert_refused(&third, StatusCode::TOO_MANY_REQUESTS, "2 snapshots");
    // Taken again under its name, a snapshot replaces itself: nothing more is kept.
    let again = h.snapshot(&id, Some("kept")).await;
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.body);
    let listed = h.api("GET", "/snapshots", None).await;
    assert_eq!(listed.body.as_array().map(Vec::len), Some(2));
    // Once one is deleted there is room again.
    let first = listed.body[1]["snapshotID"]
        .as_str()
        .expect("id")
        .to_owned();
    let deleted = h
        .api(
            "DELETE",
            &format!("/templates/{}", first.replace(':', "%3A")),
            None,
        )
        .await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{:?}", deleted.body);
    assert_eq!(h.snapshot(&id, None).await.status, StatusCode::CREATED);
}

#[tokio::test]
async fn snapshot_memory_images_past_the_bytes_answer_507() {
    let h = harness(TeamCaps {
        max_snapshot_mb: 5,
        ..ROOMY
    })
    .await;
    let id = h.sandbox().await;
    h.server
        .runtime
        .snapshot_bytes
        .store(3 * MIB, Ordering::SeqCst);
    assert_eq!(h.snapshot(&id, None).await.status, StatusCode::CREATED);
    // 3 MiB kept and 3 more would pass 5: the copy is taken, measured and let go.
    let refused = h.snapshot(&id, None).await;
    h.assert_refused(
        &refused,
        StatusCode::INSUFFICIENT_STORAGE,
        "5 MiB of snapshot memory images",
    );
    let message = refused.body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("3 MiB are in use and this would add 3 MiB"),
        "{message}"
    );
    let listed = h.api("GET", "/snapshots", None).await;
    assert_eq!(listed.body.as_array().map(Vec::len), Some(1));
    // One that fits exactly is kept; then the cap is reached before anything is copied.
    h.server
        .runtime
        .snapshot_bytes
        .store(2 * MIB, Ordering::SeqCst);
    assert_eq!(h.snapshot(&id, None).await.status, StatusCode::CREATED);
    h.server.runtime.snapshot_bytes.store(0, Ordering::SeqCst);
    let full = h.snapshot(&id, None).await;
    h.assert_refused(
        &full,
        StatusCode::INSUFFICIENT_STORAGE,
        "5 MiB of snapshot memory images",
    );
}

#[tokio::test]
async fn a_create_from_a_template_whose_build_never_started_answers_at_once() {
    let h = harness(ROOMY).await;
    let requested = h
        .api("POST", "/v3/templates", Some(json!({"name": "unstarted"})))
        .await;
    assert_eq!(
        requested.status,
        StatusCode::ACCEPTED,
        "{:?}",
        requested.body
    );
    let create = h
        .api(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": "unstarted", "timeout": 60})),
        )
        .await;
    // Not the refusal a create gets once its patience for a running build runs out.
    assert_eq!(create.status, StatusCode::BAD_REQUEST, "{:?}", create.body);
    let message = create.body["message"].as_str().unwrap_or_default();
    assert!(message.contains("never started"), "{message}");
}

#[tokio::test]
async fn templates_and_tags_past_their_counts_answer_429() {
    let h = harness(TeamCaps {
        max_templates: 2,
        max_tags_per_template: 2,
        ..ROOMY
    })
    .await;
    let id = h.sandbox().await;
    // Snapshots are templates too, but count against their own cap.
    assert_eq!(h.snapshot(&id, None).await.status, StatusCode::CREATED);
    for name in ["one", "two"] {
        let made = h
            .api("POST", "/v3/templates", Some(json!({"name": name})))
            .await;
        assert_eq!(made.status, StatusCode::ACCEPTED, "{:?}", made.body);
    }
    let third = h
        .api("POST", "/v3/templates", Some(json!({"name": "three"})))
        .await;
    h.assert_refused(&third, StatusCode::TOO_MANY_REQUESTS, "2 templates");
    let dockerfile = h
        .api(
            "POST",
            "/templates",
            Some(json!({"dockerfile": "FROM busybox", "alias": "four"})),
        )
        .await;
    h.assert_refused(&dockerfile, StatusCode::TOO_MANY_REQUESTS, "2 templates");
    // A new build of a template the team has is no new template.
    let rebuilt = h
        .api("POST", "/v3/templates", Some(json!({"name": "one:v2"})))
        .await;
    assert_eq!(rebuilt.status, StatusCode::ACCEPTED, "{:?}", rebuilt.body);

    let tagged = h
        .api(
            "POST",
            "/v3/templates",
            Some(json!({"name": "two", "tags": ["a", "b", "c"]})),
        )
        .await;
    h.assert_refused(
        &tagged,
        StatusCode::TOO_MANY_REQUESTS,
        "2 tags per template",
    );
    let within = h
        .api(
            "POST",
            "/v3/templates",
            Some(json!({"name": "two", "tags": ["a", "b"]})),
        )
        .await;
    assert_eq!(within.status, StatusCode::ACCEPTED, "{:?}", within.body);
}

#[tokio::test]
async fn volumes_past_the_count_answer_429_and_racing_creates_take_one_slot() {
    let h = harness(TeamCaps {
        max_volumes: 2,
        ..ROOMY
    })
    .await;
    assert_eq!(h.volume("first").await.status, StatusCode::CREATED);
    let statuses = h
        .race((0..4).map(|n| {
            h.request(
                "POST",
                "/volumes",
                Some(json!({"name": format!("race{n}")})),
            )
        }))
        .await;
    assert_eq!(
        statuses,
        [
            StatusCode::CREATED,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let refused = h.volume("last").await;
    h.assert_refused(&refused, StatusCode::TOO_MANY_REQUESTS, "2 volumes");
    let listed = h.api("GET", "/volumes", None).await;
    assert_eq!(listed.body.as_array().map(Vec::len), Some(2));
}

#[tokio::test]
async fn volume_bytes_past_the_cap_answer_507_to_writes_and_new_volumes() {
    let h = harness(TeamCaps {
        max_volume_mb: 1,
        ..ROOMY
    })
    .await;
    let data = h.volume("data").await;
    assert_eq!(data.status, StatusCode::CREATED);
    let half = (MIB / 2) as usize;
    assert_eq!(h.write(&data, "/a", half).await.status, StatusCode::CREATED);
    let refused = h.write(&data, "/b", half + 4096).await;
    h.assert_refused(
        &refused,
        StatusCode::INSUFFICIENT_STORAGE,
        "1 MiB of volumes",
    );
    // What a sandbox writes into a mounted volume counts too: past the cap, no new volume.
    let id = data.body["volumeID"].as_str().expect("id");
    let team_dir = h
        .server
        .dir
        .path()
        .join("volumes")
        .join(&h.server.credentials.team_id);
    std::fs::write(
        team_dir.join(id).join("from-a-sandbox"),
        vec![b'y'; MIB as usize],
    )
    .expect("write");
    let more = h.volume("more").await;
    h.assert_refused(&more, StatusCode::INSUFFICIENT_STORAGE, "1 MiB of volumes");
}

#[tokio::test]
async fn api_keys_past_the_count_answer_429_and_racing_creates_take_one_slot() {
    // The first key is the team's bootstrap key.
    let h = harness(TeamCaps {
        max_api_keys: 2,
        ..ROOMY
    })
    .await;
    let statuses = h.race((0..3).map(|_| h.new_key_request())).await;
    assert_eq!(
        statuses,
        [
            StatusCode::CREATED,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let refused = h.server.send(h.new_key_request()).await;
    h.assert_refused(&refused, StatusCode::TOO_MANY_REQUESTS, "2 API keys");
}
