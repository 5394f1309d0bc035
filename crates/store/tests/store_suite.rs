//! The store's behaviour, one suite run against each backend: SQLite in a temporary file,
//! and PostgreSQL in a throwaway cluster the binary starts (skipped, saying why, when the
//! PostgreSQL binaries are missing).

mod pg_cluster;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Once};

use chrono::{DateTime, TimeDelta, Utc};
use sandbar_core::auth::{Auth, AuthError, TeamLimits};
use sandbar_core::store::{StoredApiKey, StoredSecret};
use sandbar_core::{
    BuildLogEntry, BuildRecord, BuildStatus, EgressConfig, LayerBlob, LogLevel, NetworkConfig,
    NodeRecord, NodeReport, RuntimeHandle, Sandbox, SandboxEvent, SandboxEventQuery,
    SandboxEventType, SandboxLogEntry, SandboxLogQuery, SandboxState, SandboxStatus, SlotClaim,
    Store, StoreError, Team, TeamCaps, TeamMetricBucket, Template, Volume, VolumeMount,
};
use sandbar_store::{PgStore, SqliteStore};
use sqlx::Connection;

/// Each test as an async fn taking a [`Fixture`], run once per backend.
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Fixture::sqlite().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    if let Some(fixture) = super::Fixture::postgres().await {
                        super::$name(fixture).await;
                    }
                }
            )*
        }
    };
}

suite!(
    bootstrap_happens_once_and_keys_are_stored_hashed,
    malformed_requested_key_is_refused,
    templates_and_sandboxes_round_trip,
    names_are_per_team_and_teams_have_unique_slugs,
    duplicates_are_conflicts,
    api_keys_list_oldest_first_and_last_use_only_moves_forward,
    builds_tags_and_build_logs,
    sandbox_logs_keep_the_newest_lines_and_search_case_sensitively,
    concurrent_log_appends_number_every_line_once,
    team_metrics_merge_buckets,
    sandbox_events_page_filter_and_prune,
    webhooks_are_capped_per_team_and_keep_their_newest_deliveries,
    volumes_and_mounts,
    teams_members_and_limits,
    team_caps_round_trip_and_old_teams_get_the_defaults,
    two_hosts_on_one_database_settle_their_races,
    nodes_renew_their_leases_and_sandboxes_name_their_node,
    two_hosts_starting_on_an_empty_database_make_one_first_team,
    published_layers_keep_their_first_record,
    request_counts_add_up_over_hosts,
    team_slots_are_claimed_across_nodes,
    racing_claims_never_pass_the_limit,
    the_lookup_generation_moves_with_what_cached_lookups_read_from_any_host,
);

/// A store under test, with what it keeps its data in.
struct Fixture {
    store: Arc<Store>,
    backend: Backend,
}

enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Fixture {
    async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(&dir.path().join("db.sqlite"))
            .await
            .expect("open");
        Self {
            store: Arc::new(store),
            backend: Backend::Sqlite(dir),
        }
    }

    /// A store on a database of its own in the binary's cluster; `None` without PostgreSQL.
    async fn postgres() -> Option<Self> {
        let cluster = match pg_cluster::cluster() {
            Ok(cluster) => cluster,
            Err(reason) => {
                static SAID: Once = Once::new();
                // Straight to stderr: the test harness would hide a println of a passing test.
                SAID.call_once(|| {
                    let _ = writeln!(
                        std::io::stderr(),
                        "PostgreSQL store tests skipped: {reason}"
                    );
                });
                return None;
            }
        };
        let url = cluster.database().await;
        let store = PgStore::connect(&url).await.expect("connect and migrate");
        Some(Self {
            store: Arc::new(store),
            backend: Backend::Postgres(url),
        })
    }

    /// Another store on the same database, as a second API host would open it.
    async fn second_host(&self) -> Arc<Store> {
        match &self.backend {
            Backend::Sqlite(dir) => Arc::new(
                SqliteStore::open(&dir.path().join("db.sqlite"))
                    .await
                    .expect("open again"),
            ),
            Backend::Postgres(url) => Arc::new(PgStore::connect(url).await.expect("connect again")),
        }
    }

    /// The store and a second host's on the same database.
    async fn two_hosts(&self) -> [Arc<Store>; 2] {
        [self.store.clone(), self.second_host().await]
    }

    /// Records a team the way a server from before team caps did: without their columns.
    async fn insert_team_without_caps(&self, id: &str) {
        match &self.backend {
            Backend::Sqlite(dir) => {
                let url = format!("sqlite://{}", dir.path().join("db.sqlite").display());
                let mut conn = sqlx::SqliteConnection::connect(&url)
                    .await
                    .expect("connect");
                sqlx::query(
                    "INSERT INTO teams (id, name, slug, max_concurrent_sandboxes, max_sandbox_timeout_secs, created_at) VALUES (?, 'Old', ?, 5, 60, 0)",
                )
                .bind(id)
                .bind(id)
                .execute(&mut conn)
                .await
                .expect("insert");
            }
            Backend::Postgres(url) => {
                let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
                sqlx::query(
                    "INSERT INTO teams (id, name, slug, max_concurrent_sandboxes, max_sandbox_timeout_secs, created_at) VALUES ($1, 'Old', $1, 5, 60, now())",
                )
                .bind(id)
                .execute(&mut conn)
                .await
                .expect("insert");
            }
        }
    }

    /// Everything the backend keeps of API keys and access tokens, as text.
    async fn stored_credentials(&self) -> String {
        match &self.backend {
            Backend::Sqlite(dir) => ["db.sqlite", "db.sqlite-wal"]
                .iter()
                .filter_map(|f| std::fs::read(dir.path().join(f)).ok())
                .map(|raw| String::from_utf8_lossy(&raw).into_owned())
                .collect(),
            Backend::Postgres(url) => {
                let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
                sqlx::query_scalar(
                    "SELECT COALESCE((SELECT string_agg(k::text, ' ') FROM api_keys k), '')
                       || COALESCE((SELECT string_agg(a::text, ' ') FROM access_tokens a), '')",
                )
                .fetch_one(&mut conn)
                .await
                .expect("dump")
            }
        }
    }
}

const LIMITS: TeamLimits = TeamLimits::new(10, 3600, 0);

/// A private, built template named `alias`, owned by `team_id` (`None`: built in).
fn template(id: &str, team_id: Option<&str>, alias: &str) -> Template {
    Template {
        team_id: team_id.map(str::to_owned),
        aliases: vec![alias.into()],
        build_id: "b".into(),
        build_status: BuildStatus::Ready,
        envd_version: "0.5.7".into(),
        build_count: 1,
        ..Template::unbuilt(id.into(), 2, 512, 1024, Utc::now())
    }
}

async fn bootstrap_happens_once_and_keys_are_stored_hashed(f: Fixture) {
    let store = f.store.clone();
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
    let wrong = auth.team_for_api_key(Some("e2b_wrong")).await;
    assert!(matches!(wrong, Err(AuthError::InvalidApiKey)), "{wrong:?}");
    let missing = auth.team_for_api_key(None).await;
    assert!(
        matches!(missing, Err(AuthError::MissingApiKey)),
        "{missing:?}"
    );
    auth.team_for_access_token(Some(&creds.access_token))
        .await
        .expect("token works");

    let raw = f.stored_credentials().await;
    assert!(
        !raw.contains(&key[4..]),
        "the api key must not be stored in clear"
    );
}

async fn malformed_requested_key_is_refused(f: Fixture) {
    let store = f.store;
    let auth = Auth::new(store.clone());
    let refused = auth.bootstrap(Some("e2b_XYZ"), LIMITS).await;
    assert!(
        matches!(refused, Err(AuthError::MalformedRequestedKey)),
        "{refused:?}"
    );
    assert_eq!(store.teams.team_count().await.expect("count"), 0);
}

async fn templates_and_sandboxes_round_trip(f: Fixture) {
    let store = f.store;
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
    store
        .templates
        .upsert_template(&template)
        .await
        .expect("upsert");
    let image = sandbar_core::TemplateImage {
        layers: vec!["base/v1".into(), "layer/ab".into()],
        env: [("A".to_owned(), "1".to_owned())].into(),
        user: "user".into(),
        workdir: "/app".into(),
        start_cmd: Some("serve".into()),
        start_user: None,
        ready_cmd: None,
        snapshot: None,
        started: None,
    };
    store
        .templates
        .set_template_image(&template.id, "b", &image)
        .await
        .expect("ready");
    let by_alias = store
        .templates
        .template_by_name(None, "base")
        .await
        .expect("query")
        .expect("found");
    assert_eq!(by_alias.build_status, BuildStatus::Ready);
    assert_eq!(by_alias.image.as_ref(), Some(&image));
    assert_eq!(
        store.templates.layers_in_use().await.expect("layers"),
        vec!["base/v1".to_owned(), "layer/ab".to_owned()]
    );
    assert_eq!(by_alias.aliases, vec!["base".to_owned()]);

    // Spawns written in batches add up, and the latest time stays the latest.
    let later = now + TimeDelta::seconds(5);
    store
        .templates
        .record_template_spawns(&template.id, 3, later)
        .await
        .expect("spawns");
    store
        .templates
        .record_template_spawns(&template.id, 2, now)
        .await
        .expect("spawns");
    let spawned = store
        .templates
        .template_by_name(None, "base")
        .await
        .expect("query")
        .expect("found");
    assert_eq!(spawned.spawn_count, 5);
    assert_eq!(
        spawned.last_spawned_at.map(|t| t.timestamp_micros()),
        Some(later.timestamp_micros())
    );

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
        handle: RuntimeHandle::warm(3, 100_000, 5, 77),
        auto_pause: true,
        auto_resume: false,
        auto_pause_memory: false,
        image: Some(image.clone()),
        node_id: "n1".into(),
    };
    store
        .sandboxes
        .insert_sandbox(&sandbox, &[])
        .await
        .expect("insert");
    store
        .sandboxes
        .set_sandbox_status(&sandbox.id, SandboxStatus::Paused, None)
        .await
        .expect("pause");
    let paused = stored_sandbox(&store, &sandbox.id).await;
    assert_eq!(
        (paused.state(), paused.status, paused.auto_pause),
        (SandboxState::Paused, SandboxStatus::Paused, true)
    );
    assert!(!paused.auto_pause_memory);
    assert_eq!(paused.image.as_ref(), Some(&image));
    let released = RuntimeHandle {
        phase: sandbar_core::HandlePhase::Released,
        ..RuntimeHandle::unstarted(3)
    };
    store
        .sandboxes
        .set_sandbox_status(&sandbox.id, SandboxStatus::Shelved, Some(&released))
        .await
        .expect("pause without memory");
    let shelved = stored_sandbox(&store, &sandbox.id).await;
    assert_eq!(
        (shelved.state(), shelved.status, &shelved.handle),
        (SandboxState::Paused, SandboxStatus::Shelved, &released)
    );
    store
        .sandboxes
        .set_sandbox_status(&sandbox.id, SandboxStatus::Running, Some(&sandbox.handle))
        .await
        .expect("boot again");
    let loaded = stored_sandbox(&store, &sandbox.id).await;
    assert_eq!(loaded.metadata, sandbox.metadata);
    assert_eq!(loaded.handle, sandbox.handle);
    assert_eq!(loaded.status, SandboxStatus::Running);
    assert_eq!(
        loaded.end_at.timestamp_micros(),
        sandbox.end_at.timestamp_micros()
    );
    assert_eq!(
        store
            .sandboxes
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
        .sandboxes
        .set_sandbox_network(&sandbox.id, &network, false)
        .await
        .expect("update network");
    let updated = stored_sandbox(&store, &sandbox.id).await;
    assert_eq!(updated.network, network);
    assert!(!updated.allow_internet_access);
    // The template moves on to a new root; the sandbox still runs on the old one.
    let rebuilt = sandbar_core::TemplateImage {
        layers: vec!["base/v2".into()],
        ..image.clone()
    };
    store
        .templates
        .set_template_image(&template.id, "c", &rebuilt)
        .await
        .expect("rebuilt");
    assert_eq!(
        store.templates.layers_in_use().await.expect("layers"),
        vec![
            "base/v1".to_owned(),
            "base/v2".to_owned(),
            "layer/ab".to_owned()
        ]
    );
    store
        .sandboxes
        .delete_sandbox(&sandbox.id)
        .await
        .expect("delete");
    assert!(
        store
            .sandboxes
            .sandbox(&sandbox.id)
            .await
            .expect("get")
            .is_none()
    );
    assert_eq!(
        store.templates.layers_in_use().await.expect("layers"),
        vec!["base/v2".to_owned()]
    );
}

async fn names_are_per_team_and_teams_have_unique_slugs(f: Fixture) {
    let store = f.store;
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
            .teams
            .team_by_slug("acme-corp-2")
            .await
            .expect("slug")
            .map(|t| t.id),
        Some(two.id.clone())
    );
    let named = |id: &str, team: &str| template(id, Some(team), "app");
    store
        .templates
        .upsert_template(&named("tpl-one", &one.id))
        .await
        .expect("one's");
    store
        .templates
        .upsert_template(&named("tpl-two", &two.id))
        .await
        .expect("two's");
    for (team, id, slug) in [
        (&one, "tpl-one", "acme-corp"),
        (&two, "tpl-two", "acme-corp-2"),
    ] {
        let found = store
            .templates
            .template_by_name(Some(&team.id), "app")
            .await
            .expect("query")
            .expect("each team has its own 'app'");
        assert_eq!(found.id, id);
        assert_eq!(found.names(), vec![format!("{slug}/app")]);
    }
    assert!(
        store
            .templates
            .template_by_name(None, "app")
            .await
            .expect("query")
            .is_none()
    );
    assert!(
        store
            .templates
            .public_templates_named("app")
            .await
            .expect("query")
            .is_empty()
    );
}

/// A team made through the core, as the server makes them.
async fn team(store: &Arc<Store>, name: &str) -> Team {
    Auth::new(store.clone())
        .create_team(name, LIMITS)
        .await
        .expect("team")
        .team
}

fn sandbox(id: &str, team_id: &str, started_at: DateTime<Utc>) -> Sandbox {
    Sandbox {
        id: id.into(),
        team_id: team_id.into(),
        template_id: "base".into(),
        alias: None,
        started_at,
        end_at: started_at + TimeDelta::seconds(60),
        cpu_count: 1,
        memory_mb: 256,
        disk_size_mb: 512,
        metadata: BTreeMap::new(),
        env_vars: BTreeMap::from([("A".into(), "1".into())]),
        allow_internet_access: true,
        network: NetworkConfig::default(),
        traffic_access_token: None,
        envd_access_token: "token".into(),
        envd_version: "0.5.7".into(),
        status: SandboxStatus::Running,
        handle: RuntimeHandle::unstarted(1),
        auto_pause: false,
        auto_resume: false,
        auto_pause_memory: true,
        image: None,
        node_id: String::new(),
    }
}

fn build(id: &str, template_id: &str, status: BuildStatus, at: DateTime<Utc>) -> BuildRecord {
    BuildRecord {
        id: id.into(),
        template_id: template_id.into(),
        team_id: None,
        status,
        failure: None,
        spec: None,
        image: None,
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 1024,
        created_at: at,
        updated_at: at,
        finished_at: (status == BuildStatus::Ready).then_some(at),
        node_id: None,
    }
}

/// The node a build is recorded on.
async fn build_node(store: &Arc<Store>, id: &str) -> Option<String> {
    store
        .builds
        .build(id)
        .await
        .expect("read")
        .and_then(|b| b.node_id)
}

/// A recorded sandbox, which must be there.
async fn stored_sandbox(store: &Arc<Store>, id: &str) -> Sandbox {
    store
        .sandboxes
        .sandbox(id)
        .await
        .expect("read")
        .expect("found")
}

/// A sandbox of `team_id` recorded on `node_id`.
fn sandbox_on(id: &str, team_id: &str, node_id: &str, started_at: DateTime<Utc>) -> Sandbox {
    Sandbox {
        node_id: node_id.into(),
        ..sandbox(id, team_id, started_at)
    }
}

fn volume_named(id: &str, team_id: &str, name: &str, created_at: DateTime<Utc>) -> Volume {
    Volume {
        id: id.into(),
        team_id: team_id.into(),
        name: name.into(),
        token_hash: format!("hash-{id}"),
        created_at,
    }
}

fn log_line(at: DateTime<Utc>, level: LogLevel, message: &str) -> SandboxLogEntry {
    SandboxLogEntry {
        at,
        level,
        message: message.into(),
        fields: BTreeMap::from([("logger".into(), "agent".into())]),
    }
}

/// Whole microseconds, as both backends keep times.
fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

async fn duplicates_are_conflicts(f: Fixture) {
    let store = f.store;
    let team = team(&store, "Dups").await;
    let s = sandbox("isandbox", &team.id, Utc::now());
    store
        .sandboxes
        .insert_sandbox(&s, &[])
        .await
        .expect("first");
    assert!(matches!(
        store.sandboxes.insert_sandbox(&s, &[]).await,
        Err(StoreError::Conflict { what: "sandbox", ref id }) if id == "isandbox"
    ));
    store
        .templates
        .upsert_template(&template("tpl", None, "t"))
        .await
        .expect("template");
    let b = build("b1", "tpl", BuildStatus::Waiting, Utc::now());
    store.builds.insert_build(&b).await.expect("first build");
    assert!(matches!(
        store.builds.insert_build(&b).await,
        Err(StoreError::Conflict { what: "build", .. })
    ));
    // Two hosts that picked the same slug for two new teams: the later one conflicts.
    let same_slug = Team {
        id: "other-team".into(),
        ..team.clone()
    };
    assert!(matches!(
        store.teams.insert_team(&same_slug).await,
        Err(StoreError::Conflict { what: "team", .. })
    ));
    let volume = volume_named("vol1", &team.id, "data", Utc::now());
    assert!(
        store
            .volumes
            .insert_volume(&volume)
            .await
            .expect("first volume")
    );
    let same_name = Volume {
        id: "vol2".into(),
        ..volume.clone()
    };
    assert!(
        !store
            .volumes
            .insert_volume(&same_name)
            .await
            .expect("second")
    );
}

async fn api_keys_list_oldest_first_and_last_use_only_moves_forward(f: Fixture) {
    let store = f.store;
    let team = team(&store, "Keys").await;
    let t0 = micros(Utc::now());
    for (id, hash, at) in [
        ("key-b", "hash-b", t0),
        ("key-a", "hash-a", t0 + TimeDelta::seconds(1)),
    ] {
        store
            .teams
            .insert_team_api_key(&StoredApiKey {
                secret: StoredSecret {
                    id: id.into(),
                    team_id: team.id.clone(),
                    name: id.into(),
                    secret_hash: hash.into(),
                    mask_prefix: "e2".into(),
                    mask_suffix: "ff".into(),
                    created_at: at,
                },
                created_by: Some("user".into()),
                last_used: None,
            })
            .await
            .expect("insert key");
    }
    let listed: Vec<String> = store
        .teams
        .team_api_keys(&team.id)
        .await
        .expect("list")
        .into_iter()
        .map(|k| k.secret.id)
        .filter(|id| id.starts_with("key-"))
        .collect();
    assert_eq!(listed, vec!["key-b".to_owned(), "key-a".to_owned()]);

    let later = t0 + TimeDelta::seconds(30);
    store
        .teams
        .touch_api_key("key-b", later)
        .await
        .expect("touch");
    // A host whose touch lands late must not move the last use back.
    store
        .teams
        .touch_api_key("key-b", t0)
        .await
        .expect("late touch");
    let (key, owner) = store
        .teams
        .api_key_by_hash("hash-b")
        .await
        .expect("lookup")
        .expect("found");
    assert_eq!(key.last_used, Some(later));
    assert_eq!(key.created_by.as_deref(), Some("user"));
    assert_eq!(owner.id, team.id);

    assert!(
        store
            .teams
            .rename_api_key(&team.id, "key-b", "renamed")
            .await
            .expect("rename")
    );
    assert!(
        !store
            .teams
            .rename_api_key("other", "key-b", "x")
            .await
            .expect("rename")
    );
    assert!(
        !store
            .teams
            .delete_api_key(Some("other"), "key-b")
            .await
            .expect("delete")
    );
    assert!(
        store
            .teams
            .delete_api_key(None, "key-b")
            .await
            .expect("delete")
    );
    assert!(
        store
            .teams
            .api_key_by_hash("hash-b")
            .await
            .expect("lookup")
            .is_none()
    );
}

async fn builds_tags_and_build_logs(f: Fixture) {
    let store = f.store;
    store
        .templates
        .upsert_template(&template("tpl", None, "t"))
        .await
        .expect("template");
    let t0 = micros(Utc::now());
    let old = build("b-old", "tpl", BuildStatus::Ready, t0);
    let new = build(
        "b-new",
        "tpl",
        BuildStatus::Ready,
        t0 + TimeDelta::seconds(5),
    );
    let waiting = build(
        "b-wait",
        "tpl",
        BuildStatus::Waiting,
        t0 + TimeDelta::seconds(9),
    );
    for b in [&old, &new, &waiting] {
        store.builds.insert_build(b).await.expect("insert");
    }
    let tags = |t: &[&str]| t.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    store
        .builds
        .set_build_tags("tpl", "b-old", &tags(&["v1", "latest"]))
        .await
        .expect("tag old");
    store
        .builds
        .set_build_tags("tpl", "b-new", &tags(&["latest", "v2"]))
        .await
        .expect("tag new");
    store
        .builds
        .set_build_tags("tpl", "b-new", &tags(&["v2"]))
        .await
        .expect("tagging again is no change");
    let listed: Vec<(String, String)> = store
        .builds
        .template_tags("tpl")
        .await
        .expect("tags")
        .into_iter()
        .map(|(tag, b)| (tag, b.id))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("latest".to_owned(), "b-new".to_owned()),
            ("v1".to_owned(), "b-old".to_owned()),
            ("v2".to_owned(), "b-new".to_owned()),
        ]
    );
    assert_eq!(
        store
            .builds
            .tagged_build("tpl", "latest")
            .await
            .expect("tagged")
            .map(|b| b.id),
        Some("b-new".to_owned())
    );
    assert_eq!(
        store
            .builds
            .template_builds("tpl")
            .await
            .expect("builds")
            .into_iter()
            .map(|b| b.id)
            .collect::<Vec<_>>(),
        vec!["b-wait", "b-new", "b-old"]
    );
    assert_eq!(
        store
            .builds
            .unfinished_builds()
            .await
            .expect("unfinished")
            .into_iter()
            .map(|b| b.id)
            .collect::<Vec<_>>(),
        vec!["b-wait"]
    );
    // The node that runs it is recorded when it starts.
    let mut running = waiting.clone();
    running.node_id = Some("n1".into());
    store.builds.update_build(&running).await.expect("update");
    assert_eq!(build_node(&store, "b-wait").await, Some("n1".into()));
    // A waiting build may be given to another node; a started or ended one is not.
    for (id, assigned) in [("b-wait", true), ("b-new", false), ("nope", false)] {
        let done = store
            .builds
            .assign_waiting_build(id, "n2")
            .await
            .expect("assign");
        assert_eq!(done, assigned, "{id}");
    }
    assert_eq!(build_node(&store, "b-wait").await, Some("n2".into()));
    let mut done = running.clone();
    done.status = BuildStatus::Error;
    done.failure = Some(sandbar_core::BuildFailure::at("2", "exit 1"));
    store.builds.update_build(&done).await.expect("update");
    assert_eq!(
        store.builds.build("b-wait").await.expect("read"),
        Some(done)
    );
    assert_eq!(
        store
            .builds
            .delete_build_tags("tpl", &tags(&["latest", "nope"]))
            .await
            .expect("untag"),
        2
    );

    for (seq, level, message) in [
        (0, LogLevel::Debug, "pulling"),
        (1, LogLevel::Info, "step one"),
        (2, LogLevel::Error, "failed"),
        (3, LogLevel::Info, "cleanup"),
    ] {
        let entry = BuildLogEntry {
            timestamp: t0,
            level,
            message: message.into(),
            step: Some("1".into()),
        };
        store
            .builds
            .append_build_log("b-new", seq, &entry)
            .await
            .expect("log");
    }
    let messages =
        |entries: Vec<BuildLogEntry>| entries.into_iter().map(|e| e.message).collect::<Vec<_>>();
    assert_eq!(
        messages(
            store
                .builds
                .build_logs("b-new", 1, 10, Some(LogLevel::Info))
                .await
                .expect("logs")
        ),
        vec!["failed", "cleanup"]
    );
    store
        .templates
        .delete_template("tpl")
        .await
        .expect("delete");
    assert!(store.builds.build("b-new").await.expect("read").is_none());
    assert!(
        store
            .builds
            .build_logs("b-new", 0, 10, None)
            .await
            .expect("logs")
            .is_empty()
    );
    assert!(
        store
            .templates
            .template_by_name(None, "t")
            .await
            .expect("read")
            .is_none()
    );
}

async fn sandbox_logs_keep_the_newest_lines_and_search_case_sensitively(f: Fixture) {
    let store = f.store;
    let t0 = micros(Utc::now());
    let at = |ms: i64| t0 + TimeDelta::milliseconds(ms);
    store
        .sandbox_logs
        .open_sandbox_log(
            "isb",
            "team",
            t0,
            &[log_line(at(0), LogLevel::Info, "created")],
        )
        .await
        .expect("open");
    store
        .sandbox_logs
        .open_sandbox_log(
            "isb",
            "other",
            t0,
            &[log_line(at(0), LogLevel::Info, "again")],
        )
        .await
        .expect("opening again keeps the first");
    assert_eq!(
        store
            .sandbox_logs
            .sandbox_log_team("isb")
            .await
            .expect("team")
            .as_deref(),
        Some("team")
    );
    store
        .sandbox_logs
        .append_sandbox_logs(
            "isb",
            &[
                log_line(at(1), LogLevel::Debug, "Hello world"),
                log_line(at(2), LogLevel::Warn, "hello again"),
                log_line(at(3), LogLevel::Error, "bye"),
            ],
            Some(4096),
            3,
        )
        .await
        .expect("append");
    store
        .sandbox_logs
        .append_sandbox_logs("nobody", &[log_line(at(1), LogLevel::Info, "x")], None, 3)
        .await
        .expect("a log never opened takes nothing");
    assert_eq!(
        store
            .sandbox_logs
            .sandbox_log_offset("isb")
            .await
            .expect("offset"),
        4096
    );
    let read = |query: SandboxLogQuery| {
        let store = store.clone();
        async move {
            store
                .sandbox_logs
                .sandbox_logs("isb", &query)
                .await
                .expect("read")
                .into_iter()
                .map(|e| e.message)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        read(SandboxLogQuery::default()).await,
        vec!["Hello world", "hello again", "bye"],
        "the oldest line went beyond the 3 kept"
    );
    assert_eq!(
        read(SandboxLogQuery {
            search: Some("hello".into()),
            ..SandboxLogQuery::default()
        })
        .await,
        vec!["hello again"]
    );
    assert_eq!(
        read(SandboxLogQuery {
            forward: false,
            min_level: Some(LogLevel::Warn),
            ..SandboxLogQuery::default()
        })
        .await,
        vec!["bye", "hello again"]
    );
    assert_eq!(
        read(SandboxLogQuery {
            forward: false,
            cursor_ms: Some(at(2).timestamp_millis()),
            limit: 1,
            ..SandboxLogQuery::default()
        })
        .await,
        vec!["hello again"]
    );
    store
        .sandbox_logs
        .end_sandbox_log("isb", t0)
        .await
        .expect("end");
    assert_eq!(
        store
            .sandbox_logs
            .prune_sandbox_logs(t0)
            .await
            .expect("prune"),
        0,
        "ended exactly at the cut"
    );
    assert_eq!(
        store
            .sandbox_logs
            .prune_sandbox_logs(t0 + TimeDelta::seconds(1))
            .await
            .expect("prune"),
        1
    );
    assert!(read(SandboxLogQuery::default()).await.is_empty());
    assert!(
        store
            .sandbox_logs
            .sandbox_log_team("isb")
            .await
            .expect("team")
            .is_none()
    );
}

async fn concurrent_log_appends_number_every_line_once(f: Fixture) {
    let store = f.store;
    let t0 = micros(Utc::now());
    store
        .sandbox_logs
        .open_sandbox_log("isb", "team", t0, &[])
        .await
        .expect("open");
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..5 {
                    let line = log_line(t0, LogLevel::Info, &format!("{w}-{i}"));
                    store
                        .sandbox_logs
                        .append_sandbox_logs("isb", &[line.clone(), line], None, 1000)
                        .await
                        .expect("append");
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.expect("writer");
    }
    let lines = store
        .sandbox_logs
        .sandbox_logs("isb", &SandboxLogQuery::default())
        .await
        .expect("read");
    assert_eq!(lines.len(), 80);
}

async fn team_metrics_merge_buckets(f: Fixture) {
    let store = f.store;
    let bucket = |team: &str, at: i64, concurrent: u32, starts: u32| TeamMetricBucket {
        team_id: team.into(),
        bucket: at,
        concurrent,
        starts,
    };
    store
        .team_metrics
        .add_team_metrics(&[
            bucket("a", 10, 3, 1),
            bucket("a", 5, 1, 1),
            bucket("b", 5, 9, 9),
        ])
        .await
        .expect("add");
    store
        .team_metrics
        .add_team_metrics(&[bucket("a", 10, 2, 4)])
        .await
        .expect("merge");
    assert_eq!(
        store
            .team_metrics
            .team_metrics("a", 0, 10)
            .await
            .expect("read"),
        vec![bucket("a", 5, 1, 1), bucket("a", 10, 3, 5)]
    );
    assert_eq!(
        store
            .team_metrics
            .team_metrics("a", 6, 9)
            .await
            .expect("read"),
        Vec::new()
    );
    assert_eq!(
        store
            .team_metrics
            .prune_team_metrics(10)
            .await
            .expect("prune"),
        2
    );
    assert_eq!(
        store
            .team_metrics
            .team_metrics("a", 0, 100)
            .await
            .expect("read"),
        vec![bucket("a", 10, 3, 5)]
    );
}

async fn sandbox_events_page_filter_and_prune(f: Fixture) {
    let store = f.store;
    let start = micros(Utc::now() - TimeDelta::hours(2));
    let mut a = sandbox("ievents0a", "team-a", start);
    a.metadata.insert("k".into(), "v".into());
    let b = sandbox("ievents0b", "team-a", start);
    let other = sandbox("ievents0c", "team-b", start);
    let at = |minutes: i64| start + TimeDelta::minutes(minutes);
    let written = [
        SandboxEvent::of(SandboxEventType::Created, &a, at(0)),
        SandboxEvent::of(SandboxEventType::Created, &b, at(1)),
        SandboxEvent::of(SandboxEventType::Created, &other, at(2)),
        SandboxEvent::of(SandboxEventType::Paused, &a, at(3)),
        SandboxEvent::of(SandboxEventType::Killed, &a, at(90)),
    ];
    store
        .sandbox_events
        .add_sandbox_events(&written[..2])
        .await
        .expect("add");
    store
        .sandbox_events
        .add_sandbox_events(&written[2..])
        .await
        .expect("add more");
    let read =
        |sandbox_id: Option<&str>, types: Vec<SandboxEventType>, offset, limit, ascending| {
            let query = SandboxEventQuery {
                sandbox_id: sandbox_id.map(str::to_owned),
                types,
                offset,
                limit,
                ascending,
            };
            let store = Arc::clone(&store);
            async move {
                store
                    .sandbox_events
                    .sandbox_events("team-a", &query)
                    .await
                    .expect("read")
            }
        };
    // Read back whole, in the order added, and only the team's.
    assert_eq!(
        read(None, vec![], 0, 100, true).await,
        vec![
            written[0].clone(),
            written[1].clone(),
            written[3].clone(),
            written[4].clone()
        ]
    );
    assert_eq!(
        read(Some("ievents0a"), vec![], 0, 100, false).await,
        vec![written[4].clone(), written[3].clone(), written[0].clone()]
    );
    assert_eq!(
        read(None, vec![], 1, 2, false).await,
        vec![written[3].clone(), written[1].clone()]
    );
    assert_eq!(
        read(
            None,
            vec![SandboxEventType::Paused, SandboxEventType::Killed],
            0,
            100,
            true
        )
        .await,
        vec![written[3].clone(), written[4].clone()]
    );
    assert_eq!(
        written[4]
            .event_data
            .execution
            .as_ref()
            .map(|e| e.execution_time),
        Some(90 * 60 * 1000)
    );
    // Pruned by when they happened.
    assert_eq!(
        store
            .sandbox_events
            .prune_sandbox_events(at(60))
            .await
            .expect("prune"),
        4
    );
    assert_eq!(
        read(None, vec![], 0, 100, true).await,
        vec![written[4].clone()]
    );
}

async fn webhooks_are_capped_per_team_and_keep_their_newest_deliveries(f: Fixture) {
    use sandbar_core::webhooks::{Webhook, WebhookDelivery};
    let store = f.store;
    let now = micros(Utc::now());
    let hook = |id: &str, team: &str| Webhook {
        id: id.into(),
        team_id: team.into(),
        name: format!("hook {id}"),
        url: "https://receiver.example/hook".into(),
        enabled: true,
        events: vec![SandboxEventType::Created, SandboxEventType::Killed],
        secret: "a-secret-of-enough-bytes".into(),
        created_at: now,
    };
    let hooks = &store.webhooks;
    assert!(
        hooks
            .add_webhook(&hook("w1", "team-a"), 2)
            .await
            .expect("add")
    );
    assert!(
        hooks
            .add_webhook(&hook("w2", "team-a"), 2)
            .await
            .expect("add")
    );
    assert!(
        !hooks
            .add_webhook(&hook("w3", "team-a"), 2)
            .await
            .expect("add past the cap")
    );
    assert!(
        hooks
            .add_webhook(&hook("w4", "team-b"), 2)
            .await
            .expect("another team's")
    );
    let listed = hooks.webhooks("team-a").await.expect("list");
    assert_eq!(listed, vec![hook("w1", "team-a"), hook("w2", "team-a")]);
    assert_eq!(hooks.webhook("team-b", "w1").await.expect("get"), None);
    let mut changed = hook("w1", "team-a");
    changed.enabled = false;
    changed.events = vec![SandboxEventType::Paused];
    changed.url = "http://elsewhere.example/".into();
    assert!(hooks.update_webhook(&changed).await.expect("update"));
    assert_eq!(
        hooks.webhook("team-a", "w1").await.expect("get"),
        Some(changed.clone())
    );
    let attempt = |n: u32| WebhookDelivery {
        id: "d1".into(),
        webhook_id: "w1".into(),
        event_id: format!("e{n}"),
        event_type: SandboxEventType::Paused,
        attempt: n,
        status_code: (n > 1).then_some(200),
        error: (n == 1).then(|| "refused".to_owned()),
        at: now,
    };
    for n in 1..=4 {
        hooks
            .add_webhook_delivery(&attempt(n), 3)
            .await
            .expect("log");
    }
    let log = hooks.webhook_deliveries("w1", 10).await.expect("log");
    assert_eq!(log, vec![attempt(4), attempt(3), attempt(2)]);
    assert!(
        !hooks
            .delete_webhook("team-b", "w1")
            .await
            .expect("not theirs")
    );
    assert!(hooks.delete_webhook("team-a", "w1").await.expect("delete"));
    assert_eq!(
        hooks.webhook_deliveries("w1", 10).await.expect("log"),
        vec![]
    );
    assert!(!hooks.update_webhook(&changed).await.expect("gone"));
}

async fn volumes_and_mounts(f: Fixture) {
    let store = f.store;
    let team = team(&store, "Volumes").await;
    let t0 = micros(Utc::now());
    for (id, name, at) in [
        ("vol-b", "second", t0 + TimeDelta::seconds(1)),
        ("vol-a", "first", t0),
    ] {
        let v = volume_named(id, &team.id, name, at);
        assert!(store.volumes.insert_volume(&v).await.expect("insert"));
    }
    assert_eq!(
        store
            .volumes
            .team_volumes(&team.id)
            .await
            .expect("list")
            .into_iter()
            .map(|v| v.id)
            .collect::<Vec<_>>(),
        vec!["vol-a", "vol-b"]
    );
    let found = store
        .volumes
        .volume_by_name(&team.id, "second")
        .await
        .expect("by name")
        .expect("found");
    assert_eq!(found.created_at, t0 + TimeDelta::seconds(1));
    let mounts = vec![
        VolumeMount {
            volume_id: "vol-b".into(),
            team_id: team.id.clone(),
            name: "second".into(),
            path: "/data".into(),
        },
        VolumeMount {
            volume_id: "vol-a".into(),
            team_id: team.id.clone(),
            name: "first".into(),
            path: "/a".into(),
        },
    ];
    // A mount of a volume that does not exist fails the whole insert: no sandbox is left
    // recorded without its mounts.
    let missing = VolumeMount {
        volume_id: "vol-missing".into(),
        team_id: team.id.clone(),
        name: "missing".into(),
        path: "/m".into(),
    };
    let half = [mounts[0].clone(), missing];
    assert!(matches!(
        store
            .sandboxes
            .insert_sandbox(&sandbox("isb", &team.id, t0), &half)
            .await,
        Err(StoreError::Backend(_))
    ));
    assert!(
        store
            .sandboxes
            .sandbox("isb")
            .await
            .expect("read")
            .is_none()
    );
    store
        .sandboxes
        .insert_sandbox(&sandbox("isb", &team.id, t0), &mounts)
        .await
        .expect("sandbox with its mounts");
    assert_eq!(
        store
            .sandboxes
            .sandbox_volumes("isb")
            .await
            .expect("mounts"),
        mounts
    );
    assert_eq!(
        store.volumes.volume_users("vol-a").await.expect("users"),
        vec!["isb".to_owned()]
    );
    // A mounted volume stays: the mount's reference to it holds the row.
    let refused = store.volumes.delete_volume("vol-a").await;
    assert!(
        matches!(&refused, Err(StoreError::Backend(message))
            if message.to_lowercase().contains("foreign key constraint")),
        "{refused:?}"
    );
    store
        .sandboxes
        .delete_sandbox("isb")
        .await
        .expect("delete sandbox");
    assert!(
        store
            .volumes
            .volume_users("vol-a")
            .await
            .expect("users")
            .is_empty()
    );
    store
        .volumes
        .delete_volume("vol-a")
        .await
        .expect("delete volume");
    assert!(store.volumes.volume("vol-a").await.expect("read").is_none());
}

async fn teams_members_and_limits(f: Fixture) {
    let store = f.store;
    let one = team(&store, "One").await;
    let two = team(&store, "Two").await;
    store
        .teams
        .insert_user("user-1", &one.id, true)
        .await
        .expect("user");
    let again = store.teams.insert_user("user-1", &two.id, false).await;
    assert!(
        matches!(&again, Err(StoreError::Conflict { what: "user", id }) if id == "user-1"),
        "{again:?}"
    );
    let teams: Vec<(String, bool)> = store
        .teams
        .user_teams("user-1")
        .await
        .expect("teams")
        .into_iter()
        .map(|(t, default)| (t.id, default))
        .collect();
    assert_eq!(teams, vec![(one.id.clone(), true)]);
    let limits = TeamLimits {
        max_concurrent_sandboxes: u32::MAX,
        max_sandbox_timeout_secs: u64::from(u32::MAX) + 1,
        requests_per_minute: 7,
        max_vcpu: 4,
        max_memory_mb: 4096,
        max_disk_mb: 8192,
        disk_rates: sandbar_core::DiskRates {
            read_mbps: 1,
            write_mbps: 2,
            read_iops: 3,
            write_iops: u32::MAX,
        },
        caps: sandbar_core::TeamCaps::DEFAULT,
    };
    assert!(
        store
            .teams
            .set_team_limits(&two.id, &limits)
            .await
            .expect("limits")
    );
    assert!(
        !store
            .teams
            .set_team_limits("nobody", &limits)
            .await
            .expect("limits")
    );
    let read = store
        .teams
        .team(&two.id)
        .await
        .expect("read")
        .expect("found");
    assert_eq!(
        (
            read.limits.max_concurrent_sandboxes,
            read.limits.max_sandbox_timeout_secs,
            read.limits.max_disk_mb
        ),
        (u32::MAX, u64::from(u32::MAX) + 1, 8192)
    );
    assert_eq!(read.limits.disk_rates, limits.disk_rates);
    assert_eq!(
        store
            .teams
            .teams()
            .await
            .expect("teams")
            .into_iter()
            .map(|t| t.id)
            .collect::<Vec<_>>(),
        vec![one.id, two.id]
    );
    assert_eq!(store.teams.team_count().await.expect("count"), 2);
}

async fn team_caps_round_trip_and_old_teams_get_the_defaults(f: Fixture) {
    let store = f.store.clone();
    let made = Auth::new(store.clone())
        .create_team("Capped", LIMITS)
        .await
        .expect("team");
    assert_eq!(made.team.limits.caps, TeamCaps::DEFAULT);
    let caps = TeamCaps {
        max_snapshots: 1,
        max_snapshot_mb: 2,
        max_templates: 3,
        max_volumes: 4,
        max_volume_mb: 1 << 30,
        max_tags_per_template: 6,
        max_api_keys: 0,
    };
    let limits = TeamLimits { caps, ..LIMITS };
    assert!(
        store
            .teams
            .set_team_limits(&made.team.id, &limits)
            .await
            .expect("limits")
    );
    // Every way a team is read carries them: by id, in the list, with a key, by slug.
    let by_id = store
        .teams
        .team(&made.team.id)
        .await
        .expect("read")
        .expect("found");
    assert_eq!(by_id.limits.caps, caps);
    let listed = store.teams.teams().await.expect("teams");
    assert_eq!(
        listed
            .iter()
            .find(|t| t.id == made.team.id)
            .map(|t| t.limits.caps),
        Some(caps)
    );
    let (_, with_key) = store
        .teams
        .api_key_by_hash(&sandbar_core::auth::hash_secret(&made.api_key))
        .await
        .expect("key")
        .expect("found");
    assert_eq!(with_key.limits.caps, caps);
    let by_slug = store
        .teams
        .team_by_slug(&made.team.slug)
        .await
        .expect("slug")
        .expect("found");
    assert_eq!(by_slug.limits.caps, caps);

    f.insert_team_without_caps("old-team").await;
    let old = store
        .teams
        .team("old-team")
        .await
        .expect("read")
        .expect("found");
    assert_eq!(old.limits.caps, TeamCaps::DEFAULT);
}

async fn two_hosts_on_one_database_settle_their_races(f: Fixture) {
    let hosts = f.two_hosts().await;
    let owner = team(&hosts[0], "Racers").await;
    let t0 = micros(Utc::now());

    // The same volume name from both hosts at once: one of them has it.
    let created = futures_join(hosts.iter().enumerate().map(|(i, store)| {
        let store = store.clone();
        let volume = volume_named(&format!("vol-{i}"), &owner.id, "shared", t0);
        tokio::spawn(async move { store.volumes.insert_volume(&volume).await.expect("insert") })
    }))
    .await;
    assert_eq!(created.iter().filter(|c| **c).count(), 1, "{created:?}");

    // The same new team slug picked by both: the later insert is a conflict.
    let slug = hosts[1].teams.free_team_slug("Racers").await.expect("slug");
    assert_eq!(slug, "racers-2");
    let twin = |id: &str| Team {
        id: id.into(),
        slug: slug.clone(),
        ..owner.clone()
    };
    let results = futures_join(hosts.iter().enumerate().map(|(i, store)| {
        let store = store.clone();
        let team = twin(&format!("twin-{i}"));
        tokio::spawn(async move { store.teams.insert_team(&team).await })
    }))
    .await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(StoreError::Conflict { what: "team", .. })))
    );

    // Both hosts append to one sandbox's log: every line numbered once.
    hosts[0]
        .sandbox_logs
        .open_sandbox_log("isb", &owner.id, t0, &[])
        .await
        .expect("open");
    futures_join(hosts.iter().map(|store| {
        let store = store.clone();
        tokio::spawn(async move {
            for i in 0..10 {
                let line = log_line(t0, LogLevel::Info, &format!("line {i}"));
                store
                    .sandbox_logs
                    .append_sandbox_logs("isb", &[line], None, 1000)
                    .await
                    .expect("append");
            }
        })
    }))
    .await;
    let lines = hosts[1]
        .sandbox_logs
        .sandbox_logs("isb", &SandboxLogQuery::default())
        .await
        .expect("read");
    assert_eq!(lines.len(), 20);
}

/// Awaits every task, in order.
async fn nodes_renew_their_leases_and_sandboxes_name_their_node(f: Fixture) {
    let store = &f.store;
    let now = micros(Utc::now());
    let first = NodeRecord {
        id: "n2".into(),
        url: "http://10.0.0.12:3000".into(),
        started_at: now,
        lease_until: now + TimeDelta::seconds(10),
        report: NodeReport {
            memory_available_bytes: 1 << 30,
            templates: vec!["base-id".into()],
            ..NodeReport::default()
        },
    };
    store.nodes.renew_node(&first).await.expect("record");
    let other = NodeRecord {
        id: "n1".into(),
        ..first.clone()
    };
    store
        .nodes
        .renew_node(&other)
        .await
        .expect("record another");
    let renewed = NodeRecord {
        lease_until: now + TimeDelta::seconds(20),
        report: NodeReport {
            sandboxes: 3,
            ..first.report.clone()
        },
        ..first.clone()
    };
    store.nodes.renew_node(&renewed).await.expect("renew");
    let nodes = store.nodes.nodes().await.expect("nodes");
    assert_eq!(nodes, vec![other, renewed], "one row per node, by id");

    let t = team(store, "nodes").await;
    let s = sandbox_on("sbx-on-n2", &t.id, "n2", now);
    store
        .sandboxes
        .insert_sandbox(&s, &[])
        .await
        .expect("insert");
    assert_eq!(
        store.nodes.sandbox_node("sbx-on-n2").await.expect("node"),
        Some("n2".into())
    );
    assert_eq!(
        store.nodes.sandbox_node("missing").await.expect("node"),
        None
    );
    // A take-over moves it only from the node it is on.
    for (id, from, to, moved) in [
        ("sbx-on-n2", "n1", "n3", false),
        ("sbx-on-n2", "n2", "n1", true),
        ("sbx-on-n2", "n2", "n3", false),
        ("missing", "n2", "n1", false),
    ] {
        let done = store.nodes.move_sandbox(id, from, to).await.expect("move");
        assert_eq!(done, moved, "{id} from {from} to {to}");
    }
    assert_eq!(
        store.nodes.sandbox_node("sbx-on-n2").await.expect("node"),
        Some("n1".into())
    );
    assert_eq!(stored_sandbox(store, "sbx-on-n2").await.node_id, "n1");
}

async fn team_slots_are_claimed_across_nodes(f: Fixture) {
    let store = &f.store;
    let now = micros(Utc::now());
    let t = team(store, "slots").await;
    let live: Vec<String> = vec!["n1".into(), "n2".into()];
    let statuses = ["starting", "running", "pausing"];
    let claim = |id: &str, node: &str| SlotClaim {
        sandbox_id: id.into(),
        team_id: t.id.clone(),
        node_id: node.into(),
        until: now + TimeDelta::seconds(60),
    };
    // n2 runs one sandbox of the team and has one paused; a lost node's rows do not count.
    for (id, node, status) in [
        ("sb-run", "n2", SandboxStatus::Running),
        ("sb-paused", "n2", SandboxStatus::Paused),
        ("sb-lost", "n9", SandboxStatus::Running),
    ] {
        let s = Sandbox {
            status,
            ..sandbox_on(id, &t.id, node, now)
        };
        store
            .sandboxes
            .insert_sandbox(&s, &[])
            .await
            .expect("insert");
    }
    let take = |c: SlotClaim, limit: usize, live: Vec<String>| {
        let store = store.clone();
        async move {
            store
                .nodes
                .claim_team_slot(&c, limit, &live, &statuses)
                .await
                .expect("claim")
        }
    };
    // Limit 3: sb-run holds one; n1 claims a second, n2 a third; the fourth finds none.
    assert!(take(claim("a", "n1"), 3, live.clone()).await);
    assert!(take(claim("b", "n2"), 3, live.clone()).await);
    assert!(!take(claim("c", "n1"), 3, live.clone()).await);
    // Recorded running, a's claim stops counting twice: still full.
    let a = sandbox_on("a", &t.id, "n1", now);
    store
        .sandboxes
        .insert_sandbox(&a, &[])
        .await
        .expect("insert a");
    assert!(!take(claim("c", "n1"), 3, live.clone()).await);
    store.nodes.release_team_slot("a").await.expect("release");
    assert!(!take(claim("c", "n1"), 3, live.clone()).await);
    // Let go of b (its start failed): room again.
    store.nodes.release_team_slot("b").await.expect("release");
    assert!(take(claim("c", "n1"), 3, live.clone()).await);
    // An expired claim counts for nothing; nor do a lost node's claims and rows.
    store.nodes.release_team_slot("c").await.expect("release");
    let stale = SlotClaim {
        until: now - TimeDelta::seconds(1),
        ..claim("stale", "n2")
    };
    assert!(take(stale, 3, live.clone()).await);
    assert!(take(claim("d", "n1"), 3, live.clone()).await);
    store.nodes.release_team_slot("d").await.expect("release");
    assert!(
        take(claim("e", "n1"), 2, vec!["n1".into()]).await,
        "n2's sandboxes are not counted once n2 is lost"
    );
    store.nodes.release_team_slot("e").await.expect("release");
    // A resume's claim, for a sandbox recorded paused, counts until it is recorded running;
    // claiming again for the same sandbox renews its claim.
    assert!(take(claim("sb-paused", "n2"), 3, live.clone()).await);
    assert!(take(claim("sb-paused", "n2"), 3, live.clone()).await);
    assert!(!take(claim("f", "n1"), 3, live.clone()).await);
    store
        .nodes
        .release_team_slot("never-claimed")
        .await
        .expect("release nothing");
}

async fn racing_claims_never_pass_the_limit(f: Fixture) {
    let t = team(&f.store, "racing-slots").await;
    let live: Vec<String> = vec!["n1".into(), "n2".into()];
    let until = micros(Utc::now()) + TimeDelta::seconds(60);
    let claims: Vec<_> = (0..24)
        .map(|i| {
            let store = f.store.clone();
            let live = live.clone();
            let claim = SlotClaim {
                sandbox_id: format!("race-{i}"),
                team_id: t.id.clone(),
                node_id: format!("n{}", i % 2 + 1),
                until,
            };
            tokio::spawn(async move {
                store
                    .nodes
                    .claim_team_slot(&claim, 3, &live, &["running"])
                    .await
                    .expect("claim")
            })
        })
        .collect();
    let mut taken = 0;
    for handle in claims {
        taken += usize::from(handle.await.expect("task"));
    }
    assert_eq!(taken, 3, "slots taken of 3");
}

async fn published_layers_keep_their_first_record(f: Fixture) {
    let store = &f.store;
    let now = micros(Utc::now());
    let first = LayerBlob {
        layer: "layer/00ff".into(),
        digest: format!("sha256:{}", "a".repeat(64)),
        size_bytes: 5 << 30,
        node_id: "n1".into(),
        published_at: now,
    };
    store
        .layer_blobs
        .record_layer_blob(&first)
        .await
        .expect("record");
    let again = LayerBlob {
        digest: format!("sha256:{}", "b".repeat(64)),
        node_id: "n2".into(),
        ..first.clone()
    };
    store
        .layer_blobs
        .record_layer_blob(&again)
        .await
        .expect("record again");
    let base = LayerBlob {
        layer: "base/v2".into(),
        ..again.clone()
    };
    store
        .layer_blobs
        .record_layer_blob(&base)
        .await
        .expect("record base");

    let mut found = store
        .layer_blobs
        .layer_blobs(&["base/v2".into(), "layer/00ff".into(), "image/absent".into()])
        .await
        .expect("read");
    found.sort_by(|a, b| a.layer.cmp(&b.layer));
    assert_eq!(
        found,
        vec![base, first],
        "the first record stays; absent layers are left out"
    );
    assert!(
        store
            .layer_blobs
            .layer_blobs(&[])
            .await
            .expect("read none")
            .is_empty()
    );

    // A paused sandbox's files: each pause's copy replaces the last; a resume forgets it.
    let files = LayerBlob {
        layer: "files/isbx".into(),
        ..again.clone()
    };
    store
        .layer_blobs
        .replace_layer_blob(&files)
        .await
        .expect("first copy");
    let newer = LayerBlob {
        digest: format!("sha256:{}", "c".repeat(64)),
        size_bytes: 7,
        ..files.clone()
    };
    store
        .layer_blobs
        .replace_layer_blob(&newer)
        .await
        .expect("newer copy");
    let read = store
        .layer_blobs
        .layer_blobs(&["files/isbx".into()])
        .await
        .expect("read");
    assert_eq!(read, vec![newer.clone()]);
    // The collector reads every record at once.
    let mut all = store.layer_blobs.all_layer_blobs().await.expect("read all");
    all.sort_by(|a, b| a.layer.cmp(&b.layer));
    let mut names: Vec<&str> = all.iter().map(|b| b.layer.as_str()).collect();
    names.dedup();
    assert_eq!(names.len(), all.len(), "one record per name");
    assert!(all.contains(&newer), "{all:?}");
    store
        .layer_blobs
        .delete_layer_blob("files/isbx")
        .await
        .expect("forget");
    store
        .layer_blobs
        .delete_layer_blob("files/isbx")
        .await
        .expect("forget again");
    assert!(
        store
            .layer_blobs
            .layer_blobs(&["files/isbx".into()])
            .await
            .expect("read")
            .is_empty()
    );
}

async fn request_counts_add_up_over_hosts(f: Fixture) {
    let hosts = f.two_hosts().await;
    // Both hosts add at once: every request is counted once, whoever added last sees all.
    let added = futures_join((0..20).map(|i| {
        let store = hosts[i % 2].clone();
        tokio::spawn(async move { requests_total(&store, 100, "t1", 3).await })
    }))
    .await;
    assert_eq!(added.iter().max(), Some(&60));
    let mut seen = added.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 20, "each add saw its own total: {added:?}");
    assert_eq!(requests_total(&hosts[0], 100, "t1", 0).await, 60);
    assert_eq!(
        requests_total(&hosts[1], 100, "t2", 1).await,
        1,
        "other team"
    );
    assert_eq!(
        requests_total(&hosts[0], 101, "t1", 1).await,
        1,
        "next minute"
    );
    // Several teams in one statement, each with its own total.
    let mut batch = hosts[1]
        .request_counts
        .add_team_requests(102, &[("t1".into(), 2), ("t2".into(), 5)])
        .await
        .expect("batch");
    batch.sort();
    assert_eq!(batch, [("t1".to_owned(), 2), ("t2".to_owned(), 5)]);
    assert_eq!(
        hosts[1]
            .request_counts
            .prune_team_requests(101)
            .await
            .expect("prune"),
        2
    );
    assert_eq!(requests_total(&hosts[0], 100, "t1", 0).await, 0, "pruned");
}

/// Adds `n` requests of `team` in minute `window`; the team's total for it.
async fn requests_total(store: &Arc<Store>, window: i64, team: &str, n: u64) -> u64 {
    let totals = store
        .request_counts
        .add_team_requests(window, &[(team.into(), n)])
        .await
        .expect("add");
    assert_eq!(totals.len(), 1, "{totals:?}");
    totals[0].1
}

async fn two_hosts_starting_on_an_empty_database_make_one_first_team(f: Fixture) {
    let hosts = f.two_hosts().await;
    let key = "e2b_00112233445566778899aabbccddeeff00112233";
    // Both read an empty database before either writes: each tries to make the team.
    let started = futures_join(hosts.iter().map(|store| {
        let auth = Auth::new(store.clone());
        tokio::spawn(async move { auth.bootstrap(Some(key), LIMITS).await })
    }))
    .await;
    let made: Vec<_> = started
        .into_iter()
        .map(|r| r.expect("no host fails its first start"))
        .collect();
    assert_eq!(made.iter().filter(|m| m.is_some()).count(), 1, "{made:?}");
    assert!(
        Auth::new(hosts[1].clone())
            .team_for_api_key(Some(key))
            .await
            .is_ok(),
        "the first team's key works"
    );
}

async fn futures_join<T>(tasks: impl IntoIterator<Item = tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("task"));
    }
    out
}

/// The lookup generation another host reads, once it is steady: a PostgreSQL host answers a
/// new one on every read until its listener is up.
async fn steady_generation(store: &Arc<Store>) -> u64 {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let first = store.lookups.lookup_generation().await.expect("generation");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        if store.lookups.lookup_generation().await.expect("generation") == first {
            return first;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the generation never settled"
        );
    }
}

/// Whether `store`'s generation moves from `before` within a few seconds (a notification
/// reaches a PostgreSQL host a moment after the commit).
async fn moved(store: &Arc<Store>, before: u64) -> bool {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        if store.lookups.lookup_generation().await.expect("generation") != before {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    false
}

async fn the_lookup_generation_moves_with_what_cached_lookups_read_from_any_host(f: Fixture) {
    let [writer, reader] = f.two_hosts().await;
    let team = team(&writer, "cached").await;
    let auth = Auth::new(writer.clone());
    let key = auth.create_api_key(&team, "k", None).await.expect("key");
    writer
        .templates
        .upsert_template(&template("cached-tpl", Some(&team.id), "mine"))
        .await
        .expect("template");
    writer
        .builds
        .insert_build(&build(
            "cached-b",
            "cached-tpl",
            BuildStatus::Building,
            Utc::now(),
        ))
        .await
        .expect("build");

    // What no cached answer depends on, and changes with every create or request.
    let quiet = steady_generation(&reader).await;
    writer
        .teams
        .touch_api_key(&key.info.id, Utc::now())
        .await
        .expect("touch");
    writer
        .templates
        .record_template_spawns("cached-tpl", 3, Utc::now())
        .await
        .expect("spawns");
    writer
        .sandboxes
        .insert_sandbox(&sandbox("cached-sbx", &team.id, Utc::now()), &[])
        .await
        .expect("sandbox");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        reader
            .lookups
            .lookup_generation()
            .await
            .expect("generation"),
        quiet,
        "key uses, spawn counts and sandboxes leave cached lookups alone"
    );

    let mut limits = team.limits;
    limits.max_concurrent_sandboxes += 1;
    let mut renamed = template("cached-tpl", Some(&team.id), "renamed");
    renamed.public = true;
    let mut finished = build("cached-b", "cached-tpl", BuildStatus::Ready, Utc::now());
    finished.finished_at = Some(Utc::now());
    moves(&reader, "a new team", async {
        Auth::new(writer.clone())
            .create_team("another", LIMITS)
            .await
            .map(|_| ())
    })
    .await;
    moves(&reader, "a team's limits", async {
        writer.teams.set_team_limits(&team.id, &limits).await
    })
    .await;
    moves(&reader, "a new key", async {
        auth.create_api_key(&team, "k2", None).await.map(|_| ())
    })
    .await;
    moves(&reader, "a deleted key", async {
        writer
            .teams
            .delete_api_key(Some(&team.id), &key.info.id)
            .await
    })
    .await;
    moves(&reader, "a template's names and visibility", async {
        writer.templates.upsert_template(&renamed).await
    })
    .await;
    moves(&reader, "a build's status", async {
        writer.builds.update_build(&finished).await
    })
    .await;
    moves(&reader, "a build's tags", async {
        writer
            .builds
            .set_build_tags("cached-tpl", "cached-b", &["v1".to_owned()])
            .await
    })
    .await;
    moves(&reader, "a deleted template", async {
        writer.templates.delete_template("cached-tpl").await
    })
    .await;
}

/// Makes `change` once `reader`'s generation is steady, and checks that it moved.
async fn moves<T, E: std::fmt::Debug>(
    reader: &Arc<Store>,
    what: &str,
    change: impl std::future::Future<Output = Result<T, E>>,
) {
    let before = steady_generation(reader).await;
    change.await.expect(what);
    assert!(
        moved(reader, before).await,
        "{what} did not move the lookup generation"
    );
}
