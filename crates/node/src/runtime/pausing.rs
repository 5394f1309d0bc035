//! Pausing to disk and back: CRIU dumps of frozen sandboxes, their kept namespaces and the
//! restores.

use super::*;

/// How long a pause waits for the agent to close its ends of connections from the host.
pub(super) const HOST_SOCKETS_PATIENCE: Duration = Duration::from_secs(2);
/// Where a restored sandbox's inherited descriptors start: above anything CRIU itself opens
/// early.
pub(super) const INHERITED_FD_BASE: i32 = 200;

impl LinuxRuntime {
    pub(super) fn checkpoint_dir(&self, id: &str) -> PathBuf {
        self.config.data_dir.join("checkpoints").join(id)
    }

    /// A namespace of the sandbox kept (bind-mounted) while its processes are checkpointed.
    pub(super) fn kept_ns(&self, id: &str, kind: &str) -> PathBuf {
        self.config
            .data_dir
            .join("checkpoints")
            .join(format!("{id}.{kind}"))
    }

    /// The network namespace a checkpointed sandbox's processes are restored into; the one
    /// its PID 1 joined at boot, kept alive by a bind mount.
    pub(super) fn keep_netns(&self, id: &str, pid: i32) -> std::io::Result<PathBuf> {
        for kind in ["net", "user"] {
            let target = self.kept_ns(id, kind);
            let source = PathBuf::from(format!("/proc/{pid}/ns/{kind}"));
            if ns_inode(&target).is_some() && ns_inode(&target) == ns_inode(&source) {
                continue;
            }
            let _ = sandbar_jail::host::unmount(&target);
            sandbar_jail::host::bind_file(&source, &target)?;
        }
        Ok(self.kept_ns(id, "net"))
    }

    /// Removes a sandbox's checkpoint and the namespaces kept for it; nothing if it has none.
    pub(super) fn forget_checkpoint(&self, id: &str) {
        self.unmount_restore_aids(id);
        self.set_verified(&self.checkpoint_dir(id), false);
        for kind in ["net", "user"] {
            let kept = self.kept_ns(id, kind);
            while sandbar_jail::host::unmount(&kept).is_ok() {}
            let _ = std::fs::remove_file(&kept);
        }
        let _ = std::fs::remove_dir_all(self.checkpoint_dir(id));
        let carried = self.carried_checkpoint_dir(id);
        self.set_verified(&carried, false);
        let _ = crate::storage::disks::remove_tree(&carried);
    }

    /// Dumps the frozen sandbox `id` with CRIU, which ends its processes.
    pub(super) async fn dump(
        &self,
        id: &str,
        h: &Handle,
    ) -> Result<crate::checkpoint::Header, RuntimeError> {
        let criu = self
            .criu
            .get()
            .ok_or_else(|| sandbox_err(id, "this node cannot checkpoint sandboxes"))?;
        if !is_alive(h) {
            return Err(sandbox_err(id, "the sandbox's processes are gone"));
        }
        if !self.cgroups.is_frozen(id) {
            return Err(sandbox_err(id, "the sandbox is not frozen"));
        }
        let freezer = self
            .cgroups
            .freezer_dir(id)
            .ok_or_else(|| sandbox_err(id, "the freezer controller is not mounted"))?;
        let netns = self
            .keep_netns(id, h.pid)
            .map_err(|e| sandbox_err(id, format!("cannot keep its network namespace: {e}")))?;
        let netns_inode =
            ns_inode(&netns).ok_or_else(|| sandbox_err(id, "its network namespace is gone"))?;
        let dir = self.checkpoint_dir(id);
        self.set_verified(&dir, false);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", dir.display())))?;
        let plan = match self
            .dump_into(id, h, &criu, &freezer, &dir, netns_inode, false)
            .await
        {
            Ok(plan) => plan,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let (version, digest) = (criu.version.clone(), self.agent_digest.clone());
        let sealing = std::time::Instant::now();
        let sealed_dir = dir.clone();
        let sealed = tokio::task::spawn_blocking(move || {
            crate::checkpoint::seal(&sealed_dir, version, digest, plan)
        })
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, format!("cannot write the checkpoint header: {e}")))?;
        self.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, seal_us = sealing.elapsed().as_micros() as u64, "checkpoint sealed");
        Ok(sealed)
    }

    /// Runs `criu dump` of the frozen sandbox `id` (whose network namespace is
    /// `netns_inode`) into `images`, leaving its processes running or ending them; returns
    /// what the dump was told about the host.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn dump_into(
        &self,
        id: &str,
        h: &Handle,
        criu: &crate::checkpoint::Criu,
        freezer: &Path,
        images: &Path,
        netns_inode: u64,
        leave_running: bool,
    ) -> Result<crate::checkpoint::DumpPlan, RuntimeError> {
        let tasks = self.cgroups.members(id);
        let pid = h.pid;
        let volumes = h
            .volumes
            .iter()
            .map(|v| {
                crate::storage::volumes::volume_dir(&self.config.data_dir, &v.team_id, &v.volume_id)
                    .map(|source| (PathBuf::from(&v.path), source))
                    .map_err(|e| sandbox_err(id, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let placed = self
            .placed_files(id)
            .map_err(|e| sandbox_err(id, format!("cannot read the node's own files: {e}")))?;
        let kernel = self.kernel_filesystems.clone();
        let mut layer_dirs = vec![self.disks.path(id).join(sandbar_jail::layout::UPPER)];
        layer_dirs.extend(
            self.layers
                .stack(&h.layers)
                .map_err(|e| sandbox_err(id, e))?,
        );
        let layer_dirs = crate::checkpoint::LayerDirs(layer_dirs);
        let planning = tokio::task::spawn_blocking(move || {
            crate::checkpoint::plan_dump(
                &crate::checkpoint::HostProc,
                &crate::checkpoint::PlanInput {
                    pid,
                    tasks: &tasks,
                    netns_inode,
                    listener_fd: LISTENER_FD,
                    volumes: &volumes,
                    kernel: &kernel,
                    placed: &placed,
                    layers: &layer_dirs,
                },
            )
        });
        // The plan only reads /proc and never opens what the sandbox holds, so it does not
        // wait on the sandbox; bounded all the same, as every wait on a sandbox is.
        let plan = tokio::time::timeout(PLAN_DEADLINE, planning)
            .await
            .map_err(|_| {
                sandbox_err(
                    id,
                    format!(
                        "listing what it holds took over {} s; the checkpoint is abandoned",
                        PLAN_DEADLINE.as_secs()
                    ),
                )
            })?
            .map_err(|e| sandbox_err(id, e))?
            .map_err(|e| {
                if let crate::checkpoint::PlanError::Foreign { found, dev, .. } = &e {
                    tracing::info!(sandbox_id = %id, found, ?dev, "a checkpoint refused: the sandbox holds an object from outside it");
                }
                if e.is_refusal() {
                    RuntimeError::Uncheckpointable {
                        sandbox_id: id.to_owned(),
                        reason: e.to_string(),
                    }
                } else {
                    sandbox_err(id, e)
                }
            })?;
        crate::checkpoint::write_plan(images, &plan)
            .map_err(|e| sandbox_err(id, format!("cannot write {}: {e}", images.display())))?;
        let mut command = criu.command();
        command
            .arg("dump")
            .arg("--tree")
            .arg(h.pid.to_string())
            .arg("--images-dir")
            .arg(images)
            .arg("--log-file")
            .arg(crate::checkpoint::DUMP_LOG)
            .arg("-v2")
            .arg("--freeze-cgroup")
            .arg(freezer)
            .args(NO_NETWORK_LOCK)
            .arg(TCP_CLOSE)
            .args(&plan.args)
            // PID 1 is non-dumpable; the ownership check CRIU would run from inside its user
            // namespace cannot open its namespaces (patch 0001).
            .env("CRIU_SKIP_USERNS_CHECK", "1")
            // Nothing to a pipe: CRIU must be able to finish the dump if the server dies.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if leave_running {
            command.arg("--leave-running");
        }
        let mut child = command
            .spawn()
            .map_err(|e| sandbox_err(id, format!("run {}: {e}", criu.path.display())))?;
        sandbar_core::faults::crash_point(if leave_running {
            "snapshot.dumping"
        } else {
            "checkpoint.dumping"
        });
        let deadline = dump_deadline(h.memory_mb);
        let status = match tokio::time::timeout(deadline, child.wait()).await {
            Ok(status) => status
                .map_err(|e| sandbox_err(id, format!("wait for {}: {e}", criu.path.display())))?,
            Err(_) => {
                // CRIU lets go of the tasks it seized when it dies; they stay in their
                // frozen cgroup, paused in memory as before the dump.
                let _ = child.kill().await;
                return Err(sandbox_err(
                    id,
                    format!(
                        "the dump did not finish within {} s and was abandoned; the sandbox stays paused in memory",
                        deadline.as_secs()
                    ),
                ));
            }
        };
        if !status.success() {
            let mut errors =
                crate::checkpoint::log_errors(&images.join(crate::checkpoint::DUMP_LOG));
            let held = crate::checkpoint::host_unix_sockets(&self.cgroups.members(id));
            if !held.is_empty() {
                errors = format!(
                    "{errors}; from the host: {}",
                    crate::checkpoint::describe_host_sockets(&held)
                );
            }
            let what = if leave_running {
                "snapshot"
            } else {
                "checkpoint"
            };
            return Err(sandbox_err(
                id,
                format!("{what} failed ({status}): {errors}"),
            ));
        }
        Ok(plan)
    }

    /// Waits for the dumps and restores a server that died left running, so that what they
    /// leave (a sealed or abandoned checkpoint, a restored or killed sandbox) can be judged
    /// once they are done. One still running after a long wait is killed.
    pub(super) async fn wait_for_orphaned_criu(criu: &Path, data_dir: &Path) {
        let mut waited = Duration::ZERO;
        loop {
            let pids = crate::checkpoint::criu_in_flight(criu, data_dir);
            if pids.is_empty() {
                return;
            }
            if waited.is_zero() {
                tracing::warn!(
                    ?pids,
                    "waiting for checkpoint work a previous server left running"
                );
            }
            if waited >= ORPHANED_CRIU_WAIT {
                tracing::error!(
                    ?pids,
                    "checkpoint work a previous server left does not end; killing it"
                );
                for pid in pids {
                    // SAFETY: kill(2) on a PID just read from /proc; at worst it is gone.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            waited += Duration::from_millis(20);
        }
    }

    /// What is left of sandbox `id` once a dump ended its processes: anything that escaped
    /// the dump, the memory its cgroup still holds, its memory grant and its agent socket.
    pub(super) async fn end_dumped(&self, id: &str) {
        if let Err(err) = self.cgroups.kill_all(id).await {
            tracing::warn!(sandbox_id = %id, error = %err, "processes left after the checkpoint");
        }
        self.cgroups.empty_memory(id);
        if let Some(memory) = self.holdings.take_memory(id) {
            self.give_back_memory(id, memory);
        }
        let _ = std::fs::remove_file(self.socket_path(id));
    }

    pub(super) fn is_verified(&self, images: &Path) -> bool {
        self.verified_images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(images)
    }

    pub(super) fn set_verified(&self, images: &Path, verified: bool) {
        let mut set = self
            .verified_images
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if verified {
            set.insert(images.to_owned());
        } else {
            set.remove(images);
        }
    }

    /// The host-side mounts a restore of sandbox `id` makes (its root over `layers` layers,
    /// a sysfs of its network namespace, its volumes), gone.
    pub(super) fn unmount_restore(&self, id: &str, layers: usize) {
        sandbar_jail::host::unmount_root(&self.disks.path(id), layers);
        self.unmount_restore_aids(id);
    }

    /// The mounts outside the sandbox's directory that a restore of sandbox `id` makes for
    /// CRIU (its sysfs, its boot id, its volumes), gone with their mount points.
    pub(super) fn unmount_restore_aids(&self, id: &str) {
        for dir in [self.restored_sysfs(id), self.restored_boot_id_dir(id)] {
            let _ = sandbar_jail::host::unmount(&dir);
            let _ = std::fs::remove_dir(&dir);
        }
        let volumes = self.restored_volumes_dir(id);
        if let Ok(entries) = std::fs::read_dir(&volumes) {
            for entry in entries.flatten() {
                let _ = sandbar_jail::host::unmount(&entry.path());
                let _ = std::fs::remove_dir(entry.path());
            }
            let _ = std::fs::remove_dir(&volumes);
        }
    }

    /// Where a restore of sandbox `id` mounts a sysfs of its network namespace on the host.
    pub(super) fn restored_sysfs(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.sys"))
    }

    /// Where a restore of sandbox `id` mounts the filesystem of its boot id on the host, for
    /// CRIU to bind the file back.
    pub(super) fn restored_boot_id_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.boot"))
    }

    /// Where a restore of sandbox `id` mounts its volumes on the host, for CRIU to bind back.
    pub(super) fn restored_volumes_dir(&self, id: &str) -> PathBuf {
        self.mount_dir.join(format!("{id}.volumes"))
    }

    /// The checkpointed sandbox `id` (handle `h`) running, if a restore the server died
    /// during ran to its end: CRIU wrote its statistics, and the PID 1 it wrote lives in the
    /// sandbox's cgroup.
    pub(super) fn finished_restore(&self, id: &str, h: &Handle) -> Option<AdoptedCheckpoint> {
        let pid = crate::checkpoint::finished_restore(&self.checkpoint_dir(id))?;
        if !self.cgroups.members(id).contains(&pid) {
            return None;
        }
        let running = Handle {
            pid,
            start_ticks: start_ticks(pid)?,
            phase: Phase::Running,
            ..h.clone()
        };
        let endpoint = self.endpoint(id, h.slot).ok()?;
        let runtime_handle = running.to_runtime(id).ok()?;
        self.adopt_holdings(id, h, Phase::Running);
        tracing::info!(sandbox_id = %id, pid, "a restore finished while the server was down");
        Some(AdoptedCheckpoint::Restored(runtime_handle, endpoint))
    }

    /// Restores the checkpointed sandbox `id` into its kept network namespace and cgroups;
    /// returns its new PID 1.
    pub(super) async fn undump(&self, id: &str, h: &Handle) -> Result<i32, RuntimeError> {
        let criu = self.criu_for_restore(id).await?;
        let dir = self.checkpoint_dir(id);
        let read_dir = dir.clone();
        let started = std::time::Instant::now();
        let verify = !self.is_verified(&dir);
        let header =
            tokio::task::spawn_blocking(move || crate::checkpoint::read_header(&read_dir, verify))
                .await
                .map_err(|e| sandbox_err(id, e))?
                .map_err(|e| sandbox_err(id, e))?;
        self.set_verified(&dir, true);
        tracing::debug!(sandbox_id = %id, verify_us = started.elapsed().as_micros() as u64, "checkpoint verified");
        check_criu_version(id, &criu, &header)?;
        let layers = self
            .layers
            .stack(&h.layers)
            .map_err(|e| sandbox_err(id, e))?;
        let netns_path = self.kept_ns(id, "net");
        let userns_path = self.kept_ns(id, "user");
        let slot = h.slot;
        let opened = tokio::task::spawn_blocking(move || -> Result<_, String> {
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
        .await
        .map_err(|e| sandbox_err(id, e))?
        .map_err(|e| sandbox_err(id, e))?;
        let (prepared, userns) = opened;
        self.run_restore(
            id,
            RestoreFrom {
                images: dir,
                header,
                layers,
                userns,
                netns: prepared,
                log: self.log_path(id),
                etc: None,
                boot_id: h.boot_id.clone(),
            },
        )
        .await
    }

    /// Restores the staged checkpoint `restore` into `netns` as sandbox `spec`, on the disk
    /// the caller made ready: the slot's cgroups, ids, network rules, name server and a new
    /// agent log; the staged images are removed afterwards. Returns once the agent answers.
    pub(super) async fn restore_in_slot(
        &self,
        spec: &LaunchSpec,
        netns: PreparedNetns,
        restore: SlotRestore,
    ) -> Result<(Handle, Endpoint), (Option<Handle>, RuntimeError)> {
        let id = &spec.sandbox_id;
        let slot = netns.slot;
        let id_map = self.id_map(slot);
        let bare = |e: RuntimeError| (None, e);
        self.cgroups
            .create(id, self.limits_of(spec))
            .map_err(|e| bare(sandbox_err(id, e)))?;
        self.apply_egress(id, slot, spec.allow_internet_access, &spec.egress)
            .await
            .map_err(bare)?;
        let (log_path, log) = self
            .log_for_restore(id, &restore.header, id_map.host_base)
            .map_err(bare)?;
        let layers = self.layers.stack(&spec.image.layers).map_err(|message| {
            bare(RuntimeError::TemplateMissing {
                template_id: format!("{} ({message})", spec.template.id),
            })
        })?;
        let userns = sandbar_jail::host::new_user_namespace(id_map).map_err(|e| {
            bare(sandbox_err(
                id,
                format!("cannot make its user namespace: {e}"),
            ))
        })?;
        let gateway = self
            .network
            .addrs(slot)
            .map_err(|e| bare(sandbox_err(id, e)))?
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
                    boot_id: restore.boot_id.clone(),
                },
            )
            .await
            .map_err(bare)?;
        // Its lines from before the checkpoint belong to the sandbox it was taken of.
        let _ = log.set_len(0);
        drop(log);
        let _ = crate::storage::disks::remove_tree(&restore.work);
        let handle = Handle::running(pid, slot, id_map, spec, restore.boot_id);
        let endpoint = self
            .endpoint(id, slot)
            .map_err(|e| (Some(handle.clone()), e))?;
        if let Err(e) =
            agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(10)).await
        {
            return Err((
                Some(handle),
                sandbox_err(id, format!("the restored agent: {e}")),
            ));
        }
        Ok((handle, endpoint))
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
        let log_path = self.log_path(id);
        let log = std::fs::File::create(&log_path)
            .and_then(|log| {
                std::os::unix::fs::fchown(&log, Some(owner), Some(owner))?;
                log.set_len(held_size)?;
                Ok(log)
            })
            .map_err(|e| sandbox_err(id, format!("create {}: {e}", log_path.display())))?;
        Ok((log_path, log))
    }

    /// A checkpoint made before a restart may find CRIU installed only since: probed again.
    pub(super) async fn criu_for_restore(
        &self,
        id: &str,
    ) -> Result<std::sync::Arc<crate::checkpoint::Criu>, RuntimeError> {
        self.criu
            .get_or_probe()
            .await
            .ok_or_else(|| sandbox_err(id, "this node cannot restore checkpoints"))
    }

    /// Mounts what the restore of sandbox `id` needs on the host (its root, a sysfs of its
    /// network namespace, its agent's listener), runs `criu restore` from its cgroups and
    /// returns the restored PID 1; the host-side mounts are gone afterwards either way.
    pub(super) async fn run_restore(
        &self,
        id: &str,
        from: RestoreFrom,
    ) -> Result<i32, RuntimeError> {
        let criu = self.criu_for_restore(id).await?;
        let RestoreFrom {
            images: dir,
            header,
            layers,
            userns,
            netns: prepared,
            log,
            etc,
            boot_id,
        } = from;
        let sandbox_dir = self.disks.path(id);
        let images_bytes: u64 = header.images.iter().map(|i| i.size).sum();
        let sysfs = self.restored_sysfs(id);
        let volumes_dir = self.restored_volumes_dir(id);
        let socket = self.socket_path(id);
        let started = std::time::Instant::now();
        let mounted = {
            let sandbox_dir = sandbox_dir.clone();
            let layers = layers.clone();
            let sysfs = sysfs.clone();
            let socket = socket.clone();
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
            let volumes_dir = volumes_dir.clone();
            // A checkpoint that binds a boot id but whose handle names none cannot be made
            // by this node; it would get a new one, as a boot does.
            let boot_id = header
                .externals
                .iter()
                .any(|e| matches!(e, crate::checkpoint::External::BootId { .. }))
                .then(|| boot_id.unwrap_or_else(sandbar_core::ids::new_uuid));
            let boot_id_dir = self.restored_boot_id_dir(id);
            tokio::task::spawn_blocking(move || -> Result<_, String> {
                sandbar_jail::host::mount_root_mapped(&sandbox_dir, &layers, &userns)
                    .map_err(|e| format!("cannot mount its root again: {e}"))?;
                if !volumes.is_empty() {
                    std::fs::create_dir_all(&volumes_dir)
                        .map_err(|e| format!("create {}: {e}", volumes_dir.display()))?;
                }
                for (source, target) in &volumes {
                    sandbar_jail::host::mount_volume_mapped(source, &userns, target).map_err(
                        |e| format!("cannot mount the volume {} again: {e}", source.display()),
                    )?;
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
                let netns_path =
                    PathBuf::from(format!("/proc/self/fd/{}", prepared.netns.as_raw_fd()));
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
                Ok((prepared, listener, boot_id_file))
            })
            .await
            .map_err(|e| sandbox_err(id, e))?
        };
        let undo_mounts = || self.unmount_restore(id, layers.len());
        let (prepared, listener, boot_id_file) = match mounted {
            Ok(ok) => ok,
            Err(e) => {
                undo_mounts();
                return Err(sandbox_err(id, e));
            }
        };
        let agents = self.agents_dir();
        let mut layer_dirs = vec![sandbox_dir.join(sandbar_jail::layout::UPPER)];
        layer_dirs.extend(layers.iter().cloned());
        let libraries = self.library_sources();
        let sources = crate::checkpoint::PlacedSources {
            agents: &agents,
            log: Some(&log),
            layers: Some(&layer_dirs),
            libraries: &libraries,
        };
        let files = match crate::checkpoint::open_externals(&header, sources) {
            Ok(files) => files,
            Err(e) => {
                undo_mounts();
                return Err(sandbox_err(id, e));
            }
        };
        let mut args: Vec<String> = Vec::new();
        for external in &header.externals {
            match external {
                crate::checkpoint::External::Device { key, source } => {
                    if !crate::checkpoint::is_device_node_path(source) {
                        undo_mounts();
                        return Err(sandbox_err(
                            id,
                            "the checkpoint binds a device that is not one of /dev's",
                        ));
                    }
                    args.push(format!("--external=mnt[{key}]:{}", source.display()));
                }
                crate::checkpoint::External::Sysfs { key } => {
                    args.push(format!("--external=mnt[{key}]:{}", sysfs.display()));
                }
                crate::checkpoint::External::Volume { key, .. } => {
                    args.push(format!(
                        "--external=mnt[{key}]:{}",
                        volumes_dir.join(key).display()
                    ));
                }
                crate::checkpoint::External::BootId { key } => {
                    if let Some(file) = &boot_id_file {
                        args.push(format!("--external=mnt[{key}]:{}", file.display()));
                    }
                }
                crate::checkpoint::External::Placed { .. }
                | crate::checkpoint::External::LayerFile { .. }
                | crate::checkpoint::External::File { .. } => {}
            }
        }
        // Descriptors handed to CRIU at fixed numbers: the host files, the new listener and
        // the network namespace.
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
        inherited.push((listener.as_raw_fd(), next));
        next += 1;
        args.push(format!("--inherit-fd=fd[{next}]:extnet"));
        inherited.push((prepared.netns.as_raw_fd(), next));

        let pidfile = dir.join(crate::checkpoint::RESTORE_PIDFILE);
        crate::checkpoint::clear_restore(&dir);
        let joins: Vec<std::ffi::CString> = self
            .cgroups
            .join_files(id)
            .iter()
            .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok())
            .collect();
        let mut command = criu.command();
        command
            .arg("restore")
            .arg("--images-dir")
            .arg(&dir)
            .arg("--log-file")
            .arg(crate::checkpoint::RESTORE_LOG)
            .arg("-v2")
            .arg("--root")
            .arg(sandbox_dir.join(sandbar_jail::layout::ROOT))
            .arg("--restore-detached")
            .arg(TCP_CLOSE)
            .arg("--manage-cgroups=ignore")
            .arg("--pidfile")
            .arg(&pidfile)
            .args(&args)
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
        let prepared_in = started.elapsed();
        let deadline = restore_deadline(images_bytes);
        let mut tries = 0;
        let status = loop {
            tries += 1;
            let outcome = run_criu(&mut command, deadline).await;
            let failed = match &outcome {
                Ok(status) => !status.success(),
                Err(e) => e.kind() == std::io::ErrorKind::TimedOut,
            };
            if !failed || tries == RESTORE_TRIES {
                break outcome;
            }
            // Seen rarely: a thread of the restored tree gone before CRIU let it go, and
            // CRIU then stuck on its own kill of the tree. The images are intact; what the
            // failed attempt started has not run any of the sandbox's code yet.
            let errors = crate::checkpoint::log_errors(&dir.join(crate::checkpoint::RESTORE_LOG));
            tracing::warn!(sandbox_id = %id, error = %errors, ?outcome, "restore failed; trying again");
            let _ = self.cgroups.kill_all(id).await;
            crate::checkpoint::clear_restore(&dir);
        };
        let criu_in = started.elapsed() - prepared_in;
        drop(owned);
        drop(listener);
        drop(prepared);
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
            let _ = self.cgroups.kill_all(id).await;
            return Err(sandbox_err(
                id,
                format!("restore failed ({status}): {errors}"),
            ));
        }
        let pid = crate::checkpoint::restored_pid(&dir)
            .ok_or_else(|| sandbox_err(id, "the restore wrote no PID"))?;
        Ok(pid)
    }
}

/// Established TCP connections are not kept: their sockets come back shut down, as after a
/// network outage, and the programs holding them see the connection end. Keeping them
/// (`--tcp-established`) would freeze their peers outside the sandbox for as long as it is
/// paused and fail when the peer has moved on; without either, a sandbox with any open
/// connection could not be checkpointed at all. Given at the dump and again at the restore.
pub(super) const TCP_CLOSE: &str = "--tcp-close";

/// How many times a restore is attempted before it is given up.
pub(super) const RESTORE_TRIES: u32 = 2;

/// How long one restore may take: restores run at hundreds of MiB a second, so this is only
/// ever reached by a CRIU that is stuck.
/// How long a dump plan may take: it reads `/proc` only.
pub(super) const PLAN_DEADLINE: Duration = Duration::from_secs(20);

/// How long a dump of a sandbox with a memory limit of `memory_mb` may take before it is
/// abandoned: far longer than writing that much memory takes here.
pub(super) fn dump_deadline(memory_mb: u32) -> Duration {
    Duration::from_secs(30 + 30 * u64::from(memory_mb).div_ceil(1024))
}

pub(super) fn restore_deadline(images_bytes: u64) -> Duration {
    Duration::from_secs(20 + 20 * images_bytes.div_ceil(1 << 30))
}

/// Runs `criu restore` to its end, or kills it (and so lets go of the tasks it holds) once
/// `deadline` has passed.
pub(super) async fn run_criu(
    command: &mut tokio::process::Command,
    deadline: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    let mut child = command.spawn()?;
    sandbar_core::faults::crash_point("restore.restoring");
    match tokio::time::timeout(deadline, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            let _ = child.kill().await;
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("criu did not finish within {} s", deadline.as_secs()),
            ))
        }
    }
}

/// What a snapshot's checkpoint directory holds besides the images: what a restore into
/// another sandbox must change.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SnapshotOrigin {
    /// Host id of the snapshotted sandbox's root: its user namespace image names that range.
    pub(super) id_base: u32,
    /// The token its agent held, which the restored agent answers to until it is given its
    /// own.
    pub(super) access_token: String,
    /// Its agent log, which the checkpoint's agent holds open.
    pub(super) log: PathBuf,
}

pub(super) const SNAPSHOT_ORIGIN: &str = "origin.json";

/// CRIU would otherwise lock the sandbox's network namespace with `iptables-restore` around
/// a dump and a restore (two processes each time, about 50 ms of a restore; the restore
/// follows what the dump recorded). The lock keeps established TCP connections from being
/// reset meanwhile; a sandbox's are not kept anyway ([`TCP_CLOSE`]), and nothing routes to
/// it while it is dumped or restored.
pub(super) const NO_NETWORK_LOCK: [&str; 2] = ["--network-lock", "skip"];

/// Names a checkpoint directory gets when it is spent and is being removed.
pub(super) const SPENT_PREFIX: &str = ".spent-";

/// Removes spent checkpoints whose removal a stopped server did not finish.
pub(super) fn remove_spent_checkpoints(checkpoints: &Path) {
    let Ok(entries) = std::fs::read_dir(checkpoints) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(SPENT_PREFIX)
        {
            let _ = crate::storage::disks::remove_tree(&entry.path());
        }
    }
}

/// How long a restart waits for a dump or restore the previous server left running: far
/// longer than one of a sandbox of the largest size takes.
pub(super) const ORPHANED_CRIU_WAIT: Duration = Duration::from_secs(120);

/// What [`LinuxRuntime::run_restore`] restores, and into what.
/// A file of `/etc` written into a restored sandbox's root: name, content, mode.
pub(super) type EtcFile = (&'static str, String, u32);

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

/// A checkpoint staged for [`LinuxRuntime::restore_in_slot`], and what the restored sandbox
/// keeps or gets anew.
pub(super) struct SlotRestore {
    /// The staged images (see `stage_checkpoint`), removed once restored.
    pub(super) work: PathBuf,
    pub(super) header: crate::checkpoint::Header,
    /// A new machine id for a new machine; `None` keeps the one its files hold.
    pub(super) machine_id: Option<String>,
    pub(super) boot_id: Option<String>,
}

pub(super) fn check_criu_version(
    id: &str,
    criu: &crate::checkpoint::Criu,
    header: &crate::checkpoint::Header,
) -> Result<(), RuntimeError> {
    if header.criu_version != criu.version {
        return Err(sandbox_err(
            id,
            format!(
                "the checkpoint was made by CRIU {}, this node has {}",
                header.criu_version, criu.version
            ),
        ));
    }
    Ok(())
}

impl LinuxRuntime {
    pub(super) async fn checkpoint_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<RuntimeHandle, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if h.phase == Phase::Checkpointed {
            return Ok(handle.clone());
        }
        let started = std::time::Instant::now();
        sequence::dump_frozen(
            &LinuxHost(self),
            sandbox_id,
            HOST_SOCKETS_PATIENCE,
            |e| sandbox_err(sandbox_id, e),
            || self.dump(sandbox_id, &h),
        )
        .await?;
        let dumped_in = started.elapsed();
        sandbar_core::faults::crash_point("checkpoint.dumped");
        // CRIU ended the tree after the dump; anything that escaped it would run on.
        for _ in 0..250 {
            if !is_alive(&h) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.end_dumped(sandbox_id).await;
        tracing::debug!(
            sandbox_id,
            dump_us = dumped_in.as_micros() as u64,
            release_us = (started.elapsed() - dumped_in).as_micros() as u64,
            "checkpoint timings"
        );
        let checkpointed = Handle {
            pid: 0,
            start_ticks: 0,
            phase: Phase::Checkpointed,
            ..h
        };
        checkpointed.to_runtime(sandbox_id)
    }
}

impl LinuxRuntime {
    pub(super) async fn restore_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<(RuntimeHandle, Endpoint), RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        if h.phase != Phase::Checkpointed {
            return Err(sandbox_err(sandbox_id, "the sandbox is not checkpointed"));
        }
        let mut opening = self.holdings.opening(sandbox_id);
        opening.hold_memory(self.grant_memory(sandbox_id, h.memory_mb)?);
        let started = std::time::Instant::now();
        // Joining a frozen cgroup would freeze CRIU itself.
        let restored = match self.cgroups.thaw(sandbox_id) {
            Ok(()) => self.undump(sandbox_id, &h).await,
            Err(e) => Err(sandbox_err(sandbox_id, e)),
        };
        let pid = restored?;
        let running = Handle {
            pid,
            start_ticks: start_ticks(pid).unwrap_or_default(),
            phase: Phase::Running,
            ..h
        };
        let endpoint = self.endpoint(sandbox_id, h.slot)?;
        if let Err(e) =
            agent_client::wait_healthy(&endpoint.agent_socket, Duration::from_secs(10)).await
        {
            let _ = self.cgroups.kill_all(sandbox_id).await;
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
        Ok((running.to_runtime(sandbox_id)?, endpoint))
    }
}

impl LinuxRuntime {
    pub(super) async fn adopt_checkpointed_sandbox(
        &self,
        sandbox_id: &str,
        handle: &RuntimeHandle,
    ) -> Result<AdoptedCheckpoint, RuntimeError> {
        let h = parse_handle(sandbox_id, handle)?;
        let dir = self.checkpoint_dir(sandbox_id);
        if h.phase == Phase::Checkpointed {
            // The server may have died during a restore (CRIU was waited for at start): its
            // host-side mounts are left over, and the restore finished or not.
            self.unmount_restore(sandbox_id, h.layers.len());
            if let Some(restored) = self.finished_restore(sandbox_id, &h) {
                return Ok(restored);
            }
            if let Err(e) = self.cgroups.kill_all(sandbox_id).await {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("cannot end what an unfinished restore started: {e}"),
                ));
            }
            crate::checkpoint::clear_restore(&dir);
            let _ = std::fs::remove_file(self.socket_path(sandbox_id));
        } else {
            if is_alive(&h) {
                return Err(sandbox_err(sandbox_id, "its processes still run"));
            }
            // The dump ended the processes: if the server died before sealing it, it is
            // sealed now, and what `checkpoint` does after a dump is done here.
            if !dir.join(crate::checkpoint::HEADER_FILE).exists() {
                let criu = self
                    .criu
                    .get_or_probe()
                    .await
                    .ok_or_else(|| sandbox_err(sandbox_id, "this node cannot checkpoint"))?;
                let (version, digest) = (criu.version.clone(), self.agent_digest.clone());
                let sealed_dir = dir.clone();
                tokio::task::spawn_blocking(move || {
                    crate::checkpoint::seal_finished_dump(&sealed_dir, version, digest)
                })
                .await
                .map_err(|e| sandbox_err(sandbox_id, e))?
                .map_err(|e| sandbox_err(sandbox_id, e))?;
                tracing::info!(
                    sandbox_id,
                    "sealed a checkpoint whose dump outlived the server"
                );
            }
            self.end_dumped(sandbox_id).await;
        }
        let header_dir = dir.clone();
        tokio::task::spawn_blocking(move || crate::checkpoint::read_header(&header_dir, false))
            .await
            .map_err(|e| sandbox_err(sandbox_id, e))?
            .map_err(|e| sandbox_err(sandbox_id, e))?;
        for kind in ["net", "user"] {
            let kept = self.kept_ns(sandbox_id, kind);
            if !is_nsfs(&kept) {
                return Err(sandbox_err(
                    sandbox_id,
                    format!("its kept namespace {} is gone", kept.display()),
                ));
            }
        }
        self.adopt_holdings(sandbox_id, &h, Phase::Checkpointed);
        let checkpointed = Handle {
            pid: 0,
            start_ticks: 0,
            phase: Phase::Checkpointed,
            ..h
        };
        Ok(AdoptedCheckpoint::Checkpointed(
            checkpointed.to_runtime(sandbox_id)?,
        ))
    }
}
