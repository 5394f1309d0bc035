//! The jailed agent: started as a sandbox's PID 1 in fresh namespaces, with its descriptors,
//! log and configuration, then the template's start and ready commands run through it. The
//! host seam (`host.rs`) calls it; the launch flows above decide when.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use sandbar_core::{Endpoint, LaunchSpec, RuntimeError};
use sandbar_jail::{AgentConfig, IdMap, JailSpec};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::net::netns::PreparedNetns;

use super::{agent_client, sandbox_err};

node_part! {
    /// Starts sandboxes' agents and their templates' start commands.
    pub(super) struct Jailer;
}

impl Jailer {
    /// Starts the agent in fresh namespaces and returns the host PID of the sandbox's init.
    pub(super) async fn spawn_jailed(
        &self,
        boot: &BootSpec<'_>,
        dir: &Path,
        netns: &PreparedNetns,
        id_map: IdMap,
    ) -> Result<i32, RuntimeError> {
        let id = boot.id;
        let jail = self.jail_spec(boot, dir, netns.slot, id_map)?;
        let socket = self.node.places.socket_path(id);
        let _ = std::fs::remove_file(&socket);
        let listener = netns
            .listen_at(&socket)
            .map_err(|e| sandbox_err(id, format!("bind {}: {e}", socket.display())))?;
        let log = self.open_agent_log(id, boot.kept, id_map)?;
        // Without it the sandbox runs as well; its out-of-memory kills are only not named in
        // the ended process's error.
        let oom_events = self.node.cgroups.oom_notifier(id).unwrap_or_else(|e| {
            tracing::warn!(sandbox_id = id, error = %e, "out-of-memory kills will not be named");
            None
        });
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| sandbox_err(id, format!("make the boot socket: {e}")))?;
        let child = self
            .agent_command(log, theirs.into())
            .spawn()
            .map_err(|e| {
                sandbox_err(
                    id,
                    format!("start agent {}: {e}", self.node.agent_exec.display()),
                )
            })?;
        sandbar_jail::handoff::send_descriptors(
            &ours,
            sandbar_jail::handoff::Handed {
                listener: listener.as_fd(),
                netns: netns.netns.as_fd(),
                oom_events: oom_events.as_ref().map(|fd| fd.as_fd()),
            },
        )
        .map_err(|e| sandbox_err(id, format!("hand the boot its descriptors: {e}")))?;
        // The agent holds its own copy now; ours would keep the socket accepting after the
        // sandbox died and hang clients instead of refusing them. The namespace, likewise, must
        // end with the sandbox's processes.
        drop(listener);
        drop(oom_events);
        self.boot_child(id, child, ours, &jail).await
    }

    /// How the agent jails sandbox `boot`: its layers and writable directory `dir`, cgroups,
    /// name server, ids, volumes and identity.
    fn jail_spec(
        &self,
        boot: &BootSpec<'_>,
        dir: &Path,
        slot: u32,
        id_map: IdMap,
    ) -> Result<JailSpec, RuntimeError> {
        let id = boot.id;
        let template_layers = self.node.layers.stack(boot.layers).map_err(|message| {
            RuntimeError::TemplateMissing {
                template_id: format!("{} ({message})", boot.template_id),
            }
        })?;
        let volumes = boot
            .volumes
            .iter()
            .map(|m| {
                Ok(sandbar_jail::VolumeBind {
                    source: crate::storage::volumes::volume_dir(
                        &self.node.config.data_dir,
                        &m.team_id,
                        &m.volume_id,
                    )
                    .map_err(|e| sandbox_err(id, e))?,
                    target: m.path.clone().into(),
                })
            })
            .collect::<Result<_, RuntimeError>>()?;
        Ok(JailSpec {
            template_layers,
            sandbox_dir: dir.to_owned(),
            hostname: "e2b.local".into(),
            cgroup_join: self.node.cgroups.join_files(id),
            // The gateway: the firewall redirects DNS sent there to the server's resolver.
            nameservers: vec![
                self.node
                    .network
                    .addrs(slot)
                    .map_err(|e| sandbox_err(id, e))?
                    .host
                    .to_string(),
            ],
            id_map,
            pty_max: self.node.config.pty_max,
            volumes,
            agent: boot.agent.clone(),
            boot_id: Some(boot.boot_id.to_owned()),
            // A new writable layer makes a new machine; kept files keep the one they hold.
            machine_id: (!boot.kept).then(sandbar_core::ids::new_machine_id),
        })
    }

    /// The agent log of sandbox `id`, owned by its root. A sandbox booted again on its kept
    /// files goes on with its log: the lines read so far are counted by offset. Appending,
    /// so a warm sandbox's log can be emptied when it is taken while its agent writes on.
    fn open_agent_log(
        &self,
        id: &str,
        kept: bool,
        id_map: IdMap,
    ) -> Result<std::fs::File, RuntimeError> {
        let log_path = self.node.places.log_path(id);
        if !kept {
            self.node.remove_log(id);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", log_path.display())))?;
        // The restored root task reopens the log through its descriptor with its own rights.
        std::os::unix::fs::fchown(&log, Some(id_map.host_base), Some(id_map.host_base))
            .map_err(|e| sandbox_err(id, format!("chown {}: {e}", log_path.display())))?;
        Ok(log)
    }

    /// `sandbar-agent boot`, with `socket` as its standard input and stderr to `log`. Nothing
    /// runs between fork and exec, so the standard library starts it with `posix_spawn` and
    /// the server is never forked; the boot process takes over itself (see
    /// [`sandbar_jail::handoff`]).
    fn agent_command(&self, log: std::fs::File, socket: OwnedFd) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.node.agent_exec);
        command
            // Sandboxes read PID 1's command line: it must not name a host path.
            .arg0("sandbar-agent")
            .arg("boot")
            .stdin(Stdio::from(socket))
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .env_clear()
            .env("RUST_LOG", "info");
        command
    }

    /// Sends the started agent its jail and reads back the host PID of the sandbox's init,
    /// which it prints once the sandbox runs; the boot process then exits.
    async fn boot_child(
        &self,
        id: &str,
        mut child: tokio::process::Child,
        socket: std::os::unix::net::UnixStream,
        jail: &JailSpec,
    ) -> Result<i32, RuntimeError> {
        let payload = serde_json::to_vec(jail).map_err(|e| sandbox_err(id, e))?;
        let sent = async {
            socket.set_nonblocking(true)?;
            let mut socket = tokio::net::UnixStream::from_std(socket)?;
            socket.write_all(&payload).await?;
            socket.shutdown().await
        };
        sent.await
            .map_err(|e| sandbox_err(id, format!("send jail spec: {e}")))?;
        let mut line = String::new();
        if let Some(stdout) = child.stdout.take() {
            BufReader::new(stdout)
                .read_line(&mut line)
                .await
                .map_err(|e| sandbox_err(id, format!("read sandbox pid: {e}")))?;
        }
        let status = child
            .wait()
            .await
            .map_err(|e| sandbox_err(id, format!("wait for boot: {e}")))?;
        line.trim().parse().map_err(|_| {
            let log = std::fs::read_to_string(self.node.places.log_path(id)).unwrap_or_default();
            sandbox_err(
                id,
                format!(
                    "boot exited with {status} before starting the sandbox: {}",
                    log.trim()
                ),
            )
        })
    }
}

impl Jailer {
    /// Starts the template's start command in the background, then runs its ready command
    /// until it succeeds.
    pub(super) async fn start_and_wait_ready(
        &self,
        spec: &LaunchSpec,
        endpoint: &Endpoint,
    ) -> Result<(), RuntimeError> {
        let id = &spec.sandbox_id;
        let exec = |command, user| agent_client::Exec {
            token: &spec.envd_access_token,
            user,
            command,
            envs: &spec.env_vars,
            cwd: Some(&spec.image.workdir),
        };
        if let Some(start) = &spec.image.start_cmd {
            // As the agent starts any command of that user: root's confined by the
            // sandbox's namespaces, cgroups and seccomp like every other.
            let user = spec.image.start_user.as_deref().unwrap_or(&spec.image.user);
            let start_exec = exec(start, user);
            let started = tokio::time::timeout(
                self.node.config.ready_timeout,
                agent_client::start_detached(&endpoint.agent_socket, &start_exec),
            )
            .await
            .unwrap_or_else(|_| {
                Err(agent_client::AgentCallError::NoAnswer {
                    what: "the start of the start command",
                    waited_ms: self.node.config.ready_timeout.as_millis(),
                })
            });
            started.map_err(|e| RuntimeError::NotReady {
                sandbox_id: id.clone(),
                message: format!("cannot run the start command: {e}"),
            })?;
        }
        let Some(ready) = &spec.image.ready_cmd else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + self.node.config.ready_timeout;
        let mut last;
        loop {
            let mut output = Vec::new();
            // Each run too is held to the deadline: a ready command that never exits (the
            // template's author wrote it) must not hold the create or the build forever.
            let ready_exec = exec(ready, &spec.image.user);
            let run = agent_client::run(&endpoint.agent_socket, &ready_exec, |b| {
                if output.len() < 4096 {
                    output.extend_from_slice(b);
                }
            });
            let code = match tokio::time::timeout_at(deadline, run).await {
                Ok(ran) => ran.map_err(|e| RuntimeError::NotReady {
                    sandbox_id: id.clone(),
                    message: format!("cannot run the ready command: {e}"),
                })?,
                Err(_) => {
                    return Err(RuntimeError::NotReady {
                        sandbox_id: id.clone(),
                        message: format!(
                            "the ready command '{ready}' did not end within {} s",
                            self.node.config.ready_timeout.as_secs()
                        ),
                    });
                }
            };
            if code == 0 {
                return Ok(());
            }
            last = format!(
                "exit code {code}: {}",
                String::from_utf8_lossy(&output).trim()
            );
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(RuntimeError::NotReady {
            sandbox_id: id.clone(),
            message: format!(
                "the ready command '{ready}' did not succeed within {} s (last: {last})",
                self.node.config.ready_timeout.as_secs()
            ),
        })
    }
}

/// What booting a sandbox needs beyond its slot and directory.
pub(super) struct BootSpec<'a> {
    pub(super) id: &'a str,
    /// Named when a layer is missing.
    pub(super) template_id: &'a str,
    pub(super) layers: &'a [String],
    pub(super) volumes: &'a [sandbar_core::VolumeMount],
    pub(super) agent: AgentConfig,
    /// Booted again on kept files: its log goes on, and its machine id is the one they hold.
    pub(super) kept: bool,
    /// What the sandbox reads as the kernel's boot id.
    pub(super) boot_id: &'a str,
}

impl<'a> BootSpec<'a> {
    pub(super) fn of(spec: &'a LaunchSpec, boot_id: &'a str) -> Self {
        BootSpec {
            id: &spec.sandbox_id,
            template_id: &spec.template.id,
            layers: &spec.image.layers,
            volumes: &spec.volumes,
            agent: AgentConfig {
                access_token: Some(spec.envd_access_token.clone()),
                default_user: spec.image.user.clone(),
                env_vars: spec.env_vars.clone(),
                default_workdir: default_workdir(&spec.image.user, &spec.image.workdir)
                    .map(str::to_owned),
                memory_limit_mb: Some(spec.memory_mb),
            },
            kept: spec.kept.is_some(),
            boot_id,
        }
    }
}

/// The agent's default working directory for an image: none when it is the user's home,
/// which leaves each user in their own.
pub(super) fn default_workdir<'a>(user: &str, workdir: &'a str) -> Option<&'a str> {
    Some(workdir).filter(|w| *w != format!("/home/{user}"))
}
