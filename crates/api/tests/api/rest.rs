//! The REST surface in-process: a real SQLite store and router, with a runtime double that
//! records launches instead of starting processes (the end-to-end suite covers real sandboxes).

use crate::common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::Utc;
use sandbar_api::{MetricsAccess, routers};
use sandbar_core::Store;
use sandbar_core::auth::TeamLimits;
use sandbar_core::{BuildStatus, Template, Templates};
use serde_json::Value;
use tower::ServiceExt;

use common::{Cred, FakeRuntime, HangingBuilder, KEY, Reply, Setup};

struct Harness {
    _dir: tempfile::TempDir,
    app: axum::Router,
    templates: Templates,
    runtime: Arc<FakeRuntime>,
    store: Arc<Store>,
    key: String,
}

async fn harness(limits: TeamLimits) -> Harness {
    harness_with(limits, Arc::new(common::RefusingBuilder)).await
}

async fn harness_with(limits: TeamLimits, builder: Arc<dyn sandbar_core::Builder>) -> Harness {
    let server = common::serve(Setup {
        key: Some(KEY),
        limits,
        builder,
        ..Setup::default()
    })
    .await;
    let metrics = MetricsAccess {
        token: Some(Arc::from(SCRAPE_TOKEN)),
        own_listener: false,
    };
    Harness {
        app: routers(server.state(), &metrics).main,
        _dir: server.dir,
        templates: server.templates,
        runtime: server.runtime,
        store: server.store,
        key: KEY.into(),
    }
}

const GENEROUS: TeamLimits = common::LIMITS;

impl Harness {
    async fn call(&self, method: &str, path: &str, key: Option<&str>, body: Option<&str>) -> Reply {
        common::call(
            &self.app,
            method,
            path,
            key.map_or(Cred::None, Cred::Key),
            body,
        )
        .await
    }

    async fn api(&self, method: &str, path: &str, body: Option<&str>) -> Reply {
        self.call(method, path, Some(&self.key.clone()), body).await
    }

    async fn create(&self, body: &str) -> String {
        let reply = self.api("POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        reply.body["sandboxID"]
            .as_str()
            .expect("sandboxID")
            .to_owned()
    }

    fn launched(&self) -> usize {
        self.runtime.launches()
    }
}

fn assert_error_body(reply: &Reply, status: StatusCode) {
    let message = common::error_message(reply.status, &reply.body, status);
    assert!(message.is_some_and(|m| !m.is_empty()));
}

#[tokio::test]
async fn api_key_is_required_and_checked() {
    let h = harness(GENEROUS).await;
    let wrong = "e2b_ffffffffffffffffffffffffffffffffffffffff";
    for (method, key, body) in [
        ("GET", None, None),
        ("GET", Some(wrong), None),
        ("POST", Some(wrong), Some(r#"{"templateID":"base"}"#)),
    ] {
        assert_error_body(
            &h.call(method, "/v2/sandboxes", key, body).await,
            StatusCode::UNAUTHORIZED,
        );
    }
    assert_eq!(h.launched(), 0);
    assert_eq!(
        h.api("GET", "/v2/sandboxes", None).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn create_answers_every_field_the_sdk_requires() {
    let h = harness(GENEROUS).await;
    for path in ["/v2/sandboxes", "/sandboxes"] {
        let reply = h
            .api(
                "POST",
                path,
                Some(r#"{"templateID":"base","timeout":300,"secure":true,"allow_internet_access":true,"metadata":{"k":"v"},"envVars":{"A":"1"},"unknownField":1}"#),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        for field in [
            "templateID",
            "sandboxID",
            "clientID",
            "envdVersion",
            "envdAccessToken",
        ] {
            assert!(
                reply.body[field].is_string(),
                "{path}: {field} missing in {:?}",
                reply.body
            );
        }
        let id = reply.body["sandboxID"].as_str().expect("id");
        let detail = h.api("GET", &format!("/sandboxes/{id}"), None).await;
        assert_eq!(detail.status, StatusCode::OK);
        for field in [
            "startedAt",
            "endAt",
            "cpuCount",
            "memoryMB",
            "diskSizeMB",
            "state",
            "envdVersion",
            "clientID",
        ] {
            assert!(!detail.body[field].is_null(), "detail lacks {field}");
        }
        assert_eq!(detail.body["metadata"]["k"], "v");
        assert_eq!(detail.body["state"], "running");
    }
}

#[tokio::test]
async fn bad_create_requests_are_refused_and_start_nothing() {
    let h = harness(GENEROUS).await;
    let cases = [
        ("{not json", StatusCode::BAD_REQUEST),
        (r#"{"templateID": 5}"#, StatusCode::BAD_REQUEST),
        (
            r#"{"templateID":"base","timeout":"x"}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"templateID":"base","timeout":-1}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"templateID":"base","timeout":999999}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"templateID":"base","metadata":{"k":1}}"#,
            StatusCode::BAD_REQUEST,
        ),
        (r#"{"timeout":10}"#, StatusCode::BAD_REQUEST),
        (
            r#"{"templateID":"no-such-template"}"#,
            StatusCode::NOT_FOUND,
        ),
        (r#"{"templateID":"bad name!"}"#, StatusCode::BAD_REQUEST),
        (
            r#"{"templateID":"base","autoPause":false,"autoResume":{"enabled":true}}"#,
            StatusCode::BAD_REQUEST,
        ),
        // A filesystem-only pause on timeout needs autoPause, and cannot resume on traffic.
        (
            r#"{"templateID":"base","autoPauseMemory":false}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"templateID":"base","autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"templateID":"base","network":{"denyOut":["example.com"]}}"#,
            StatusCode::BAD_REQUEST,
        ),
    ];
    for (body, status) in cases {
        let reply = h.api("POST", "/v2/sandboxes", Some(body)).await;
        assert_error_body(&reply, status);
    }
    assert_eq!(h.launched(), 0);
    let list = h.api("GET", "/v2/sandboxes", None).await;
    assert_eq!(list.body.as_array().map(Vec::len), Some(0));
}

#[tokio::test]
async fn list_paginates_and_filters() {
    let h = harness(GENEROUS).await;
    let mut created = Vec::new();
    for i in 0..5 {
        created.push(
            h.create(&format!(
                r#"{{"templateID":"base","metadata":{{"group":"g","n":"{i}"}}}}"#
            ))
            .await,
        );
    }
    h.create(r#"{"templateID":"base","metadata":{"group":"other"}}"#)
        .await;

    let mut seen = Vec::new();
    let mut path = "/v2/sandboxes?limit=2&metadata=group%3Dg".to_owned();
    loop {
        let reply = h.api("GET", &path, None).await;
        assert_eq!(reply.status, StatusCode::OK);
        let items = reply.body.as_array().expect("array");
        assert!(items.len() <= 2);
        seen.extend(
            items
                .iter()
                .map(|i| i["sandboxID"].as_str().expect("id").to_owned()),
        );
        match reply.headers.get("x-next-token") {
            Some(token) => {
                path = format!(
                    "/v2/sandboxes?limit=2&metadata=group%3Dg&nextToken={}",
                    token.to_str().expect("token")
                )
            }
            None => break,
        }
    }
    seen.sort();
    created.sort();
    assert_eq!(seen, created);

    for (path, count) in [
        ("/v2/sandboxes?metadata=n%3D3%26group%3Dg", 1),
        ("/v2/sandboxes?state=running%2Cpaused", 6),
        ("/sandboxes", 6),
    ] {
        let listed = h.api("GET", path, None).await;
        assert_eq!(listed.body.as_array().map(Vec::len), Some(count), "{path}");
    }

    for bad in [
        "limit=0",
        "limit=101",
        "limit=x",
        "state=killed",
        "nextToken=zz",
    ] {
        assert_error_body(
            &h.api("GET", &format!("/v2/sandboxes?{bad}"), None).await,
            StatusCode::BAD_REQUEST,
        );
    }
}

#[tokio::test]
async fn timeouts_kill_and_unknown_ids() {
    let h = harness(GENEROUS).await;
    let id = h.create(r#"{"templateID":"base","timeout":60}"#).await;
    let end = |r: &Reply| r.body["endAt"].as_str().expect("endAt").to_owned();
    let before = end(&h.api("GET", &format!("/sandboxes/{id}"), None).await);

    let reply = h
        .api(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":600}"#),
        )
        .await;
    assert_eq!(reply.status, StatusCode::NO_CONTENT);
    let after = end(&h.api("GET", &format!("/sandboxes/{id}"), None).await);
    assert!(after > before);

    for (path, body) in [
        (format!("/sandboxes/{id}/timeout"), r#"{"timeout":-5}"#),
        (format!("/sandboxes/{id}/refreshes"), r#"{"duration":3601}"#),
    ] {
        assert_error_body(
            &h.api("POST", &path, Some(body)).await,
            StatusCode::BAD_REQUEST,
        );
    }
    let connect = h
        .api("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    assert_eq!(connect.status, StatusCode::OK);
    assert_eq!(connect.body["sandboxID"], id.as_str());

    for (method, path, body) in [
        ("GET", "/sandboxes/inope", "{}"),
        ("DELETE", "/sandboxes/inope", "{}"),
        ("POST", "/v2/sandboxes/inope/connect", "{}"),
        ("POST", "/sandboxes/inope/timeout", r#"{"timeout":5}"#),
    ] {
        assert_error_body(
            &h.api(method, path, Some(body)).await,
            StatusCode::NOT_FOUND,
        );
    }

    assert_eq!(
        h.api("DELETE", &format!("/sandboxes/{id}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(h.runtime.destroyed(), vec![id.clone()]);
    assert_error_body(
        &h.api("DELETE", &format!("/sandboxes/{id}"), None).await,
        StatusCode::NOT_FOUND,
    );
}

#[tokio::test]
async fn another_teams_sandbox_is_invisible() {
    let h = harness(GENEROUS).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    common::add_other_team(&h.store).await;
    let other_key = common::OTHER_KEY;
    let path = format!("/sandboxes/{id}");
    for method in ["GET", "DELETE"] {
        assert_error_body(
            &h.call(method, &path, Some(other_key), None).await,
            StatusCode::NOT_FOUND,
        );
    }
    let list = h.call("GET", "/v2/sandboxes", Some(other_key), None).await;
    assert_eq!(list.body.as_array().map(Vec::len), Some(0));
    assert_eq!(h.api("GET", &path, None).await.status, StatusCode::OK);
}

impl Harness {
    /// Requests a build of a new template `name`, and starts it from `base` unless `start`
    /// is false; its template and build IDs.
    async fn build(&self, name: &str, start: bool) -> (String, String) {
        let requested = self
            .api(
                "POST",
                "/v3/templates",
                Some(&format!(r#"{{"name":"{name}"}}"#)),
            )
            .await;
        let (template_id, build_id) = common::requested_build(requested.status, &requested.body);
        if start {
            let started = self
                .api(
                    "POST",
                    &format!("/v2/templates/{template_id}/builds/{build_id}"),
                    Some(r#"{"fromTemplate":"base","steps":[{"type":"RUN","args":["sleep 100000"]}]}"#),
                )
                .await;
            assert_eq!(started.status, StatusCode::ACCEPTED, "{:?}", started.body);
        }
        (template_id, build_id)
    }

    async fn build_status(&self, template_id: &str, build_id: &str) -> Value {
        let reply = self
            .api(
                "GET",
                &format!("/templates/{template_id}/builds/{build_id}/status"),
                None,
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        reply.body
    }

    /// Cancels a build, which then reports itself cancelled by request.
    async fn cancel(&self, template_id: &str, build_id: &str) {
        let path = format!("/templates/{template_id}/builds/{build_id}");
        assert_eq!(
            self.api("DELETE", &path, None).await.status,
            StatusCode::NO_CONTENT
        );
        let status = self.build_status(template_id, build_id).await;
        assert!(says_cancelled(&status), "{status}");
    }
}

fn says_cancelled(status: &Value) -> bool {
    status["status"] == "error"
        && status["reason"]["message"] == "the build was cancelled by request"
        && status["logEntries"].as_array().is_some_and(|lines| {
            lines.iter().any(|l| {
                l["message"] == "the build was cancelled by request" && l["level"] == "error"
            })
        })
}

#[tokio::test]
async fn builds_are_cancelled_waiting_running_or_never_started_and_only_by_their_team() {
    use std::sync::atomic::Ordering;
    let builder = Arc::new(HangingBuilder::default());
    let h = harness_with(GENEROUS, builder.clone()).await;
    // One build runs at a time: the first runs, the second waits for it.
    let (running_template, running) = h.build("runs", true).await;
    let (waiting_template, waiting) = h.build("waits", true).await;
    let (idle_template, idle) = h.build("never-started", false).await;
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while builder.began.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first build began");
    assert_eq!(builder.began.load(Ordering::SeqCst), 1);

    common::add_other_team(&h.store).await;
    let other_key = common::OTHER_KEY;
    let running_path = format!("/templates/{running_template}/builds/{running}");
    assert_error_body(
        &h.call("DELETE", &running_path, Some(other_key), None).await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!(
        h.build_status(&running_template, &running).await["status"],
        "building"
    );

    h.cancel(&waiting_template, &waiting).await;
    assert_eq!(
        builder.began.load(Ordering::SeqCst),
        1,
        "the waiting build never began"
    );

    h.cancel(&running_template, &running).await;
    assert_eq!(
        builder.dropped.load(Ordering::SeqCst),
        1,
        "the running build's work was dropped"
    );
    assert_error_body(
        &h.api("DELETE", &running_path, None).await,
        StatusCode::CONFLICT,
    );

    h.cancel(&idle_template, &idle).await;
    assert_error_body(
        &h.api(
            "DELETE",
            &format!("/templates/{idle_template}/builds/nope"),
            None,
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!(builder.began.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn team_limits_answer_429() {
    let h = harness(TeamLimits {
        max_concurrent_sandboxes: 2,
        ..GENEROUS
    })
    .await;
    h.create(r#"{"templateID":"base"}"#).await;
    h.create(r#"{"templateID":"base"}"#).await;
    let third = h
        .api("POST", "/v2/sandboxes", Some(r#"{"templateID":"base"}"#))
        .await;
    assert_error_body(&third, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h.launched(), 2);

    let limited = harness(TeamLimits {
        max_concurrent_sandboxes: 2,
        requests_per_minute: 3,
        ..GENEROUS
    })
    .await;
    for _ in 0..3 {
        assert_eq!(
            limited.api("GET", "/v2/sandboxes", None).await.status,
            StatusCode::OK
        );
    }
    let refused = limited.api("GET", "/v2/sandboxes", None).await;
    assert_error_body(&refused, StatusCode::TOO_MANY_REQUESTS);
    let wait = common::retry_after(&refused.headers);
    assert!((1..=60).contains(&wait));
}

#[tokio::test]
async fn edge_answers_502_for_unknown_sandboxes() {
    let h = harness(GENEROUS).await;
    let request = Request::builder()
        .method("POST")
        .uri("/process.Process/List")
        .header("E2b-Sandbox-Id", "inope")
        .header("E2b-Sandbox-Port", "49983")
        .body(Body::from("{}"))
        .expect("request");
    let answer = common::send(&h.app, request).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert!(String::from_utf8_lossy(&answer.bytes).contains("sandbox was not found"));

    let by_host = Request::builder()
        .uri("/health")
        .header("Host", "49983-inope.sandbar.localhost:3000")
        .body(Body::empty())
        .expect("request");
    let response = h.app.clone().oneshot(by_host).await.expect("call");
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);

    let unknown_route = h.api("GET", "/no/such/route", None).await;
    assert_error_body(&unknown_route, StatusCode::NOT_FOUND);
}

/// Registers a second template that is still building, as the default one is on first start.
async fn building_template(h: &Harness, alias: &str) -> String {
    let now = Utc::now();
    let id = format!("{alias:0<20}");
    h.templates
        .register(&Template {
            id: id.clone(),
            aliases: vec![alias.into()],
            build_id: "b2".into(),
            build_status: BuildStatus::Building,
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 1024,
            image: None,
            ..common::base_template(now)
        })
        .await
        .expect("register");
    id
}

#[tokio::test]
async fn create_waits_for_a_building_template() {
    let h = Arc::new(harness(GENEROUS).await);
    let id = building_template(&h, "slow").await;
    let creating = {
        let h = h.clone();
        tokio::spawn(async move {
            h.api("POST", "/v2/sandboxes", Some(r#"{"templateID":"slow"}"#))
                .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !creating.is_finished(),
        "create must wait while the template builds"
    );
    assert_eq!(h.launched(), 0);
    h.store
        .templates
        .set_template_image(&id, "b2", &common::image())
        .await
        .expect("finish");
    h.templates.build_finished().notify_waiters();
    let reply = creating.await.expect("join");
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert_eq!(reply.body["templateID"], id.as_str());
    assert_eq!(h.launched(), 1);
}

#[tokio::test]
async fn create_from_a_failed_template_says_why() {
    let h = harness(GENEROUS).await;
    let id = building_template(&h, "broken").await;
    h.store
        .templates
        .set_template_build(&id, BuildStatus::Error, Some("mirror unreachable"))
        .await
        .expect("finish");
    h.templates.build_finished().notify_waiters();
    let reply = h
        .api("POST", "/v2/sandboxes", Some(r#"{"templateID":"broken"}"#))
        .await;
    assert_error_body(&reply, StatusCode::BAD_REQUEST);
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("mirror unreachable")),
        "{:?}",
        reply.body
    );
    assert_eq!(h.launched(), 0);
}

#[tokio::test]
async fn builds_from_refused_registries_answer_400_when_requested() {
    let h = harness(GENEROUS).await;
    let requested = h
        .api("POST", "/v3/templates", Some(r#"{"name":"from-image"}"#))
        .await;
    assert_eq!(
        requested.status,
        StatusCode::ACCEPTED,
        "{:?}",
        requested.body
    );
    let template_id = requested.body["templateID"].as_str().expect("template");
    let build_id = requested.body["buildID"].as_str().expect("build");
    let start = format!("/v2/templates/{template_id}/builds/{build_id}");
    let refused = h
        .api(
            "POST",
            &start,
            Some(r#"{"fromImage":"refused.test/x/y:1"}"#),
        )
        .await;
    assert_error_body(&refused, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.body["message"],
        "image 'refused.test/x/y:1' cannot be pulled: registry refused.test:443 resolves to 127.0.0.1, a loopback address"
    );
    // Nothing was queued: the same build can still start from an allowed image.
    let started = h
        .api(
            "POST",
            &start,
            Some(r#"{"fromImage":"allowed.test/x/y:1"}"#),
        )
        .await;
    assert_eq!(started.status, StatusCode::ACCEPTED, "{:?}", started.body);

    let dockerfile = h
        .api(
            "POST",
            "/templates",
            Some(r#"{"dockerfile":"FROM refused.test/x/y\nRUN true\n","alias":"from-file"}"#),
        )
        .await;
    assert_error_body(&dockerfile, StatusCode::BAD_REQUEST);
    assert!(
        dockerfile.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("loopback")),
        "{:?}",
        dockerfile.body
    );
    let listed = h.api("GET", "/templates", None).await;
    assert!(
        !listed.body.to_string().contains("from-file"),
        "a refused Dockerfile template was recorded: {:?}",
        listed.body
    );
}

#[tokio::test]
async fn undecodable_path_parameters_get_json_errors() {
    let h = harness(GENEROUS).await;
    for (method, path) in [
        ("GET", "/sandboxes/%FF"),
        ("DELETE", "/sandboxes/%FF"),
        ("POST", "/sandboxes/%C3%28/timeout"),
        ("POST", "/sandboxes/%FF/refreshes"),
        ("GET", "/templates/aliases/%FF"),
    ] {
        let reply = h.api(method, path, Some("{}")).await;
        assert_error_body(&reply, StatusCode::BAD_REQUEST);
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| m.contains("path parameter")),
            "{method} {path}: {:?}",
            reply.body
        );
    }
    assert_eq!(h.launched(), 0);
}

/// The token the harness's server gives `/metrics` to.
const SCRAPE_TOKEN: &str = "scrape-token";

async fn scrape(h: &Harness) -> String {
    let request = common::request("GET", "/metrics", Cred::Bearer(SCRAPE_TOKEN), None);
    let answer = common::send(&h.app, request).await;
    assert_eq!(answer.status, StatusCode::OK);
    String::from_utf8(answer.bytes.to_vec()).expect("utf-8")
}

#[tokio::test]
async fn prometheus_metrics_count_requests_by_route_sandboxes_by_state_and_edge_errors() {
    let h = harness(GENEROUS).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    assert_eq!(
        h.api("GET", &format!("/sandboxes/{id}"), None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.api("GET", "/sandboxes/nosuchsandbox", None).await.status,
        StatusCode::NOT_FOUND
    );
    let edge = Request::builder()
        .uri("/health")
        .header("E2b-Sandbox-Id", "inope")
        .body(Body::empty())
        .expect("request");
    let response = h.app.clone().oneshot(edge).await.expect("call");
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);

    let text = scrape(&h).await;
    let has = |line: &str| text.lines().any(|l| l == line);
    assert!(
        has(r#"sandbar_http_requests_total{method="POST",route="/v2/sandboxes",status="201"} 1"#),
        "{text}"
    );
    // Ids never become labels: both lookups count under the route template.
    assert!(
        has(
            r#"sandbar_http_requests_total{method="GET",route="/sandboxes/{sandboxID}",status="200"} 1"#
        ),
        "{text}"
    );
    assert!(
        has(
            r#"sandbar_http_requests_total{method="GET",route="/sandboxes/{sandboxID}",status="404"} 1"#
        ),
        "{text}"
    );
    assert!(!text.contains(&id), "{text}");
    assert!(
        has("sandbar_sandbox_create_duration_seconds_count 1"),
        "{text}"
    );
    assert!(has(r#"sandbar_sandboxes{state="running"} 1"#), "{text}");
    assert!(has(r#"sandbar_sandboxes{state="paused"} 0"#), "{text}");
    assert!(
        has(r#"sandbar_edge_requests_total{target="agent",status="502"} 1"#),
        "{text}"
    );
    // The edge's answers are not API requests.
    assert!(!text.contains(r#"route="/health""#), "{text}");
}

#[tokio::test]
async fn copying_memory_without_checkpoints_is_501_naming_why() {
    let h = harness(GENEROUS).await;
    let id = h.create(r#"{"templateID":"base","timeout":60}"#).await;
    for (path, body) in [
        (format!("/sandboxes/{id}/snapshots"), "{}"),
        (format!("/sandboxes/{id}/fork"), "{}"),
    ] {
        let reply = h.api("POST", &path, Some(body)).await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_IMPLEMENTED,
            "{path}: {:?}",
            reply.body
        );
        let message = reply.body["message"].as_str().unwrap_or_default();
        assert!(message.contains("checkpoints are off"), "{message}");
    }
}
