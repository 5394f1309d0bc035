//! Shared pieces of the API's handler tests.
// Each suite uses a part of it.
#![allow(dead_code)]

pub mod app;
pub mod runtime;

pub use app::{
    Answer, Cred, KEY, LIMITS, OTHER_KEY, Reply, Server, Setup, add_other_team, call,
    error_message, json_request, open_store, request, requested_build, retry_after, sandboxes,
    send, serve, state,
};
pub use runtime::FakeRuntime;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sandbar_core::builds::{BuildFailure, BuildJob, BuildLog, UploadBody, UploadError};
use sandbar_core::{
    BuildStatus, Builder, Builds, BuildsConfig, RegistryCheck, Store, Template, TemplateImage,
    Templates,
};

/// Implements [`Builder`] for a test builder from its build alone, as an async function of
/// the builder and the job: the HTTP surface under test never finds or keeps an upload.
macro_rules! builder_without_uploads {
    ($builder:ty, $build:path) => {
        #[async_trait::async_trait]
        impl Builder for $builder {
            async fn build(
                &self,
                job: BuildJob,
                _: BuildLog,
            ) -> Result<TemplateImage, BuildFailure> {
                $build(self, job).await
            }
            async fn has_upload(&self, _: &str, _: &str, _: &str) -> bool {
                false
            }
            async fn store_upload(
                &self,
                _: &str,
                _: &str,
                _: &str,
                _: UploadBody,
                _: u64,
            ) -> Result<(), UploadError> {
                Ok(())
            }
            async fn collect_garbage(&self, _: &[String]) {}
        }
    };
}

/// A builder that fails every build: these tests exercise the HTTP surface, not builds.
#[derive(Debug, Default)]
pub struct RefusingBuilder;

async fn refuse(_: &RefusingBuilder, job: BuildJob) -> Result<TemplateImage, BuildFailure> {
    Err(BuildFailure {
        message: format!("build {} refused by the test builder", job.build_id),
        step: None,
    })
}

builder_without_uploads!(RefusingBuilder, refuse);

/// A builder whose builds never end on their own; counts the builds it began and those
/// dropped unfinished, as a cancel drops them.
#[derive(Debug, Default)]
pub struct HangingBuilder {
    pub began: AtomicUsize,
    pub dropped: Arc<AtomicUsize>,
}

struct CountsDrop(Arc<AtomicUsize>);

impl Drop for CountsDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

async fn hang(builder: &HangingBuilder, _: BuildJob) -> Result<TemplateImage, BuildFailure> {
    builder.began.fetch_add(1, Ordering::SeqCst);
    let _work = CountsDrop(builder.dropped.clone());
    std::future::pending().await
}

builder_without_uploads!(HangingBuilder, hang);

/// Refuses images from the registry `refused.test`, as the node's rule refuses loopback.
#[derive(Debug)]
pub struct RefusingRegistry;

#[async_trait::async_trait]
impl RegistryCheck for RefusingRegistry {
    async fn refusal(&self, reference: &str) -> Option<String> {
        reference
            .starts_with("refused.test/")
            .then(|| "registry refused.test:443 resolves to 127.0.0.1, a loopback address".into())
    }
}

pub fn builds(store: Arc<Store>, templates: &Templates) -> Builds {
    builds_with(store, templates, Arc::new(RefusingBuilder))
}

/// The build service of [`builds`], running its builds on `builder`: one build at a time.
pub fn builds_with(store: Arc<Store>, templates: &Templates, builder: Arc<dyn Builder>) -> Builds {
    Builds::new(
        store,
        builder,
        BuildsConfig {
            default_cpu_count: 2,
            default_memory_mb: 512,
            disk_size_mb: 1024,
            max_cpu_count: 8,
            max_memory_mb: 8192,
            max_upload_bytes: 1 << 20,
            upload_link_ttl: std::time::Duration::from_secs(60),
            concurrent_builds: 1,
            builds_per_team: 1,
            step_timeout: std::time::Duration::from_secs(3600),
            envd_version: "0.5.7",
        },
        templates.build_finished(),
    )
    .with_registry_check(Arc::new(RefusingRegistry))
}

pub fn image() -> TemplateImage {
    TemplateImage::of_layers(vec!["base/v1".into()])
}

/// The public `base` template every harness registers, ready, built at `now`.
pub fn base_template(now: chrono::DateTime<chrono::Utc>) -> Template {
    Template {
        id: "base000000000000000a".into(),
        team_id: None,
        namespace: None,
        aliases: vec!["base".into()],
        public: true,
        build_id: "b".into(),
        build_status: BuildStatus::Ready,
        build_error: None,
        cpu_count: 2,
        memory_mb: 512,
        disk_size_mb: 2048,
        envd_version: "0.5.7".into(),
        image: Some(image()),
        created_at: now,
        updated_at: now,
        last_spawned_at: None,
        spawn_count: 0,
        build_count: 1,
    }
}
