//! The SQLite store against a real database file.

use std::collections::BTreeMap;

use chrono::{TimeDelta, Utc};
use sandbar_core::auth::{Auth, TeamLimits};
use sandbar_core::store::{SandboxRecords, TeamRecords, TemplateRecords};
use sandbar_core::{
    BuildStatus, EgressConfig, NetworkConfig, RuntimeHandle, Sandbox, SandboxState, SandboxStatus,
    Template,
};
use sandbar_store::SqliteStore;
use std::sync::Arc;

const LIMITS: TeamLimits = TeamLimits {
    max_concurrent_sandboxes: 10,
    max_sandbox_timeout_secs: 3600,
    requests_per_minute: 0,
    max_vcpu: 0,
    max_memory_mb: 0,
    max_disk_mb: 0,
};

/// A private, built template named `alias`, owned by `team_id` (`None`: built in).
fn template(id: &str, team_id: Option<&str>, alias: &str) -> Template {
    let now = Utc::now();
    Template {
        id: id.into(),
        team_id: team_id.map(str::to_owned),
        namespace: None,
        aliases: vec![alias.into()],
        public: false,
        build_id: "b".into(),
        build_status: BuildStatus::Ready,
        build_error: None,
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 1024,
        envd_version: "0.5.7".into(),
        image: None,
        created_at: now,
        updated_at: now,
        last_spawned_at: None,
        spawn_count: 0,
        build_count: 1,
    }
}

async fn open() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(&dir.path().join("db.sqlite"))
        .await
        .expect("open");
    (dir, Arc::new(store))
}

#[tokio::test]
async fn bootstrap_happens_once_and_keys_are_stored_hashed() {
    let (dir, store) = open().await;
    let auth = Auth::new(store.clone());
    let key = format!("e2b_{}", "ab".repeat(20));
    let creds = auth
        .bootstrap(Some(&key), LIMITS)
        .await
        .expect("bootstrap")
        .expect("first start creates credentials");
    assert_eq!(creds.api_key, key);
    assert!(creds.access_token.starts_with("sk_e2b_"));
    assert!(
        auth.bootstrap(None, LIMITS)
            .await
            .expect("second")
            .is_none()
    );

    let team = auth.team_for_api_key(Some(&key)).await.expect("key works");
    assert_eq!(team.id, creds.team_id);
    assert!(auth.team_for_api_key(Some("e2b_wrong")).await.is_err());
    assert!(auth.team_for_api_key(None).await.is_err());
    auth.team_for_access_token(Some(&creds.access_token))
        .await
        .expect("token works");

    drop(store);
    let raw = std::fs::read(dir.path().join("db.sqlite")).expect("read db");
    let raw = String::from_utf8_lossy(&raw);
    assert!(
        !raw.contains(&key[4..]),
        "the api key must not be stored in clear"
    );
}

#[tokio::test]
async fn malformed_requested_key_is_refused() {
    let (_dir, store) = open().await;
    let auth = Auth::new(store.clone());
    assert!(auth.bootstrap(Some("e2b_XYZ"), LIMITS).await.is_err());
    assert_eq!(store.team_count().await.expect("count"), 0);
}

#[tokio::test]
async fn templates_and_sandboxes_round_trip() {
    let (_dir, store) = open().await;
    let auth = Auth::new(store.clone());
    let creds = auth
        .bootstrap(None, LIMITS)
        .await
        .expect("boot")
        .expect("creds");
    let now = Utc::now();
    let template = Template {
        public: true,
        build_status: BuildStatus::Building,
        ..template("tpl0000000000000000a", None, "base")
    };
    store.upsert_template(&template).await.expect("upsert");
    let image = sandbar_core::TemplateImage {
        layers: vec!["base/v1".into(), "layer/ab".into()],
        env: [("A".to_owned(), "1".to_owned())].into(),
        user: "user".into(),
        workdir: "/app".into(),
        start_cmd: Some("serve".into()),
        ready_cmd: None,
        snapshot: None,
    };
    store
        .set_template_image(&template.id, "b", &image)
        .await
        .expect("ready");
    let by_alias = store
        .template_by_name(None, "base")
        .await
        .expect("query")
        .expect("found");
    assert_eq!(by_alias.build_status, BuildStatus::Ready);
    assert_eq!(by_alias.image.as_ref(), Some(&image));
    assert_eq!(
        store.layers_in_use().await.expect("layers"),
        vec!["base/v1".to_owned(), "layer/ab".to_owned()]
    );
    assert_eq!(by_alias.aliases, vec!["base".to_owned()]);

    let sandbox = Sandbox {
        id: "iaaaaaaaaaaaaaaaaaaaa".into(),
        team_id: creds.team_id.clone(),
        template_id: template.id.clone(),
        alias: Some("base".into()),
        started_at: now,
        end_at: now + TimeDelta::seconds(60),
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 1024,
        metadata: BTreeMap::from([("k".into(), "v".into())]),
        env_vars: BTreeMap::new(),
        allow_internet_access: true,
        network: NetworkConfig {
            allow_public_traffic: false,
            ..NetworkConfig::default()
        },
        traffic_access_token: Some("traffic".into()),
        envd_access_token: "t".into(),
        envd_version: "0.5.7".into(),
        status: SandboxStatus::Running,
        handle: RuntimeHandle(serde_json::json!({"pid": 5})),
        auto_pause: true,
        auto_resume: false,
        auto_pause_memory: false,
        image: Some(image.clone()),
    };
    store.insert_sandbox(&sandbox).await.expect("insert");
    store
        .set_sandbox_status(&sandbox.id, SandboxStatus::Paused, None)
        .await
        .expect("pause");
    let paused = store
        .sandbox(&sandbox.id)
        .await
        .expect("read")
        .expect("found");
    assert_eq!(
        (paused.state(), paused.status, paused.auto_pause),
        (SandboxState::Paused, SandboxStatus::Paused, true)
    );
    assert!(!paused.auto_pause_memory);
    assert_eq!(paused.image.as_ref(), Some(&image));
    let released = RuntimeHandle(serde_json::json!({"pid": 0}));
    store
        .set_sandbox_status(&sandbox.id, SandboxStatus::Shelved, Some(&released))
        .await
        .expect("pause without memory");
    let shelved = store
        .sandbox(&sandbox.id)
        .await
        .expect("read")
        .expect("found");
    assert_eq!(
        (shelved.state(), shelved.status, &shelved.handle),
        (SandboxState::Paused, SandboxStatus::Shelved, &released)
    );
    store
        .set_sandbox_status(&sandbox.id, SandboxStatus::Running, Some(&sandbox.handle))
        .await
        .expect("boot again");
    let loaded = store
        .sandbox(&sandbox.id)
        .await
        .expect("get")
        .expect("found");
    assert_eq!(loaded.metadata, sandbox.metadata);
    assert_eq!(loaded.handle, sandbox.handle);
    assert_eq!(loaded.status, SandboxStatus::Running);
    assert_eq!(
        loaded.end_at.timestamp_micros(),
        sandbox.end_at.timestamp_micros()
    );
    assert_eq!(
        store
            .team_sandboxes(&creds.team_id)
            .await
            .expect("list")
            .len(),
        1
    );
    assert_eq!(loaded.network, sandbox.network);
    assert_eq!(loaded.traffic_access_token.as_deref(), Some("traffic"));
    let mut network = sandbox.network.clone();
    network.egress = EgressConfig {
        allow_out: vec!["example.com".into()],
        deny_out: vec!["0.0.0.0/0".into()],
        dns_servers: None,
    };
    store
        .set_sandbox_network(&sandbox.id, &network, false)
        .await
        .expect("update network");
    let updated = store
        .sandbox(&sandbox.id)
        .await
        .expect("get")
        .expect("found");
    assert_eq!(updated.network, network);
    assert!(!updated.allow_internet_access);
    // The template moves on to a new root; the sandbox still runs on the old one.
    let rebuilt = sandbar_core::TemplateImage {
        layers: vec!["base/v2".into()],
        ..image.clone()
    };
    store
        .set_template_image(&template.id, "c", &rebuilt)
        .await
        .expect("rebuilt");
    assert_eq!(
        store.layers_in_use().await.expect("layers"),
        vec![
            "base/v1".to_owned(),
            "base/v2".to_owned(),
            "layer/ab".to_owned()
        ]
    );
    store.delete_sandbox(&sandbox.id).await.expect("delete");
    assert!(store.sandbox(&sandbox.id).await.expect("get").is_none());
    assert_eq!(
        store.layers_in_use().await.expect("layers"),
        vec!["base/v2".to_owned()]
    );
}

#[tokio::test]
async fn names_are_per_team_and_teams_have_unique_slugs() {
    let (_dir, store) = open().await;
    let auth = Auth::new(store.clone());
    let one = auth
        .create_team("Acme Corp", LIMITS)
        .await
        .expect("one")
        .team;
    let two = auth
        .create_team("acme  corp!", LIMITS)
        .await
        .expect("two")
        .team;
    assert_eq!(one.slug, "acme-corp");
    assert_eq!(two.slug, "acme-corp-2");
    assert_eq!(
        store
            .team_by_slug("acme-corp-2")
            .await
            .expect("slug")
            .map(|t| t.id),
        Some(two.id.clone())
    );
    let named = |id: &str, team: &str| template(id, Some(team), "app");
    store
        .upsert_template(&named("tpl-one", &one.id))
        .await
        .expect("one's");
    store
        .upsert_template(&named("tpl-two", &two.id))
        .await
        .expect("two's");
    for (team, id, slug) in [
        (&one, "tpl-one", "acme-corp"),
        (&two, "tpl-two", "acme-corp-2"),
    ] {
        let found = store
            .template_by_name(Some(&team.id), "app")
            .await
            .expect("query")
            .expect("each team has its own 'app'");
        assert_eq!(found.id, id);
        assert_eq!(found.names(), vec![format!("{slug}/app")]);
    }
    assert!(
        store
            .template_by_name(None, "app")
            .await
            .expect("query")
            .is_none()
    );
    assert!(
        store
            .public_templates_named("app")
            .await
            .expect("query")
            .is_empty()
    );
}
