//! `sandbar team …` and `sandbar key …`: the operator's commands on the store a server uses.
//!
//! They open the same database as the server (SQLite's WAL lets them write next to a running
//! server; `--database-url` names a shared PostgreSQL one) and go through the same core
//! operations as the API. A running server sees their changes with the
//! next request, because it reads the team and the key from the store on every request.

use std::path::PathBuf;

use anyhow::bail;
use sandbar_core::Auth;
use sandbar_core::auth::TeamLimits;

use crate::database::{self, DatabaseArgs};

#[derive(clap::Args, Debug)]
pub struct DataDir {
    /// The server's data directory (its database is `sandbar.db` in it).
    #[arg(long, env = "SANDBAR_DATA_DIR", default_value = "/var/lib/sandbar")]
    data_dir: PathBuf,
    #[command(flatten)]
    database: DatabaseArgs,
}

#[derive(clap::Args, Debug, Default)]
pub struct Limits {
    /// Sandboxes the team may run at once.
    #[arg(long)]
    max_sandboxes: Option<u32>,
    /// Longest sandbox lifetime, in seconds.
    #[arg(long)]
    max_timeout_secs: Option<u64>,
    /// API requests per minute; 0 for no limit.
    #[arg(long)]
    requests_per_minute: Option<u32>,
    /// vCPUs one sandbox (or template build) may have; 0 for no team limit.
    #[arg(long)]
    max_vcpu: Option<u32>,
    /// Memory, in MiB, one sandbox (or template build) may have; 0 for no team limit.
    #[arg(long)]
    max_memory_mb: Option<u32>,
    /// Disk, in MiB, one sandbox (or template build) may have; 0 for no team limit.
    #[arg(long)]
    max_disk_mb: Option<u32>,
    /// MiB/s each of the team's sandboxes may read from disk; 0 for the server's
    /// `--sandbox-disk-read-mbps`.
    #[arg(long)]
    disk_read_mbps: Option<u32>,
    /// MiB/s each of the team's sandboxes may write to disk; 0 for the server's
    /// `--sandbox-disk-write-mbps`.
    #[arg(long)]
    disk_write_mbps: Option<u32>,
    /// Disk reads per second each of the team's sandboxes may issue; 0 for the server's
    /// `--sandbox-disk-read-iops`.
    #[arg(long)]
    disk_read_iops: Option<u32>,
    /// Disk writes per second each of the team's sandboxes may issue; 0 for the server's
    /// `--sandbox-disk-write-iops`.
    #[arg(long)]
    disk_write_iops: Option<u32>,
    /// Snapshots the team may keep (default 100); 0 for no cap.
    #[arg(long)]
    max_snapshots: Option<u32>,
    /// MiB of memory images the team's snapshots may hold on the data disk (default 20480);
    /// 0 for no cap.
    #[arg(long)]
    max_snapshot_mb: Option<u32>,
    /// Templates the team may keep, snapshots not counted (default 100); 0 for no cap.
    #[arg(long)]
    max_templates: Option<u32>,
    /// Volumes the team may keep (default 100); 0 for no cap.
    #[arg(long)]
    max_volumes: Option<u32>,
    /// MiB the files of all the team's volumes may hold (default 51200); 0 for no cap.
    #[arg(long)]
    max_volume_mb: Option<u32>,
    /// Tags one template of the team may carry (default 100); 0 for no cap.
    #[arg(long)]
    max_tags_per_template: Option<u32>,
    /// API keys the team may have (default 100); 0 for no cap.
    #[arg(long)]
    max_api_keys: Option<u32>,
}

impl Limits {
    fn changes(&self) -> sandbar_core::LimitChanges {
        sandbar_core::LimitChanges {
            max_concurrent_sandboxes: self.max_sandboxes,
            max_sandbox_timeout_secs: self.max_timeout_secs,
            requests_per_minute: self.requests_per_minute,
            max_vcpu: self.max_vcpu,
            max_memory_mb: self.max_memory_mb,
            max_disk_mb: self.max_disk_mb,
            disk_read_mbps: self.disk_read_mbps,
            disk_write_mbps: self.disk_write_mbps,
            disk_read_iops: self.disk_read_iops,
            disk_write_iops: self.disk_write_iops,
            max_snapshots: self.max_snapshots,
            max_snapshot_mb: self.max_snapshot_mb,
            max_templates: self.max_templates,
            max_volumes: self.max_volumes,
            max_volume_mb: self.max_volume_mb,
            max_tags_per_template: self.max_tags_per_template,
            max_api_keys: self.max_api_keys,
        }
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum TeamCommand {
    /// Create a team; prints its id, an API key and an access token (shown only now).
    Create {
        name: String,
        #[command(flatten)]
        limits: Limits,
        #[command(flatten)]
        data: DataDir,
    },
    /// List teams with their limits.
    List {
        #[command(flatten)]
        data: DataDir,
    },
    /// One team's limits, as JSON (team by id or unique name).
    Show {
        team: String,
        #[command(flatten)]
        data: DataDir,
    },
    /// Change some of a team's limits (team by id or unique name).
    SetLimits {
        team: String,
        #[command(flatten)]
        limits: Limits,
        #[command(flatten)]
        data: DataDir,
    },
}

#[derive(clap::Subcommand, Debug)]
pub enum KeyCommand {
    /// Create an API key for a team (by id or unique name); prints it once.
    Create {
        team: String,
        #[arg(long, default_value = "cli")]
        name: String,
        #[command(flatten)]
        data: DataDir,
    },
    /// List a team's API keys, masked.
    List {
        team: String,
        #[command(flatten)]
        data: DataDir,
    },
    /// Delete an API key by id; it stops working with the server's next request.
    Revoke {
        key_id: String,
        #[command(flatten)]
        data: DataDir,
    },
}

/// Limits of a team made by `team create`: those `sandbar serve` gives its first team.
const NEW_TEAM_LIMITS: TeamLimits = TeamLimits::new(100, 86_400, 6000);

async fn open(data: &DataDir) -> anyhow::Result<Auth> {
    if let Some(url) = data.database.postgres_url()? {
        return Ok(Auth::new(database::connect_postgres(url).await?));
    }
    let db = data.data_dir.join("sandbar.db");
    // Creating the database here would leave it with this process's umask; the server makes
    // it owner-only, so it has to exist first.
    if !db.exists() {
        bail!(
            "no database at {}: start `sandbar serve --data-dir {}` once first",
            db.display(),
            data.data_dir.display()
        );
    }
    Ok(Auth::new(database::open_sqlite(&db).await?))
}

fn print_limits(t: &sandbar_core::Team) -> String {
    let c = &t.limits.caps;
    format!(
        "max-sandboxes={} max-timeout-secs={} requests-per-minute={} max-vcpu={} max-memory-mb={} max-disk-mb={} disk-read-mbps={} disk-write-mbps={} disk-read-iops={} disk-write-iops={} max-snapshots={} max-snapshot-mb={} max-templates={} max-volumes={} max-volume-mb={} max-tags-per-template={} max-api-keys={}",
        t.limits.max_concurrent_sandboxes,
        t.limits.max_sandbox_timeout_secs,
        t.limits.requests_per_minute,
        t.limits.max_vcpu,
        t.limits.max_memory_mb,
        t.limits.max_disk_mb,
        t.limits.disk_rates.read_mbps,
        t.limits.disk_rates.write_mbps,
        t.limits.disk_rates.read_iops,
        t.limits.disk_rates.write_iops,
        c.max_snapshots,
        c.max_snapshot_mb,
        c.max_templates,
        c.max_volumes,
        c.max_volume_mb,
        c.max_tags_per_template,
        c.max_api_keys
    )
}

pub async fn team(command: TeamCommand) -> anyhow::Result<()> {
    match command {
        TeamCommand::Create { name, limits, data } => {
            let auth = open(&data).await?;
            let limits = NEW_TEAM_LIMITS.with(limits.changes());
            let created = auth.create_team(&name, limits).await?;
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "teamID": created.team.id,
                    "name": created.team.name,
                    "slug": created.team.slug,
                    "apiKeyID": created.api_key_id,
                    "apiKey": created.api_key,
                    "accessToken": created.access_token,
                }))?
            );
        }
        TeamCommand::List { data } => {
            let auth = open(&data).await?;
            for t in auth.all_teams().await? {
                println!("{}  {}  {}  {}", t.id, t.slug, t.name, print_limits(&t));
            }
        }
        TeamCommand::Show { team, data } => {
            let auth = open(&data).await?;
            let t = auth.find_team(&team).await?;
            let c = &t.limits.caps;
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "teamID": t.id,
                    "name": t.name,
                    "slug": t.slug,
                    "maxSandboxes": t.limits.max_concurrent_sandboxes,
                    "maxTimeoutSecs": t.limits.max_sandbox_timeout_secs,
                    "requestsPerMinute": t.limits.requests_per_minute,
                    "maxVcpu": t.limits.max_vcpu,
                    "maxMemoryMB": t.limits.max_memory_mb,
                    "maxDiskMB": t.limits.max_disk_mb,
                    "diskReadMBps": t.limits.disk_rates.read_mbps,
                    "diskWriteMBps": t.limits.disk_rates.write_mbps,
                    "diskReadIops": t.limits.disk_rates.read_iops,
                    "diskWriteIops": t.limits.disk_rates.write_iops,
                    "maxSnapshots": c.max_snapshots,
                    "maxSnapshotMB": c.max_snapshot_mb,
                    "maxTemplates": c.max_templates,
                    "maxVolumes": c.max_volumes,
                    "maxVolumeMB": c.max_volume_mb,
                    "maxTagsPerTemplate": c.max_tags_per_template,
                    "maxApiKeys": c.max_api_keys,
                }))?
            );
        }
        TeamCommand::SetLimits { team, limits, data } => {
            let auth = open(&data).await?;
            let changes = limits.changes();
            if changes.is_empty() {
                bail!(
                    "nothing to change: give at least one of --max-sandboxes, --max-timeout-secs, --requests-per-minute, --max-vcpu, --max-memory-mb, --max-disk-mb, --max-snapshots, --max-snapshot-mb, --max-templates, --max-volumes, --max-volume-mb, --max-tags-per-template, --max-api-keys"
                );
            }
            let t = auth.set_team_limits(&team, changes).await?;
            println!("{}  {}  {}  {}", t.id, t.slug, t.name, print_limits(&t));
        }
    }
    Ok(())
}

pub async fn key(command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::Create { team, name, data } => {
            let auth = open(&data).await?;
            let created = auth.create_team_api_key(&team, &name).await?;
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "id": created.info.id,
                    "name": created.info.name,
                    "key": created.key,
                }))?
            );
        }
        KeyCommand::List { team, data } => {
            let auth = open(&data).await?;
            for k in auth.team_api_keys(&team).await? {
                println!(
                    "{}  {}  {}  created {}  last used {}",
                    k.id,
                    k.mask.display(),
                    k.name,
                    k.created_at.to_rfc3339(),
                    k.last_used
                        .map(|t| t.to_rfc3339())
                        .unwrap_or_else(|| "never".into())
                );
            }
        }
        KeyCommand::Revoke { key_id, data } => {
            let auth = open(&data).await?;
            auth.revoke_api_key(&key_id).await?;
            println!("revoked {key_id}");
        }
    }
    Ok(())
}
