//! An API host in front of two nodes, in-process: one SQLite store shared by all three (as a
//! cluster shares PostgreSQL), nodes served on loopback with runtime doubles, and the API
//! host's router called directly. Placement, forwarding, the node's secret, lost nodes and
//! the team's limit across nodes.

use crate::common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{TimeDelta, Utc};
use sandbar_api::cluster::{ClusterRouting, NODE_SECRET_HEADER};
use sandbar_api::{AppState, ClusterRole, router};
use sandbar_core::auth::TeamLimits;
use sandbar_core::cluster::NoLocalNode;
use sandbar_core::{
    Auth, BuildStatus, LayerBlob, NodeDirectory, NodeRecord, NodeReport, Sandboxes,
    SandboxesConfig, Store, Templates,
};
use serde_json::Value;

use common::{FakeRuntime, HangingBuilder, KEY};

const SECRET: &str = "0123456789abcdef0123456789abcdef-cluster";

struct Node {
    id: String,
    url: String,
    runtime: Arc<FakeRuntime>,
}

struct Cluster {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    directory: Arc<NodeDirectory>,
    api: axum::Router,
    nodes: Vec<Node>,
}

fn limits(max: u32) -> TeamLimits {
    TeamLimits {
        max_concurrent_sandboxes: max,
        ..common::LIMITS
    }
}

fn state(
    store: &Arc<Store>,
    runtime: Arc<dyn sandbar_core::Runtime>,
    node_id: &str,
    directory: Arc<NodeDirectory>,
    cluster: ClusterRole,
) -> AppState {
    let templates = Templates::new(store.clone());
    let sandboxes = Sandboxes::new(
        store.clone(),
        runtime,
        templates.clone(),
        SandboxesConfig {
            node_id: node_id.into(),
            ..SandboxesConfig::default()
        },
    )
    .with_cluster(directory);
    let builds = if node_id.is_empty() {
        common::builds(store.clone(), &templates)
    } else {
        common::builds_with(
            store.clone(),
            &templates,
            Arc::new(HangingBuilder::default()),
        )
        .on_node(node_id.into())
    };
    AppState {
        cluster: Some(cluster),
        ..common::state(
            Auth::new(store.clone()),
            Arc::new(sandboxes),
            builds,
            templates,
        )
    }
}

async fn cluster(team_limit: u32) -> Cluster {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<Store> = common::open_store(&dir).await;
    Auth::new(store.clone())
        .bootstrap(Some(KEY), limits(team_limit))
        .await
        .expect("bootstrap");
    let base = common::base_template(Utc::now());
    Templates::new(store.clone())
        .register(&base)
        .await
        .expect("template");
    let directory = Arc::new(NodeDirectory::new(store.clone()));
    let secret: Arc<str> = Arc::from(SECRET);
    let mut nodes = Vec::new();
    for id in ["n1", "n2"] {
        let runtime = Arc::new(FakeRuntime::default());
        let app = router(state(
            &store,
            runtime.clone(),
            id,
            directory.clone(),
            ClusterRole::Node {
                secret: secret.clone(),
            },
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        nodes.push(Node {
            id: id.into(),
            url,
            runtime,
        });
    }
    let api = router(state(
        &store,
        Arc::new(NoLocalNode),
        "",
        directory.clone(),
        ClusterRole::Api(Arc::new(ClusterRouting::new(
            directory.clone(),
            store.clone(),
            secret,
        ))),
    ));
    let cluster = Cluster {
        _dir: dir,
        store,
        directory,
        api,
        nodes,
    };
    // n2 has the more room: creates go there first.
    cluster.renew("n1", 2, 60, &[&base.id]).await;
    cluster.renew("n2", 4, 60, &[&base.id]).await;
    cluster
}

impl Cluster {
    /// Renews `node`'s lease for `lease_secs` (negative: lapsed) with `free_gib` available.
    async fn renew(&self, node: &str, free_gib: u64, lease_secs: i64, templates: &[&str]) {
        let now = Utc::now();
        let url = &self.nodes.iter().find(|n| n.id == node).expect("node").url;
        self.store
            .nodes
            .renew_node(&NodeRecord {
                id: node.into(),
                url: url.clone(),
                started_at: now,
                lease_until: now + TimeDelta::seconds(lease_secs),
                report: NodeReport {
                    // Placement weighs headroom as a share of this.
                    memory_total_bytes: 64 << 30,
                    memory_available_bytes: free_gib << 30,
                    templates: templates.iter().map(|t| (*t).to_owned()).collect(),
                    ..NodeReport::default()
                },
            })
            .await
            .expect("renew");
        self.directory.refresh().await.expect("refresh");
    }

    /// Renews `node`'s lease with its last report changed by `change`.
    async fn renew_changed(&self, node: &str, change: impl FnOnce(&mut NodeReport)) {
        let mut record = self
            .store
            .nodes
            .nodes()
            .await
            .expect("nodes")
            .into_iter()
            .find(|n| n.id == node)
            .expect("node");
        change(&mut record.report);
        self.store.nodes.renew_node(&record).await.expect("renew");
        self.directory.refresh().await.expect("refresh");
    }

    /// Renews `node`'s lease with `running` of its `slots` build slots taken.
    async fn renew_builds(&self, node: &str, slots: u32, running: u32) {
        self.renew_changed(node, |report| {
            report.builds = sandbar_core::BuildSlotUse {
                slots,
                running,
                waiting: 0,
            };
        })
        .await;
    }

    /// Renews `node`'s lease with a report that counted `sandboxes` just now.
    async fn renew_counted(&self, node: &str, sandboxes: u32) {
        self.renew_changed(node, |report| {
            report.sandboxes = sandboxes;
            report.measured_at = Some(Utc::now());
        })
        .await;
    }

    async fn build_node(&self, build_id: &str) -> Option<String> {
        self.store
            .builds
            .build(build_id)
            .await
            .expect("read")
            .expect("build")
            .node_id
    }

    fn node(&self, id: &str) -> &Node {
        self.nodes.iter().find(|n| n.id == id).expect("node")
    }

    async fn call(&self, method: &str, path: &str, body: Option<&str>) -> (StatusCode, Value) {
        let request = common::json_request(method, path, Some(KEY), body);
        let answer = common::send(&self.api, request).await;
        (answer.status, answer.json_or_null())
    }

    async fn create(&self) -> (StatusCode, Value) {
        self.call(
            "POST",
            "/sandboxes",
            Some(r#"{"templateID":"base","timeout":300}"#),
        )
        .await
    }
}

#[tokio::test]
async fn creates_land_on_the_roomiest_node_and_every_call_follows_the_sandbox() {
    let c = cluster(10).await;
    let (status, created) = c.create().await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["clientID"], "n2", "{created}");
    assert_eq!(c.node("n2").runtime.launches(), 1);
    assert_eq!(c.node("n1").runtime.launches(), 0);
    let id = created["sandboxID"].as_str().expect("id").to_owned();

    let (status, detail) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["clientID"], "n2");
    let (status, listed) = c.call("GET", "/v2/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");

    let (status, _) = c
        .call(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":600}"#),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = c.call("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(c.node("n2").runtime.destroyed(), vec![id.clone()]);
    let (status, _) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_node_answers_only_requests_with_the_cluster_secret() {
    let c = cluster(10).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let url = &c.node("n1").url;
    for secret in [None, Some("wrong"), Some(&SECRET[..SECRET.len() - 1])] {
        let mut request = Request::get(format!("{url}/v2/sandboxes")).header("X-API-Key", KEY);
        if let Some(secret) = secret {
            request = request.header(NODE_SECRET_HEADER, secret);
        }
        let response = client
            .request(request.body(Body::empty()).expect("request"))
            .await
            .expect("call");
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{secret:?}");
    }
    let request = Request::get(format!("{url}/v2/sandboxes"))
        .header("X-API-Key", KEY)
        .header(NODE_SECRET_HEADER, SECRET)
        .body(Body::empty())
        .expect("request");
    let response = client.request(request).await.expect("call");
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_lost_node_s_sandboxes_are_reported_and_creates_go_elsewhere() {
    let c = cluster(10).await;
    let (_, created) = c.create().await;
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    assert_eq!(created["clientID"], "n2");

    let base = common::base_template(Utc::now()).id;
    c.renew("n2", 4, -1, &[&base]).await;
    let (status, listed) = c.call("GET", "/v2/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed,
        Value::Array(Vec::new()),
        "a lost node's sandbox is not listed"
    );
    let (status, body) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("The sandbox was not found") && message.contains("node 'n2'"),
        "{message}"
    );
    let (status, again) = c.create().await;
    assert_eq!(status, StatusCode::CREATED, "{again}");
    assert_eq!(again["clientID"], "n1");

    // Back within its lease: its sandbox is listed and reachable again.
    c.renew("n2", 4, 60, &[&base]).await;
    let (status, _) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_sandbox_killed_while_its_node_is_lost_is_forgotten() {
    let c = cluster(10).await;
    let (_, created) = c.create().await;
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    let base = common::base_template(Utc::now()).id;
    c.renew("n2", 4, -1, &[&base]).await;
    let (status, body) = c.call("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    assert!(
        c.store
            .sandboxes
            .sandbox(&id)
            .await
            .expect("read")
            .is_none(),
        "the record is gone, so the node removes the sandbox when it returns"
    );
    c.renew("n2", 4, 60, &[&base]).await;
    let (status, _) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn latest_metrics_gather_from_every_node() {
    let c = cluster(10).await;
    let base = common::base_template(Utc::now()).id;
    let (_, on_n2) = c.create().await;
    c.renew("n2", 1, 60, &[&base]).await;
    let (_, on_n1) = c.create().await;
    assert_eq!(
        (on_n1["clientID"].as_str(), on_n2["clientID"].as_str()),
        (Some("n1"), Some("n2"))
    );
    let ids = [&on_n1, &on_n2].map(|s| s["sandboxID"].as_str().expect("id").to_owned());
    let (status, body) = c
        .call(
            "GET",
            &format!("/sandboxes/metrics?sandbox_ids={},{}", ids[0], ids[1]),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["sandboxes"].is_object(), "{body}");
    let (status, _) = c.call("GET", "/sandboxes/metrics", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_node_without_room_passes_the_create_to_the_next() {
    let c = cluster(10).await;
    c.node("n2")
        .runtime
        .no_capacity
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, created) = c.create().await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["clientID"], "n1");
    c.node("n1")
        .runtime
        .no_capacity
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, refused) = c.create().await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{refused}");
}

#[tokio::test]
async fn only_nodes_holding_the_template_get_its_sandboxes() {
    let c = cluster(10).await;
    // n2 has more room but not the template's layers.
    c.renew("n2", 8, 60, &[]).await;
    for _ in 0..3 {
        let (status, created) = c.create().await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        assert_eq!(created["clientID"], "n1");
    }
}

#[tokio::test]
async fn the_team_limit_counts_sandboxes_on_every_node() {
    let c = cluster(2).await;
    let base = common::base_template(Utc::now()).id;
    let (_, first) = c.create().await;
    assert_eq!(first["clientID"], "n2");
    // The next create goes to n1, which sees n2's sandbox in the store.
    c.renew("n2", 1, 60, &[&base]).await;
    let (_, second) = c.create().await;
    assert_eq!(second["clientID"], "n1");
    let (status, body) = c.create().await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn creates_racing_on_two_nodes_never_pass_the_team_limit() {
    let c = cluster(3).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    // Straight to the nodes, as two API hosts placing at once would send them.
    let creates = (0..12).map(|i| {
        let client = client.clone();
        let url = c.node(if i % 2 == 0 { "n1" } else { "n2" }).url.clone();
        async move {
            let request = Request::post(format!("{url}/sandboxes"))
                .header("X-API-Key", KEY)
                .header(NODE_SECRET_HEADER, SECRET)
                .header("content-type", "application/json")
                .body(Body::from(r#"{"templateID":"base","timeout":300}"#))
                .expect("request");
            client.request(request).await.expect("call").status()
        }
    });
    let statuses = futures_join_all(creates).await;
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    assert_eq!(created, 3, "{statuses:?}");
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::CREATED || *s == StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
}

/// Runs every future at once and gathers their outputs in order.
async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

#[tokio::test]
async fn a_paused_sandbox_of_a_lost_node_is_taken_over_by_a_live_one() {
    let c = cluster(10).await;
    let base = common::base_template(Utc::now()).id;
    let (_, created) = c.create().await;
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    assert_eq!(created["clientID"], "n2");
    let (status, body) = c
        .call("POST", &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    // What n2's file sharing recorded while the sandbox was paused there.
    let files = LayerBlob {
        layer: format!("files/{id}"),
        digest: format!("sha256:{}", "f".repeat(64)),
        size_bytes: 10240,
        node_id: "n2".into(),
        published_at: Utc::now(),
    };
    c.store
        .layer_blobs
        .replace_layer_blob(&files)
        .await
        .expect("record");
    // And the checkpoint of its processes, once it was paused to disk.
    let memory = LayerBlob {
        layer: format!("memory/{id}"),
        digest: format!("sha256:{}", "e".repeat(64)),
        ..files.clone()
    };
    c.store
        .layer_blobs
        .replace_layer_blob(&memory)
        .await
        .expect("record");

    let connect = format!("/sandboxes/{id}/connect");
    c.renew("n2", 4, -1, &[&base]).await;
    let (status, body) = c.call("POST", &connect, Some(r#"{"timeout":60}"#)).await;
    assert!(status.is_success(), "{status} {body}");
    assert_eq!(body["clientID"], "n1", "{body}");
    assert_eq!(
        c.store.nodes.sandbox_node(&id).await.expect("node"),
        Some("n1".into())
    );
    assert_eq!(
        *c.node("n1").runtime.taken_over.lock().expect("lock"),
        [(id.clone(), Some(memory.layer.clone()))],
        "taken over with its checkpoint"
    );
    let launched = c.node("n1").runtime.launched.lock().expect("lock").clone();
    assert!(
        launched
            .iter()
            .any(|l| l.sandbox_id == id && l.kept.is_some()),
        "booted on the files it was given"
    );
    assert!(
        c.store
            .layer_blobs
            .layer_blobs(&[files.layer.clone(), memory.layer.clone()])
            .await
            .expect("read")
            .is_empty(),
        "the woken sandbox's copies are forgotten"
    );
    let (status, body) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["clientID"], "n1");
}

#[tokio::test]
async fn a_paused_sandbox_of_a_lost_node_without_a_copy_is_reported_lost() {
    let c = cluster(10).await;
    let base = common::base_template(Utc::now()).id;
    let (_, created) = c.create().await;
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    let (status, _) = c
        .call("POST", &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    c.renew("n2", 4, -1, &[&base]).await;
    let (status, body) = c
        .call(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    let message = body["message"].as_str().expect("message");
    assert!(message.contains("before a copy of its files"), "{message}");
    assert_eq!(
        c.store.nodes.sandbox_node(&id).await.expect("node"),
        Some("n2".into()),
        "still n2's"
    );
    assert!(
        c.node("n1")
            .runtime
            .taken_over
            .lock()
            .expect("lock")
            .is_empty()
    );
}

#[tokio::test]
async fn a_node_fails_only_its_own_and_lost_nodes_unfinished_builds() {
    let c = cluster(10).await;
    let base = common::base_template(Utc::now());
    let unfinished = |id: &str, node: Option<&str>| sandbar_core::BuildRecord {
        id: id.into(),
        template_id: base.id.clone(),
        team_id: None,
        status: BuildStatus::Building,
        failure: None,
        spec: None,
        image: None,
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 1024,
        created_at: Utc::now(),
        updated_at: Utc::now(),
        finished_at: None,
        node_id: node.map(str::to_owned),
    };
    for (id, node) in [
        ("b-mine", Some("n1")),
        ("b-live", Some("n2")),
        ("b-lost", Some("n3")),
        ("b-unnamed", None),
    ] {
        c.store
            .builds
            .insert_build(&unfinished(id, node))
            .await
            .expect("insert");
    }
    let templates = Templates::new(c.store.clone());
    let builds = common::builds(c.store.clone(), &templates).on_node("n1".into());
    // n2 is live, n3 is not; another node is live, so builds naming no node are left alone.
    let failed = builds
        .recover(|node| node == Some("n3"))
        .await
        .expect("recover");
    assert_eq!(failed, 2);
    let status = |id: &'static str| {
        let store = c.store.clone();
        async move {
            store
                .builds
                .build(id)
                .await
                .expect("read")
                .expect("build")
                .status
        }
    };
    assert_eq!(status("b-mine").await, BuildStatus::Error);
    assert_eq!(status("b-lost").await, BuildStatus::Error);
    assert_eq!(
        status("b-live").await,
        BuildStatus::Building,
        "n2's build goes on"
    );
    assert_eq!(status("b-unnamed").await, BuildStatus::Building);
    // A stop of n1 fails nothing of n2's either.
    builds.shutdown().await;
    assert_eq!(status("b-live").await, BuildStatus::Building);
}

#[tokio::test]
async fn a_build_goes_to_the_node_with_a_free_slot_and_its_files_start_and_cancel_follow() {
    let c = cluster(10).await;
    // n1, the keeper, has its one build slot taken; n2 has room.
    c.renew_builds("n1", 1, 1).await;
    c.renew_builds("n2", 1, 0).await;
    let (status, requested) = c
        .call("POST", "/v3/templates", Some(r#"{"name":"spread"}"#))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{requested}");
    let template_id = requested["templateID"]
        .as_str()
        .expect("template")
        .to_owned();
    let build_id = requested["buildID"].as_str().expect("build").to_owned();
    assert_eq!(c.build_node(&build_id).await.as_deref(), Some("n2"));

    let hash = "ab".repeat(32);
    let (status, link) = c
        .call(
            "GET",
            &format!("/templates/{template_id}/files/{hash}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{link}");
    let url = link["url"].as_str().expect("an upload link");
    let upload = &url[url.find("/upload/").expect("an upload path")..];
    // Only the node that gave the link knows its token.
    let (status, body) = c.call("PUT", upload, Some("not a tar")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    let (status, body) = c
        .call(
            "POST",
            &format!("/v2/templates/{template_id}/builds/{build_id}"),
            Some(r#"{"fromTemplate":"base","steps":[{"type":"COPY","args":["a","/a"],"filesHash":"abababababababababababababababababababababababababababababababab"}]}"#),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(c.build_node(&build_id).await.as_deref(), Some("n2"));
    let (status, body) = c
        .call(
            "GET",
            &format!("/templates/{template_id}/builds/{build_id}/status"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "building");

    // Only n2 runs it: n1 would answer that the build is on another node.
    let (status, body) = c
        .call(
            "DELETE",
            &format!("/templates/{template_id}/builds/{build_id}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let build = c
        .store
        .builds
        .build(&build_id)
        .await
        .expect("read")
        .expect("build");
    assert_eq!(build.status, BuildStatus::Error);
}

#[tokio::test]
async fn with_every_build_slot_free_builds_go_to_the_first_node_by_id() {
    let c = cluster(10).await;
    c.renew_builds("n1", 2, 0).await;
    c.renew_builds("n2", 2, 0).await;
    let (status, requested) = c
        .call("POST", "/v3/templates", Some(r#"{"name":"first"}"#))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{requested}");
    let first = requested["buildID"].as_str().expect("build").to_owned();
    assert_eq!(c.build_node(&first).await.as_deref(), Some("n1"));
    // The first is counted against n1 until n1's report shows it.
    let (status, requested) = c
        .call("POST", "/v3/templates", Some(r#"{"name":"second"}"#))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{requested}");
    let second = requested["buildID"].as_str().expect("build").to_owned();
    assert_eq!(c.build_node(&second).await.as_deref(), Some("n2"));
}

#[tokio::test]
async fn the_api_host_refuses_a_create_a_node_would_refuse_and_sends_none() {
    let c = cluster(10).await;
    let body = r#"{"templateID":"base","autoResume":{"enabled":true}}"#;
    let (status, refused) = c.call("POST", "/sandboxes", Some(body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("autoResume needs autoPause")),
        "{refused}"
    );
    let (status, refused) = c.call("POST", "/v2/sandboxes", Some("{not json")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    // Without a key the answer is the single host's: who is asking comes first.
    let anonymous = common::json_request("POST", "/sandboxes", None, Some("{not json"));
    assert_eq!(
        common::send(&c.api, anonymous).await.status,
        StatusCode::UNAUTHORIZED
    );
    for node in &c.nodes {
        assert_eq!(node.runtime.launches(), 0, "{} was sent a create", node.id);
    }
}

#[tokio::test]
async fn a_forwarded_create_is_the_checked_one_whatever_length_the_client_sent() {
    let c = cluster(10).await;
    // Spaces and a field the API does not know: the node gets a shorter body than the
    // client's Content-Length says.
    let body = r#"{ "templateID" : "base",  "timeout": 120,
        "envVars": {"GREETING": "hello"}, "metadata": {"owner": "tests"},
        "notAField": [1, 2, 3] }"#;
    let request = Request::builder()
        .method("POST")
        .uri("/v2/sandboxes")
        .header("X-API-Key", KEY)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(Body::from(body))
        .expect("request");
    let answer = common::send(&c.api, request).await;
    let created = answer.json_or_null();
    assert_eq!(answer.status, StatusCode::CREATED, "{created}");
    let launched = c.node("n2").runtime.launched.lock().expect("lock").clone();
    let [spec] = launched.as_slice() else {
        panic!("one launch on n2, got {}", launched.len());
    };
    assert_eq!(
        spec.env_vars.get("GREETING").map(String::as_str),
        Some("hello")
    );
    let id = created["sandboxID"].as_str().expect("id");
    let (status, detail) = c.call("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["metadata"]["owner"], "tests", "{detail}");
}

#[tokio::test]
async fn a_create_a_node_s_report_already_counts_is_not_counted_again() {
    let c = cluster(10).await;
    let base = common::base_template(Utc::now()).id;
    // Alike nodes whose reports were measured before any create: placement alternates,
    // the first by id.
    c.renew("n1", 4, 60, &[&base]).await;
    c.renew_counted("n1", 0).await;
    c.renew_counted("n2", 0).await;
    let mut landed = Vec::new();
    for _ in 0..2 {
        let (status, created) = c.create().await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        landed.push(created["clientID"].as_str().expect("node").to_owned());
    }
    assert_eq!(landed, ["n1", "n2"]);
    // n1 reports again and counts its sandbox; n2's report is older than its create. Each
    // holds one: the tie goes to n1 again, where counting n1's sandbox twice (reported and
    // sent) would send it to n2.
    c.renew_counted("n1", 1).await;
    let (status, created) = c.create().await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["clientID"], "n1", "{created}");
}
