//! The server's part in a cluster: `--role`, and the API host, which runs no sandboxes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use sandbar_api::cluster::ClusterRouting;
use sandbar_api::{AppState, ClusterRole, EdgeConfig};
use sandbar_core::cluster::NoLocalNode;
use sandbar_core::{
    Auth, Builds, BuildsConfig, NodeDirectory, Sandboxes, SandboxesConfig, Store, Templates,
};

/// What a server does in a cluster.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    /// API, edge and sandboxes on one host (the default).
    #[default]
    All,
    /// Serves E2B's API and edge and forwards sandbox work to nodes; runs no sandboxes.
    Api,
    /// Runs sandboxes for the cluster's API hosts; answers only requests with the secret.
    Node,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// What this server does: `all` on a single host; in a cluster (which needs
    /// --database-url), `api` hosts serve clients and `node`s run sandboxes.
    #[arg(long, env = "SANDBAR_ROLE", value_enum, default_value_t = Role::All)]
    pub role: Role,
    /// A node's name in the cluster, unique and kept across restarts (letters, digits,
    /// `-`, `_`, `.`): after a restart the node takes back the sandboxes recorded under it.
    #[arg(long, env = "SANDBAR_NODE_ID")]
    pub node_id: Option<String>,
    /// Where API hosts reach this node, e.g. `http://10.0.0.11:3000`; default
    /// `http://<--listen>`.
    #[arg(long, env = "SANDBAR_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// A file holding the secret API hosts and nodes share (at least 32 characters; one
    /// line). Nodes answer only requests that carry it.
    #[arg(long, env = "SANDBAR_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// A repository of an OCI registry where nodes publish the template layers they build
    /// and fetch the ones they lack, e.g. `http://registry.internal:5000/sandbar/layers`:
    /// with it, any node can start any template.
    #[arg(long, env = "SANDBAR_LAYER_STORE")]
    pub layer_store: Option<String>,
    /// A file holding `username:password` for the layer store's registry (mode 0600).
    #[arg(long, env = "SANDBAR_LAYER_STORE_CREDENTIALS_FILE")]
    pub layer_store_credentials_file: Option<PathBuf>,
    /// Seconds between two passes that let go of what the layer store no longer needs
    /// (records and blob tags of deleted templates and snapshots, copies of sandboxes that
    /// are gone); something goes once two passes found it unneeded. 0 turns it off. The
    /// registry must allow deletes, and its own garbage collection removes the bytes.
    #[arg(long, env = "SANDBAR_LAYER_STORE_COLLECT_SECS", default_value_t = 600)]
    pub layer_store_collect_secs: u64,
}

impl ClusterArgs {
    /// The shared secret, read from its file; an error unless it is long enough.
    pub fn secret(&self) -> anyhow::Result<Arc<str>> {
        let path = self
            .cluster_secret_file
            .as_deref()
            .context("--cluster-secret-file is required with --role api or node")?;
        read_secret(path)
    }

    pub fn node_id(&self) -> anyhow::Result<String> {
        let id = self
            .node_id
            .clone()
            .context("--node-id is required with --role node")?;
        if !sandbar_core::cluster::valid_node_id(&id) {
            bail!("node id '{id}' must be 1 to 63 letters, digits, '-', '_' or '.'");
        }
        Ok(id)
    }
}

impl ClusterArgs {
    /// The layer store, if one is configured. The operator named its registry, so it may be
    /// anywhere, the host's own addresses included.
    pub fn layer_store(&self) -> anyhow::Result<Option<sandbar_image::BlobStore>> {
        let Some(location) = &self.layer_store else {
            if self.layer_store_credentials_file.is_some() {
                bail!("--layer-store-credentials-file needs --layer-store");
            }
            return Ok(None);
        };
        let url =
            url::Url::parse(location).with_context(|| format!("bad --layer-store '{location}'"))?;
        let host = url
            .host_str()
            .with_context(|| format!("--layer-store '{location}' names no host"))?;
        let port = url
            .port_or_known_default()
            .with_context(|| format!("--layer-store '{location}' names no port"))?;
        let allowed: sandbar_image::AllowedRegistry = format!(
            "{}:{port}",
            if host.contains(':') {
                format!("[{host}]")
            } else {
                host.to_owned()
            }
        )
        .parse()
        .with_context(|| format!("bad --layer-store '{location}'"))?;
        let policy = Arc::new(sandbar_image::RegistryPolicy::new(
            vec![allowed],
            vec![],
            vec![],
        )?);
        let credentials = match &self.layer_store_credentials_file {
            Some(path) => Some(read_credentials(path)?),
            None => None,
        };
        Ok(Some(sandbar_image::BlobStore::new(
            location,
            credentials.as_ref(),
            policy,
        )?))
    }
}

/// The text of the file at `path`, which holds `what` and so must be readable by its owner
/// alone.
fn read_private(path: &Path, what: &str) -> anyhow::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let cannot_read = || format!("cannot read {}", path.display());
    // Opened once: the mode checked is that of the file read.
    let mut file = std::fs::File::open(path).with_context(cannot_read)?;
    if file
        .metadata()
        .with_context(cannot_read)?
        .permissions()
        .mode()
        & 0o077
        != 0
    {
        bail!(
            "{} is readable by other users: {what} must be private (chmod 600)",
            path.display()
        );
    }
    let mut text = String::new();
    file.read_to_string(&mut text).with_context(cannot_read)?;
    Ok(text)
}

/// `username:password` from a private file.
fn read_credentials(path: &Path) -> anyhow::Result<sandbar_image::RegistryAuth> {
    let text = read_private(path, "credentials")?;
    let (username, password) = text
        .trim_end_matches(['\r', '\n'])
        .split_once(':')
        .with_context(|| format!("{} must hold username:password", path.display()))?;
    Ok(sandbar_image::RegistryAuth {
        username: username.to_owned(),
        password: password.to_owned(),
    })
}

fn read_secret(path: &Path) -> anyhow::Result<Arc<str>> {
    let text = read_private(path, "the cluster secret")?;
    let secret = text.trim();
    if secret.len() < 32 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
        bail!(
            "the cluster secret in {} must be at least 32 printable characters without spaces",
            path.display()
        );
    }
    Ok(Arc::from(secret))
}

/// What an API host needs beyond the store: where it listens and serves from.
pub struct ApiHost {
    pub store: Arc<Store>,
    pub auth: Auth,
    pub secret: Arc<str>,
    pub domain: String,
    pub max_upload_bytes: u64,
    pub base_disk_mb: u32,
    pub metrics: sandbar_api::MetricsAccess,
}

/// The router of an API host: the REST API answered from the shared store, and everything
/// that touches a sandbox, a build or a volume forwarded to a node.
pub async fn api_router(host: ApiHost) -> anyhow::Result<sandbar_api::Routers> {
    let store = host.store;
    let nodes = Arc::new(NodeDirectory::new(store.clone()));
    nodes
        .refresh()
        .await
        .context("cannot read the cluster's nodes")?;
    tokio::spawn(
        nodes
            .clone()
            .run_refresher(std::time::Duration::from_secs(1)),
    );
    let templates = Templates::new(store.clone());
    let elsewhere = Arc::new(NoLocalNode);
    let builds = Builds::new(
        store.clone(),
        elsewhere.clone(),
        BuildsConfig {
            default_cpu_count: 2,
            default_memory_mb: 512,
            disk_size_mb: host.base_disk_mb,
            max_cpu_count: 8,
            max_memory_mb: 8192,
            max_upload_bytes: host.max_upload_bytes,
            upload_link_ttl: std::time::Duration::from_secs(3600),
            concurrent_builds: 1,
            builds_per_team: 1,
            step_timeout: std::time::Duration::from_secs(3600),
            envd_version: sandbar_jail::ENVD_VERSION,
        },
        templates.build_finished(),
    );
    let sandboxes = Sandboxes::new(
        store.clone(),
        elsewhere,
        templates.clone(),
        SandboxesConfig::default(),
    )
    .with_cluster(nodes.clone());
    // Registered here; the nodes, which record the events, deliver them.
    sandboxes.deliver_events_to(sandbar_core::webhooks::Webhooks::new(
        store.clone(),
        Arc::new(sandbar_api::HttpWebhookTransport::new(false)),
        sandbar_core::webhooks::WebhookConfig::default(),
    ));
    let sandboxes = Arc::new(sandboxes);
    let store_for_limits = store.request_counts.clone();
    let routing = Arc::new(ClusterRouting::new(nodes, store, host.secret));
    Ok(sandbar_api::routers(
        AppState {
            auth: host.auth,
            sandboxes,
            templates,
            builds,
            rate_limits: sandbar_core::RateLimits::shared_through(store_for_limits),
            edge: Arc::new(EdgeConfig {
                domain: host.domain,
            }),
            cluster: Some(ClusterRole::Api(routing)),
        },
        &host.metrics,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn secret_file(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp");
        file.write_all(text.as_bytes()).expect("write");
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(mode)).expect("mode");
        file
    }

    #[test]
    fn the_secret_is_long_private_and_trimmed() {
        let good = "a".repeat(40);
        let file = secret_file(&format!("{good}\n"), 0o600);
        assert_eq!(&*read_secret(file.path()).expect("good"), good.as_str());
        let open = secret_file(&good, 0o644);
        assert!(
            read_secret(open.path())
                .expect_err("refused")
                .to_string()
                .contains("chmod 600")
        );
        let short = secret_file("short", 0o600);
        assert!(
            read_secret(short.path())
                .expect_err("refused")
                .to_string()
                .contains("32")
        );
        let spaced = secret_file(&format!("{good} {good}"), 0o600);
        let err = read_secret(spaced.path()).expect_err("a space inside the secret");
        assert!(
            err.to_string()
                .contains("printable characters without spaces"),
            "{err}"
        );
    }
}
