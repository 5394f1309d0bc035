//! Sandboxes booted ahead of demand (see [`crate::runtime::warm`]) and how a create takes one.

use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{Endpoint, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::AgentConfig;

use crate::resources::cgroups::Limits;

use super::handle::{is_alive, start_ticks};
use super::holdings::SlotHold;
use super::jailed::{BootSpec, Jailer, default_workdir};
use super::{agent_client, holdings, sandbox_err};

node_part! {
    /// Boots sandboxes ahead of demand into the warm pool and hands them to creates.
    pub(super) struct WarmKeeper;
}

/// How long a warm sandbox's agent may take to answer after its boot.
pub(super) const WARM_AGENT_PATIENCE: Duration = Duration::from_secs(15);

impl WarmKeeper {
    /// Keeps sandboxes booted for the image creates last asked for, in the background, from
    /// now on. Called once the sandboxes recorded before a restart are recovered: the
    /// recovery sweeps every unrecorded sandbox, and warm ones are never recorded.
    pub(super) fn start_warm_pool(&self) {
        if self.node.warm.target() == 0 {
            return;
        }
        let runtime = Arc::downgrade(&self.node);
        let refill = async move {
            loop {
                let Some(node) = runtime.upgrade() else {
                    return;
                };
                if let Some(wait) = node.warm.hold_off(std::time::Instant::now()) {
                    drop(node);
                    tokio::time::sleep(wait).await;
                    continue;
                }
                let Some(working) = node.warm.work().await else {
                    return;
                };
                match node.warm.next_job() {
                    crate::runtime::warm::Job::Wait => {
                        drop(working);
                        // Also the retry pace after a failed boot.
                        let pool = &node.warm;
                        pool.wait(Duration::from_secs(1)).await;
                    }
                    crate::runtime::warm::Job::Retire(warm) => {
                        WarmKeeper::of(&node).retire_warm(&warm).await
                    }
                    crate::runtime::warm::Job::Boot(key) => {
                        if let Err(err) = WarmKeeper::of(&node).boot_warm(&key).await {
                            drop(working);
                            tracing::warn!(error = %err, "cannot boot a warm sandbox");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            }
        };
        // A boot makes blocking system calls (cgroups, the btrfs subvolume and its quota,
        // the boot process's start) that take a thread for up to milliseconds. On a thread and
        // runtime of their own they never hold a worker that a request's task waits on.
        let spawned = std::thread::Builder::new()
            .name("warm-pool".into())
            .spawn(move || {
                run_refills_in_background();
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(pool_runtime) => pool_runtime.block_on(refill),
                    Err(err) => {
                        tracing::error!(error = %err, "cannot start the warm pool's runtime")
                    }
                }
            });
        if let Err(err) = spawned {
            tracing::error!(error = %err, "cannot start the warm pool's thread");
        }
    }

    /// Boots a sandbox for `key` under a name of its own and puts it in the pool. It counts
    /// against no memory grant (an idle sandbox uses about a MiB) but against the disk pool,
    /// like any disk.
    pub(super) async fn boot_warm(
        &self,
        key: &crate::runtime::warm::WarmKey,
    ) -> Result<(), RuntimeError> {
        let name = format!(
            "{}{}",
            crate::runtime::warm::NAME_PREFIX,
            &sandbar_core::ids::new_secret("")[..16]
        );
        self.node.admit_start(&name)?;
        let mut opening = self.node.holdings.opening(&name);
        opening.hold_disk(
            self.node
                .admit_disk(&name, crate::runtime::warm::BOOT_DISK_MB)
                .await?,
        );
        let netns = match self.node.netns_pool.claim(true).await {
            Some(Ok(netns)) => netns,
            Some(Err(err)) => return Err(sandbox_err(&name, err)),
            None => {
                return Err(RuntimeError::NoCapacity {
                    sandbox_id: name,
                    message: "no free network slot on this node".into(),
                });
            }
        };
        let slot = netns.slot;
        opening.hold_slot(SlotHold::taken(&self.node.slots, slot));
        opening.use_layers(key.layers.clone());
        let id_map = self.node.id_map(slot);
        let token = sandbar_core::ids::new_secret("");
        let boot_id = sandbar_core::ids::new_uuid();
        let started = std::time::Instant::now();
        let mut spawned_at = std::time::Duration::ZERO;
        let mut cgroups_at = std::time::Duration::ZERO;
        let mut disk_at = std::time::Duration::ZERO;
        let booted = async {
            self.node
                .cgroups
                .create(
                    &name,
                    Limits {
                        cpu_count: self.node.warm.cpu_count_for(key),
                        memory_mb: crate::runtime::warm::BOOT_MEMORY_MB,
                        pids_max: self.node.config.pids_max,
                        cpu_priority: crate::resources::cgroups::CpuPriority::Background,
                        io: self.node.cgroups.io_rates(),
                    },
                )
                .map_err(|e| sandbox_err(&name, e))?;
            cgroups_at = started.elapsed();
            self.node.warm.boot_started(&name);
            let _ = self.while_held().await;
            let dir = self
                .node
                .disks
                .create(&name, crate::runtime::warm::BOOT_DISK_MB, id_map.host_base)
                .map_err(|e| sandbox_err(&name, e))?;
            disk_at = started.elapsed();
            let boot = BootSpec {
                id: &name,
                template_id: "(warm)",
                layers: &key.layers,
                volumes: &[],
                agent: AgentConfig {
                    access_token: Some(token.clone()),
                    default_user: key.user.clone(),
                    env_vars: Default::default(),
                    default_workdir: default_workdir(&key.user, &key.workdir).map(str::to_owned),
                    memory_limit_mb: None,
                },
                kept: false,
                boot_id: &boot_id,
            };
            let _ = self.while_held().await;
            let pid = Jailer::of(&self.node)
                .spawn_jailed(&boot, &dir, &netns, id_map)
                .await?;
            spawned_at = started.elapsed();
            let warm = crate::runtime::warm::WarmSandbox {
                name: name.clone(),
                key: key.clone(),
                pid,
                start_ticks: start_ticks(pid).unwrap_or_default(),
                slot,
                id_map,
                token: token.clone(),
                boot_id: boot_id.clone(),
            };
            agent_client::wait_healthy(&self.node.places.socket_path(&name), WARM_AGENT_PATIENCE)
                .await
                .map_err(|e| sandbox_err(&name, e))?;
            Ok::<_, RuntimeError>(warm)
        };
        let booted = tokio::select! {
            booted = booted => booted,
            never = self.release_when_quiet() => match never {},
        };
        let held = self.node.warm.boot_ended(|held| self.thaw(held));
        drop(netns);
        match booted {
            Ok(warm) => {
                tracing::debug!(
                    warm = %warm.name,
                    slot,
                    cgroups_us = cgroups_at.as_micros() as u64,
                    disk_us = disk_at.as_micros() as u64,
                    spawned_us = spawned_at.as_micros() as u64,
                    healthy_us = started.elapsed().as_micros() as u64,
                    held_us = held.as_micros() as u64,
                    "warm sandbox booted"
                );
                opening.commit();
                self.node.warm.put(warm);
                Ok(())
            }
            Err(err) => {
                let handle = RuntimeHandle::warm(slot, id_map.host_base, 0, 0);
                if let Err(cleanup) = self.node.teardown(&name, Some(&handle)).await {
                    tracing::error!(warm = %name, error = %cleanup, "cannot clean up a warm sandbox");
                }
                Err(err)
            }
        }
    }

    /// Lets the boot under way run again whenever creates stopped it and have since been
    /// quiet long enough (see [`crate::runtime::warm::WarmPool::creating`]); runs beside the
    /// boot until the boot ends.
    async fn release_when_quiet(&self) -> std::convert::Infallible {
        loop {
            let change = self.node.warm.activity().notified();
            tokio::pin!(change);
            change.as_mut().enable();
            if !self.while_held().await {
                change.await;
            }
        }
    }

    /// Waits while creates have the boot under way stopped, and lets it run again once that
    /// is due: its own steps on the server's side wait with its processes. Whichever of this
    /// and [`Self::release_when_quiet`] comes first releases it. Returns whether it was
    /// stopped.
    async fn while_held(&self) -> bool {
        let pool = &self.node.warm;
        loop {
            let change = pool.activity().notified();
            tokio::pin!(change);
            change.as_mut().enable();
            match pool.release_in(std::time::Instant::now()) {
                None => return false,
                Some(wait) if wait.is_zero() => {
                    pool.release(std::time::Instant::now(), |held| self.thaw(held));
                    return true;
                }
                Some(wait) => {
                    let _ = tokio::time::timeout(wait, change).await;
                }
            }
        }
    }

    /// Lets a boot that creates stopped run again; a boot whose cgroup is gone has nothing
    /// left to thaw.
    fn thaw(&self, held: &str) {
        let _ = self.node.cgroups.thaw(held);
    }

    pub(super) async fn retire_warm(&self, warm: &crate::runtime::warm::WarmSandbox) {
        let handle = warm.handle();
        if let Err(err) = self.node.teardown(&warm.name, Some(&handle)).await {
            tracing::error!(warm = %warm.name, error = %err, "cannot tear down a warm sandbox");
        }
    }

    /// Makes warm sandbox `warm` sandbox `spec`: its cgroups, disk, socket and log take the
    /// sandbox's id, its limits become the sandbox's and its agent gets the sandbox's token
    /// and environment. On failure the warm sandbox is gone, whatever name it had got.
    pub(super) async fn take_warm(
        &self,
        spec: &LaunchSpec,
        warm: &crate::runtime::warm::WarmSandbox,
        opening: &mut holdings::Opening<'_>,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let id = spec.sandbox_id.as_str();
        let started = std::time::Instant::now();
        let mut handle = warm.handle();
        if !is_alive(&handle) {
            self.retire_warm(warm).await;
            return Err(sandbox_err(id, format!("warm sandbox {} died", warm.name)));
        }
        let mut name = warm.name.as_str();
        // The agent takes its sandbox's token and environment while the node renames and
        // limits the sandbox's resources: nothing reaches the agent before the create
        // returns, and the two together are most of a take. The connection is made before
        // the socket's path is renamed.
        let handing_over = self.hand_agent_its_sandbox(spec, warm).await;
        let handing_over = match handing_over {
            Ok(stream) => stream,
            Err(err) => {
                self.retire_warm(warm).await;
                return Err(err);
            }
        };
        let taken = async {
            self.node
                .cgroups
                .rename(&warm.name, id)
                .map_err(|e| sandbox_err(id, e))?;
            name = id;
            self.give_warm_to(spec, warm, opening)?;
            // Before the agent hands anything out: the sandbox never has a moment without
            // its rules.
            self.node
                .apply_egress(id, warm.slot, true, &spec.egress)
                .await?;
            let endpoint = self.node.endpoint(id, warm.slot)?;
            agent_client::init_answered(handing_over)
                .await
                .map_err(|e| sandbox_err(id, format!("cannot hand the agent its sandbox: {e}")))?;
            handle = RuntimeHandle::running(
                warm.pid,
                warm.start_ticks,
                warm.slot,
                warm.id_map.host_base,
                spec,
                Some(warm.boot_id.clone()),
            );
            if spec.image.start_cmd.is_some() || spec.image.ready_cmd.is_some() {
                Jailer::of(&self.node)
                    .start_and_wait_ready(spec, &endpoint)
                    .await?;
            }
            Ok::<_, RuntimeError>(endpoint)
        }
        .await;
        match taken {
            Ok(endpoint) => {
                tracing::debug!(
                    sandbox_id = %id,
                    warm = %warm.name,
                    taken_us = started.elapsed().as_micros() as u64,
                    "warm sandbox taken"
                );
                Ok((handle, endpoint))
            }
            Err(err) => {
                // Whatever was renamed already goes under the sandbox's id, the rest under
                // the warm name.
                let _ = self.node.teardown(name, Some(&handle)).await;
                for rest in [warm.name.as_str(), id] {
                    let _ = self.node.teardown(rest, None).await;
                }
                Err(err)
            }
        }
    }

    /// Empties the warm sandbox's log and sends its agent the sandbox it now serves (token,
    /// environment, user); the answer is read later, from the returned connection.
    async fn hand_agent_its_sandbox(
        &self,
        spec: &LaunchSpec,
        warm: &crate::runtime::warm::WarmSandbox,
    ) -> Result<tokio::net::UnixStream, RuntimeError> {
        let id = spec.sandbox_id.as_str();
        let fail = |e: &dyn std::fmt::Display| {
            sandbox_err(id, format!("cannot hand the agent its sandbox: {e}"))
        };
        // What the agent logged while it waited is no part of this sandbox's life. Emptied
        // before the agent is handed its sandbox, as the agent then writes the new log's
        // first line.
        let log = self.node.places.log_path(&warm.name);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&log)
            .and_then(|f| f.set_len(0))
            .map_err(|e| fail(&format!("empty {}: {e}", log.display())))?;
        let mut stream = agent_client::connect(&self.node.places.socket_path(&warm.name))
            .await
            .map_err(|e| fail(&e))?;
        agent_client::send_init(
            &mut stream,
            &warm.token,
            &agent_client::Init {
                access_token: &spec.envd_access_token,
                env_vars: &spec.env_vars,
                default_user: &spec.image.user,
                default_workdir: default_workdir(&spec.image.user, &spec.image.workdir),
                memory_limit_mb: spec.memory_mb,
            },
        )
        .await
        .map_err(|e| fail(&e))?;
        Ok(stream)
    }

    /// Moves what the warm sandbox holds (its cgroups already renamed) to sandbox `spec`:
    /// its slot, limits, disk, socket and log, and its owner's layers.
    fn give_warm_to(
        &self,
        spec: &LaunchSpec,
        warm: &crate::runtime::warm::WarmSandbox,
        opening: &mut holdings::Opening<'_>,
    ) -> Result<(), RuntimeError> {
        let id = spec.sandbox_id.as_str();
        // The sandbox's slot from now on: a failure tears it down under the new id.
        if let Some(slot) = self.node.holdings.take_slot(&warm.name) {
            opening.hold_slot(slot);
        }
        let limits = self.node.limits_of(spec);
        self.node
            .cgroups
            .apply_limits(id, limits)
            .map_err(|e| sandbox_err(id, e))?;
        // Booted with the node's disk rates; a team with rates of its own gets them now.
        if limits.io != self.node.cgroups.io_rates() {
            self.node
                .cgroups
                .throttle_io(id, limits.io)
                .map_err(|e| sandbox_err(id, e))?;
        }
        self.node
            .disks
            .hand_over(&warm.name, id, spec.disk_size_mb)
            .map_err(|e| sandbox_err(id, e))?;
        for (from, to) in [
            (
                self.node.places.socket_path(&warm.name),
                self.node.places.socket_path(id),
            ),
            (
                self.node.places.log_path(&warm.name),
                self.node.places.log_path(id),
            ),
        ] {
            std::fs::rename(&from, &to)
                .map_err(|e| sandbox_err(id, format!("rename {}: {e}", from.display())))?;
        }
        // The warm name's disk promise went with its disk; its layers are the sandbox's.
        drop(self.node.holdings.remove(&warm.name));
        opening.use_layers(spec.image.layers.clone());
        Ok(())
    }
}

/// Nice value of the thread that boots warm sandboxes: its own system calls (mounts, the
/// btrfs subvolume and quota, the boot process's start) then take only cycles requests leave.
const REFILL_NICE: i32 = 19;

/// Lowers the calling thread's priority to [`REFILL_NICE`] where the jails it forks can take
/// the server's priority back (`CAP_SYS_NICE`, see `sandbar_jail::handoff`); without that,
/// sandboxes would inherit the low priority, so the thread keeps the server's.
fn run_refills_in_background() {
    use rustix::thread::{CapabilitySet, capabilities};
    let may_raise =
        capabilities(None).is_ok_and(|caps| caps.effective.contains(CapabilitySet::SYS_NICE));
    if !may_raise {
        tracing::info!("warm boots run at the server's priority: it lacks CAP_SYS_NICE");
        return;
    }
    if let Err(err) =
        rustix::process::setpriority_process(Some(rustix::thread::gettid()), REFILL_NICE)
    {
        tracing::warn!(error = %err, "warm boots run at the server's priority");
    }
}
