//! The node's template builder: pulls base images, runs each build step in a build sandbox
//! (with the same isolation as any sandbox) or writes it straight into a fresh layer, and
//! caches every layer under the hash of its parent and its own definition.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sandbar_core::builds::{
    BASE_STEP, BuildFailure, BuildJob, BuildLog, BuildSource, Builder, FINALIZE_STEP, LogLevel,
    StepKind, TemplateImage, UploadBody, UploadError,
};
use sandbar_core::{EgressRules, LaunchSpec, Runtime, Template};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use crate::layers::{self, Found, LayerStore};
use crate::runtime::LinuxRuntime;

/// Bump when the prerequisites written into every image change.
const PREREQUISITES_VERSION: &str = "prerequisites-v1";
/// The account every sandbox has, as E2B's templates do.
const SANDBOX_USER: &str = "user";
/// Disk quota of a build sandbox's writable layer, in MiB.
const BUILD_DISK_MB: u32 = 20 * 1024;
const MAX_LOG_LINES_PER_STEP: usize = 5000;

#[derive(Debug)]
pub struct NodeBuilder {
    runtime: Arc<LinuxRuntime>,
    images: sandbar_image::ImageCache,
    images_layers_dir: PathBuf,
    uploads_dir: PathBuf,
    /// Layers running builds use or made, kept from the garbage collector.
    pinned: Mutex<HashMap<String, Vec<String>>>,
    templates_dir: PathBuf,
    /// Debian mirror the built-in root is made from.
    mirror: String,
}

fn sha(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

fn io_fail(step: &str, what: impl std::fmt::Display) -> BuildFailure {
    BuildFailure::at(step, what.to_string())
}

/// The build's running state between steps.
#[derive(Debug, Clone)]
struct State {
    layers: Vec<String>,
    env: BTreeMap<String, String>,
    user: String,
    workdir: String,
    key: String,
}

impl NodeBuilder {
    pub fn new(
        runtime: Arc<LinuxRuntime>,
        data_dir: &Path,
        plain_http_registries: Vec<String>,
        mirror: String,
    ) -> Self {
        let images_root = data_dir.join("images");
        Self {
            templates_dir: data_dir.join("templates"),
            mirror,
            runtime,
            images_layers_dir: images_root.join("layers"),
            images: sandbar_image::ImageCache::new(images_root, plain_http_registries),
            uploads_dir: data_dir.join("uploads"),
            pinned: Mutex::new(HashMap::new()),
        }
    }

    fn store(&self) -> &LayerStore {
        self.runtime.layer_store()
    }

    fn pin(&self, build_id: &str, layer: &str) {
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(build_id.to_owned())
            .or_default()
            .push(layer.to_owned());
    }

    fn upload_path(&self, team_id: &str, hash: &str) -> Option<PathBuf> {
        let safe =
            |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
        (safe(team_id) && sandbar_core::builds::valid_files_hash(hash))
            .then(|| self.uploads_dir.join(team_id).join(hash))
    }

    async fn start_from_source(
        &self,
        job: &BuildJob,
        log: &BuildLog,
    ) -> Result<State, BuildFailure> {
        match &job.spec.source {
            BuildSource::Builtin { layer } => {
                if layer != crate::templates::BASE_LAYER {
                    return Err(BuildFailure::at(
                        BASE_STEP,
                        format!("unknown built-in root '{layer}'"),
                    ));
                }
                if self.store().exists(layer) {
                    log.info(Some(BASE_STEP), format!("CACHED FROM {layer}"));
                } else {
                    log.info(
                        Some(BASE_STEP),
                        format!("FROM {layer}: building the Debian root with mmdebstrap"),
                    );
                    crate::templates::build_base(&self.templates_dir, &self.mirror)
                        .await
                        .map_err(|e| BuildFailure::at(BASE_STEP, e.to_string()))?;
                }
                Ok(State {
                    key: sha(&[b"builtin", layer.as_bytes()]),
                    layers: vec![layer.clone()],
                    env: BTreeMap::new(),
                    user: SANDBOX_USER.into(),
                    workdir: format!("/home/{SANDBOX_USER}"),
                })
            }
            BuildSource::Template { reference } => {
                let base = job.base.clone().ok_or_else(|| {
                    BuildFailure::at(BASE_STEP, format!("template '{reference}' has no image"))
                })?;
                log.info(Some(BASE_STEP), format!("FROM template {reference}"));
                let identity = serde_json::to_vec(&base).unwrap_or_default();
                Ok(State {
                    key: sha(&[b"template", &identity]),
                    layers: base.layers,
                    env: base.env,
                    user: base.user,
                    workdir: base.workdir,
                })
            }
            BuildSource::Image {
                reference,
                credentials,
            } => {
                log.info(Some(BASE_STEP), format!("FROM {reference}"));
                let auth = credentials.as_ref().map(|c| sandbar_image::RegistryAuth {
                    username: c.username.clone(),
                    password: c.password.clone(),
                });
                let progress_log = log.clone();
                let progress = move |line: String| progress_log.info(Some(BASE_STEP), line);
                let image = self
                    .images
                    .pull_for(
                        job.team_id.as_deref().unwrap_or(""),
                        reference,
                        auth.as_ref(),
                        &progress,
                    )
                    .await
                    .map_err(|e| {
                        BuildFailure::at(BASE_STEP, format!("cannot pull image '{reference}': {e}"))
                    })?;
                let layers: Vec<String> = image
                    .layers
                    .iter()
                    .map(|l| format!("image/{}", l.diff_id.trim_start_matches("sha256:")))
                    .collect();
                for layer in &layers {
                    self.pin(&job.build_id, layer);
                }
                let mut state = State {
                    key: sha(&[b"image", image.manifest_digest.as_bytes()]),
                    layers,
                    env: image.config.env.iter().cloned().collect(),
                    user: SANDBOX_USER.into(),
                    workdir: format!("/home/{SANDBOX_USER}"),
                };
                state.key = sha(&[state.key.as_bytes(), PREREQUISITES_VERSION.as_bytes()]);
                let name = LayerStore::step_layer_name(&state.key);
                self.pin(&job.build_id, &name);
                if !self.store().exists(&name) {
                    let stack = self.stack(&state, BASE_STEP)?;
                    self.write_layer(&state.key, BASE_STEP, |upper| {
                        write_prerequisites(&stack, upper)
                    })?;
                }
                state.layers.push(name);
                log.info(
                    Some(BASE_STEP),
                    format!("image {reference} ready ({})", image.manifest_digest),
                );
                Ok(state)
            }
        }
    }

    fn stack(&self, state: &State, step: &str) -> Result<Vec<PathBuf>, BuildFailure> {
        self.store()
            .stack(&state.layers)
            .map_err(|e| io_fail(step, e))
    }

    /// Makes the step layer `key` by filling a fresh directory on the host.
    fn write_layer(
        &self,
        key: &str,
        step: &str,
        fill: impl FnOnce(&Path) -> std::io::Result<()>,
    ) -> Result<(), BuildFailure> {
        let steps = self.store().steps_dir().to_owned();
        let staging = steps.join(format!(".tmp-{}", sandbar_core::ids::new_secret("")));
        let result = (|| {
            std::fs::create_dir(&staging)?;
            std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o700))?;
            let upper = staging.join(sandbar_jail::layout::UPPER);
            std::fs::create_dir(&upper)?;
            std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o755))?;
            fill(&upper)?;
            let target = steps.join(key);
            if target.exists() {
                crate::disks::remove_tree(&staging)
            } else {
                std::fs::rename(&staging, &target)
            }
        })();
        if result.is_err() {
            let _ = crate::disks::remove_tree(&staging);
        }
        result.map_err(|e| io_fail(step, e))
    }

    async fn run_step(
        &self,
        job: &BuildJob,
        state: &State,
        key: &str,
        step: &str,
        (command, user): (&str, &str),
        log: &BuildLog,
    ) -> Result<(), BuildFailure> {
        let id = sandbar_core::ids::new_sandbox_id();
        let token = sandbar_core::ids::new_secret("");
        let spec = self.launch_spec(job, state, &id, &token, None, None);
        let (handle, endpoint) = self
            .runtime
            .launch(spec)
            .await
            .map_err(|e| io_fail(step, format!("cannot start the build sandbox: {e}")))?;
        let exec = crate::agent_client::Exec {
            token: &token,
            user,
            command,
            envs: &state.env,
            cwd: Some(&state.workdir),
        };
        let mut pending = Vec::new();
        let mut lines = 0usize;
        let result = crate::agent_client::run(&endpoint.agent_socket, &exec, |bytes| {
            pending.extend_from_slice(bytes);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                lines += 1;
                if lines <= MAX_LOG_LINES_PER_STEP {
                    log.info(
                        Some(step),
                        String::from_utf8_lossy(&line).trim_end().to_owned(),
                    );
                }
            }
        })
        .await;
        if !pending.is_empty() {
            log.info(
                Some(step),
                String::from_utf8_lossy(&pending).trim_end().to_owned(),
            );
        }
        if lines > MAX_LOG_LINES_PER_STEP {
            log.log(
                LogLevel::Warn,
                Some(step),
                format!(
                    "{} more output lines not kept",
                    lines - MAX_LOG_LINES_PER_STEP
                ),
            );
        }
        match result {
            Ok(0) => self
                .runtime
                .commit_layer(&id, &handle, key)
                .await
                .map_err(|e| io_fail(step, e)),
            outcome => {
                if let Err(e) = self.runtime.destroy(&id, &handle).await {
                    tracing::warn!(sandbox_id = %id, error = %e, "cannot remove a build sandbox");
                }
                Err(match outcome {
                    Ok(code) => io_fail(
                        step,
                        format!("step {step} (RUN {command}) failed with exit code {code}"),
                    ),
                    Err(e) => io_fail(
                        step,
                        format!("step {step} (RUN {command}) could not run: {e}"),
                    ),
                })
            }
        }
    }

    fn launch_spec(
        &self,
        job: &BuildJob,
        state: &State,
        id: &str,
        token: &str,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
    ) -> LaunchSpec {
        let now = chrono::Utc::now();
        LaunchSpec {
            sandbox_id: id.to_owned(),
            template: Template {
                id: job.template_id.clone(),
                team_id: job.team_id.clone(),
                aliases: Vec::new(),
                public: false,
                build_id: job.build_id.clone(),
                build_status: sandbar_core::BuildStatus::Building,
                build_error: None,
                cpu_count: job.cpu_count,
                memory_mb: job.memory_mb,
                disk_size_mb: job.disk_size_mb,
                envd_version: String::new(),
                image: None,
                created_at: now,
                updated_at: now,
                last_spawned_at: None,
                spawn_count: 0,
                build_count: 0,
            },
            image: TemplateImage {
                layers: state.layers.clone(),
                env: state.env.clone(),
                user: state.user.clone(),
                workdir: state.workdir.clone(),
                start_cmd,
                ready_cmd,
                snapshot: None,
            },
            cpu_count: job.cpu_count,
            memory_mb: job.memory_mb,
            disk_size_mb: BUILD_DISK_MB.max(job.disk_size_mb),
            env_vars: state.env.clone(),
            allow_internet_access: true,
            egress: EgressRules::default(),
            envd_access_token: token.to_owned(),
            volumes: Vec::new(),
            kept: None,
        }
    }

    async fn build_inner(
        &self,
        job: &BuildJob,
        log: &BuildLog,
    ) -> Result<TemplateImage, BuildFailure> {
        let mut state = self.start_from_source(job, log).await?;
        let total = job.spec.steps.len();
        let mut cached = !job.spec.force;
        for (index, step) in job.spec.steps.iter().enumerate() {
            let number = (index + 1).to_string();
            let definition = serde_json::to_vec(&step.kind).unwrap_or_default();
            let mut key_parts: Vec<Vec<u8>> = vec![state.key.clone().into_bytes(), definition];
            if let StepKind::Copy { files_hash, .. } = &step.kind {
                let path = self
                    .upload_path(job.team_id.as_deref().unwrap_or("builtin"), files_hash)
                    .filter(|p| p.is_file())
                    .ok_or_else(|| {
                        io_fail(
                            &number,
                            format!(
                                "step {number} (COPY): the files {files_hash} were never uploaded"
                            ),
                        )
                    })?;
                key_parts.push(
                    file_sha(&path)
                        .map_err(|e| io_fail(&number, e))?
                        .into_bytes(),
                );
            }
            if step.force || job.spec.force {
                cached = false;
                key_parts.push(job.build_id.clone().into_bytes());
            }
            let parts: Vec<&[u8]> = key_parts.iter().map(Vec::as_slice).collect();
            let key = sha(&parts);
            let name = LayerStore::step_layer_name(&key);
            let makes_layer = matches!(step.kind, StepKind::Run { .. } | StepKind::Copy { .. });
            let hit = cached && (!makes_layer || self.store().exists(&name));
            let shown = format!("[{number}/{total}] {}", step.kind.describe());
            if hit {
                log.info(Some(&number), format!("CACHED {shown}"));
            } else {
                cached = false;
                log.info(Some(&number), shown);
            }
            match &step.kind {
                StepKind::Env { vars } => {
                    state.env.extend(vars.iter().cloned());
                }
                StepKind::Workdir { path } => {
                    let target = absolute(&state.workdir, path);
                    let stack = self.stack(&state, &number)?;
                    let relative =
                        layers::resolve(&stack, &target).map_err(|e| io_fail(&number, e))?;
                    if matches!(layers::lookup(&stack, &relative), Found::Missing) {
                        if !self.store().exists(&name) {
                            let owner = lookup_ids(&stack, &state.user, None)
                                .map_err(|e| io_fail(&number, e))?;
                            self.write_layer(&key, &number, |upper| {
                                make_parents(&stack, upper, &relative, true, owner)
                            })?;
                        }
                        self.pin(&job.build_id, &name);
                        state.layers.push(name.clone());
                    }
                    state.workdir = target;
                }
                StepKind::User { user } => {
                    let stack = self.stack(&state, &number)?;
                    if lookup_ids(&stack, user, None).is_err() {
                        if !self.store().exists(&name) {
                            self.write_layer(&key, &number, |upper| add_user(&stack, upper, user))?;
                        }
                        self.pin(&job.build_id, &name);
                        state.layers.push(name.clone());
                    }
                    state.user = user.clone();
                }
                StepKind::Run { command, user } => {
                    self.pin(&job.build_id, &name);
                    if !hit {
                        let as_user = user.clone().unwrap_or_else(|| state.user.clone());
                        self.run_step(job, &state, &key, &number, (command, &as_user), log)
                            .await?;
                    }
                    state.layers.push(name.clone());
                }
                StepKind::Copy {
                    src,
                    dest,
                    owner,
                    mode,
                    files_hash,
                } => {
                    self.pin(&job.build_id, &name);
                    if !hit {
                        let upload = self
                            .upload_path(job.team_id.as_deref().unwrap_or("builtin"), files_hash)
                            .ok_or_else(|| io_fail(&number, "invalid upload"))?;
                        let stack = self.stack(&state, &number)?;
                        let dest = absolute(&state.workdir, dest);
                        let owner_spec = owner
                            .clone()
                            .filter(|o| !o.is_empty())
                            .unwrap_or_else(|| state.user.clone());
                        let (uid, gid) = {
                            let (u, g) = match owner_spec.split_once(':') {
                                Some((u, g)) => (u.to_owned(), Some(g.to_owned())),
                                None => (owner_spec.clone(), None),
                            };
                            lookup_ids(&stack, &u, g.as_deref()).map_err(|e| io_fail(&number, e))?
                        };
                        let ctx_dir = self
                            .store()
                            .steps_dir()
                            .join(format!(".tmp-ctx-{}", sandbar_core::ids::new_secret("")));
                        let step_name = number.clone();
                        let src = src.clone();
                        let mode = *mode;
                        let result = tokio::task::block_in_place(|| -> Result<(), BuildFailure> {
                            std::fs::create_dir(&ctx_dir).map_err(|e| io_fail(&step_name, e))?;
                            let file =
                                std::fs::File::open(&upload).map_err(|e| io_fail(&step_name, e))?;
                            sandbar_image::extract_upload(std::io::BufReader::new(file), &ctx_dir)
                                .map_err(|e| io_fail(&step_name, format!("step {step_name} (COPY): the uploaded files are refused: {e}")))?;
                            let sources = select_sources(&ctx_dir, &src).map_err(|e| {
                                io_fail(&step_name, format!("step {step_name} (COPY): {e}"))
                            })?;
                            self.write_layer(&key, &step_name, |upper| {
                                copy_into_layer(&stack, upper, &sources, &dest, (uid, gid), mode)
                            })
                        });
                        let _ = crate::disks::remove_tree(&ctx_dir);
                        result?;
                    }
                    state.layers.push(name.clone());
                }
            }
            state.key = key;
        }
        let image = TemplateImage {
            layers: state.layers.clone(),
            env: state.env.clone(),
            user: state.user.clone(),
            workdir: state.workdir.clone(),
            start_cmd: job.spec.start_cmd.clone().filter(|c| !c.is_empty()),
            ready_cmd: job.spec.ready_cmd.clone().filter(|c| !c.is_empty()),
            snapshot: None,
        };
        if image.start_cmd.is_some() || image.ready_cmd.is_some() {
            log.info(
                Some(FINALIZE_STEP),
                "checking the start and ready commands in a new sandbox",
            );
            let id = sandbar_core::ids::new_sandbox_id();
            let token = sandbar_core::ids::new_secret("");
            let spec = self.launch_spec(
                job,
                &state,
                &id,
                &token,
                image.start_cmd.clone(),
                image.ready_cmd.clone(),
            );
            let (handle, _) =
                self.runtime.launch(spec).await.map_err(|e| {
                    io_fail(FINALIZE_STEP, format!("the template does not start: {e}"))
                })?;
            if let Err(e) = self.runtime.destroy(&id, &handle).await {
                tracing::warn!(sandbox_id = %id, error = %e, "cannot remove a build sandbox");
            }
            log.info(Some(FINALIZE_STEP), "start command ready");
        }
        log.info(
            Some(FINALIZE_STEP),
            format!("template ready ({} layers)", image.layers.len()),
        );
        Ok(image)
    }
}

#[async_trait::async_trait]
impl Builder for NodeBuilder {
    async fn build(&self, job: BuildJob, log: BuildLog) -> Result<TemplateImage, BuildFailure> {
        let result = self.build_inner(&job, &log).await;
        if let Err(failure) = &result {
            log.log(
                LogLevel::Error,
                failure.step.as_deref(),
                failure.message.clone(),
            );
        }
        self.pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&job.build_id);
        result
    }

    async fn has_upload(&self, team_id: &str, hash: &str) -> bool {
        self.upload_path(team_id, hash).is_some_and(|p| p.is_file())
    }

    async fn store_upload(
        &self,
        team_id: &str,
        hash: &str,
        mut body: UploadBody,
        limit: u64,
    ) -> Result<(), UploadError> {
        let fail = |message: String| UploadError::Failed {
            hash: hash.to_owned(),
            message,
        };
        let target = self
            .upload_path(team_id, hash)
            .ok_or_else(|| fail("invalid team or hash".into()))?;
        let dir = target.parent().map(Path::to_owned).unwrap_or_default();
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let staging = dir.join(format!(".tmp-{}", sandbar_core::ids::new_secret("")));
        let result = async {
            let mut file = tokio::fs::File::create(&staging)
                .await
                .map_err(|e| fail(e.to_string()))?;
            let mut total: u64 = 0;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = body.read(&mut buf).await.map_err(|e| fail(e.to_string()))?;
                if n == 0 {
                    break;
                }
                total += n as u64;
                if total > limit {
                    return Err(UploadError::TooLarge {
                        hash: hash.to_owned(),
                        limit,
                    });
                }
                tokio::io::AsyncWriteExt::write_all(&mut file, &buf[..n])
                    .await
                    .map_err(|e| fail(e.to_string()))?;
            }
            tokio::io::AsyncWriteExt::flush(&mut file)
                .await
                .map_err(|e| fail(e.to_string()))?;
            tokio::fs::rename(&staging, &target)
                .await
                .map_err(|e| fail(e.to_string()))
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&staging).await;
        }
        result
    }

    async fn collect_garbage(&self, in_use: &[String]) {
        let mut keep: Vec<String> = in_use.to_vec();
        keep.extend(
            self.pinned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .flatten()
                .cloned(),
        );
        let runtime = self.runtime.clone();
        let images = self.images_layers_dir.clone();
        let _ = tokio::task::spawn_blocking(move || runtime.collect_layers(&keep, &images)).await;
    }
}

fn file_sha(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// `path` made absolute against `workdir`, normalised.
fn absolute(workdir: &str, path: &str) -> String {
    let joined = if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        Path::new(workdir).join(path)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            std::path::Component::Normal(n) => out.push(n),
            std::path::Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    let mut text = out.display().to_string();
    if path.ends_with('/') && text != "/" {
        text.push('/');
    }
    text
}

/// The uid and gid of `user` (and of `group`, else the user's primary group), read through
/// the image's `/etc/passwd` and `/etc/group`; numeric ids are taken as they are.
fn lookup_ids(stack: &[PathBuf], user: &str, group: Option<&str>) -> Result<(u32, u32), String> {
    let passwd = layers::read_file(stack, "/etc/passwd").unwrap_or_default();
    let (uid, primary) = match user.parse::<u32>() {
        Ok(uid) => (uid, uid),
        Err(_) => passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() >= 4 && f[0] == user)
                    .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
            })
            .next()
            .ok_or_else(|| format!("user '{user}' does not exist in the image"))?,
    };
    let gid = match group {
        None => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                let groups = layers::read_file(stack, "/etc/group").unwrap_or_default();
                groups
                    .lines()
                    .filter_map(|l| {
                        let f: Vec<&str> = l.split(':').collect();
                        (f.len() >= 3 && f[0] == g).then(|| f[2].parse().ok())?
                    })
                    .next()
                    .ok_or_else(|| format!("group '{g}' does not exist in the image"))?
            }
        },
    };
    Ok((uid, gid))
}

/// Creates in `upper` the directories leading to `relative` (and `relative` itself when
/// `include_last`), each with the owner and mode it has below, so the layer changes none.
fn make_parents(
    stack: &[PathBuf],
    upper: &Path,
    relative: &Path,
    include_last: bool,
    new_owner: (u32, u32),
) -> std::io::Result<()> {
    let components: Vec<_> = relative.components().collect();
    let count = if include_last {
        components.len()
    } else {
        components.len().saturating_sub(1)
    };
    let mut so_far = PathBuf::new();
    for component in &components[..count] {
        so_far.push(component);
        let target = upper.join(&so_far);
        if target.exists() {
            continue;
        }
        std::fs::create_dir(&target)?;
        let below = stack
            .iter()
            .map(|l| l.join(&so_far))
            .find(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()));
        match below.and_then(|p| std::fs::metadata(p).ok()) {
            Some(meta) => {
                std::os::unix::fs::lchown(&target, Some(meta.uid()), Some(meta.gid()))?;
                std::fs::set_permissions(
                    &target,
                    std::fs::Permissions::from_mode(meta.mode() & 0o7777),
                )?;
            }
            None => {
                std::os::unix::fs::lchown(&target, Some(new_owner.0), Some(new_owner.1))?;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
            }
        }
    }
    Ok(())
}

/// Writes into `upper` the files that make `name` a user with a home and a group, and, when
/// the image has sudo's drop-in directory, passwordless sudo for the sandbox user.
fn add_user(stack: &[PathBuf], upper: &Path, name: &str) -> std::io::Result<()> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
    {
        return Err(std::io::Error::other(format!("invalid user name '{name}'")));
    }
    let passwd = layers::read_file(stack, "/etc/passwd")
        .unwrap_or_else(|| "root:x:0:0:root:/root:/bin/sh\n".into());
    let group = layers::read_file(stack, "/etc/group").unwrap_or_else(|| "root:x:0:\n".into());
    let used: Vec<u32> = passwd
        .lines()
        .chain(group.lines())
        .filter_map(|l| l.split(':').nth(2)?.parse().ok())
        .collect();
    let id = (1000..60000).find(|i| !used.contains(i)).unwrap_or(60000);
    let shell = if layers::read_file(stack, "/etc/shells").is_some_and(|s| s.contains("/bin/bash"))
    {
        "/bin/bash"
    } else {
        "/bin/sh"
    };
    let home = format!("home/{name}");
    make_parents(stack, upper, Path::new("etc/x"), false, (0, 0))?;
    let append = |text: &str, line: String| {
        let mut t = text.to_owned();
        if !t.is_empty() && !t.ends_with('\n') {
            t.push('\n');
        }
        t.push_str(&line);
        t
    };
    std::fs::write(
        upper.join("etc/passwd"),
        append(&passwd, format!("{name}:x:{id}:{id}::/{home}:{shell}\n")),
    )?;
    std::fs::set_permissions(
        upper.join("etc/passwd"),
        std::fs::Permissions::from_mode(0o644),
    )?;
    std::fs::write(
        upper.join("etc/group"),
        append(&group, format!("{name}:x:{id}:\n")),
    )?;
    std::fs::set_permissions(
        upper.join("etc/group"),
        std::fs::Permissions::from_mode(0o644),
    )?;
    if let Some(shadow) = layers::read_file(stack, "/etc/shadow") {
        std::fs::write(
            upper.join("etc/shadow"),
            append(&shadow, format!("{name}:*:19000:0:99999:7:::\n")),
        )?;
        std::fs::set_permissions(
            upper.join("etc/shadow"),
            std::fs::Permissions::from_mode(0o640),
        )?;
    }
    make_parents(stack, upper, Path::new(&home), false, (0, 0))?;
    let home_dir = upper.join(&home);
    if !home_dir.exists() {
        std::fs::create_dir(&home_dir)?;
    }
    std::os::unix::fs::lchown(&home_dir, Some(id), Some(id))?;
    std::fs::set_permissions(&home_dir, std::fs::Permissions::from_mode(0o750))?;
    if name == SANDBOX_USER
        && matches!(
            layers::lookup(stack, Path::new("etc/sudoers.d")),
            Found::Dir
        )
    {
        make_parents(stack, upper, Path::new("etc/sudoers.d"), true, (0, 0))?;
        let file = upper.join("etc/sudoers.d").join(name);
        std::fs::write(&file, format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL\n"))?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o440))?;
    }
    Ok(())
}

/// What every sandbox needs whatever the image: the sandbox user, `/tmp`, `/etc`.
fn write_prerequisites(stack: &[PathBuf], upper: &Path) -> std::io::Result<()> {
    for (dir, mode) in [
        ("tmp", 0o1777),
        ("etc", 0o755),
        ("home", 0o755),
        ("root", 0o700),
    ] {
        if matches!(layers::lookup(stack, Path::new(dir)), Found::Missing) {
            let target = upper.join(dir);
            std::fs::create_dir(&target)?;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))?;
        }
    }
    let passwd = layers::read_file(stack, "/etc/passwd").unwrap_or_default();
    if !passwd
        .lines()
        .any(|l| l.starts_with(&format!("{SANDBOX_USER}:")))
    {
        add_user(stack, upper, SANDBOX_USER)?;
    }
    Ok(())
}

/// The entries of the extracted context that `src` names: a path, or a pattern with `*`
/// and `?` in its components.
fn select_sources(ctx: &Path, src: &str) -> Result<Vec<PathBuf>, String> {
    let pattern: Vec<&str> = src
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if pattern.contains(&"..") {
        return Err(format!("source '{src}' leaves the build context"));
    }
    let mut current = vec![ctx.to_owned()];
    for component in &pattern {
        let mut next = Vec::new();
        for dir in &current {
            if component.contains(['*', '?']) {
                if let Ok(entries) = std::fs::read_dir(dir) {
                    let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
                    names.sort();
                    for name in names {
                        if wildcard(component, &name.to_string_lossy()) {
                            next.push(dir.join(name));
                        }
                    }
                }
            } else {
                let path = dir.join(component);
                if std::fs::symlink_metadata(&path).is_ok() {
                    next.push(path);
                }
            }
        }
        current = next;
    }
    if current.is_empty() {
        return Err(format!("no uploaded file matches '{src}'"));
    }
    Ok(current)
}

fn wildcard(pattern: &str, name: &str) -> bool {
    fn matches(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => matches(&p[1..], n) || (!n.is_empty() && matches(p, &n[1..])),
            (Some(b'?'), Some(_)) => matches(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => matches(&p[1..], &n[1..]),
            _ => false,
        }
    }
    matches(pattern.as_bytes(), name.as_bytes())
}

/// Places `sources` at `dest` in the new layer with Docker's COPY rules: a directory's
/// contents go into `dest`; a file goes to `dest` itself, or into it when `dest` ends with
/// `/`, names an existing directory, or there are several sources.
fn copy_into_layer(
    stack: &[PathBuf],
    upper: &Path,
    sources: &[PathBuf],
    dest: &str,
    owner: (u32, u32),
    mode: Option<u32>,
) -> std::io::Result<()> {
    let dest_relative = layers::resolve(stack, dest).map_err(std::io::Error::other)?;
    let dest_is_dir = dest.ends_with('/')
        || sources.len() > 1
        || matches!(layers::lookup(stack, &dest_relative), Found::Dir)
        || sources
            .iter()
            .all(|s| std::fs::symlink_metadata(s).is_ok_and(|m| m.is_dir()));
    for source in sources {
        let meta = std::fs::symlink_metadata(source)?;
        let target_relative = if meta.is_dir() || !dest_is_dir {
            dest_relative.clone()
        } else {
            dest_relative.join(source.file_name().unwrap_or_default())
        };
        let parent_is_dest = dest_is_dir && !meta.is_dir();
        make_parents(stack, upper, &target_relative, false, owner)?;
        if parent_is_dest || meta.is_dir() {
            let dir_relative = if meta.is_dir() {
                &target_relative
            } else {
                &dest_relative
            };
            make_parents(stack, upper, dir_relative, true, owner)?;
        }
        copy_tree(source, &upper.join(&target_relative), owner, mode)?;
    }
    Ok(())
}

/// Copies `from` (a file, link or directory from the extracted context) to `to`, giving
/// every entry `owner` and, when set, `mode`.
fn copy_tree(from: &Path, to: &Path, owner: (u32, u32), mode: Option<u32>) -> std::io::Result<()> {
    let mut pending = vec![(from.to_owned(), to.to_owned())];
    while let Some((src, dst)) = pending.pop() {
        let meta = std::fs::symlink_metadata(&src)?;
        let kind = meta.file_type();
        if kind.is_symlink() {
            let _ = std::fs::remove_file(&dst);
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
            std::os::unix::fs::lchown(&dst, Some(owner.0), Some(owner.1))?;
            continue;
        }
        if kind.is_dir() {
            if !dst.is_dir() {
                std::fs::create_dir(&dst)?;
            }
            for entry in std::fs::read_dir(&src)? {
                let entry = entry?;
                pending.push((entry.path(), dst.join(entry.file_name())));
            }
        } else if kind.is_file() {
            std::fs::copy(&src, &dst)?;
        } else {
            return Err(std::io::Error::other(format!(
                "{} is not a file, link or directory",
                src.display()
            )));
        }
        std::os::unix::fs::lchown(&dst, Some(owner.0), Some(owner.1))?;
        let bits = mode.unwrap_or(meta.mode() & 0o7777);
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(bits))?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_made_absolute_against_the_workdir() {
        assert_eq!(absolute("/home/user", "app"), "/home/user/app");
        assert_eq!(absolute("/home/user", "/app/"), "/app/");
        assert_eq!(absolute("/a/b", "../c"), "/a/c");
        assert_eq!(absolute("/", "../../x"), "/x");
    }

    #[test]
    fn wildcards_match_per_component() {
        assert!(wildcard("*.txt", "a.txt"));
        assert!(!wildcard("*.txt", "a.txt.bak"));
        assert!(wildcard("a?c", "abc"));
        assert!(wildcard("*", ""));
    }

    #[test]
    fn copy_follows_docker_rules_and_keeps_parent_metadata() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        std::fs::create_dir_all(lower.join("home/user")).unwrap();
        std::fs::set_permissions(
            lower.join("home/user"),
            std::fs::Permissions::from_mode(0o750),
        )
        .unwrap();
        std::os::unix::fs::lchown(lower.join("home/user"), Some(1000), Some(1000)).unwrap();
        std::os::unix::fs::symlink("home", lower.join("h")).unwrap();
        let ctx = tmp.path().join("ctx");
        std::fs::create_dir_all(ctx.join("dir/sub")).unwrap();
        std::fs::write(ctx.join("hello.txt"), "hi").unwrap();
        std::fs::write(ctx.join("dir/sub/a"), "a").unwrap();
        let upper = tmp.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let stack = vec![lower];
        copy_into_layer(
            &stack,
            &upper,
            &[ctx.join("hello.txt")],
            "/h/user/",
            (1000, 1000),
            None,
        )
        .unwrap();
        copy_into_layer(
            &stack,
            &upper,
            &[ctx.join("dir")],
            "/app/dir",
            (0, 0),
            Some(0o700),
        )
        .unwrap();
        copy_into_layer(
            &stack,
            &upper,
            &[ctx.join("hello.txt")],
            "/app/renamed.txt",
            (0, 0),
            None,
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(upper.join("home/user/hello.txt")).unwrap(),
            "hi"
        );
        let home = std::fs::metadata(upper.join("home/user")).unwrap();
        assert_eq!((home.uid(), home.mode() & 0o777), (1000, 0o750));
        assert_eq!(
            std::fs::read_to_string(upper.join("app/dir/sub/a")).unwrap(),
            "a"
        );
        assert_eq!(
            std::fs::read_to_string(upper.join("app/renamed.txt")).unwrap(),
            "hi"
        );
        assert_eq!(
            std::fs::metadata(upper.join("app/dir/sub/a"))
                .unwrap()
                .mode()
                & 0o777,
            0o700
        );
    }

    #[test]
    fn users_are_added_with_a_home() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        std::fs::create_dir_all(lower.join("etc/sudoers.d")).unwrap();
        std::fs::write(lower.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        std::fs::write(lower.join("etc/group"), "root:x:0:\n").unwrap();
        let upper = tmp.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let stack = vec![lower];
        write_prerequisites(&stack, &upper).unwrap();
        let passwd = std::fs::read_to_string(upper.join("etc/passwd")).unwrap();
        assert!(
            passwd.contains("user:x:1000:1000::/home/user:/bin/sh"),
            "{passwd}"
        );
        assert!(upper.join("etc/sudoers.d/user").exists());
        assert!(upper.join("tmp").is_dir());
        let stack = vec![upper, stack[0].clone()];
        assert_eq!(lookup_ids(&stack, "user", None).unwrap(), (1000, 1000));
        assert_eq!(lookup_ids(&stack, "root", Some("user")).unwrap(), (0, 1000));
        assert!(lookup_ids(&stack, "nobody", None).is_err());
    }
}
