//! Sandbox logs, team metrics, list filters and refreshes in-process: a real SQLite store and
//! router, with a runtime double whose agent logs are in memory.

use std::sync::Arc;
use std::time::Duration;

use crate::common;

use axum::http::StatusCode;
use chrono::Utc;
use sandbar_core::Store;
use sandbar_core::{Sandboxes, SandboxesConfig};
use serde_json::Value;

use common::{FakeRuntime, KEY, OTHER_KEY, Reply, Setup};

struct Harness {
    _dir: tempfile::TempDir,
    app: axum::Router,
    runtime: Arc<FakeRuntime>,
    sandboxes: Arc<Sandboxes>,
    store: Arc<Store>,
    team_id: String,
}

async fn harness(config: SandboxesConfig) -> Harness {
    let server = common::serve(Setup {
        key: Some(KEY),
        config,
        other_team: true,
        ..Setup::default()
    })
    .await;
    Harness {
        app: server.app,
        team_id: server.credentials.team_id,
        _dir: server.dir,
        runtime: server.runtime,
        sandboxes: server.sandboxes,
        store: server.store,
    }
}

impl Harness {
    async fn call(&self, method: &str, path: &str, key: Option<&str>, body: Option<&str>) -> Reply {
        common::send(&self.app, common::json_request(method, path, key, body))
            .await
            .json_reply(method, path)
    }

    async fn get(&self, path: &str) -> Reply {
        self.call("GET", path, Some(KEY), None).await
    }

    async fn create(&self, body: &str) -> String {
        let reply = self
            .call("POST", "/v2/sandboxes", Some(KEY), Some(body))
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        reply.body["sandboxID"].as_str().expect("id").to_owned()
    }

    async fn messages(&self, path: &str) -> Vec<String> {
        let reply = self.get(path).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        reply.body["logs"]
            .as_array()
            .expect("logs")
            .iter()
            .map(|e| e["message"].as_str().expect("message").to_owned())
            .collect()
    }
}

fn assert_error(reply: &Reply, status: StatusCode, mentions: &str) {
    let message = common::error_message(reply.status, &reply.body, status).expect("message");
    assert!(message.contains(mentions), "{message:?} lacks {mentions:?}");
}

#[tokio::test]
async fn logs_hold_lifecycle_events_and_agent_lines_after_the_sandbox_is_killed() {
    let h = harness(SandboxesConfig::default()).await;
    let id = h.create(r#"{"templateID":"base","timeout":60}"#).await;
    let v2 = format!("/v2/sandboxes/{id}/logs");
    assert_eq!(
        h.messages(&v2).await,
        ["sandbox created", "sandbox started"]
    );
    let timeout = h
        .call(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            Some(KEY),
            Some(r#"{"timeout":120}"#),
        )
        .await;
    assert_eq!(timeout.status, StatusCode::NO_CONTENT);
    h.runtime.agent_writes(
        &id,
        "2026-01-01T00:00:01Z  WARN sandbar_agent::process: process ended pid=7 status=\"exit status 1\"\npartial",
    );
    assert_eq!(
        h.call("DELETE", &format!("/sandboxes/{id}"), Some(KEY), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );

    // Killing read the agent's whole lines first; the log outlives the sandbox.
    let all = h.get(&v2).await;
    let entries = all.body["logs"].as_array().expect("logs");
    let messages: Vec<&str> = entries
        .iter()
        .map(|e| e["message"].as_str().expect("message"))
        .collect();
    assert!(messages.contains(&"agent started"), "{messages:?}");
    assert!(messages.contains(&"sandbox timeout set"), "{messages:?}");
    assert!(!messages.contains(&"partial"), "{messages:?}");
    assert_eq!(messages.last(), Some(&"sandbox killed"));
    let ended = entries
        .iter()
        .find(|e| e["message"] == "process ended")
        .expect("agent line");
    assert_eq!(ended["level"], "warn");
    assert_eq!(ended["fields"]["status"], "exit status 1");
    assert_eq!(ended["fields"]["logger"], "agent");
    assert_eq!(ended["timestamp"], "2026-01-01T00:00:01.000Z");

    // v1: every line also as JSON text, from `start` on.
    let v1 = h.get(&format!("/sandboxes/{id}/logs")).await;
    assert_eq!(v1.status, StatusCode::OK);
    let lines = v1.body["logs"].as_array().expect("logs");
    assert_eq!(lines.len(), entries.len());
    assert_eq!(
        v1.body["logEntries"].as_array().map(Vec::len),
        Some(entries.len())
    );
    let line: Value = serde_json::from_str(lines[0]["line"].as_str().expect("line")).expect("json");
    assert!(line["level"].is_string() && line["logger"].is_string() && line["msg"].is_string());
    let recent = h
        .get(&format!(
            "/sandboxes/{id}/logs?start={}&limit=1",
            Utc::now().timestamp_millis() - 60_000
        ))
        .await;
    assert_eq!(recent.body["logs"].as_array().map(Vec::len), Some(1));
    assert_eq!(recent.body["logEntries"][0]["message"], "sandbox created");
}

#[tokio::test]
async fn v2_logs_page_both_ways_and_filter_by_level_and_text() {
    let h = harness(SandboxesConfig::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    h.runtime.agent_writes(
        &id,
        "2026-01-01T00:00:02Z ERROR sandbar_agent: Disk Full code=28\n\
         2026-01-01T00:00:03Z DEBUG sandbar_agent: disk full retry\n\
         not a tracing line\n",
    );
    h.call("DELETE", &format!("/sandboxes/{id}"), Some(KEY), None)
        .await;
    let v2 = format!("/v2/sandboxes/{id}/logs");
    // 2026-01-01T00:00:02Z in milliseconds.
    let cursor = 1_767_225_602_000_i64;
    let pages: [(String, &[&str]); 9] = [
        ("limit=2".into(), &["agent started", "Disk Full"]),
        ("direction=backward&limit=1".into(), &["sandbox killed"]),
        (
            format!("direction=backward&cursor={cursor}"),
            &["Disk Full", "agent started"],
        ),
        (
            format!("cursor={cursor}&limit=2"),
            &["Disk Full", "disk full retry"],
        ),
        ("level=error".into(), &["Disk Full"]),
        ("level=warn&search=Disk".into(), &["Disk Full"]),
        // Case-sensitive, and the plain line is kept as it was.
        ("search=disk".into(), &["disk full retry"]),
        ("search=tracing".into(), &["not a tracing line"]),
        ("limit=0".into(), &[]),
    ];
    for (query, expected) in pages {
        assert_eq!(
            h.messages(&format!("{v2}?{query}")).await,
            expected,
            "{query}"
        );
    }

    let long = "x".repeat(257);
    for (path, mentions) in [
        (format!("{v2}?cursor=-1"), "cursor"),
        (format!("{v2}?cursor=soon"), "cursor"),
        (format!("{v2}?limit=1001"), "limit"),
        (format!("{v2}?limit=-1"), "limit"),
        (format!("{v2}?direction=sideways"), "direction"),
        (format!("{v2}?level=loud"), "level"),
        (format!("{v2}?search={long}"), "search"),
        (format!("/sandboxes/{id}/logs?start=-5"), "start"),
        (format!("/sandboxes/{id}/logs?limit=x"), "limit"),
    ] {
        assert_error(&h.get(&path).await, StatusCode::BAD_REQUEST, mentions);
    }
}

#[tokio::test]
async fn logs_of_unknown_and_other_teams_sandboxes_are_not_found() {
    let h = harness(SandboxesConfig::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    for path in [
        format!("/sandboxes/{id}/logs"),
        format!("/v2/sandboxes/{id}/logs"),
    ] {
        assert_error(
            &h.call("GET", &path, Some(OTHER_KEY), None).await,
            StatusCode::NOT_FOUND,
            &id,
        );
        assert_eq!(
            h.call("GET", &path, None, None).await.status,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(h.get(&path).await.status, StatusCode::OK);
    }
    assert_error(
        &h.get("/v2/sandboxes/inever00000000000000/logs").await,
        StatusCode::NOT_FOUND,
        "inever00000000000000",
    );
    assert_error(
        &h.get("/sandboxes/inever00000000000000/logs").await,
        StatusCode::NOT_FOUND,
        "inever00000000000000",
    );
}

#[tokio::test]
async fn the_reaper_reads_agent_lines_while_the_sandbox_runs_and_caps_each_log() {
    let mut config = SandboxesConfig::default();
    config.activity.log_lines_per_sandbox = 5;
    let h = harness(config).await;
    let reaper = tokio::spawn(h.sandboxes.reaper().clone().run());
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let lines: String = (0..10)
        .map(|i| format!("2026-01-01T00:01:{i:02}Z  INFO sandbar_agent: line {i}\n"))
        .collect();
    h.runtime.agent_writes(&id, &lines);
    let v2 = format!("/v2/sandboxes/{id}/logs");
    let mut messages = Vec::new();
    for _ in 0..100 {
        messages = h.messages(&v2).await;
        if messages.iter().any(|m| m == "line 9") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reaper.abort();
    assert_eq!(
        messages,
        ["line 5", "line 6", "line 7", "line 8", "line 9"],
        "only the newest lines are kept"
    );
    // Read once: the offset is remembered in the store.
    assert_eq!(
        h.store
            .sandbox_logs
            .sandbox_log_offset(&id)
            .await
            .expect("offset"),
        {
            let logs = h.runtime.agent_logs.lock().expect("lock");
            logs[&id].len() as u64
        }
    );
}

#[tokio::test]
async fn ended_logs_are_pruned_after_the_retention_period() {
    let mut config = SandboxesConfig::default();
    config.activity.retention = Duration::from_millis(1);
    let h = harness(config).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    h.call("DELETE", &format!("/sandboxes/{id}"), Some(KEY), None)
        .await;
    let path = format!("/v2/sandboxes/{id}/logs");
    assert_eq!(h.get(&path).await.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reaper = tokio::spawn(h.sandboxes.reaper().clone().run());
    let mut status = StatusCode::OK;
    for _ in 0..100 {
        status = h.get(&path).await.status;
        if status == StatusCode::NOT_FOUND {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reaper.abort();
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn team_metrics_count_starts_and_concurrency_for_the_own_team_only() {
    let h = harness(SandboxesConfig::default()).await;
    let start = Utc::now().timestamp() - 1;
    let first = h.create(r#"{"templateID":"base"}"#).await;
    h.create(r#"{"templateID":"base"}"#).await;
    h.call("DELETE", &format!("/sandboxes/{first}"), Some(KEY), None)
        .await;
    let end = Utc::now().timestamp() + 1;
    let team = &h.team_id;

    let series = h
        .get(&format!("/teams/{team}/metrics?start={start}&end={end}"))
        .await;
    assert_eq!(series.status, StatusCode::OK, "{:?}", series.body);
    let points = series.body.as_array().expect("points");
    assert!(!points.is_empty());
    for p in points {
        assert!(p["timestamp"].is_string() && p["timestampUnix"].is_i64());
        assert!(p["concurrentSandboxes"].is_u64() && p["sandboxStartRate"].is_f64());
    }
    let most = points
        .iter()
        .filter_map(|p| p["concurrentSandboxes"].as_u64())
        .max();
    assert_eq!(most, Some(2));
    let started: f64 = points
        .iter()
        .filter_map(|p| p["sandboxStartRate"].as_f64())
        .sum();
    assert!((started * 5.0 - 2.0).abs() < 1e-9, "{points:?}");

    let max = h
        .get(&format!(
            "/teams/{team}/metrics/max?metric=concurrent_sandboxes&start={start}&end={end}"
        ))
        .await;
    assert_eq!(max.status, StatusCode::OK, "{:?}", max.body);
    assert_eq!(max.body["value"], 2.0);
    let at = max.body["timestampUnix"].as_i64().expect("time");
    assert!(start - 5 <= at && at <= end);
    let rate = h
        .get(&format!(
            "/teams/{team}/metrics/max?metric=sandbox_start_rate&start={start}&end={end}"
        ))
        .await;
    assert!(rate.body["value"].as_f64().expect("rate") > 0.0);

    // Written by the reaper's flush, the numbers stay the same.
    let reaper = tokio::spawn(h.sandboxes.reaper().clone().run());
    tokio::time::sleep(Duration::from_millis(100)).await;
    reaper.abort();
    let again = h
        .get(&format!(
            "/teams/{team}/metrics/max?metric=concurrent_sandboxes&start={start}&end={end}"
        ))
        .await;
    assert_eq!(again.body["value"], 2.0);

    // Defaults cover the retention period up to now.
    let default = h.get(&format!("/teams/{team}/metrics")).await;
    assert_eq!(default.status, StatusCode::OK);
    assert!(default.body.as_array().is_some_and(|p| p.len() <= 720));

    let base = format!("/teams/{team}/metrics");
    for (path, mentions) in [
        (format!("{base}?start=10&end=5"), "start"),
        (format!("{base}?start=-1"), "start"),
        (format!("{base}?end=later"), "end"),
        (format!("{base}/max"), "metric"),
        (format!("{base}/max?metric=cpu"), "metric"),
        (
            format!("{base}/max?metric=sandbox_start_rate&start=9&end=1"),
            "start",
        ),
    ] {
        assert_error(&h.get(&path).await, StatusCode::BAD_REQUEST, mentions);
    }
    for path in [
        "/teams/other-team/metrics",
        "/teams/nobody/metrics/max?metric=concurrent_sandboxes",
    ] {
        assert_error(&h.get(path).await, StatusCode::FORBIDDEN, "team");
    }
    assert_error(
        &h.call("GET", &base, Some(OTHER_KEY), None).await,
        StatusCode::FORBIDDEN,
        team,
    );
    assert_eq!(
        h.call("GET", &base, None, None).await.status,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn lists_filter_by_template_and_start_time_and_count_running() {
    let h = harness(SandboxesConfig::default()).await;
    let before = Utc::now() - chrono::TimeDelta::seconds(1);
    for _ in 0..3 {
        h.create(r#"{"templateID":"base","metadata":{"g":"1"}}"#)
            .await;
    }
    let list = |query: String| {
        let h = &h;
        async move { h.get(&format!("/v2/sandboxes?{query}")).await }
    };
    let page = list("limit=2&template=base".into()).await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.body.as_array().map(Vec::len), Some(2));
    assert_eq!(page.headers["x-total-running"], "3");
    assert!(page.headers.contains_key("x-next-token"));
    let by_id = list("template=base000000000000000a".into()).await;
    assert_eq!(by_id.body.as_array().map(Vec::len), Some(3));
    let unknown = list("template=nothing".into()).await;
    assert_eq!(unknown.body.as_array().map(Vec::len), Some(0));
    assert_eq!(unknown.headers["x-total-running"], "0");
    let encoded =
        url::form_urlencoded::byte_serialize(before.to_rfc3339().as_bytes()).collect::<String>();
    let after = list(format!("startedAfter={encoded}")).await;
    assert_eq!(after.body.as_array().map(Vec::len), Some(3));
    let later = (Utc::now() + chrono::TimeDelta::hours(1)).to_rfc3339();
    // An offset's `+` sent unencoded arrives as a space and is still understood.
    let none = list(format!("startedAfter={later}")).await;
    assert_eq!(none.status, StatusCode::OK, "{:?}", none.body);
    assert_eq!(none.body.as_array().map(Vec::len), Some(0));
    let paused_only = list("state=paused".into()).await;
    assert!(!paused_only.headers.contains_key("x-total-running"));
    assert_error(
        &list("startedAfter=yesterday".into()).await,
        StatusCode::BAD_REQUEST,
        "startedAfter",
    );
}

#[tokio::test]
async fn refreshes_keep_a_sandbox_at_least_fifteen_seconds() {
    let h = harness(SandboxesConfig::default()).await;
    let id = h.create(r#"{"templateID":"base","timeout":1}"#).await;
    let end_at = |h: &Harness| {
        let id = id.clone();
        let store = h.store.clone();
        async move {
            store
                .sandboxes
                .sandbox(&id)
                .await
                .expect("get")
                .expect("sandbox")
                .end_at
        }
    };
    let path = format!("/sandboxes/{id}/refreshes");
    for body in [None, Some(r#"{"duration":3}"#)] {
        let reply = h.call("POST", &path, Some(KEY), body).await;
        assert_eq!(reply.status, StatusCode::NO_CONTENT, "{:?}", reply.body);
        let left = end_at(&h).await - Utc::now();
        assert!(left > chrono::TimeDelta::seconds(13), "{left:?}");
        assert!(left <= chrono::TimeDelta::seconds(15), "{left:?}");
    }
    h.call("POST", &path, Some(KEY), Some(r#"{"duration":60}"#))
        .await;
    assert!(end_at(&h).await - Utc::now() > chrono::TimeDelta::seconds(55));
    for bad in [r#"{"duration":3601}"#, r#"{"duration":-1}"#] {
        assert_error(
            &h.call("POST", &path, Some(KEY), Some(bad)).await,
            StatusCode::BAD_REQUEST,
            "duration",
        );
    }
    assert_error(
        &h.call(
            "POST",
            "/sandboxes/inever00000000000000/refreshes",
            Some(KEY),
            None,
        )
        .await,
        StatusCode::NOT_FOUND,
        "inever00000000000000",
    );
}

#[tokio::test]
async fn the_concurrency_limit_answer_says_when_to_retry() {
    let h = harness(SandboxesConfig::default()).await;
    let create = || {
        h.call(
            "POST",
            "/v2/sandboxes",
            Some(OTHER_KEY),
            Some(r#"{"templateID":"base"}"#),
        )
    };
    for _ in 0..5 {
        assert_eq!(create().await.status, StatusCode::CREATED);
    }
    let refused = create().await;
    assert_error(&refused, StatusCode::TOO_MANY_REQUESTS, "limit");
    // Seconds until the team's next sandbox ends, within a minute.
    let retry_after = common::retry_after(&refused.headers);
    assert!((1..=60).contains(&retry_after), "{retry_after}");
}
