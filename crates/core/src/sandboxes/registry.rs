//! Creating sandboxes, and looking them up and listing them.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::shared::Shared;
use super::{
    AFTER_CREATE_QUIET, CreateSandbox, CreateSandboxError, ListQuery, ListSandboxesError, Live,
    Page, SandboxError, UserPortAccess, seconds, slot_wait,
};
use crate::agent_links::AgentLinks;
use crate::builds::LogLevel;
use crate::ids;
use crate::lifecycle::SandboxStatus;
use crate::model::SandboxEventType;
use crate::model::{Sandbox, SandboxState, Team, Template, TemplateImage};
use crate::network::EgressRules;
use crate::runtime::{Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use crate::sandbox_logs::SandboxLogEntry;
use crate::templates::TemplateError;
use crate::volumes::{VolumeMount, VolumeMountError};

/// Starts sandboxes and finds them again: the store's records, with the registry's view of
/// those still starting or being stopped.
#[derive(Clone, Debug)]
pub struct SandboxRegistry {
    shared: Arc<Shared>,
}

impl SandboxRegistry {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// A team's sandbox; another team's is reported as not found.
    pub async fn get(&self, team: &Team, id: &str) -> Result<Sandbox, SandboxError> {
        self.shared.get(team, id).await
    }

    pub async fn create(
        &self,
        team: &Team,
        request: CreateSandbox,
    ) -> Result<Sandbox, CreateSandboxError> {
        if request.timeout_secs > team.limits.max_sandbox_timeout_secs {
            return Err(CreateSandboxError::TimeoutTooLong {
                requested: request.timeout_secs,
                max: team.limits.max_sandbox_timeout_secs,
            });
        }
        let egress = request.network.validate(request.allow_internet_access)?;
        let template = self
            .shared
            .templates
            .resolve_to_start(team, &request.template)
            .await?;
        let template = self
            .shared
            .templates
            .wait_ready(template, self.shared.config.template_wait)
            .await?;
        self.create_from(team, request, template, egress).await
    }

    /// Starts a sandbox of `template` (whose image is the one it starts from) for a request
    /// already checked against the team's timeout and with its egress rules validated.
    pub(super) async fn create_from(
        &self,
        team: &Team,
        request: CreateSandbox,
        template: Template,
        egress: EgressRules,
    ) -> Result<Sandbox, CreateSandboxError> {
        check_resources(team, &template)?;
        // After the wait for the template: the guard holds off volume deletes until the
        // mounts are recorded, which must not include a build's duration.
        let (mounts, _mounting) =
            match (self.shared.volumes.get(), request.volume_mounts.is_empty()) {
                (_, true) => (Vec::new(), None),
                (None, false) => return Err(VolumeMountError::Disabled.into()),
                (Some(volumes), false) => {
                    let (mounts, guard) =
                        volumes.resolve_mounts(team, &request.volume_mounts).await?;
                    (mounts, Some(guard))
                }
            };

        let id = ids::new_sandbox_id();
        let now = Utc::now();
        let reservation = self.reserve(team, &id, now + seconds(request.timeout_secs))?;
        // Held until the sandbox is recorded (the end of this function): until then the
        // claim is what the other nodes count.
        let _claim = self.shared.claim_slot(team, &id).await?;

        let Some(image) = template.image.clone() else {
            return Err(TemplateError::StillBuilding(template.id.clone()).into());
        };
        // Restored from the template's capture with its start command running, where the
        // node can restore; the record names the layers the sandbox's files are on.
        let image = match image.restored_from_capture() {
            Some(restored) if self.shared.runtime.checkpoints_ready().await => restored,
            _ => image,
        };
        let booted_from = image.clone();
        let spec = launch_spec(
            &id,
            team,
            &request,
            &template,
            image,
            egress,
            mounts.clone(),
        );
        let token = spec.envd_access_token.clone();
        let (handle, endpoint) =
            self.shared
                .runtime
                .launch(spec)
                .await
                .map_err(|err| match err {
                    RuntimeError::NoCapacity { .. } => CreateSandboxError::NoCapacity {
                        source: err,
                        retry_after_secs: self.shared.capacity_wait(),
                    },
                    err => err.into(),
                })?;

        // The timeout runs from the moment the sandbox is usable, not from the request.
        let sandbox =
            self.started_sandbox(&id, team, request, &template, handle, token, booted_from);
        self.record_started(&sandbox, &mounts).await?;
        reservation.keep();
        // Started before the sandbox counts as running; the reaper's reads of its agent log
        // wait for the log to exist.
        self.log_start(&sandbox, now);
        self.make_routable(&sandbox, endpoint);
        self.record_spawn_later(&template.id, sandbox.started_at);
        tracing::info!(sandbox_id = %id, template_id = %template.id, "sandbox started");
        Ok(sandbox)
    }

    /// The record of a sandbox of `template` just started for `request`, whose timeout runs
    /// from now.
    #[allow(clippy::too_many_arguments)]
    fn started_sandbox(
        &self,
        id: &str,
        team: &Team,
        request: CreateSandbox,
        template: &Template,
        handle: RuntimeHandle,
        envd_access_token: String,
        booted_from: TemplateImage,
    ) -> Sandbox {
        let started_at = Utc::now();
        let named = &request.template;
        let alias = template
            .aliases
            .iter()
            .find(|a| named.strip_suffix(":default").unwrap_or(named) == a.as_str())
            .or(template.aliases.first())
            .cloned();
        Sandbox {
            id: id.to_owned(),
            team_id: team.id.clone(),
            template_id: template.id.clone(),
            alias,
            started_at,
            end_at: started_at + seconds(request.timeout_secs),
            cpu_count: template.cpu_count,
            memory_mb: template.memory_mb,
            disk_size_mb: template.disk_size_mb,
            metadata: request.metadata,
            env_vars: request.env_vars,
            allow_internet_access: request.allow_internet_access,
            traffic_access_token: (!request.network.allow_public_traffic)
                .then(|| ids::new_secret("")),
            network: request.network,
            envd_access_token,
            envd_version: template.envd_version.clone(),
            status: SandboxStatus::Running,
            handle,
            auto_pause: request.auto_pause,
            auto_resume: request.auto_resume,
            auto_pause_memory: !request.auto_pause_files_only,
            image: Some(booted_from),
            node_id: self.shared.config.node_id.clone(),
        }
    }

    /// Records a started sandbox and its volume mounts; if that fails, the sandbox is
    /// destroyed, since nothing could find it again.
    async fn record_started(
        &self,
        sandbox: &Sandbox,
        mounts: &[VolumeMount],
    ) -> Result<(), CreateSandboxError> {
        let recorded = self
            .shared
            .store
            .sandboxes
            .insert_sandbox(sandbox, mounts)
            .await;
        if let Err(err) = recorded {
            let id = &sandbox.id;
            if let Err(destroy) = self.shared.runtime.destroy(id, &sandbox.handle).await {
                tracing::error!(sandbox_id = %id, error = %destroy, "cannot clean up unrecorded sandbox");
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Gives a recorded sandbox's registry entry its endpoint, tokens and limits, then lets
    /// traffic reach it.
    fn make_routable(&self, sandbox: &Sandbox, endpoint: Endpoint) {
        let id = &sandbox.id;
        if let Some(entry) = self.shared.live().get_mut(id) {
            entry.endpoint = Some(endpoint);
            entry.access_token = self.shared.signers.list(id, &sandbox.envd_access_token);
            entry.handle = sandbox.handle.clone();
            entry.end_at = sandbox.end_at;
            entry.user_ports = UserPortAccess::of(sandbox);
            entry.auto_pause = sandbox.auto_pause;
            entry.auto_resume = sandbox.auto_resume;
            entry.cpu_count = sandbox.cpu_count;
            entry.memory_mb = sandbox.memory_mb;
            entry.disk_size_mb = sandbox.disk_size_mb;
        }
        // Routable only now that its endpoint and token are in place.
        self.shared.set_status(id, SandboxStatus::Running, None);
    }

    /// Counts a spawn of `template_id`: a statistic nothing waits for, written after the
    /// first command had its chance, together with the spawns around it.
    fn record_spawn_later(&self, template_id: &str, started_at: DateTime<Utc>) {
        self.shared
            .spawns
            .add(&self.shared.store, template_id, started_at);
    }

    /// The first lines of a new sandbox's log, and its start in the team's metrics.
    fn log_start(&self, sandbox: &Sandbox, requested_at: DateTime<Utc>) {
        let mut created = vec![
            ("templateID", sandbox.template_id.clone()),
            ("endAt", sandbox.end_at.to_rfc3339()),
        ];
        if let Some(alias) = &sandbox.alias {
            created.push(("alias", alias.clone()));
        }
        let startup_ms = (sandbox.started_at - requested_at).num_milliseconds();
        let entries = vec![
            SandboxLogEntry::event(requested_at, LogLevel::Info, "sandbox created", &created),
            SandboxLogEntry::event(
                sandbox.started_at,
                LogLevel::Info,
                "sandbox started",
                &[("startupMs", startup_ms.to_string())],
            ),
        ];
        self.shared
            .lifecycle_event(SandboxEventType::Created, sandbox);
        self.shared.activity.open_soon(
            &sandbox.id,
            &sandbox.team_id,
            requested_at,
            entries,
            AFTER_CREATE_QUIET,
        );
        let running = self
            .shared
            .live()
            .values()
            .filter(|l| l.team_id == sandbox.team_id && l.status.holds_a_slot())
            .count();
        self.shared
            .activity
            .started(&sandbox.team_id, u32::try_from(running).unwrap_or(u32::MAX));
    }

    /// Takes one of the team's slots on this node for sandbox `id` (marked starting).
    /// Counts sandbox `id` against its team's concurrency from now on, before its launch.
    fn reserve(
        &self,
        team: &Team,
        id: &str,
        end_at: DateTime<Utc>,
    ) -> Result<Reservation<'_>, CreateSandboxError> {
        let mut live = self.shared.live();
        let active = live
            .values()
            .filter(|l| l.team_id == team.id && l.status.holds_a_slot())
            .count();
        if active >= team.limits.max_concurrent_sandboxes as usize {
            return Err(CreateSandboxError::ConcurrencyLimit {
                limit: team.limits.max_concurrent_sandboxes,
                retry_after_secs: slot_wait(&live, team),
            });
        }
        live.insert(
            id.to_owned(),
            Live {
                team_id: team.id.clone(),
                end_at,
                endpoint: None,
                access_token: Arc::from(""),
                handle: RuntimeHandle::default(),
                status: SandboxStatus::Starting,
                user_ports: UserPortAccess::default(),
                auto_pause: false,
                auto_resume: false,
                cpu_count: 0,
                memory_mb: 0,
                disk_size_mb: 0,
                paused_at: None,
                checkpoint_failures: 0,
                agent_links: AgentLinks::new(),
                wakes: 0,
                files_shared_at: None,
                memory_shared_at: None,
            },
        );
        Ok(Reservation {
            shared: &self.shared,
            id: id.to_owned(),
            kept: false,
        })
    }

    pub async fn list(
        &self,
        team: &Team,
        query: &ListQuery,
    ) -> Result<Page<Sandbox>, ListSandboxesError> {
        let after = query
            .next_token
            .as_deref()
            .map(|t| parse_page_token(t).ok_or_else(|| ListSandboxesError::BadToken(t.to_owned())))
            .transpose()?;
        let stopping: Vec<String> = self
            .shared
            .live()
            .iter()
            .filter(|(_, l)| l.status == SandboxStatus::Stopping)
            .map(|(id, _)| id.clone())
            .collect();
        let mut sandboxes = self.shared.store.sandboxes.team_sandboxes(&team.id).await?;
        if query.ascending {
            sandboxes.reverse();
        }
        // A name resolves to one template; an unknown name simply matches nothing.
        let template_id = match &query.template {
            Some(name) => Some(
                self.shared
                    .templates
                    .resolve(team, name)
                    .await
                    .map(|t| t.id)
                    .unwrap_or_else(|_| name.clone()),
            ),
            None => None,
        };
        let filtered: Vec<Sandbox> = sandboxes
            .into_iter()
            .filter(|s| !stopping.contains(&s.id))
            // A lost node's sandboxes are neither running nor paused anywhere the API can
            // reach: they are left out until the node comes back.
            .filter(|s| self.shared.listable(s))
            .filter(|s| s.status != SandboxStatus::Stopping)
            .filter(|s| {
                query
                    .states
                    .as_ref()
                    .is_none_or(|st| st.contains(&s.state()))
            })
            .filter(|s| {
                query
                    .metadata
                    .iter()
                    .all(|(k, v)| s.metadata.get(k) == Some(v))
            })
            .filter(|s| query.started_after.is_none_or(|t| s.started_at >= t))
            .filter(|s| {
                template_id.as_ref().is_none_or(|id| {
                    s.template_id == *id || s.alias.as_ref() == query.template.as_ref()
                })
            })
            .collect();
        let running_total = filtered
            .iter()
            .filter(|s| s.state() == SandboxState::Running)
            .count();
        let total = filtered.len();
        let mut matching = filtered.into_iter().filter(|s| match &after {
            None => true,
            Some((micros, id)) => {
                let position = (s.started_at.timestamp_micros(), s.id.as_str());
                let cursor = (*micros, id.as_str());
                if query.ascending {
                    position > cursor
                } else {
                    position < cursor
                }
            }
        });
        let items: Vec<Sandbox> = matching.by_ref().take(query.limit).collect();
        let next_token = match (items.last(), matching.next()) {
            (Some(last), Some(_)) => Some(page_token(last)),
            _ => None,
        };
        Ok(Page {
            items,
            next_token,
            running_total,
            total,
        })
    }
}

fn page_token(sandbox: &Sandbox) -> String {
    hex::encode(format!(
        "{}:{}",
        sandbox.started_at.timestamp_micros(),
        sandbox.id
    ))
}

fn parse_page_token(token: &str) -> Option<(i64, String)> {
    let raw = String::from_utf8(hex::decode(token).ok()?).ok()?;
    let (micros, id) = raw.split_once(':')?;
    Some((micros.parse().ok()?, id.to_owned()))
}

/// What the node needs to start sandbox `id` of `template` from `image` for `team`'s
/// `request`.
fn launch_spec(
    id: &str,
    team: &Team,
    request: &CreateSandbox,
    template: &Template,
    image: TemplateImage,
    egress: EgressRules,
    volumes: Vec<VolumeMount>,
) -> LaunchSpec {
    let mut env_vars = image.env.clone();
    env_vars.extend(request.env_vars.clone());
    LaunchSpec {
        sandbox_id: id.to_owned(),
        image,
        cpu_count: template.cpu_count,
        memory_mb: template.memory_mb,
        disk_size_mb: template.disk_size_mb,
        disk_rates: team.limits.disk_rates,
        env_vars,
        allow_internet_access: !egress.is_isolated(),
        egress,
        envd_access_token: ids::new_secret(""),
        template: template.clone(),
        volumes,
        kept: None,
    }
}

/// A team's per-sandbox ceilings (0: none) against what the template would get.
fn check_resources(team: &Team, template: &Template) -> Result<(), CreateSandboxError> {
    match team.limits.exceeded_by(
        template.cpu_count,
        template.memory_mb,
        template.disk_size_mb,
    ) {
        Some((field, value, max)) => Err(CreateSandboxError::ResourceLimit {
            template_id: template.id.clone(),
            field,
            value,
            max,
        }),
        None => Ok(()),
    }
}

/// A sandbox counted against its team's concurrency before it is recorded. Dropped before
/// [`Reservation::keep`] (a create that failed, or whose request went away mid-way), the
/// count goes back.
#[must_use]
struct Reservation<'a> {
    shared: &'a Shared,
    id: String,
    kept: bool,
}

impl Reservation<'_> {
    /// The sandbox is recorded: it counts for as long as it lives.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.shared.live().remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_page_token;

    #[test]
    fn page_tokens_round_trip() {
        let token = hex::encode("1700000000000000:iabc");
        assert_eq!(
            parse_page_token(&token),
            Some((1_700_000_000_000_000, "iabc".to_owned()))
        );
        assert_eq!(parse_page_token("zz"), None);
        assert_eq!(parse_page_token(&hex::encode("nocolon")), None);
    }
}
