//! The node's template builder: pulls base images, runs each build step in a build sandbox
//! (with the same isolation as any sandbox) or writes it straight into a fresh layer, and
//! caches every layer under the hash of its parent and its own definition.

#![deny(clippy::disallowed_methods)]

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sandbar_core::builds::{
    BASE_STEP, BuildFailure, BuildJob, BuildLog, BuildSource, BuildStep, Builder, FINALIZE_STEP,
    LogLevel, StartedImage, StepKind, TemplateImage, UploadBody, UploadError,
};
use sandbar_core::{EgressRules, LaunchSpec, Runtime, RuntimeHandle, Template};
use sha2::{Digest, Sha256};

use std::ffi::OsStr;

use sandbar_fs::{Dir, Kind, Links, Tree};

use crate::runtime::LinuxRuntime;
use crate::storage::layers::{self, Found, LayerStore, Stack};

/// Bump when the prerequisites written into every image change.
const PREREQUISITES_VERSION: &str = "prerequisites-v1";
/// The account every sandbox has, as E2B's templates do.
const SANDBOX_USER: &str = "user";
/// Disk quota of a build sandbox's writable layer, in MiB, where the pool has the room.
const BUILD_DISK_MB: u32 = 20 * 1024;
const MAX_LOG_LINES_PER_STEP: usize = 5000;

#[derive(Debug)]
pub struct NodeBuilder {
    runtime: Arc<LinuxRuntime>,
    images: sandbar_image::ImageCache,
    image_layers: Arc<crate::storage::image_layers::ImageLayers>,
    uploads: crate::storage::uploads::Uploads,
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
        registry_policy: Arc<sandbar_image::RegistryPolicy>,
        mirror: String,
        upload_limits: crate::storage::uploads::UploadLimits,
        image_cache_bytes: u64,
    ) -> Self {
        let images_root = data_dir.join("images");
        let layers_dir = runtime.layers().layer_store().images_dir().to_owned();
        Self {
            templates_dir: data_dir.join("templates"),
            mirror,
            runtime,
            image_layers: Arc::new(crate::storage::image_layers::ImageLayers::new(
                layers_dir.clone(),
                images_root.join("layers"),
                image_cache_bytes,
            )),
            images: sandbar_image::ImageCache::with_layers_dir(
                images_root,
                layers_dir,
                registry_policy,
            ),
            uploads: crate::storage::uploads::Uploads::open(
                data_dir.join("uploads"),
                upload_limits,
            ),
            pinned: Mutex::new(HashMap::new()),
        }
    }

    /// A build sandbox's disk: the template's, or more room for its steps' downloads and
    /// caches ([`BUILD_DISK_MB`]), as far as the pool has room now.
    fn build_disk_mb(&self, template_mb: u32) -> u32 {
        use sandbar_core::Runtime as _;
        let room_mb = self.runtime.disks().pool.map_or(u32::MAX, |pool| {
            u32::try_from(pool.free_bytes.saturating_sub(pool.reserve_bytes) >> 20)
                .unwrap_or(u32::MAX)
        });
        BUILD_DISK_MB.min(room_mb).max(template_mb)
    }

    fn store(&self) -> &LayerStore {
        self.runtime.layers().layer_store()
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
        self.uploads.path(team_id, hash)
    }

    /// Layers that must stay: what the store last named, running builds' and live
    /// sandboxes'.
    fn layers_to_keep(&self, in_use: &[String]) -> std::collections::BTreeSet<String> {
        let mut keep: Vec<String> = in_use.to_vec();
        keep.extend(
            self.pinned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .flatten()
                .cloned(),
        );
        self.runtime.layers().layers_to_keep(&keep)
    }

    async fn start_from_source(
        &self,
        job: &BuildJob,
        log: &BuildLog,
    ) -> Result<State, BuildFailure> {
        match &job.spec.source {
            BuildSource::Builtin { layer } => {
                let Some(recipe) = crate::build::templates::built_in_root(layer) else {
                    return Err(BuildFailure::at(
                        BASE_STEP,
                        format!("unknown built-in root '{layer}'"),
                    ));
                };
                if self.store().exists(layer) {
                    log.info(Some(BASE_STEP), format!("CACHED FROM {layer}"));
                } else {
                    log.info(
                        Some(BASE_STEP),
                        format!("FROM {layer}: building the Debian root with mmdebstrap"),
                    );
                    let started = std::time::Instant::now();
                    crate::build::templates::build_root(recipe, &self.templates_dir, &self.mirror)
                        .await
                        .map_err(|e| BuildFailure::at(BASE_STEP, e.to_string()))?;
                    log.info(
                        Some(BASE_STEP),
                        format!("built {layer} in {:.0} s", started.elapsed().as_secs_f32()),
                    );
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
                if let Some(shared) = self.runtime.layers().shared_layers() {
                    shared
                        .ensure(&base.layers)
                        .await
                        .map_err(|e| BuildFailure::at(BASE_STEP, e.to_string()))?;
                }
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
                    .image_layers
                    .pull(
                        &self.images,
                        job.team_id.as_deref().unwrap_or(""),
                        reference,
                        auth.as_ref(),
                        &progress,
                        u64::from(job.disk_size_mb) << 20,
                        self.layers_to_keep(&self.image_layers.in_use()),
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

    fn stack(&self, state: &State, step: &str) -> Result<Stack, BuildFailure> {
        self.store()
            .trees(&state.layers)
            .map_err(|e| io_fail(step, e))
    }

    /// Makes the step layer `key` by filling a fresh directory on the host.
    fn write_layer(
        &self,
        key: &str,
        step: &str,
        fill: impl FnOnce(&Tree) -> std::io::Result<()>,
    ) -> Result<(), BuildFailure> {
        let steps = Tree::open(self.store().steps_dir(), Links::Refused)
            .map_err(|e| io_fail(step, format!("cannot open the layer directory: {e}")))?;
        let staging = PathBuf::from(format!(".tmp-{}", sandbar_core::ids::new_secret("")));
        let result = (|| -> std::io::Result<()> {
            let staging_dir = steps.create_dir(&staging, 0o700)?;
            staging_dir.create_dir(OsStr::new(sandbar_jail::layout::UPPER), 0o755)?;
            let upper = Tree::from_dir(
                staging_dir.open_dir(OsStr::new(sandbar_jail::layout::UPPER))?,
                Links::Refused,
            );
            fill(&upper)?;
            if steps.symlink_metadata(key)?.is_some() {
                steps.remove_all(&staging)?;
            } else {
                steps.rename(&staging, key)?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = steps.remove_all(&staging);
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
        let host = RunStepHost {
            builder: self,
            job,
            state,
            key,
            step,
            command,
            user,
        };
        let mut output = crate::build::build_output::StepOutput::new(MAX_LOG_LINES_PER_STEP);
        let result = {
            let mut on_output =
                |bytes: &[u8]| output.push(bytes, |line| log.info(Some(step), line));
            crate::build::build_step::run_step(
                &host,
                step,
                command,
                job.step_timeout,
                &mut on_output,
            )
            .await
        };
        if let Some(note) = output.finish(|line| log.info(Some(step), line)) {
            log.log(LogLevel::Warn, Some(step), note);
        }
        result
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
                team_id: job.team_id.clone(),
                build_id: job.build_id.clone(),
                build_status: sandbar_core::BuildStatus::Building,
                ..Template::unbuilt(
                    job.template_id.clone(),
                    job.cpu_count,
                    job.memory_mb,
                    job.disk_size_mb,
                    now,
                )
            },
            image: TemplateImage {
                layers: state.layers.clone(),
                env: state.env.clone(),
                user: state.user.clone(),
                workdir: state.workdir.clone(),
                start_cmd,
                start_user: job.spec.start_user.clone(),
                ready_cmd,
                snapshot: None,
                started: None,
            },
            cpu_count: job.cpu_count,
            memory_mb: job.memory_mb,
            disk_size_mb: self.build_disk_mb(job.disk_size_mb),
            disk_rates: Default::default(),
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
            let planned = self.plan_step(job, &state, index, step, &mut cached)?;
            log.info(Some(&planned.number), planned.shown(total, step));
            self.apply_step(job, &mut state, step, &planned, log)
                .await?;
            state.key = planned.key;
        }
        let mut image = final_image(job, &state);
        if image.start_cmd.is_some() || image.ready_cmd.is_some() {
            self.check_start(job, &state, &mut image, log).await?;
        }
        log.info(
            Some(FINALIZE_STEP),
            format!("template ready ({} layers)", image.layers.len()),
        );
        Ok(image)
    }

    /// Works out a step's cache key before it runs: the key chains the parent's with the
    /// step's definition (and a `COPY`'s uploaded files), so one changed step rebuilds it and
    /// every step after it. `cached` stays true only while every step so far was a hit.
    fn plan_step(
        &self,
        job: &BuildJob,
        state: &State,
        index: usize,
        step: &BuildStep,
        cached: &mut bool,
    ) -> Result<PlannedStep, BuildFailure> {
        let number = (index + 1).to_string();
        let definition = serde_json::to_vec(&step.kind).unwrap_or_default();
        let mut key_parts: Vec<Vec<u8>> = vec![state.key.clone().into_bytes(), definition];
        if let StepKind::Copy { files_hash, .. } = &step.kind {
            let path = self
                .upload_path(job.team_id.as_deref().unwrap_or("builtin"), files_hash)
                .filter(|p| sandbar_fs::host_is_file(p))
                .ok_or_else(|| {
                    io_fail(
                        &number,
                        format!("step {number} (COPY): the files {files_hash} were never uploaded"),
                    )
                })?;
            key_parts.push(
                file_sha(&path)
                    .map_err(|e| io_fail(&number, e))?
                    .into_bytes(),
            );
        }
        if step.force || job.spec.force {
            *cached = false;
            key_parts.push(job.build_id.clone().into_bytes());
        }
        let parts: Vec<&[u8]> = key_parts.iter().map(Vec::as_slice).collect();
        let key = sha(&parts);
        let name = LayerStore::step_layer_name(&key);
        let makes_layer = matches!(step.kind, StepKind::Run { .. } | StepKind::Copy { .. });
        let hit = *cached && (!makes_layer || self.store().exists(&name));
        if !hit {
            *cached = false;
        }
        Ok(PlannedStep {
            number,
            key,
            name,
            hit,
        })
    }

    /// Carries one step out on the build's state, by kind.
    async fn apply_step(
        &self,
        job: &BuildJob,
        state: &mut State,
        step: &BuildStep,
        planned: &PlannedStep,
        log: &BuildLog,
    ) -> Result<(), BuildFailure> {
        match &step.kind {
            StepKind::Env { vars } => {
                state.env.extend(vars.iter().cloned());
                Ok(())
            }
            StepKind::Workdir { path } => self.apply_workdir(job, state, path, planned),
            StepKind::User { user } => self.apply_user(job, state, user, planned),
            StepKind::Run { command, user } => {
                self.pin(&job.build_id, &planned.name);
                if !planned.hit {
                    let as_user = user.clone().unwrap_or_else(|| state.user.clone());
                    self.run_step(
                        job,
                        state,
                        &planned.key,
                        &planned.number,
                        (command, &as_user),
                        log,
                    )
                    .await?;
                }
                state.layers.push(planned.name.clone());
                Ok(())
            }
            StepKind::Copy {
                src,
                dest,
                owner,
                mode,
                files_hash,
            } => {
                self.pin(&job.build_id, &planned.name);
                if !planned.hit {
                    let copy = CopyStep {
                        src,
                        dest,
                        owner: owner.as_deref(),
                        mode: *mode,
                        files_hash,
                    };
                    self.apply_copy(job, state, &copy, planned)?;
                }
                state.layers.push(planned.name.clone());
                Ok(())
            }
        }
    }

    /// `WORKDIR`: a directory that does not exist yet is made in a layer of its own, owned
    /// by the current user as Docker does; one that exists adds no layer.
    fn apply_workdir(
        &self,
        job: &BuildJob,
        state: &mut State,
        path: &str,
        planned: &PlannedStep,
    ) -> Result<(), BuildFailure> {
        let number = &planned.number;
        let target = absolute(&state.workdir, path);
        let stack = self.stack(state, number)?;
        let relative = layers::resolve(&stack, &target).map_err(|e| io_fail(number, e))?;
        if matches!(layers::lookup(&stack, &relative), Found::Missing) {
            if !self.store().exists(&planned.name) {
                let owner =
                    lookup_ids(&stack, &state.user, None).map_err(|e| io_fail(number, e))?;
                self.write_layer(&planned.key, number, |upper| {
                    make_parents(&stack, upper, &relative, true, owner)
                })?;
            }
            self.pin(&job.build_id, &planned.name);
            state.layers.push(planned.name.clone());
        }
        state.workdir = target;
        Ok(())
    }

    /// `USER`: an account the image lacks is added in a layer of its own, so a step may name
    /// any user; one the image has adds no layer.
    fn apply_user(
        &self,
        job: &BuildJob,
        state: &mut State,
        user: &str,
        planned: &PlannedStep,
    ) -> Result<(), BuildFailure> {
        let stack = self.stack(state, &planned.number)?;
        if lookup_ids(&stack, user, None).is_err() {
            if !self.store().exists(&planned.name) {
                self.write_layer(&planned.key, &planned.number, |upper| {
                    add_user(&stack, upper, user)
                })?;
            }
            self.pin(&job.build_id, &planned.name);
            state.layers.push(planned.name.clone());
        }
        state.user = user.to_owned();
        Ok(())
    }

    /// `COPY`: unpacks the uploaded context into a scratch directory of the pool and copies
    /// the selected files into a new layer; the scratch directory goes however it ends.
    fn apply_copy(
        &self,
        job: &BuildJob,
        state: &State,
        copy: &CopyStep<'_>,
        planned: &PlannedStep,
    ) -> Result<(), BuildFailure> {
        let number = &planned.number;
        let upload = self
            .upload_path(job.team_id.as_deref().unwrap_or("builtin"), copy.files_hash)
            .ok_or_else(|| io_fail(number, "invalid upload"))?;
        let stack = self.stack(state, number)?;
        let dest = absolute(&state.workdir, copy.dest);
        let owner_spec = copy
            .owner
            .filter(|o| !o.is_empty())
            .map_or_else(|| state.user.clone(), str::to_owned);
        let (user, group) = match owner_spec.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (owner_spec.as_str(), None),
        };
        let owner = lookup_ids(&stack, user, group).map_err(|e| io_fail(number, e))?;
        let ctx_dir = self
            .store()
            .steps_dir()
            .join(format!(".tmp-ctx-{}", sandbar_core::ids::new_secret("")));
        let ctx_name = ctx_dir.file_name().map(OsStr::to_owned).unwrap_or_default();
        let target = CopyTarget {
            stack: &stack,
            dest: &dest,
            owner,
        };
        let scratch = CopyScratch {
            upload: &upload,
            dir: &ctx_dir,
            name: &ctx_name,
        };
        let result = tokio::task::block_in_place(|| {
            self.fill_copy_layer(job, copy, planned, &scratch, &target)
        });
        if let Ok(steps) = Tree::open(self.store().steps_dir(), Links::Refused) {
            let _ = steps.remove_all(&ctx_name);
        }
        result
    }

    /// The blocking half of `COPY`: unpacks the upload within the template's disk and writes
    /// the step's layer from it.
    fn fill_copy_layer(
        &self,
        job: &BuildJob,
        copy: &CopyStep<'_>,
        planned: &PlannedStep,
        scratch: &CopyScratch<'_>,
        target: &CopyTarget<'_>,
    ) -> Result<(), BuildFailure> {
        let step_name = &planned.number;
        let (upload, ctx_dir, ctx_name) = (scratch.upload, scratch.dir, scratch.name);
        Tree::open(self.store().steps_dir(), Links::Refused)
            .and_then(|steps| Ok(steps.create_dir(ctx_name, 0o700)?))
            .map_err(|e| io_fail(step_name, e))?;
        let file = self
            .uploads
            .open_for_build(upload)
            .map_err(|e| io_fail(step_name, e))?;
        // The context and its copy both land in the pool: each may take at most the
        // template's disk.
        let budget = sandbar_image::ByteBudget::new(u64::from(job.disk_size_mb) << 20);
        sandbar_image::extract_upload_within(std::io::BufReader::new(file), ctx_dir, &budget)
            .map_err(|e| {
                io_fail(
                    step_name,
                    format!("step {step_name} (COPY): the uploaded files are refused: {e}"),
                )
            })?;
        let ctx = Tree::open(ctx_dir, Links::Refused).map_err(|e| io_fail(step_name, e))?;
        let sources = select_sources(&ctx, copy.src)
            .map_err(|e| io_fail(step_name, format!("step {step_name} (COPY): {e}")))?;
        self.write_layer(&planned.key, step_name, |upper| {
            copy_into_layer(
                target.stack,
                upper,
                &ctx,
                &sources,
                target.dest,
                target.owner,
                copy.mode,
            )
        })
        .map_err(|f| BuildFailure::at(step_name, format!("step {step_name} (COPY): {}", f.message)))
    }

    /// Starts the finished template once so a start or ready command that never gets ready
    /// fails the build rather than every sandbox made from it, and captures the started
    /// sandbox where the node can.
    async fn check_start(
        &self,
        job: &BuildJob,
        state: &State,
        image: &mut TemplateImage,
        log: &BuildLog,
    ) -> Result<(), BuildFailure> {
        log.info(
            Some(FINALIZE_STEP),
            "checking the start and ready commands in a new sandbox",
        );
        let id = sandbar_core::ids::new_sandbox_id();
        let token = sandbar_core::ids::new_secret("");
        let spec = self.launch_spec(
            job,
            state,
            &id,
            &token,
            image.start_cmd.clone(),
            image.ready_cmd.clone(),
        );
        let (sandbox, _) = launch_build_sandbox(self.runtime.clone(), spec)
            .await
            .map_err(|e| io_fail(FINALIZE_STEP, format!("the template does not start: {e}")))?;
        let Some(handle) = sandbox.handle.clone() else {
            return Err(io_fail(FINALIZE_STEP, "the template's sandbox is gone"));
        };
        log.info(Some(FINALIZE_STEP), "start command ready");
        // Captured with its memory once ready, as E2B's templates are: sandboxes of the
        // template are restored from it with the start command's processes running instead
        // of started and waited for again. In a field of its own: an image with `snapshot`
        // set is a snapshot's.
        let captured = if image.start_cmd.is_some() && self.runtime.checkpoints_ready().await {
            self.capture_started(&id, &handle, &token).await
        } else {
            Err(CaptureError::NotSupported {
                sandbox_id: id.clone(),
            })
        };
        sandbox.destroy().await;
        match captured {
            Ok((layer, checkpoint)) => {
                image.started = Some(StartedImage {
                    layer,
                    checkpoint,
                    sandbox_id: id,
                });
                log.info(
                    Some(FINALIZE_STEP),
                    "captured the started sandbox with its memory: new sandboxes start with the start command running",
                );
            }
            Err(e) if image.start_cmd.is_some() => log.log(
                LogLevel::Warn,
                Some(FINALIZE_STEP),
                format!(
                    "the started sandbox is not captured ({e}); each new sandbox runs the start command and waits until it is ready"
                ),
            ),
            Err(_) => {}
        }
        Ok(())
    }

    /// Snapshots the ready build sandbox with its memory; the layer and checkpoint it names
    /// become the template's started image.
    async fn capture_started(
        &self,
        id: &str,
        handle: &RuntimeHandle,
        token: &str,
    ) -> Result<(String, String), CaptureError> {
        let parts = self
            .runtime
            .snapshot(id, handle, token, true)
            .await
            .map_err(CaptureError::Snapshot)?;
        parts
            .checkpoint
            .map(|checkpoint| (parts.layer, checkpoint))
            .ok_or_else(|| CaptureError::NoCheckpoint {
                sandbox_id: id.to_owned(),
            })
    }
}

/// Why a template's started sandbox is not captured with its memory; its sandboxes then run
/// the start command each.
#[derive(Debug, thiserror::Error)]
enum CaptureError {
    #[error("this node cannot checkpoint sandboxes")]
    NotSupported { sandbox_id: String },
    #[error("{0}")]
    Snapshot(sandbar_core::RuntimeError),
    #[error("the capture has no checkpoint")]
    NoCheckpoint { sandbox_id: String },
}

/// Why a build sandbox does not start.
#[derive(Debug, thiserror::Error)]
enum LaunchBuildSandboxError {
    #[error("{0}")]
    Launch(sandbar_core::RuntimeError),
    #[error("the launch of the build sandbox ended: {source}")]
    Ended {
        sandbox_id: String,
        source: tokio::task::JoinError,
    },
}

/// Why a `RUN` step's command cannot be run to its end in its sandbox.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct StepExecError {
    sandbox_id: String,
    /// What the sandbox's agent answered.
    message: String,
}

/// Why a `RUN` step's sandbox cannot be kept as its layer.
#[derive(Debug, thiserror::Error)]
enum StepCommitError {
    #[error("step {step}: the build sandbox is gone")]
    Gone { step: String },
    #[error("{0}")]
    Commit(sandbar_core::RuntimeError),
}

/// Why a user or group a step names has no ids in the image.
#[derive(Debug, thiserror::Error)]
enum LookupIdsError {
    #[error("user '{user}' does not exist in the image")]
    NoUser { user: String },
    #[error("group '{group}' does not exist in the image")]
    NoGroup { group: String },
}

/// Why a `COPY` step's sources cannot be taken from the uploaded files.
#[derive(Debug, thiserror::Error)]
pub enum SelectSourcesError {
    #[error("source '{src}' leaves the build context")]
    LeavesContext { src: String },
    #[error("source '{src}' passes through the link '{}' in the uploaded files", link.display())]
    ThroughLink { src: String, link: PathBuf },
    #[error("{source}")]
    Read {
        src: String,
        source: sandbar_fs::FsError,
    },
    #[error("no uploaded file matches '{src}'")]
    NoMatch { src: String },
}

/// Why a step run outside a build ([`copy_step`], [`prerequisites_step`]) fails.
#[derive(Debug, thiserror::Error)]
pub enum LayerStepError {
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Sources(#[from] SelectSourcesError),
    #[error("cannot write the layer {}: {source}", upper.display())]
    Write {
        upper: PathBuf,
        source: std::io::Error,
    },
}

/// The image a finished build names, before its start command is checked.
fn final_image(job: &BuildJob, state: &State) -> TemplateImage {
    TemplateImage {
        layers: state.layers.clone(),
        env: state.env.clone(),
        user: state.user.clone(),
        workdir: state.workdir.clone(),
        start_cmd: job.spec.start_cmd.clone().filter(|c| !c.is_empty()),
        start_user: job.spec.start_user.clone().filter(|u| !u.is_empty()),
        ready_cmd: job.spec.ready_cmd.clone().filter(|c| !c.is_empty()),
        snapshot: None,
        started: None,
    }
}

/// One step's place in the layer cache, worked out before it runs.
struct PlannedStep {
    /// The step's number as the build log shows it, from 1.
    number: String,
    /// The cache key of the state after the step.
    key: String,
    /// The step layer the key names.
    name: String,
    /// Whether the step's result is cached and need not run again.
    hit: bool,
}

impl PlannedStep {
    /// The build log's line for the step.
    fn shown(&self, total: usize, step: &BuildStep) -> String {
        let shown = format!("[{}/{total}] {}", self.number, step.kind.describe());
        if self.hit {
            format!("CACHED {shown}")
        } else {
            shown
        }
    }
}

/// A `COPY` step's fields, borrowed from its definition.
struct CopyStep<'a> {
    src: &'a str,
    dest: &'a str,
    owner: Option<&'a str>,
    mode: Option<u32>,
    files_hash: &'a str,
}

/// Where a `COPY` unpacks its upload: a directory of the pool, so a context as large as the
/// template's disk never fills the host's.
struct CopyScratch<'a> {
    /// The uploaded tar.
    upload: &'a Path,
    /// The scratch directory's path, and its name in the steps directory.
    dir: &'a Path,
    name: &'a OsStr,
}

/// Where a `COPY` puts its files: the image below, the absolute destination and the owner.
struct CopyTarget<'a> {
    stack: &'a Stack,
    dest: &'a str,
    owner: (u32, u32),
}

/// Lets go of a build's pinned layers when the build ends, also when it is dropped where it
/// stands.
struct PinsOfBuild<'a> {
    builder: &'a NodeBuilder,
    build_id: &'a str,
}

impl Drop for PinsOfBuild<'_> {
    fn drop(&mut self) {
        let unpinned = self
            .builder
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.build_id);
        // Until the store names them in the template, only a recent use keeps them cached.
        self.builder
            .image_layers
            .touch(&unpinned.unwrap_or_default());
    }
}

/// A build sandbox that is removed when dropped unless it was committed or destroyed first,
/// so a build dropped where it stands (cancelled, or the server stopping) leaves none.
/// From its launch to its removal it counts as in flight, so the server's stop waits for a
/// sandbox of a build it dropped to be gone.
struct BuildSandbox {
    runtime: Arc<LinuxRuntime>,
    id: String,
    handle: Option<RuntimeHandle>,
    _alive: crate::runtime::InFlightGuard,
}

impl BuildSandbox {
    fn new(
        runtime: Arc<LinuxRuntime>,
        id: String,
        handle: RuntimeHandle,
        alive: crate::runtime::InFlightGuard,
    ) -> Self {
        Self {
            runtime,
            id,
            handle: Some(handle),
            _alive: alive,
        }
    }

    async fn destroy(mut self) {
        if let Some(handle) = self.handle.take() {
            destroy_build_sandbox(&self.runtime, &self.id, &handle).await;
        }
    }
}

impl Drop for BuildSandbox {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        let Ok(tokio) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let runtime = self.runtime.clone();
        let id = std::mem::take(&mut self.id);
        // Taken before this one's drops, so the count never passes through zero meanwhile.
        let in_flight = runtime.layers().build_sandbox_in_flight();
        tokio.spawn(async move {
            destroy_build_sandbox(&runtime, &id, &handle).await;
            drop(in_flight);
        });
    }
}

/// Launches a build sandbox in a task of its own: a build dropped meanwhile (cancelled, or the
/// server stopping) must not leave a sandbox half made, so the launch runs to its end and a
/// sandbox nobody waits for any more is removed as its [`BuildSandbox`] drops.
async fn launch_build_sandbox(
    runtime: Arc<LinuxRuntime>,
    spec: LaunchSpec,
) -> Result<(BuildSandbox, sandbar_core::Endpoint), LaunchBuildSandboxError> {
    let id = spec.sandbox_id.clone();
    let sandbox_id = id.clone();
    let alive = runtime.layers().build_sandbox_in_flight();
    tokio::spawn(async move {
        let (handle, endpoint) = runtime
            .launch(spec)
            .await
            .map_err(LaunchBuildSandboxError::Launch)?;
        Ok((BuildSandbox::new(runtime, id, handle, alive), endpoint))
    })
    .await
    .map_err(|source| LaunchBuildSandboxError::Ended { sandbox_id, source })?
}

async fn destroy_build_sandbox(runtime: &LinuxRuntime, id: &str, handle: &RuntimeHandle) {
    if let Err(e) = runtime.destroy(id, handle).await {
        tracing::warn!(sandbox_id = %id, error = %e, "cannot remove a build sandbox");
    }
}

/// The node side of one `RUN` step.
struct RunStepHost<'a> {
    builder: &'a NodeBuilder,
    job: &'a BuildJob,
    state: &'a State,
    key: &'a str,
    step: &'a str,
    command: &'a str,
    user: &'a str,
}

/// A `RUN` step's sandbox and what its agent needs to run the command.
struct StepSandbox {
    sandbox: BuildSandbox,
    agent_socket: PathBuf,
    token: String,
}

#[async_trait::async_trait]
impl crate::build::build_step::StepHost for RunStepHost<'_> {
    type Sandbox = StepSandbox;
    type StartError = LaunchBuildSandboxError;
    type ExecError = StepExecError;
    type CommitError = StepCommitError;

    async fn start(&self) -> Result<StepSandbox, LaunchBuildSandboxError> {
        let id = sandbar_core::ids::new_sandbox_id();
        let token = sandbar_core::ids::new_secret("");
        let spec = self
            .builder
            .launch_spec(self.job, self.state, &id, &token, None, None);
        let (sandbox, endpoint) = launch_build_sandbox(self.builder.runtime.clone(), spec).await?;
        Ok(StepSandbox {
            sandbox,
            agent_socket: endpoint.agent_socket,
            token,
        })
    }

    async fn exec(
        &self,
        sandbox: &StepSandbox,
        on_output: &mut (dyn for<'b> FnMut(&'b [u8]) + Send),
    ) -> Result<i32, StepExecError> {
        let exec = crate::runtime::agent_client::Exec {
            token: &sandbox.token,
            user: self.user,
            command: self.command,
            envs: &self.state.env,
            cwd: Some(&self.state.workdir),
        };
        crate::runtime::agent_client::run(&sandbox.agent_socket, &exec, |bytes| on_output(bytes))
            .await
            .map_err(|e| StepExecError {
                sandbox_id: sandbox.sandbox.id.clone(),
                message: e.to_string(),
            })
    }

    async fn commit(&self, mut sandbox: StepSandbox) -> Result<(), StepCommitError> {
        let Some(handle) = sandbox.sandbox.handle.clone() else {
            return Err(StepCommitError::Gone {
                step: self.step.to_owned(),
            });
        };
        self.builder
            .runtime
            .layers()
            .commit_layer(&sandbox.sandbox.id, &handle, self.key)
            .await
            .map_err(StepCommitError::Commit)?;
        // Committed: its directory is the layer now, and nothing of it is left to remove.
        sandbox.sandbox.handle = None;
        Ok(())
    }

    async fn discard(&self, sandbox: StepSandbox) {
        sandbox.sandbox.destroy().await;
    }
}

#[async_trait::async_trait]
impl Builder for NodeBuilder {
    async fn build(&self, job: BuildJob, log: BuildLog) -> Result<TemplateImage, BuildFailure> {
        let _pins = PinsOfBuild {
            builder: self,
            build_id: &job.build_id,
        };
        let mut result = self.build_inner(&job, &log).await;
        if let (Ok(image), Some(shared)) = (&result, self.runtime.layers().shared_layers()) {
            // Published before the template is ready, so every node can start it as soon as
            // any API host sees it ready.
            log.info(
                Some(FINALIZE_STEP),
                format!("publishing its layers to {}", shared.location()),
            );
            if let Err(e) = shared.publish(&image.parts()).await {
                result = Err(BuildFailure::at(FINALIZE_STEP, e.to_string()));
            }
        }
        if let Err(failure) = &result {
            log.log(
                LogLevel::Error,
                failure.step.as_deref(),
                failure.message.clone(),
            );
        }
        result
    }

    async fn has_upload(&self, team_id: &str, template_id: &str, hash: &str) -> bool {
        self.uploads.contains(team_id, template_id, hash)
    }

    async fn store_upload(
        &self,
        team_id: &str,
        template_id: &str,
        hash: &str,
        body: UploadBody,
        limit: u64,
    ) -> Result<(), UploadError> {
        self.uploads
            .store(team_id, template_id, hash, body, limit)
            .await
    }

    fn forget_template_uploads(&self, team_id: &str, template_id: &str) {
        self.uploads.forget_template(team_id, template_id);
    }

    fn hold_uploads(&self, job: &BuildJob) {
        let (team, hashes) = uploads_of(job);
        self.uploads.hold(team, &hashes);
    }

    fn release_uploads(&self, job: &BuildJob) {
        let (team, hashes) = uploads_of(job);
        self.uploads.release(team, &hashes);
    }

    async fn sweep_uploads(&self) {
        let uploads = self.uploads.clone();
        let _ = tokio::task::spawn_blocking(move || uploads.sweep()).await;
    }

    async fn collect_garbage(&self, in_use: &[String]) {
        self.image_layers.set_in_use(in_use);
        let keep = self.layers_to_keep(in_use);
        let runtime = self.runtime.clone();
        let image_layers = self.image_layers.clone();
        let _ = tokio::task::spawn_blocking(move || {
            runtime.layers().collect_layers(&keep);
            image_layers.collect(&keep);
        })
        .await;
    }
}

/// The team uploads of `job` are kept under, and the hashes its `COPY` steps read.
fn uploads_of(job: &BuildJob) -> (&str, Vec<String>) {
    let hashes = job
        .spec
        .steps
        .iter()
        .filter_map(|step| match &step.kind {
            StepKind::Copy { files_hash, .. } => Some(files_hash.clone()),
            _ => None,
        })
        .collect();
    (job.team_id.as_deref().unwrap_or("builtin"), hashes)
}

fn file_sha(path: &Path) -> std::io::Result<String> {
    let mut file = sandbar_fs::open_host_file(path)?;
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
fn lookup_ids(
    stack: &Stack,
    user: &str,
    group: Option<&str>,
) -> Result<(u32, u32), LookupIdsError> {
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
            .ok_or_else(|| LookupIdsError::NoUser {
                user: user.to_owned(),
            })?,
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
                    .ok_or_else(|| LookupIdsError::NoGroup {
                        group: g.to_owned(),
                    })?
            }
        },
    };
    Ok((uid, gid))
}

/// `relative` as the sandbox shows it, for messages.
fn in_image(relative: &Path) -> String {
    format!("/{}", relative.display())
}

/// Creates in `upper` the directories leading to `relative` (and `relative` itself when
/// `include_last`), each with the owner and mode it has below, so the layer changes none.
/// `relative` must already be resolved (no link on the way in the merge); a link or file
/// met in `upper` is an error, never followed.
fn make_parents(
    stack: &Stack,
    upper: &Tree,
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
        match upper.symlink_metadata(&so_far)? {
            Some(meta) if meta.is_dir() => continue,
            Some(_) => {
                return Err(std::io::Error::other(format!(
                    "'{}' is not a directory in the new layer",
                    in_image(&so_far)
                )));
            }
            None => {}
        }
        let (uid, gid, mode) =
            layers::dir_owner_mode(stack, &so_far).unwrap_or((new_owner.0, new_owner.1, 0o755));
        upper.create_dir(&so_far, mode)?;
        upper.chown(&so_far, uid, gid)?;
        // A change of owner may clear setgid.
        upper.chmod(&so_far, mode)?;
    }
    Ok(())
}

/// Writes `text` at `path` of the image: where the merge resolves it, in `upper`.
fn write_in_image(
    stack: &Stack,
    upper: &Tree,
    path: &str,
    text: &str,
    mode: u32,
) -> std::io::Result<()> {
    let merged = stack.with_top(upper)?;
    let relative = layers::resolve(&merged, path).map_err(std::io::Error::other)?;
    make_parents(stack, upper, &relative, false, (0, 0))?;
    upper.write(&relative, text.as_bytes(), mode)?;
    upper.chown(&relative, 0, 0)?;
    Ok(())
}

/// Writes into `upper` the files that make `name` a user with a home and a group, and, when
/// the image has sudo's drop-in directory, passwordless sudo for the sandbox user.
fn add_user(stack: &Stack, upper: &Tree, name: &str) -> std::io::Result<()> {
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
    let home = format!("/home/{name}");
    let append = |text: &str, line: String| {
        let mut t = text.to_owned();
        if !t.is_empty() && !t.ends_with('\n') {
            t.push('\n');
        }
        t.push_str(&line);
        t
    };
    write_in_image(
        stack,
        upper,
        "/etc/passwd",
        &append(&passwd, format!("{name}:x:{id}:{id}::{home}:{shell}\n")),
        0o644,
    )?;
    write_in_image(
        stack,
        upper,
        "/etc/group",
        &append(&group, format!("{name}:x:{id}:\n")),
        0o644,
    )?;
    if let Some(shadow) = layers::read_file(stack, "/etc/shadow") {
        write_in_image(
            stack,
            upper,
            "/etc/shadow",
            &append(&shadow, format!("{name}:*:19000:0:99999:7:::\n")),
            0o640,
        )?;
    }
    let merged = stack.with_top(upper)?;
    let home_dir = layers::resolve(&merged, &home).map_err(std::io::Error::other)?;
    make_parents(stack, upper, &home_dir, false, (0, 0))?;
    if upper.symlink_metadata(&home_dir)?.is_none() {
        upper.create_dir(&home_dir, 0o750)?;
    }
    upper.chown(&home_dir, id, id)?;
    upper.chmod(&home_dir, 0o750)?;
    let sudoers = layers::resolve(&merged, "/etc/sudoers.d").map_err(std::io::Error::other)?;
    if name == SANDBOX_USER && matches!(layers::lookup(&merged, &sudoers), Found::Dir(_)) {
        make_parents(stack, upper, &sudoers, true, (0, 0))?;
        let file = sudoers.join(name);
        upper.write(
            &file,
            format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL\n").as_bytes(),
            0o440,
        )?;
        upper.chown(&file, 0, 0)?;
    }
    Ok(())
}

/// What every sandbox needs whatever the image: the sandbox user, `/tmp`, `/etc`.
fn write_prerequisites(stack: &Stack, upper: &Tree) -> std::io::Result<()> {
    for (dir, mode) in [
        ("tmp", 0o1777),
        ("etc", 0o755),
        ("home", 0o755),
        ("root", 0o700),
    ] {
        if matches!(layers::lookup(stack, Path::new(dir)), Found::Missing) {
            upper.create_dir(dir, mode)?;
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

/// One COPY step outside a build: `src` (a path or pattern) from the extracted context `ctx`
/// to `dest` in the layer directory `upper`, over the layers `lower` (topmost first). For
/// harnesses and benchmarks that drive the step with trees of their own.
pub fn copy_step(
    lower: &[PathBuf],
    upper: &Path,
    ctx: &Path,
    src: &str,
    dest: &str,
    owner: (u32, u32),
    mode: Option<u32>,
) -> Result<(), LayerStepError> {
    let stack = open_lower(lower)?;
    let upper_tree = open_tree(upper)?;
    let ctx = open_tree(ctx)?;
    let sources = select_sources(&ctx, src)?;
    copy_into_layer(&stack, &upper_tree, &ctx, &sources, dest, owner, mode).map_err(|source| {
        LayerStepError::Write {
            upper: upper.to_owned(),
            source,
        }
    })
}

/// The layers `lower` opened for a step outside a build.
fn open_lower(lower: &[PathBuf]) -> Result<Stack, LayerStepError> {
    Stack::open(lower).map_err(|source| LayerStepError::Open {
        path: lower.first().cloned().unwrap_or_default(),
        source,
    })
}

/// A directory opened for a step outside a build, following no link.
fn open_tree(path: &Path) -> Result<Tree, LayerStepError> {
    Tree::open(path, Links::Refused).map_err(|source| LayerStepError::Open {
        path: path.to_owned(),
        source,
    })
}

/// What a build from an image writes before its steps (the sandbox user, `/tmp`, `/etc`), into
/// the layer directory `upper` over the layers `lower` (topmost first).
pub fn prerequisites_step(lower: &[PathBuf], upper: &Path) -> Result<(), LayerStepError> {
    let stack = open_lower(lower)?;
    let upper_tree = open_tree(upper)?;
    write_prerequisites(&stack, &upper_tree).map_err(|source| LayerStepError::Write {
        upper: upper.to_owned(),
        source,
    })
}

/// The entries of the extracted context that `src` names: a path, or a pattern with `*`
/// and `?` in its components, as paths relative to the context. A link in the context is
/// copied as a link; a source that passes through one is refused, never followed.
fn select_sources(ctx: &Tree, src: &str) -> Result<Vec<PathBuf>, SelectSourcesError> {
    let pattern: Vec<&str> = src
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if pattern.contains(&"..") {
        return Err(SelectSourcesError::LeavesContext {
            src: src.to_owned(),
        });
    }
    let through_link = |path: &Path| SelectSourcesError::ThroughLink {
        src: src.to_owned(),
        link: path.to_owned(),
    };
    let mut current = vec![(PathBuf::new(), Kind::Dir)];
    for component in &pattern {
        let mut next = Vec::new();
        for (dir, kind) in &current {
            match kind {
                Kind::Dir => {}
                Kind::Symlink => return Err(through_link(dir)),
                Kind::File | Kind::Other => continue,
            }
            if component.contains(['*', '?']) {
                let entries = match ctx.read_dir(dir) {
                    Ok(entries) => entries,
                    Err(sandbar_fs::FsError::Link(_)) => return Err(through_link(dir)),
                    Err(_) => continue,
                };
                for entry in entries {
                    if wildcard(component, &entry.name.to_string_lossy()) {
                        next.push((dir.join(&entry.name), entry.kind));
                    }
                }
            } else {
                let path = dir.join(component);
                match ctx.symlink_metadata(&path) {
                    Ok(Some(meta)) => next.push((path, Kind::of(&meta))),
                    Ok(None) | Err(sandbar_fs::FsError::NotADirectory(_)) => {}
                    Err(sandbar_fs::FsError::Link(_)) => return Err(through_link(dir)),
                    Err(source) => {
                        return Err(SelectSourcesError::Read {
                            src: src.to_owned(),
                            source,
                        });
                    }
                }
            }
        }
        current = next;
    }
    if current.is_empty() {
        return Err(SelectSourcesError::NoMatch {
            src: src.to_owned(),
        });
    }
    Ok(current.into_iter().map(|(path, _)| path).collect())
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

/// Places `sources` (paths in `ctx`) at `dest` in the new layer `upper` with Docker's COPY
/// rules: a directory's contents go into `dest`; a file goes to `dest` itself, or into it
/// when `dest` ends with `/`, names an existing directory, or there are several sources.
/// `dest` is resolved as the sandbox would see it (links in the image and in what earlier
/// sources wrote are followed inside the image), and every write is then made through
/// directory handles that follow nothing.
fn copy_into_layer(
    stack: &Stack,
    upper: &Tree,
    ctx: &Tree,
    sources: &[PathBuf],
    dest: &str,
    owner: (u32, u32),
    mode: Option<u32>,
) -> std::io::Result<()> {
    let kinds = sources
        .iter()
        .map(|s| {
            ctx.symlink_metadata(s)?
                .map(|m| Kind::of(&m))
                .ok_or_else(|| std::io::Error::other(format!("'{}' is gone", s.display())))
        })
        .collect::<std::io::Result<Vec<Kind>>>()?;
    for (source, kind) in sources.iter().zip(&kinds) {
        let merged = stack.with_top(upper)?;
        let dest_relative = layers::resolve(&merged, dest).map_err(std::io::Error::other)?;
        let dest_is_dir = dest.ends_with('/')
            || sources.len() > 1
            || matches!(layers::lookup(&merged, &dest_relative), Found::Dir(_))
            || kinds.iter().all(|k| *k == Kind::Dir);
        let is_dir = *kind == Kind::Dir;
        let target_relative = if is_dir || !dest_is_dir {
            dest_relative.clone()
        } else {
            dest_relative.join(source.file_name().unwrap_or_default())
        };
        make_parents(stack, upper, &target_relative, is_dir, owner)?;
        let copy = Copy { owner, mode };
        if is_dir {
            let from = ctx.dir(source)?;
            let to = upper.dir(&target_relative)?;
            copy.apply_to_dir(&to, &from.metadata()?, &target_relative)?;
            copy.tree(from, to, &target_relative)?;
        } else {
            let (from_dir, from_name) = ctx.parent(source)?;
            let (to_dir, to_name) = upper.parent(&target_relative)?;
            let mut pending = Vec::new();
            copy.entry(
                (&from_dir, &from_name),
                (&to_dir, &to_name),
                &target_relative,
                &mut pending,
            )?;
        }
    }
    Ok(())
}

/// One COPY's owner and mode for every entry it writes.
struct Copy {
    owner: (u32, u32),
    mode: Option<u32>,
}

impl Copy {
    fn bits(&self, meta: &std::fs::Metadata) -> u32 {
        self.mode.unwrap_or(meta.mode() & 0o7777)
    }

    fn apply_to_dir(
        &self,
        dir: &Dir,
        source: &std::fs::Metadata,
        shown: &Path,
    ) -> std::io::Result<()> {
        dir.chown_self(self.owner.0, self.owner.1)
            .and_then(|()| dir.chmod_self(self.bits(source)))
            .map_err(|e| std::io::Error::other(format!("cannot set up '{}': {e}", in_image(shown))))
    }

    /// Copies the contents of `from` into `to`, entry by entry.
    fn tree(&self, from: Dir, to: Dir, shown: &Path) -> std::io::Result<()> {
        let mut pending = vec![(from, to, shown.to_owned())];
        while let Some((from, to, shown)) = pending.pop() {
            for entry in from.entries()? {
                self.entry(
                    (&from, &entry.name),
                    (&to, &entry.name),
                    &shown.join(&entry.name),
                    &mut pending,
                )?;
            }
        }
        Ok(())
    }

    /// Copies the entry `from` to `to` (a directory handle and a name each); a directory's
    /// contents are left in `pending`.
    fn entry(
        &self,
        (from_dir, from_name): (&Dir, &OsStr),
        (to_dir, to_name): (&Dir, &OsStr),
        shown: &Path,
        pending: &mut Vec<(Dir, Dir, PathBuf)>,
    ) -> std::io::Result<()> {
        let fail = |e: sandbar_fs::FsError| {
            std::io::Error::other(format!("cannot copy to '{}': {e}", in_image(shown)))
        };
        let meta = from_dir
            .stat(from_name)
            .map_err(fail)?
            .ok_or_else(|| std::io::Error::other(format!("'{}' is gone", shown.display())))?;
        match Kind::of(&meta) {
            Kind::Symlink => {
                let target = from_dir.read_link(from_name).map_err(fail)?;
                to_dir.clear_for(to_name).map_err(fail)?;
                to_dir.symlink(&target, to_name).map_err(fail)?;
                to_dir
                    .chown(to_name, self.owner.0, self.owner.1)
                    .map_err(fail)?;
            }
            Kind::Dir => {
                let to = to_dir.ensure_dir(to_name, 0o700).map_err(fail)?;
                self.apply_to_dir(&to, &meta, shown)?;
                pending.push((
                    from_dir.open_dir(from_name).map_err(fail)?,
                    to,
                    shown.to_owned(),
                ));
            }
            Kind::File => {
                let mut input = from_dir.open_looked_at(from_name, &meta).map_err(fail)?;
                to_dir.clear_for(to_name).map_err(fail)?;
                let mut output = to_dir.create_file(to_name, 0o600, true).map_err(fail)?;
                std::io::copy(&mut input, &mut output)?;
                to_dir
                    .chown(to_name, self.owner.0, self.owner.1)
                    .map_err(fail)?;
                to_dir.chmod(to_name, self.bits(&meta)).map_err(fail)?;
            }
            Kind::Other => {
                return Err(std::io::Error::other(format!(
                    "'{}' is not a file, link or directory",
                    shown.display()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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

    fn tree(path: &Path) -> Tree {
        Tree::open(path, Links::Refused).unwrap()
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
        let stack = Stack::open(&[lower]).unwrap();
        let (up, cx) = (tree(&upper), tree(&ctx));
        let copy = |src: &str, dest: &str, owner, mode| {
            copy_into_layer(&stack, &up, &cx, &[PathBuf::from(src)], dest, owner, mode).unwrap()
        };
        copy("hello.txt", "/h/user/", (1000, 1000), None);
        copy("dir", "/app/dir", (0, 0), Some(0o700));
        copy("hello.txt", "/app/renamed.txt", (0, 0), None);
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

    /// A victim directory beside the build's trees, and everything observable about it.
    /// Path, mode, owner and content of every entry of a tree.
    type Look = Vec<(PathBuf, u32, u32, Vec<u8>)>;

    fn victim(tmp: &Path) -> (PathBuf, impl Fn() -> Look) {
        let victim = tmp.join("victim");
        std::fs::create_dir_all(victim.join("dir")).unwrap();
        std::fs::write(victim.join("target"), "host").unwrap();
        std::fs::write(victim.join("secret"), "root-only").unwrap();
        std::fs::set_permissions(
            victim.join("secret"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let root = victim.clone();
        let look = move || {
            let mut out = Vec::new();
            let mut pending = vec![root.clone()];
            while let Some(p) = pending.pop() {
                let m = std::fs::symlink_metadata(&p).unwrap();
                let data = if m.is_file() {
                    std::fs::read(&p).unwrap()
                } else {
                    Vec::new()
                };
                out.push((p.clone(), m.mode(), m.uid(), data));
                if m.is_dir() {
                    for e in std::fs::read_dir(&p).unwrap() {
                        pending.push(e.unwrap().path());
                    }
                }
            }
            out.sort();
            out
        };
        (victim, look)
    }

    #[test]
    fn copies_through_context_links_never_reach_the_host() {
        let tmp = tempfile::tempdir().unwrap();
        let (victim, look) = victim(tmp.path());
        let before = look();
        let lower = tmp.path().join("lower");
        std::fs::create_dir_all(lower.join("etc")).unwrap();
        let ctx = tmp.path().join("ctx");
        std::fs::create_dir_all(ctx.join("a")).unwrap();
        std::fs::create_dir_all(ctx.join("b/l")).unwrap();
        std::fs::write(ctx.join("b/l/target"), "tenant").unwrap();
        std::fs::write(ctx.join("b/l/new"), "tenant").unwrap();
        std::os::unix::fs::symlink(&victim, ctx.join("a/l")).unwrap();
        std::os::unix::fs::symlink(&victim, ctx.join("l")).unwrap();
        std::os::unix::fs::symlink(victim.join("target"), ctx.join("t")).unwrap();
        let upper = tmp.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let stack = Stack::open(&[lower]).unwrap();
        let (up, cx) = (tree(&upper), tree(&ctx));
        // A source through a context link is refused, naming the link.
        let err = select_sources(&cx, "l/secret").unwrap_err().to_string();
        assert!(err.contains("'l'"), "{err}");
        assert_eq!(
            select_sources(&cx, "l/*").map_err(|e| e.to_string()),
            Err("source 'l/*' passes through the link 'l' in the uploaded files".to_owned())
        );
        // The first source lays the link, the second writes where it points: refused.
        let sources = select_sources(&cx, "*").unwrap();
        let err =
            copy_into_layer(&stack, &up, &cx, &sources, "/dst/", (0, 0), Some(0o4755)).unwrap_err();
        assert!(err.to_string().contains("/dst/l"), "{err}");
        // A link source is copied as a link; a later file onto it lands where the link points
        // inside the image, as in the sandbox.
        copy_into_layer(
            &stack,
            &up,
            &cx,
            &[PathBuf::from("t")],
            "/x",
            (0, 0),
            Some(0o4755),
        )
        .unwrap();
        copy_into_layer(
            &stack,
            &up,
            &cx,
            &[PathBuf::from("b/l/new")],
            "/x",
            (0, 0),
            Some(0o4755),
        )
        .unwrap();
        assert!(
            std::fs::symlink_metadata(upper.join("x"))
                .unwrap()
                .is_symlink()
        );
        let inside = upper.join(victim.strip_prefix("/").unwrap()).join("target");
        assert_eq!(std::fs::read_to_string(inside).unwrap(), "tenant");
        assert_eq!(look(), before);
    }

    #[test]
    fn lower_layer_links_are_followed_inside_the_image_only() {
        let tmp = tempfile::tempdir().unwrap();
        let (victim, look) = victim(tmp.path());
        let before = look();
        let lower = tmp.path().join("lower");
        std::fs::create_dir_all(&lower).unwrap();
        std::os::unix::fs::symlink(&victim, lower.join("etc")).unwrap();
        std::os::unix::fs::symlink(&victim, lower.join("home")).unwrap();
        std::os::unix::fs::symlink("/", lower.join("tmp")).unwrap();
        std::os::unix::fs::symlink("../../../../..", lower.join("up")).unwrap();
        std::os::unix::fs::symlink("loop", lower.join("loop")).unwrap();
        let upper = tmp.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let stack = Stack::open(&[lower]).unwrap();
        let up = tree(&upper);
        // Reading the image's files never reads the host's.
        assert_eq!(layers::read_file(&stack, "/etc/target"), None);
        assert_eq!(layers::read_file(&stack, "/up/etc/passwd"), None);
        write_prerequisites(&stack, &up).unwrap();
        // The links kept their meaning inside the image: /etc is the image's own victim path.
        let merged = Stack::open(&[upper.clone(), tmp.path().join("lower")]).unwrap();
        let passwd = layers::read_file(&merged, "/etc/passwd").unwrap();
        assert!(passwd.contains("user:x:1000"), "{passwd}");
        let ctx = tmp.path().join("ctx");
        std::fs::create_dir_all(&ctx).unwrap();
        std::fs::write(ctx.join("f"), "tenant").unwrap();
        let cx = tree(&ctx);
        for dest in ["/etc/target", "/tmp/x", "/up/y", "/home/dir/"] {
            copy_into_layer(&stack, &up, &cx, &[PathBuf::from("f")], dest, (0, 0), None).unwrap();
        }
        let err = copy_into_layer(
            &stack,
            &up,
            &cx,
            &[PathBuf::from("f")],
            "/loop/z",
            (0, 0),
            None,
        )
        .expect_err("a destination through a link to itself");
        assert_eq!(err.to_string(), "too many symbolic links resolving /loop/z");
        assert_eq!(look(), before);
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
        let stack = Stack::open(std::slice::from_ref(&lower)).unwrap();
        write_prerequisites(&stack, &tree(&upper)).unwrap();
        let passwd = std::fs::read_to_string(upper.join("etc/passwd")).unwrap();
        assert!(
            passwd.contains("user:x:1000:1000::/home/user:/bin/sh"),
            "{passwd}"
        );
        assert!(upper.join("etc/sudoers.d/user").exists());
        assert!(upper.join("tmp").is_dir());
        let stack = Stack::open(&[upper, lower]).unwrap();
        assert_eq!(lookup_ids(&stack, "user", None).unwrap(), (1000, 1000));
        assert_eq!(lookup_ids(&stack, "root", Some("user")).unwrap(), (0, 1000));
        assert_eq!(
            lookup_ids(&stack, "nobody", None).map_err(|e| e.to_string()),
            Err("user 'nobody' does not exist in the image".to_owned())
        );
    }

    /// Prints what a COPY of a 10,000-file context (10 × 10 directories of 100 files of 1 KiB)
    /// to `/app/` costs, into a fresh layer each time, 20 times after one warm-up. On tmpfs, so
    /// that a shared disk's writeback does not drown it: `TMPDIR=/dev/shm cargo test --release
    /// -p sandbar-node --lib -- --ignored copy_cost --nocapture`.
    #[test]
    #[ignore = "a benchmark"]
    fn copy_cost() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        std::fs::create_dir_all(lower.join("etc")).unwrap();
        std::fs::write(lower.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        let ctx = tmp.path().join("ctx");
        let payload = vec![b'x'; 1024];
        for group in 0..10 {
            for dir in 0..10 {
                let dir = ctx.join(format!("g{group}/d{dir}"));
                std::fs::create_dir_all(&dir).unwrap();
                for file in 0..100 {
                    std::fs::write(dir.join(format!("f{file}")), &payload).unwrap();
                }
            }
        }
        let lower = [lower];
        let mut times = Vec::new();
        for i in 0..21 {
            let upper = tmp.path().join(format!("upper{i}"));
            std::fs::create_dir(&upper).unwrap();
            let started = std::time::Instant::now();
            copy_step(&lower, &upper, &ctx, ".", "/app/", (1000, 1000), None).unwrap();
            let elapsed = started.elapsed().as_secs_f64() * 1000.0;
            let copied = std::fs::metadata(upper.join("app/g9/d9/f99")).unwrap();
            assert_eq!((copied.len(), copied.uid()), (1024, 1000));
            std::fs::remove_dir_all(&upper).unwrap();
            if i > 0 {
                times.push(elapsed);
            }
        }
        times.sort_by(f64::total_cmp);
        println!(
            "copy of 10,000 files: p50 {:.1} ms, p90 {:.1} ms, min {:.1} ms, n {}",
            times[times.len() / 2],
            times[times.len() * 9 / 10],
            times[0],
            times.len()
        );
    }
}
