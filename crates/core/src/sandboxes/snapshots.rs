//! Snapshots of running sandboxes and forks: a sandbox's files and processes copied into a
//! template that new sandboxes start from with those processes already running.

use std::sync::Arc;

use chrono::Utc;

use super::registry::SandboxRegistry;
use super::shared::Shared;
use super::{CreateSandbox, CreateSandboxError, SandboxError};
use crate::builds::{BuildRecord, SnapshotImage, TemplateImage, split_name, valid_name};
use crate::caps::{CapError, check_bytes, check_count};
use crate::ids;
use crate::lifecycle::SandboxStatus;
use crate::model::{BuildStatus, Sandbox, Team, Template};
use crate::runtime::SnapshotParts;
use crate::store::StoreError;

/// How many forks one request may ask for.
pub const MAX_FORKS: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("sandbox '{0}' not found")]
    NotFound(String),
    #[error("sandbox '{id}' is {state}; only running sandboxes can be snapshotted")]
    NotRunning { id: String, state: &'static str },
    #[error("invalid snapshot name '{0}': use lower-case letters, digits, '-', '_' and '.'")]
    BadName(String),
    #[error(
        "the name '{0}' belongs to a built-in template or a template of this team that is not a snapshot"
    )]
    NameTaken(String),
    #[error("fork count {0} is outside 1..=100")]
    BadCount(u32),
    #[error("cannot fork: {0}")]
    Network(#[from] crate::network::NetworkConfigError),
    #[error(
        "sandbox '{0}' has volumes mounted, which a copy of its memory cannot take along; snapshot it with memory: false"
    )]
    HasVolumes(String),
    #[error(
        "sandbox '{0}' predates snapshots: its image was not recorded, so it cannot be copied; start a new sandbox of its template"
    )]
    NoImage(String),
    #[error(
        "this server cannot copy the memory of sandbox '{0}': checkpoints are off (CRIU is missing or failed its checks); snapshot it with memory: false"
    )]
    NoCheckpoints(String),
    #[error("cannot snapshot sandbox '{id}': {source}")]
    Runtime {
        id: String,
        source: crate::runtime::RuntimeError,
    },
    #[error(transparent)]
    Cap(#[from] CapError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A snapshot as `GET /snapshots` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// `name:default` when it was named, else `<template id>:default`.
    pub snapshot_id: String,
    pub names: Vec<String>,
    pub template_id: String,
    pub sandbox_id: String,
    pub created_at: chrono::DateTime<Utc>,
}

impl SnapshotInfo {
    fn of(template: &Template) -> Option<Self> {
        let snapshot = template.image.as_ref()?.snapshot.as_ref()?;
        let names: Vec<String> = template
            .names()
            .iter()
            .map(|a| format!("{a}:default"))
            .collect();
        Some(Self {
            snapshot_id: names
                .first()
                .cloned()
                .unwrap_or_else(|| format!("{}:default", template.id)),
            names: if names.is_empty() {
                vec![format!("{}:default", template.id)]
            } else {
                names
            },
            template_id: template.id.clone(),
            sandbox_id: snapshot.sandbox_id.clone(),
            created_at: template.updated_at,
        })
    }
}

#[derive(Debug, Clone, Default)]
pub struct SnapshotQuery {
    pub sandbox_id: Option<String>,
    /// A name or template ID, with or without a tag.
    pub name: Option<String>,
    pub limit: usize,
    /// The template ID the previous page ended with.
    pub next_token: Option<String>,
}

/// One fork's outcome.
#[derive(Debug)]
pub enum ForkResult {
    Started(Box<Sandbox>),
    Failed(CreateSandboxError),
}

/// Copies of running sandboxes: snapshot templates of a team, and forks.
#[derive(Clone, Debug)]
pub struct Snapshots {
    shared: Arc<Shared>,
    /// Starts the forks.
    registry: SandboxRegistry,
}

impl Snapshots {
    pub(super) fn new(shared: Arc<Shared>, registry: SandboxRegistry) -> Self {
        Self { shared, registry }
    }

    /// Copies a running sandbox's files and processes into a snapshot template of the team,
    /// named `name` when given (a snapshot of that name gets the new copy as its latest
    /// build). The sandbox is held still while it is copied and runs on afterwards.
    pub async fn snapshot(
        &self,
        team: &Team,
        id: &str,
        name: Option<&str>,
        memory: bool,
    ) -> Result<SnapshotInfo, SnapshotError> {
        let name = name.filter(|n| !n.is_empty());
        let _turn = self.shared.snapshot_gate.enter(&team.id).await;
        let existing = match name {
            Some(name) => self.snapshot_named(team, name).await?,
            None => None,
        };
        self.check_snapshot_caps(team, existing.as_ref(), None)
            .await?;
        let sandbox = self.shared.get(team, id).await.map_err(not_found(id))?;
        let (image, parts) = self.capture(&sandbox, memory).await?;
        // Its size is known only now: one past the cap is not kept.
        let recorded = match self
            .check_snapshot_caps(team, existing.as_ref(), Some(parts.checkpoint_bytes))
            .await
        {
            Ok(()) => {
                self.record_snapshot(team, &sandbox, name, existing, &image)
                    .await
            }
            Err(err) => Err(err),
        };
        match recorded {
            Ok(template) => {
                self.shared.runtime.snapshot_recorded(&parts);
                tracing::info!(sandbox_id = %id, template_id = %template.id, "snapshot created");
                SnapshotInfo::of(&template)
                    .ok_or_else(|| SnapshotError::NoImage(sandbox.id.clone()))
            }
            Err(err) => {
                self.shared.runtime.discard_snapshot(&parts).await;
                Err(err)
            }
        }
    }

    /// Refuses a snapshot past the team's caps: a new one past its count, and one whose
    /// checkpoint (`adding` bytes, `None` before it is taken) would pass its bytes. A named
    /// snapshot taken again replaces `existing`, whose count and bytes are its own.
    async fn check_snapshot_caps(
        &self,
        team: &Team,
        existing: Option<&Template>,
        adding: Option<u64>,
    ) -> Result<(), SnapshotError> {
        let caps = &team.limits.caps;
        if caps.max_snapshots == 0 && caps.max_snapshot_mb == 0 {
            return Ok(());
        }
        let kept: Vec<u64> = self
            .team_templates(team)
            .await?
            .iter()
            .filter(|t| existing.is_none_or(|e| e.id != t.id))
            .filter_map(|t| t.image.as_ref()?.snapshot.as_ref())
            .map(|s| s.checkpoint_bytes)
            .collect();
        if existing.is_none() {
            check_count(team, "snapshots", caps.max_snapshots, kept.len())?;
        }
        check_bytes(
            team,
            "snapshot memory images",
            caps.max_snapshot_mb,
            kept.iter().sum(),
            adding,
        )?;
        Ok(())
    }

    /// The templates `team` owns, its snapshots among them.
    async fn team_templates(&self, team: &Team) -> Result<Vec<Template>, StoreError> {
        let mut templates = self.shared.store.templates.templates().await?;
        templates.retain(|t| t.team_id.as_deref() == Some(team.id.as_str()));
        Ok(templates)
    }

    /// The team's snapshot template named `name`, if there is one; an error when the name is
    /// malformed or taken by something else.
    async fn snapshot_named(
        &self,
        team: &Team,
        name: &str,
    ) -> Result<Option<Template>, SnapshotError> {
        if !valid_name(name) {
            return Err(SnapshotError::BadName(name.to_owned()));
        }
        // A built-in template's name stays unambiguous in every namespace.
        if self
            .shared
            .store
            .templates
            .template_by_name(None, name)
            .await?
            .is_some()
        {
            return Err(SnapshotError::NameTaken(name.to_owned()));
        }
        match self
            .shared
            .store
            .templates
            .template_by_name(Some(&team.id), name)
            .await?
        {
            None => Ok(None),
            Some(t) if t.image.as_ref().is_some_and(|i| i.snapshot.is_some()) => Ok(Some(t)),
            Some(_) => Err(SnapshotError::NameTaken(name.to_owned())),
        }
    }

    /// Holds the sandbox in `Snapshotting` while the runtime copies it; the image new
    /// sandboxes start from and the parts it is made of.
    async fn capture(
        &self,
        sandbox: &Sandbox,
        memory: bool,
    ) -> Result<(TemplateImage, SnapshotParts), SnapshotError> {
        let id = sandbox.id.as_str();
        let base = sandbox
            .image
            .clone()
            .ok_or_else(|| SnapshotError::NoImage(id.to_owned()))?;
        if memory && !self.shared.runtime.checkpoints_ready().await {
            return Err(SnapshotError::NoCheckpoints(id.to_owned()));
        }
        if memory
            && !self
                .shared
                .store
                .sandboxes
                .sandbox_volumes(id)
                .await?
                .is_empty()
        {
            return Err(SnapshotError::HasVolumes(id.to_owned()));
        }
        if let Err(status) =
            self.shared
                .claim(id, SandboxStatus::can_snapshot, SandboxStatus::Snapshotting)
        {
            return Err(match status {
                None => SnapshotError::NotFound(id.to_owned()),
                Some(s) => SnapshotError::NotRunning {
                    id: id.to_owned(),
                    state: if s.is_paused() { "paused" } else { s.name() },
                },
            });
        }
        if memory {
            self.shared.end_agent_links(id).await;
        }
        let handle = self
            .shared
            .live()
            .get(id)
            .map(|l| l.handle.clone())
            .unwrap_or_else(|| sandbox.handle.clone());
        let taken = self
            .shared
            .runtime
            .snapshot(id, &handle, &sandbox.envd_access_token, memory)
            .await;
        self.shared.set_status(id, SandboxStatus::Running, None);
        let parts = taken.map_err(|source| SnapshotError::Runtime {
            id: id.to_owned(),
            source,
        })?;
        let mut layers = base.layers.clone();
        layers.push(parts.layer.clone());
        let image = TemplateImage {
            layers,
            env: base.env.clone(),
            user: base.user.clone(),
            workdir: base.workdir.clone(),
            // With its memory the processes come back running: nothing is started again;
            // a snapshot of the files boots like the template did.
            start_cmd: base.start_cmd.clone().filter(|_| !memory),
            start_user: base.start_user.clone().filter(|_| !memory),
            ready_cmd: base.ready_cmd.clone().filter(|_| !memory),
            snapshot: Some(SnapshotImage {
                checkpoint: parts.checkpoint.clone(),
                sandbox_id: id.to_owned(),
                checkpoint_bytes: parts.checkpoint_bytes,
            }),
            started: None,
        };
        Ok((image, parts))
    }

    async fn record_snapshot(
        &self,
        team: &Team,
        sandbox: &Sandbox,
        name: Option<&str>,
        existing: Option<Template>,
        image: &TemplateImage,
    ) -> Result<Template, SnapshotError> {
        let now = Utc::now();
        let build_id = ids::new_uuid();
        let template = match existing {
            Some(mut t) => {
                t.build_id = build_id.clone();
                t.build_status = BuildStatus::Ready;
                t.build_error = None;
                t.cpu_count = sandbox.cpu_count;
                t.memory_mb = sandbox.memory_mb;
                t.disk_size_mb = sandbox.disk_size_mb;
                t.image = Some(image.clone());
                t.updated_at = now;
                t.build_count += 1;
                t
            }
            None => Template {
                id: ids::new_template_id(),
                team_id: Some(team.id.clone()),
                namespace: Some(team.slug.clone()),
                aliases: name.map(str::to_owned).into_iter().collect(),
                build_id: build_id.clone(),
                build_count: 1,
                ..Template::of_sandbox(sandbox, image.clone(), now)
            },
        };
        self.shared
            .store
            .templates
            .upsert_template(&template)
            .await?;
        self.shared
            .store
            .builds
            .insert_build(&BuildRecord {
                id: build_id,
                template_id: template.id.clone(),
                team_id: Some(team.id.clone()),
                status: BuildStatus::Ready,
                failure: None,
                spec: None,
                image: Some(image.clone()),
                cpu_count: template.cpu_count,
                memory_mb: template.memory_mb,
                disk_size_mb: template.disk_size_mb,
                created_at: now,
                updated_at: now,
                finished_at: Some(now),
                node_id: None,
            })
            .await?;
        Ok(template)
    }

    /// The team's snapshots, newest first, filtered and paged.
    pub async fn list_snapshots(
        &self,
        team: &Team,
        query: &SnapshotQuery,
    ) -> Result<(Vec<SnapshotInfo>, Option<String>), SnapshotError> {
        let wanted_name = query.name.as_deref().map(|n| split_name(n).0);
        let mut found: Vec<SnapshotInfo> = self
            .team_templates(team)
            .await?
            .iter()
            .filter(|t| wanted_name.is_none_or(|n| t.id == n || t.aliases.iter().any(|a| a == n)))
            .filter_map(SnapshotInfo::of)
            .filter(|s| {
                query
                    .sandbox_id
                    .as_deref()
                    .is_none_or(|id| s.sandbox_id == id)
            })
            .collect();
        found.sort_by(|a, b| {
            b.created_at
                .cmp(&a.created_at)
                .then_with(|| a.template_id.cmp(&b.template_id))
        });
        if let Some(token) = &query.next_token {
            match found.iter().position(|s| &s.template_id == token) {
                Some(at) => {
                    found.drain(..=at);
                }
                None => found.clear(),
            }
        }
        let limit = query.limit.max(1);
        let next = (found.len() > limit).then(|| found[limit - 1].template_id.clone());
        found.truncate(limit);
        Ok((found, next))
    }

    /// Snapshots the running sandbox once and starts `count` sandboxes from the copy, each
    /// with `timeout_secs` to live and the source's settings; each fork succeeds or fails on
    /// its own. The copy itself is not kept as a template.
    pub async fn fork(
        &self,
        team: &Team,
        id: &str,
        timeout_secs: u64,
        count: u32,
    ) -> Result<Vec<ForkResult>, SnapshotError> {
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(SnapshotError::BadCount(count));
        }
        if timeout_secs > team.limits.max_sandbox_timeout_secs {
            return Err(SandboxError::TimeoutTooLong {
                requested: timeout_secs,
                max: team.limits.max_sandbox_timeout_secs,
            }
            .into());
        }
        let source = self.shared.get(team, id).await.map_err(not_found(id))?;
        let egress = source.network.validate(source.allow_internet_access)?;
        let template = self
            .shared
            .store
            .templates
            .template(&source.template_id)
            .await?
            .ok_or_else(|| SnapshotError::NoImage(id.to_owned()))?;
        let (image, parts) = self.capture(&source, true).await?;
        let template = Template {
            cpu_count: source.cpu_count,
            memory_mb: source.memory_mb,
            disk_size_mb: source.disk_size_mb,
            image: Some(image),
            ..template
        };
        let mut results = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let request = CreateSandbox {
                template: source.alias.clone().unwrap_or(source.template_id.clone()),
                timeout_secs,
                metadata: source.metadata.clone(),
                env_vars: source.env_vars.clone(),
                allow_internet_access: source.allow_internet_access,
                network: source.network.clone(),
                auto_pause: source.auto_pause,
                auto_resume: source.auto_resume,
                auto_pause_files_only: !source.auto_pause_memory,
                volume_mounts: Vec::new(),
            };
            let started = self
                .registry
                .create_from(team, request, template.clone(), egress.clone())
                .await;
            results.push(match started {
                Ok(sandbox) => ForkResult::Started(Box::new(sandbox)),
                Err(err) => {
                    tracing::warn!(sandbox_id = %id, error = %err, "a fork did not start");
                    ForkResult::Failed(err)
                }
            });
        }
        // The forks run on the copy's layer, which the node keeps while they live; its
        // checkpoint is spent.
        self.shared.runtime.discard_snapshot(&parts).await;
        tracing::info!(sandbox_id = %id, count, "sandbox forked");
        Ok(results)
    }
}

fn not_found(id: &str) -> impl FnOnce(SandboxError) -> SnapshotError + '_ {
    move |e| match e {
        SandboxError::NotFound(_) => SnapshotError::NotFound(id.to_owned()),
        other => SnapshotError::Sandbox(other),
    }
}
