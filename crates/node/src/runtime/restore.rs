//! Restoring a checkpointed sandbox with CRIU: the host-side mounts its root, sysfs, boot id
//! and volumes need, the descriptors handed to CRIU, and the restore itself.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sandbar_core::{Endpoint, HandlePhase, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

use crate::net::netns::PreparedNetns;

use super::criu_runs::{TCP_CLOSE, check_criu_version, run_criu};
use super::handle::{launched, start_ticks};
use super::{agent_client, run_blocking, sandbox_err};

node_part! {
    /// Restores sandboxes paused to disk from their checkpoint.
    pub(super) struct Restorer;
}

/// Where a restored sandbox's inherited descriptors start: above anything CRIU itself opens
/// early.
pub(super) const INHERITED_FD_BASE: i32 = 200;

impl Restorer {
    /// Restores the checkpointed sandbox `id` into its kept network namespace and cgroups;
    /// returns its new PID 1.
    pub(super) async fn undump(&self, id: &str, h: &RuntimeHandle) -> Result<i32, RuntimeError> {
        let criu = self.node.criu_for_restore(id).await?;
        let dir = self.node.places.checkpoint_dir(id);
        let read_dir = dir.clone();
        let started = std::time::Instant::now();
        let verify = !self.node.is_verified(&dir);
        let header = run_blocking(id, move || {
            crate::checkpoint::read_header(&read_dir, verify)
        })
        .await?;
        self.node.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, verify_us = started.elapsed().as_micros() as u64, "checkpoint verified");
        check_criu_version(id, &criu, &header)?;
        let layers = self
            .node
            .layers
            .stack(&h.layers)
            .map_err(|e| sandbox_err(id, e))?;
        let netns_path = self.node.places.kept_ns(id, "net");
        let userns_path = self.node.places.kept_ns(id, "user");
        let slot = h.slot;
        let opened = run_blocking(id, move || -> Result<_, String> {
            let netns: std::os::fd::OwnedFd = std::fs::File::open(&netns_path)
                .map_err(|e| format!("open {}: {e}", netns_path.display()))?
                .into();
            let userns: std::os::fd::OwnedFd = std::fs::File::open(&userns_path)
                .map_err(|e| format!("open {}: {e}", userns_path.display()))?
                .into();
            let agent_socket = crate::net::netns::socket_in(&netns)
                .map_err(|e| format!("cannot make the agent's socket: {e}"))?;
            Ok((
                PreparedNetns {
                    slot,
                    netns,
                    agent_socket,
                },
                userns,
            ))
        })
        .await?;
        let (prepared, userns) = opened;
        self.run_restore(
            id,
            RestoreFrom {
                images: dir,
                header,
                layers,
                userns,
                netns: prepared,
                log: self.node.places.log_path(id),
                etc: None,
                boot_id: h.boot_id.clone(),
            },
        )
        .await
    }

    /// Restores the processes of the staged checkpoint `restore` as sandbox `spec` in `netns`,
    /// on its disk and cgroups, with the slot's ids and name server and a new agent log; the
    /// staged images are removed afterwards. Returns the restored PID 1.
    pub(super) async fn restore_processes(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        id_map: IdMap,
        restore: SlotRestore,
    ) -> Result<i32, RuntimeError> {
        let id = &spec.sandbox_id;
        let (log_path, log) = self.log_for_restore(id, &restore.header, id_map.host_base)?;
        let layers = self
            .node
            .layers
            .stack(&spec.image.layers)
            .map_err(|message| RuntimeError::TemplateMissing {
                template_id: format!("{} ({message})", spec.template.id),
            })?;
        let userns = sandbar_jail::host::new_user_namespace(id_map)
            .map_err(|e| sandbox_err(id, format!("cannot make its user namespace: {e}")))?;
        let gateway = self
            .node
            .network
            .addrs(netns.slot)
            .map_err(|e| sandbox_err(id, e))?
            .host;
        let mut etc = vec![("resolv.conf", format!("nameserver {gateway}\n"), 0o644)];
        if let Some(machine_id) = &restore.machine_id {
            etc.push(("machine-id", format!("{machine_id}\n"), 0o444));
        }
        let pid = self
            .run_restore(
                id,
                RestoreFrom {
                    images: restore.work.clone(),
                    header: restore.header,
                    layers,
                    userns,
                    netns,
                    log: log_path,
                    etc: Some((id_map.host_base, etc)),
                    boot_id: restore.boot_id,
                },
            )
            .await?;
        // Its lines from before the checkpoint belong to the sandbox it was taken of.
        let _ = log.set_len(0);
        drop(log);
        let _ = crate::storage::disks::remove_tree(&restore.work);
        Ok(pid)
    }

    /// The agent log a restored sandbox writes, made as long as the one its processes held
    /// was at the dump: CRIU checks the size of every file it reopens. The caller empties it
    /// once the restore is done; the agent appends, so its next line lands at the start.
    pub(super) fn log_for_restore(
        &self,
        id: &str,
        header: &crate::checkpoint::Header,
        owner: u32,
    ) -> Result<(PathBuf, std::fs::File), RuntimeError> {
        let held_size = header
            .externals
            .iter()
            .find_map(|e| match e {
                crate::checkpoint::External::Placed {
                    file: crate::checkpoint::Placed::Log,
                    size,
                    ..
                } => Some(*size),
                // Format 1 recorded the log as the one file held for appending.
                crate::checkpoint::External::File {
                    append: true, size, ..
                } => Some(*size),
                _ => None,
            })
            .unwrap_or(0);
        let log_path = self.node.places.log_path(id);
        let log = std::fs::File::create(&log_path)
            .and_then(|log| {
                std::os::unix::fs::fchown(&log, Some(owner), Some(owner))?;
                log.set_len(held_size)?;
                Ok(log)
            })
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", log_path.display())))?;
        Ok((log_path, log))
    }
}

impl Restorer {
    /// Mounts what the restore of sandbox `id` needs on the host (its root, a sysfs of its
    /// network namespace, its agent's listener), runs `criu restore` from its cgroups and
    /// returns the restored PID 1; the host-side mounts are gone afterwards either way.
    pub(super) async fn run_restore(
        &self,
        id: &str,
        from: RestoreFrom,
    ) -> Result<i32, RuntimeError> {
        let criu = self.node.criu_for_restore(id).await?;
        let RestoreFrom {
            images: dir,
            header,
            layers,
            userns,
            netns,
            log,
            etc,
            boot_id,
        } = from;
        let images_bytes: u64 = header.images.iter().map(|i| i.size).sum();
        let started = std::time::Instant::now();
        let undo_mounts = || self.node.unmount_restore(id, layers.len());
        let mounts = HostMounts {
            layers: layers.clone(),
            userns,
            netns,
            etc,
            boot_id,
        };
        let aids = match self.mount_for_restore(id, &header, mounts).await {
            Ok(aids) => aids,
            Err(e) => {
                undo_mounts();
                return Err(e);
            }
        };
        let inputs = match self.criu_inputs(id, &header, &layers, &log, &aids) {
            Ok(inputs) => inputs,
            Err(e) => {
                undo_mounts();
                return Err(e);
            }
        };
        let mut command = self.criu_restore_command(&criu, id, &dir, &inputs);
        let prepared_in = started.elapsed();
        let status = self
            .restore_with_retries(id, &dir, &mut command, restore_deadline(images_bytes))
            .await;
        let criu_in = started.elapsed() - prepared_in;
        drop(inputs);
        drop(aids);
        undo_mounts();
        tracing::debug!(
            sandbox_id = %id,
            prepare_us = prepared_in.as_micros() as u64,
            criu_us = criu_in.as_micros() as u64,
            "restore timings"
        );
        let status =
            status.map_err(|e| sandbox_err(id, format!("run {}: {e}", criu.path.display())))?;
        if !status.success() {
            let errors = crate::checkpoint::log_errors(&dir.join(crate::checkpoint::RESTORE_LOG));
            // Whatever CRIU had started is in the sandbox's cgroups.
            let _ = self.node.cgroups.kill_all(id).await;
            return Err(sandbox_err(
                id,
                format!("restore failed ({status}): {errors}"),
            ));
        }
        crate::checkpoint::restored_pid(&dir)
            .ok_or_else(|| sandbox_err(id, "the restore wrote no PID"))
    }

    /// Mounts, on the host, what CRIU binds back into restored sandbox `id`: its root over
    /// its layers, its volumes, a sysfs of its network namespace and its boot id; writes the
    /// `/etc` files it gets anew and binds its agent's listener.
    async fn mount_for_restore(
        &self,
        id: &str,
        header: &crate::checkpoint::Header,
        mounts: HostMounts,
    ) -> Result<RestoreAids, RuntimeError> {
        let HostMounts {
            layers,
            userns,
            netns: prepared,
            etc,
            boot_id,
        } = mounts;
        let sandbox_dir = self.node.disks.path(id);
        let sysfs = self.node.places.restored_sysfs(id);
        let volumes_dir = self.node.places.restored_volumes_dir(id);
        let socket = self.node.places.socket_path(id);
        let volumes: Vec<(PathBuf, PathBuf)> = header
            .externals
            .iter()
            .filter_map(|e| match e {
                crate::checkpoint::External::Volume { key, source } => {
                    Some((source.clone(), volumes_dir.join(key)))
                }
                _ => None,
            })
            .collect();
        // A checkpoint that binds a boot id but whose handle names none cannot be made by
        // this node; it would get a new one, as a boot does.
        let boot_id = header
            .externals
            .iter()
            .any(|e| matches!(e, crate::checkpoint::External::BootId { .. }))
            .then(|| boot_id.unwrap_or_else(sandbar_core::ids::new_uuid));
        let boot_id_dir = self.node.places.restored_boot_id_dir(id);
        run_blocking(id, move || -> Result<_, String> {
            sandbar_jail::host::mount_root_mapped(&sandbox_dir, &layers, &userns)
                .map_err(|e| format!("cannot mount its root again: {e}"))?;
            if !volumes.is_empty() {
                std::fs::create_dir_all(&volumes_dir)
                    .map_err(|e| format!("create {}: {e}", volumes_dir.display()))?;
            }
            for (source, target) in &volumes {
                sandbar_jail::host::mount_volume_mapped(source, &userns, target).map_err(|e| {
                    format!("cannot mount the volume {} again: {e}", source.display())
                })?;
            }
            if let Some((owner, etc)) = &etc {
                let root = sandbox_dir.join(sandbar_jail::layout::ROOT);
                for (name, content, mode) in etc {
                    sandbar_jail::host::replace_file_beneath(
                        &root,
                        &Path::new("etc").join(name),
                        content.as_bytes(),
                        *mode,
                        *owner,
                    )
                    .map_err(|e| format!("cannot write /etc/{name}: {e}"))?;
                }
            }
            if let Err(e) = std::fs::create_dir(&sysfs)
                && e.kind() != std::io::ErrorKind::AlreadyExists
            {
                return Err(format!("create {}: {e}", sysfs.display()));
            }
            let netns_path = PathBuf::from(format!("/proc/self/fd/{}", prepared.netns.as_raw_fd()));
            sandbar_jail::host::mount_sysfs_of(&netns_path, &sysfs)
                .map_err(|e| format!("cannot mount its sysfs: {e}"))?;
            let boot_id_file = boot_id
                .map(|boot_id| sandbar_jail::host::mount_boot_id(&boot_id_dir, &boot_id))
                .transpose()
                .map_err(|e| format!("cannot make its boot id: {e}"))?;
            let _ = std::fs::remove_file(&socket);
            let listener = prepared
                .listen_at(&socket)
                .map_err(|e| format!("bind {}: {e}", socket.display()))?;
            Ok(RestoreAids {
                netns: prepared,
                listener,
                boot_id_file,
                sysfs,
                volumes_dir,
            })
        })
        .await
    }

    /// CRIU's arguments for the checkpoint's external mounts and the descriptors it is handed
    /// at fixed numbers: the host files the processes held, the new listener and the network
    /// namespace.
    fn criu_inputs(
        &self,
        id: &str,
        header: &crate::checkpoint::Header,
        layers: &[PathBuf],
        log: &Path,
        aids: &RestoreAids,
    ) -> Result<CriuInputs, RuntimeError> {
        let agents = self.node.places.agents_dir();
        let mut layer_dirs = vec![self.node.disks.path(id).join(sandbar_jail::layout::UPPER)];
        layer_dirs.extend(layers.iter().cloned());
        let libraries = self.node.library_sources();
        let sources = crate::checkpoint::PlacedSources {
            agents: &agents,
            log: Some(log),
            layers: Some(&layer_dirs),
            libraries: &libraries,
        };
        let files =
            crate::checkpoint::open_externals(header, sources).map_err(|e| sandbox_err(id, e))?;
        let mut args = external_mount_args(id, header, aids)?;
        let mut inherited: Vec<(i32, i32)> = Vec::new();
        let mut owned = Vec::new();
        let mut next = INHERITED_FD_BASE;
        for (key, fd) in files {
            args.push(format!("--inherit-fd=fd[{next}]:{key}"));
            inherited.push((fd.as_raw_fd(), next));
            owned.push(fd);
            next += 1;
        }
        args.push(format!(
            "--inherit-fd=fd[{next}]:socket:[{}]",
            header.listener_inode
        ));
        inherited.push((aids.listener.as_raw_fd(), next));
        next += 1;
        args.push(format!("--inherit-fd=fd[{next}]:extnet"));
        inherited.push((aids.netns.netns.as_raw_fd(), next));
        Ok(CriuInputs {
            args,
            inherited,
            _open_files: owned,
        })
    }

    /// `criu restore` of the images in `dir` into sandbox `id`'s root, joining its cgroups
    /// and taking `inputs`' descriptors before it starts.
    fn criu_restore_command(
        &self,
        criu: &crate::checkpoint::Criu,
        id: &str,
        dir: &Path,
        inputs: &CriuInputs,
    ) -> tokio::process::Command {
        let joins: Vec<std::ffi::CString> = self
            .node
            .cgroups
            .join_files(id)
            .iter()
            .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok())
            .collect();
        let inherited = inputs.inherited.clone();
        let mut command = criu.command();
        command
            .arg("restore")
            .arg("--images-dir")
            .arg(dir)
            .arg("--log-file")
            .arg(crate::checkpoint::RESTORE_LOG)
            .arg("-v2")
            .arg("--root")
            .arg(self.node.disks.path(id).join(sandbar_jail::layout::ROOT))
            .arg("--restore-detached")
            .arg(TCP_CLOSE)
            .arg("--manage-cgroups=ignore")
            .arg("--pidfile")
            .arg(dir.join(crate::checkpoint::RESTORE_PIDFILE))
            .args(&inputs.args)
            // Nothing to a pipe: CRIU must be able to finish the restore if the server dies.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
        // functions (open, write, close, dup2) on data prepared before the fork.
        unsafe {
            command.pre_exec(move || {
                // CRIU leaves restored tasks in its own cgroups (--manage-cgroups=ignore): it
                // joins the sandbox's first.
                for file in &joins {
                    let fd = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let written = libc::write(fd, c"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for (from, to) in &inherited {
                    if libc::dup2(*from, *to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        command
    }

    /// Runs the restore `command`, once more if the first try fails or hangs.
    async fn restore_with_retries(
        &self,
        id: &str,
        dir: &Path,
        command: &mut tokio::process::Command,
        deadline: Duration,
    ) -> std::io::Result<std::process::ExitStatus> {
        crate::checkpoint::clear_restore(dir);
        let mut tries = 0;
        loop {
            tries += 1;
            let outcome = run_criu(command, deadline).await;
            let failed = match &outcome {
                Ok(status) => !status.success(),
                Err(e) => e.kind() == std::io::ErrorKind::TimedOut,
            };
            if !failed || tries == RESTORE_TRIES {
                return outcome;
            }
            // Seen rarely: a thread of the restored tree gone before CRIU let it go, and
            // CRIU then stuck on its own kill of the tree. The images are intact; what the
            // failed attempt started has not run any of the sandbox's code yet.
            let errors = crate::checkpoint::log_errors(&dir.join(crate::checkpoint::RESTORE_LOG));
            tracing::warn!(sandbox_id = %id, error = %errors, ?outcome, "restore failed; trying again");
            let _ = self.node.cgroups.kill_all(id).await;
            crate::checkpoint::clear_restore(dir);
        }
    }
}

/// How many times a restore is attempted before it is given up.
pub(super) const RESTORE_TRIES: u32 = 2;

/// How long one restore may take: restores run at hundreds of MiB a second, so this is only
/// ever reached by a CRIU that is stuck.
pub(super) fn restore_deadline(images_bytes: u64) -> Duration {
    Duration::from_secs(20 + 20 * images_bytes.div_ceil(1 << 30))
}

/// What [`LinuxRuntime::run_restore`] restores, and into what.
/// A file of `/etc` written into a restored sandbox's root: name, content, mode.
pub(super) type EtcFile = (&'static str, String, u32);

/// What a restore mounts or binds on the host for CRIU, taken from its [`RestoreFrom`].
struct HostMounts {
    layers: Vec<PathBuf>,
    userns: std::os::fd::OwnedFd,
    netns: PreparedNetns,
    etc: Option<(u32, Vec<EtcFile>)>,
    boot_id: Option<String>,
}

/// What the host holds for a restore while CRIU runs; its mounts are undone by
/// `unmount_restore` once it is dropped.
struct RestoreAids {
    netns: PreparedNetns,
    listener: std::os::unix::net::UnixListener,
    boot_id_file: Option<PathBuf>,
    sysfs: PathBuf,
    volumes_dir: PathBuf,
}

/// CRIU's arguments and the descriptors handed to it (`inherited`: ours, at its numbers).
struct CriuInputs {
    args: Vec<String>,
    inherited: Vec<(i32, i32)>,
    /// The host files among them, open until CRIU is done with them.
    _open_files: Vec<std::os::fd::OwnedFd>,
}

/// `--external` arguments binding the checkpoint's mounts to what `aids` mounted.
fn external_mount_args(
    id: &str,
    header: &crate::checkpoint::Header,
    aids: &RestoreAids,
) -> Result<Vec<String>, RuntimeError> {
    let mut args = Vec::new();
    for external in &header.externals {
        match external {
            crate::checkpoint::External::Device { key, source } => {
                if !crate::checkpoint::is_device_node_path(source) {
                    return Err(sandbox_err(
                        id,
                        "the checkpoint binds a device that is not one of /dev's",
                    ));
                }
                args.push(format!("--external=mnt[{key}]:{}", source.display()));
            }
            crate::checkpoint::External::Sysfs { key } => {
                args.push(format!("--external=mnt[{key}]:{}", aids.sysfs.display()));
            }
            crate::checkpoint::External::Volume { key, .. } => {
                args.push(format!(
                    "--external=mnt[{key}]:{}",
                    aids.volumes_dir.join(key).display()
                ));
            }
            crate::checkpoint::External::BootId { key } => {
                if let Some(file) = &aids.boot_id_file {
                    args.push(format!("--external=mnt[{key}]:{}", file.display()));
                }
            }
            crate::checkpoint::External::Placed { .. }
            | crate::checkpoint::External::LayerFile { .. }
            | crate::checkpoint::External::File { .. } => {}
        }
    }
    Ok(args)
}

pub(super) struct RestoreFrom {
    /// The images, where CRIU also writes its log and the PID file.
    pub(super) images: PathBuf,
    pub(super) header: crate::checkpoint::Header,
    /// The sandbox's layers, topmost first.
    pub(super) layers: Vec<PathBuf>,
    /// A user namespace with the sandbox's id range, to id-map the layers.
    pub(super) userns: std::os::fd::OwnedFd,
    pub(super) netns: PreparedNetns,
    /// The agent log the restored sandbox writes (the checkpoint's processes get it in place
    /// of the one they held).
    pub(super) log: PathBuf,
    /// Files of `/etc` written into the root before the restore, and their owner.
    pub(super) etc: Option<(u32, Vec<EtcFile>)>,
    /// The boot id the restored sandbox shows, when its checkpoint binds one.
    pub(super) boot_id: Option<String>,
}

/// A checkpoint staged for [`sequence::restore_in_slot`], and what the restored sandbox
/// keeps or gets anew.
pub(super) struct SlotRestore {
    /// The staged images (see `stage_checkpoint`), removed once restored.
    pub(super) work: PathBuf,
    pub(super) header: crate::checkpoint::Header,
    /// A new machine id for a new machine; `None` keeps the one its files hold.
    pub(super) machine_id: Option<String>,
    pub(super) boot_id: Option<String>,
}

impl Restorer {
    pub(super) async fn restore_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let h = launched(sandbox_id, handle)?;
        if h.phase != HandlePhase::Checkpointed {
            return Err(sandbox_err(sandbox_id, "the sandbox is not checkpointed"));
        }
        let mut opening = self.node.holdings.opening(sandbox_id);
        opening.hold_memory(self.node.grant_memory(sandbox_id, h.memory_mb)?);
        let started = std::time::Instant::now();
        // Joining a frozen cgroup would freeze CRIU itself.
        let restored = match self.node.cgroups.thaw(sandbox_id) {
            Ok(()) => self.undump(sandbox_id, h).await,
            Err(e) => Err(sandbox_err(sandbox_id, e)),
        };
        let pid = restored?;
        let running = RuntimeHandle {
            pid,
            start_ticks: start_ticks(pid).unwrap_or_default(),
            phase: HandlePhase::Running,
            ..h.clone()
        };
        let endpoint = self.node.endpoint(sandbox_id, h.slot)?;
        if let Err(e) =
            agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(10)).await
        {
            let _ = self.node.cgroups.kill_all(sandbox_id).await;
            return Err(sandbox_err(
                sandbox_id,
                format!("the restored agent does not answer: {e}"),
            ));
        }
        tracing::debug!(
            sandbox_id,
            healthy_us = started.elapsed().as_micros() as u64,
            "restored agent answers"
        );
        opening.commit();
        sandbar_core::faults::crash_point("restore.restored");
        // The images stay until the sandbox is recorded running (`discard_checkpoint`): a
        // restart before that finds the finished restore beside them.
        Ok((running, endpoint))
    }
}
