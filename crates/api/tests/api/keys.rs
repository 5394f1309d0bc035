//! API keys, access tokens, teams and per-team limits over the REST surface, in-process with a
//! real SQLite store and a runtime double that only records launches.

use crate::common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use sandbar_core::{Auth, LimitChanges, TeamAdminError};
use serde_json::{Value, json};
use tower::ServiceExt;

use common::{Cred, FakeRuntime, LIMITS, Reply, Setup};

struct Harness {
    _dir: tempfile::TempDir,
    app: axum::Router,
    auth: Auth,
    runtime: Arc<FakeRuntime>,
    team_id: String,
    key: String,
    token: String,
}

/// Changes of a single limit, the others left as they are.
fn one_limit(change: impl FnOnce(&mut LimitChanges)) -> LimitChanges {
    let mut changes = LimitChanges::default();
    change(&mut changes);
    changes
}

async fn harness() -> Harness {
    let server = common::serve(Setup::default()).await;
    let creds = &server.credentials;
    Harness {
        app: server.app,
        team_id: creds.team_id.clone(),
        key: creds.api_key.clone(),
        token: creds.access_token.clone(),
        _dir: server.dir,
        auth: server.auth,
        runtime: server.runtime,
    }
}

impl Harness {
    async fn call(&self, method: &str, path: &str, cred: Cred<'_>, body: Option<&str>) -> Reply {
        common::call(&self.app, method, path, cred, body).await
    }

    fn bearer(&self) -> Cred<'_> {
        Cred::Bearer(&self.token)
    }

    async fn keys(&self) -> Vec<Value> {
        let reply = self.call("GET", "/api-keys", self.bearer(), None).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        reply.body.as_array().expect("array").clone()
    }

    async fn new_key(&self, name: &str) -> Value {
        let reply = self
            .call(
                "POST",
                "/api-keys",
                self.bearer(),
                Some(&json!({ "name": name }).to_string()),
            )
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        reply.body
    }

    /// Changes the team's limits; the team as changed.
    async fn set_limits(&self, changes: LimitChanges) -> sandbar_core::Team {
        self.auth
            .set_team_limits(&self.team_id, changes)
            .await
            .expect("set")
    }

    /// Starts a sandbox described by `body` with the team's key.
    async fn create(&self, body: &str) -> Reply {
        self.call("POST", "/v2/sandboxes", Cred::Key(&self.key), Some(body))
            .await
    }

    /// Deletes the credential `id` at `path`: from then on a `GET` of the probe's path with
    /// it is refused with `refusal`, and a second delete finds nothing.
    async fn revoke(&self, path: &str, id: &str, probe: (&str, Cred<'_>), refusal: &str) {
        let deleted = self.call("DELETE", path, self.bearer(), None).await;
        assert_eq!(deleted.status, StatusCode::NO_CONTENT);
        let (probe_path, credential) = probe;
        assert_error(
            &self.call("GET", probe_path, credential, None).await,
            StatusCode::UNAUTHORIZED,
            refusal,
        );
        assert_error(
            &self.call("DELETE", path, self.bearer(), None).await,
            StatusCode::NOT_FOUND,
            id,
        );
    }

    async fn sandboxes_status(&self, key: &str) -> StatusCode {
        self.call("GET", "/v2/sandboxes", Cred::Key(key), None)
            .await
            .status
    }
}

fn assert_error(reply: &Reply, status: StatusCode, mentions: &str) {
    let message = common::error_message(reply.status, &reply.body, status).expect("message");
    assert!(
        message.to_lowercase().contains(&mentions.to_lowercase()),
        "{message:?} does not mention {mentions:?}"
    );
}

fn assert_mask(mask: &Value, prefix: &str) {
    assert_eq!(mask["prefix"], prefix);
    assert_eq!(mask["valueLength"], 40);
    assert_eq!(mask["maskedValuePrefix"].as_str().map(str::len), Some(2));
    assert_eq!(mask["maskedValueSuffix"].as_str().map(str::len), Some(4));
}

#[tokio::test]
async fn api_keys_are_listed_masked_created_once_renamed_and_deleted() {
    let h = harness().await;
    let listed = h.keys().await;
    assert_eq!(listed.len(), 1);
    let first = &listed[0];
    assert_mask(&first["mask"], "e2b_");
    assert!(first.get("key").is_none(), "a listed key shows its value");
    assert!(!listed[0].to_string().contains(&h.key[4..]));
    assert_eq!(first["createdBy"], Value::Null);
    assert_eq!(first["lastUsed"], Value::Null);
    assert_eq!(
        first["mask"]["maskedValueSuffix"],
        &h.key[h.key.len() - 4..]
    );

    // Using a key records it, at most once every few seconds.
    assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::OK);
    let used = h.keys().await[0]["lastUsed"].clone();
    assert!(used.is_string(), "{used:?}");
    assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::OK);
    assert_eq!(h.keys().await[0]["lastUsed"], used);

    let created = h.new_key("ci").await;
    let key = created["key"].as_str().expect("key").to_owned();
    assert!(key.starts_with("e2b_") && key.len() == 44, "{key}");
    assert_mask(&created["mask"], "e2b_");
    assert_eq!(created["name"], "ci");
    assert!(created["createdAt"].is_string());
    assert!(created["createdBy"]["id"].is_string());
    assert_eq!(created["createdBy"]["email"], Value::Null);
    let id = created["id"].as_str().expect("id").to_owned();
    assert_eq!(h.sandboxes_status(&key).await, StatusCode::OK);

    let listed = h.keys().await;
    assert_eq!(listed.len(), 2);
    assert!(!listed.iter().any(|k| k.get("key").is_some()));

    let renamed = h
        .call(
            "PATCH",
            &format!("/api-keys/{id}"),
            h.bearer(),
            Some(r#"{"name":"deploy"}"#),
        )
        .await;
    assert_eq!(renamed.status, StatusCode::OK, "{:?}", renamed.body);
    assert!(h.keys().await.iter().any(|k| k["name"] == "deploy"));

    h.revoke(
        &format!("/api-keys/{id}"),
        &id,
        ("/v2/sandboxes", Cred::Key(&key)),
        "invalid api key",
    )
    .await;
    assert_eq!(h.keys().await.len(), 1);
}

#[tokio::test]
async fn the_last_api_key_may_be_deleted_and_the_token_makes_a_new_one() {
    let h = harness().await;
    let id = h.keys().await[0]["id"].as_str().expect("id").to_owned();
    let reply = h
        .call("DELETE", &format!("/api-keys/{id}"), h.bearer(), None)
        .await;
    assert_eq!(reply.status, StatusCode::NO_CONTENT);
    assert!(h.keys().await.is_empty());
    assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::UNAUTHORIZED);
    let teams = h.call("GET", "/teams", h.bearer(), None).await;
    assert_eq!(teams.body[0]["apiKey"], "");
    let key = h.new_key("again").await["key"]
        .as_str()
        .expect("key")
        .to_owned();
    assert_eq!(h.sandboxes_status(&key).await, StatusCode::OK);
}

#[tokio::test]
async fn key_management_needs_a_valid_access_token() {
    let h = harness().await;
    let id = h.keys().await[0]["id"].as_str().expect("id").to_owned();
    let wrong = "sk_e2b_ffffffffffffffffffffffffffffffffffffffff";
    let item = format!("/api-keys/{id}");
    for (method, path, body) in [
        ("GET", "/api-keys", None),
        ("POST", "/api-keys", Some(r#"{"name":"x"}"#)),
        ("PATCH", item.as_str(), Some(r#"{"name":"x"}"#)),
        ("DELETE", item.as_str(), None),
        ("POST", "/access-tokens", Some(r#"{"name":"x"}"#)),
        ("DELETE", "/access-tokens/nope", None),
        ("GET", "/teams", None),
    ] {
        for cred in [Cred::None, Cred::Key(&h.key), Cred::Bearer(wrong)] {
            let reply = h.call(method, path, cred, body).await;
            assert_error(&reply, StatusCode::UNAUTHORIZED, "access token");
        }
    }
    let keys = h.keys().await;
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0]["name"], "default");
}

#[tokio::test]
async fn bad_bodies_are_refused_and_change_nothing() {
    let h = harness().await;
    let id = h.keys().await[0]["id"].as_str().expect("id").to_owned();
    let item = format!("/api-keys/{id}");
    for body in [
        "",
        "{}",
        "{not json",
        r#"{"name":5}"#,
        r#"{"name":null}"#,
        r#"{"name":"   "}"#,
        r#"{"name":"a\nb"}"#,
        "[]",
    ] {
        for (method, path) in [
            ("POST", "/api-keys"),
            ("PATCH", item.as_str()),
            ("POST", "/access-tokens"),
        ] {
            let reply = h.call(method, path, h.bearer(), Some(body)).await;
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{method} {body}");
            assert!(reply.body["message"].is_string());
        }
    }
    let long = json!({ "name": "x".repeat(300) }).to_string();
    assert_error(
        &h.call("POST", "/api-keys", h.bearer(), Some(&long)).await,
        StatusCode::BAD_REQUEST,
        "name",
    );
    let keys = h.keys().await;
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0]["name"], "default");
    assert_error(
        &h.call(
            "PATCH",
            "/api-keys/00000000-0000-4000-8000-000000000000",
            h.bearer(),
            Some(r#"{"name":"x"}"#),
        )
        .await,
        StatusCode::NOT_FOUND,
        "00000000-0000-4000-8000-000000000000",
    );
}

#[tokio::test]
async fn another_teams_keys_tokens_and_team_are_out_of_reach() {
    let h = harness().await;
    let other = h
        .auth
        .create_team("other", LIMITS)
        .await
        .expect("other team");
    let their_key_id = other.api_key_id.clone();
    let their_item = format!("/api-keys/{their_key_id}");

    // Their key ids are unknown to us, whatever the operation.
    assert_error(
        &h.call("PATCH", &their_item, h.bearer(), Some(r#"{"name":"mine"}"#))
            .await,
        StatusCode::NOT_FOUND,
        &their_key_id,
    );
    assert_error(
        &h.call("DELETE", &their_item, h.bearer(), None).await,
        StatusCode::NOT_FOUND,
        &their_key_id,
    );
    assert_eq!(h.sandboxes_status(&other.api_key).await, StatusCode::OK);
    let theirs = h
        .call("GET", "/api-keys", Cred::Bearer(&other.access_token), None)
        .await;
    assert_eq!(theirs.body[0]["name"], "default");
    assert!(
        !h.keys()
            .await
            .iter()
            .any(|k| k["id"] == their_key_id.as_str())
    );

    // Naming their team, or a team that does not exist, is refused alike.
    for team in [other.team.id.as_str(), "no-such-team"] {
        let reply = h
            .call("GET", "/api-keys", Cred::BearerTeam(&h.token, team), None)
            .await;
        assert_error(&reply, StatusCode::FORBIDDEN, team);
        let reply = h
            .call(
                "POST",
                "/api-keys",
                Cred::BearerTeam(&h.token, team),
                Some(r#"{"name":"sneaky"}"#),
            )
            .await;
        assert_error(&reply, StatusCode::FORBIDDEN, team);
    }
    let ours = h
        .call(
            "GET",
            "/api-keys",
            Cred::BearerTeam(&h.token, &h.team_id),
            None,
        )
        .await;
    assert_eq!(ours.status, StatusCode::OK);
    assert_eq!(
        h.auth
            .team_api_keys(&other.team.id)
            .await
            .expect("keys")
            .len(),
        1
    );

    // Their access token ids too.
    let token = h
        .call(
            "POST",
            "/access-tokens",
            Cred::Bearer(&other.access_token),
            Some(r#"{"name":"t"}"#),
        )
        .await;
    let token_id = token.body["id"].as_str().expect("id").to_owned();
    assert_error(
        &h.call(
            "DELETE",
            &format!("/access-tokens/{token_id}"),
            h.bearer(),
            None,
        )
        .await,
        StatusCode::NOT_FOUND,
        &token_id,
    );
    let still = token.body["token"].as_str().expect("token");
    assert_eq!(
        h.call("GET", "/teams", Cred::Bearer(still), None)
            .await
            .status,
        StatusCode::OK
    );

    let teams = h.call("GET", "/teams", h.bearer(), None).await;
    let teams = teams.body.as_array().expect("array");
    assert_eq!(teams.len(), 1);
    assert_eq!(teams[0]["teamID"], h.team_id.as_str());
}

#[tokio::test]
async fn access_tokens_are_created_once_and_stop_working_when_deleted() {
    let h = harness().await;
    let reply = h
        .call(
            "POST",
            "/access-tokens",
            h.bearer(),
            Some(r#"{"name":"laptop"}"#),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    let token = reply.body["token"].as_str().expect("token").to_owned();
    assert!(token.starts_with("sk_e2b_") && token.len() == 47, "{token}");
    assert_mask(&reply.body["mask"], "sk_e2b_");
    assert_eq!(reply.body["name"], "laptop");
    assert!(reply.body["createdAt"].is_string());
    let id = reply.body["id"].as_str().expect("id").to_owned();

    // The new token is the same user's: it sees the same team and its keys.
    let teams = h.call("GET", "/teams", Cred::Bearer(&token), None).await;
    assert_eq!(teams.body[0]["teamID"], h.team_id.as_str());
    let keys = h.call("GET", "/api-keys", Cred::Bearer(&token), None).await;
    assert_eq!(keys.body.as_array().map(Vec::len), Some(1));

    h.revoke(
        &format!("/access-tokens/{id}"),
        &id,
        ("/api-keys", Cred::Bearer(&token)),
        "invalid access token",
    )
    .await;
    // The template endpoints that take an access token refuse it as well.
    assert_error(
        &h.call(
            "GET",
            "/templates/nope/builds/nope/status",
            Cred::Bearer(&token),
            None,
        )
        .await,
        StatusCode::UNAUTHORIZED,
        "access token",
    );
}

#[tokio::test]
async fn teams_list_the_users_teams_with_a_masked_key() {
    let h = harness().await;
    let reply = h.call("GET", "/teams", h.bearer(), None).await;
    assert_eq!(reply.status, StatusCode::OK);
    let teams = reply.body.as_array().expect("array");
    assert_eq!(teams.len(), 1);
    assert_eq!(teams[0]["teamID"], h.team_id.as_str());
    assert_eq!(teams[0]["name"], "default");
    assert_eq!(teams[0]["isDefault"], true);
    let shown = teams[0]["apiKey"].as_str().expect("apiKey");
    assert_eq!(shown.len(), h.key.len());
    assert!(shown.starts_with(&h.key[..6]) && shown.ends_with(&h.key[40..]));
    assert!(shown.contains('*'));
    assert_ne!(shown, h.key);
}

#[tokio::test]
async fn resource_limits_refuse_creates_and_builds_naming_the_field() {
    let h = harness().await;
    for (changes, field) in [
        (one_limit(|c| c.max_vcpu = Some(1)), "cpuCount"),
        (one_limit(|c| c.max_memory_mb = Some(256)), "memoryMB"),
        (one_limit(|c| c.max_disk_mb = Some(512)), "diskSizeMB"),
    ] {
        h.set_limits(changes).await;
        let reply = h.create(r#"{"templateID":"base"}"#).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, field);
        let reply = h
            .call(
                "POST",
                "/v3/templates",
                Cred::Key(&h.key),
                Some(r#"{"name":"big","cpuCount":2,"memoryMB":512}"#),
            )
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, field);
        // Back to no ceilings for the next field.
        h.set_limits(LimitChanges {
            max_vcpu: Some(0),
            max_memory_mb: Some(0),
            max_disk_mb: Some(0),
            ..LimitChanges::default()
        })
        .await;
    }
    assert_eq!(h.runtime.launches(), 0);
    let reply = h.create(r#"{"templateID":"base"}"#).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
}

#[tokio::test]
async fn changed_limits_apply_to_the_next_request() {
    let h = harness().await;
    let create = || h.create(r#"{"templateID":"base","timeout":30}"#);
    assert_eq!(create().await.status, StatusCode::CREATED);
    h.set_limits(one_limit(|c| c.max_concurrent_sandboxes = Some(1)))
        .await;
    let refused = create().await;
    assert_error(&refused, StatusCode::TOO_MANY_REQUESTS, "1 concurrent");
    let wait = common::retry_after(&refused.headers);
    assert!((1..=30).contains(&wait), "{wait}");
    assert_eq!(h.runtime.launches(), 1);

    h.set_limits(LimitChanges {
        max_sandbox_timeout_secs: Some(10),
        max_concurrent_sandboxes: Some(5),
        requests_per_minute: Some(2),
        ..LimitChanges::default()
    })
    .await;
    assert_error(&create().await, StatusCode::BAD_REQUEST, "timeout");
    assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::OK);
    let limited = h
        .call("GET", "/v2/sandboxes", Cred::Key(&h.key), None)
        .await;
    assert_error(
        &limited,
        StatusCode::TOO_MANY_REQUESTS,
        "2 requests per minute",
    );
    assert!(limited.headers.contains_key("retry-after"));
    // The key-management routes count against the same budget.
    let limited = h.call("GET", "/api-keys", h.bearer(), None).await;
    assert_error(
        &limited,
        StatusCode::TOO_MANY_REQUESTS,
        "requests per minute",
    );
}

#[tokio::test]
async fn operator_limits_are_range_checked() {
    let h = harness().await;
    for (changes, expected) in [
        (
            one_limit(|c| c.max_concurrent_sandboxes = Some(0)),
            "max-sandboxes",
        ),
        (
            one_limit(|c| c.max_sandbox_timeout_secs = Some(0)),
            "max-timeout-secs",
        ),
        (one_limit(|c| c.max_vcpu = Some(5000)), "max-vcpu"),
    ] {
        let result = h.auth.set_team_limits(&h.team_id, changes).await;
        assert!(
            matches!(&result, Err(TeamAdminError::BadLimit { field, .. }) if *field == expected),
            "{expected}: {result:?}"
        );
    }
    let result = h
        .auth
        .set_team_limits("no-such-team", LimitChanges::default())
        .await;
    assert!(
        matches!(&result, Err(TeamAdminError::NotFound(reference)) if reference == "no-such-team"),
        "{result:?}"
    );
    let team = h.auth.find_team("default").await.expect("by name");
    assert_eq!(team.limits, LIMITS);
}

#[tokio::test]
async fn every_range_of_the_documented_limits_is_enforced_naming_the_field() {
    let h = harness().await;
    let key = Cred::Key(&h.key);
    let sandbox = h.create(r#"{"templateID":"base"}"#).await;
    let sandbox_id = sandbox.body["sandboxID"].as_str().expect("id").to_owned();
    let build = h
        .call("POST", "/v3/templates", key, Some(r#"{"name":"ranges"}"#))
        .await;
    assert_eq!(build.status, StatusCode::ACCEPTED, "{:?}", build.body);
    let template_id = build.body["templateID"].as_str().expect("template");
    let build_id = build.body["buildID"].as_str().expect("build");
    let builds = format!("/templates/{template_id}/builds/{build_id}");
    let many_ids = vec!["i"; 101].join(",");
    let cases: Vec<(&str, String, Option<&str>, &str)> = vec![
        ("GET", "/v2/sandboxes?limit=0".into(), None, "limit"),
        ("GET", "/v2/sandboxes?limit=101".into(), None, "limit"),
        (
            "GET",
            format!("/templates/{template_id}?limit=101"),
            None,
            "limit",
        ),
        ("GET", format!("{builds}/status?limit=101"), None, "limit"),
        (
            "GET",
            format!("{builds}/status?logsOffset=-1"),
            None,
            "logsOffset",
        ),
        ("GET", format!("{builds}/logs?limit=101"), None, "limit"),
        ("GET", format!("{builds}/logs?cursor=-1"), None, "cursor"),
        (
            "GET",
            format!("/sandboxes/metrics?sandbox_ids={many_ids}"),
            None,
            "sandbox_ids",
        ),
        (
            "POST",
            format!("/sandboxes/{sandbox_id}/refreshes"),
            Some(r#"{"duration":3601}"#),
            "duration",
        ),
        (
            "POST",
            format!("/sandboxes/{sandbox_id}/timeout"),
            Some(r#"{"timeout":-1}"#),
            "timeout",
        ),
        (
            "POST",
            format!("/sandboxes/{sandbox_id}/connect"),
            Some(r#"{"timeout":-1}"#),
            "timeout",
        ),
        (
            "POST",
            format!("/sandboxes/{sandbox_id}/timeout"),
            Some(r#"{"timeout":2147483648}"#),
            "timeout",
        ),
    ];
    for (method, path, body, field) in cases {
        let reply = h.call(method, &path, key, body).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, field);
    }
    for path in [
        "/v2/sandboxes?limit=1",
        "/v2/sandboxes?limit=100",
        &format!("{builds}/logs?limit=0"),
        &format!("{builds}/status?limit=100"),
    ] {
        assert_eq!(
            h.call("GET", path, key, None).await.status,
            StatusCode::OK,
            "{path}"
        );
    }
}

#[tokio::test]
async fn a_paused_sandbox_frees_its_slot_and_must_win_one_back_to_resume() {
    let h = harness().await;
    h.set_limits(one_limit(|c| c.max_concurrent_sandboxes = Some(1)))
        .await;
    let key = Cred::Key(&h.key);
    let create = r#"{"templateID":"base","timeout":30}"#;
    let first = h.create(create).await;
    let first_id = first.body["sandboxID"].as_str().expect("id").to_owned();
    let paused = h
        .call("POST", &format!("/sandboxes/{first_id}/pause"), key, None)
        .await;
    assert_eq!(paused.status, StatusCode::NO_CONTENT, "{:?}", paused.body);
    let second = h.create(create).await;
    assert_eq!(second.status, StatusCode::CREATED, "{:?}", second.body);
    let second_id = second.body["sandboxID"].as_str().expect("id").to_owned();

    for path in [
        format!("/sandboxes/{first_id}/resume"),
        format!("/sandboxes/{first_id}/connect"),
    ] {
        let refused = h.call("POST", &path, key, Some(r#"{"timeout":30}"#)).await;
        assert_error(&refused, StatusCode::TOO_MANY_REQUESTS, &first_id);
        assert!(refused.headers.contains_key("retry-after"));
    }
    let detail = h
        .call("GET", &format!("/sandboxes/{first_id}"), key, None)
        .await;
    assert_eq!(detail.body["state"], "paused");

    let killed = h
        .call("DELETE", &format!("/sandboxes/{second_id}"), key, None)
        .await;
    assert_eq!(killed.status, StatusCode::NO_CONTENT);
    let resumed = h
        .call(
            "POST",
            &format!("/sandboxes/{first_id}/resume"),
            key,
            Some(r#"{"timeout":30}"#),
        )
        .await;
    assert_eq!(resumed.status, StatusCode::CREATED, "{:?}", resumed.body);
}

#[tokio::test]
async fn traffic_to_a_paused_sandbox_without_a_free_slot_is_told_when_to_retry() {
    let h = harness().await;
    h.set_limits(one_limit(|c| c.max_concurrent_sandboxes = Some(1)))
        .await;
    let key = Cred::Key(&h.key);
    let sleeper = h
        .call(
            "POST",
            "/v2/sandboxes",
            key,
            Some(
                r#"{"templateID":"base","timeout":30,"secure":true,"autoPause":true,"autoResume":{"enabled":true}}"#,
            ),
        )
        .await;
    let sleeper_id = sleeper.body["sandboxID"].as_str().expect("id").to_owned();
    let agent_token = sleeper.body["envdAccessToken"]
        .as_str()
        .expect("token")
        .to_owned();
    let paused = h
        .call("POST", &format!("/sandboxes/{sleeper_id}/pause"), key, None)
        .await;
    assert_eq!(paused.status, StatusCode::NO_CONTENT, "{:?}", paused.body);
    let other = h.create(r#"{"templateID":"base","timeout":30}"#).await;
    assert_eq!(other.status, StatusCode::CREATED, "{:?}", other.body);

    let request = Request::builder()
        .uri("/health")
        .header("E2b-Sandbox-Id", sleeper_id.as_str())
        .header("E2b-Sandbox-Port", "49983")
        .header("X-Access-Token", agent_token.as_str())
        .body(Body::empty())
        .expect("request");
    let response = h.app.clone().oneshot(request).await.expect("call");
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    let detail = h
        .call("GET", &format!("/sandboxes/{sleeper_id}"), key, None)
        .await;
    assert_eq!(detail.body["state"], "paused");
}

/// The admin commands change the records from a process of their own: what the server keeps
/// of a key, its team and a template must not outlive such a change by one request.
#[tokio::test]
async fn a_change_made_by_another_process_applies_to_the_servers_next_request() {
    let h = harness().await;
    let create = r#"{"templateID": "base", "timeout": 120}"#;
    // Twice each, so that the second answer can come from what the server kept.
    for _ in 0..2 {
        assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::OK);
        assert_eq!(h.create(create).await.status, StatusCode::CREATED);
    }
    let admin_store = common::open_store(&h._dir).await;
    let admin = Auth::new(admin_store.clone());

    admin
        .set_team_limits(
            &h.team_id,
            one_limit(|c| c.max_sandbox_timeout_secs = Some(60)),
        )
        .await
        .expect("set limits");
    assert_error(&h.create(create).await, StatusCode::BAD_REQUEST, "60");

    let base = admin_store
        .templates
        .template_by_name(None, "base")
        .await
        .expect("read")
        .expect("base");
    admin_store
        .templates
        .delete_template(&base.id)
        .await
        .expect("delete");
    assert_error(
        &h.create(r#"{"templateID": "base", "timeout": 30}"#).await,
        StatusCode::NOT_FOUND,
        "base",
    );

    let key_id = h.keys().await[0]["id"].as_str().expect("id").to_owned();
    admin.revoke_api_key(&key_id).await.expect("revoke");
    assert_eq!(h.sandboxes_status(&h.key).await, StatusCode::UNAUTHORIZED);
}
