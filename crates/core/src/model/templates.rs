//! Templates and what their sandboxes start from.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Alias of the template every installation builds on first start.
pub const DEFAULT_TEMPLATE_ALIAS: &str = "base";
/// Alias of the built-in template E2B's code interpreter SDKs create by default.
pub const INTERPRETER_TEMPLATE_ALIAS: &str = "code-interpreter-v1";
/// Alias of the built-in template E2B's Desktop SDKs create by default.
pub const DESKTOP_TEMPLATE_ALIAS: &str = "desktop";
/// Names no team may give a template of its own.
pub const BUILT_IN_TEMPLATE_ALIASES: [&str; 3] = [
    DEFAULT_TEMPLATE_ALIAS,
    INTERPRETER_TEMPLATE_ALIAS,
    DESKTOP_TEMPLATE_ALIAS,
];

/// Splits `name[:tag]`.
pub fn split_name(name: &str) -> (&str, Option<&str>) {
    match name.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (name, None),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Building,
    Waiting,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Building => "building",
            BuildStatus::Waiting => "waiting",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "building" => BuildStatus::Building,
            "waiting" => BuildStatus::Waiting,
            "ready" => BuildStatus::Ready,
            "error" => BuildStatus::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    pub id: String,
    /// `None` for templates every team may use (the built-in ones).
    pub team_id: Option<String>,
    /// The owning team's slug, which namespaces the aliases; `None` for built-in templates.
    pub namespace: Option<String>,
    /// Names within the owner's namespace, unique there.
    pub aliases: Vec<String>,
    pub public: bool,
    pub build_id: String,
    pub build_status: BuildStatus,
    /// Why the last build failed, when it did.
    pub build_error: Option<String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub envd_version: String,
    /// What sandboxes of the template start from: the last successful build's image.
    pub image: Option<TemplateImage>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub last_spawned_at: Option<DateTime<Utc>>,
    pub spawn_count: u64,
    pub build_count: u64,
}

impl Template {
    /// A template `id` of these resources, made at `at` and not built or used since: private,
    /// unnamed and waiting for its first build; the caller sets what else it knows.
    pub fn unbuilt(
        id: String,
        cpu_count: u32,
        memory_mb: u32,
        disk_size_mb: u32,
        at: DateTime<Utc>,
    ) -> Self {
        Template {
            id,
            team_id: None,
            namespace: None,
            aliases: Vec::new(),
            public: false,
            build_id: String::new(),
            build_status: BuildStatus::Waiting,
            build_error: None,
            cpu_count,
            memory_mb,
            disk_size_mb,
            envd_version: String::new(),
            image: None,
            created_at: at,
            updated_at: at,
            last_spawned_at: None,
            spawn_count: 0,
            build_count: 0,
        }
    }

    /// A ready template of `sandbox`'s team and resources whose sandboxes start from `image`,
    /// made at `at`; its id, names and build are the caller's to fill in.
    pub fn of_sandbox(sandbox: &super::Sandbox, image: TemplateImage, at: DateTime<Utc>) -> Self {
        Template {
            team_id: Some(sandbox.team_id.clone()),
            build_status: BuildStatus::Ready,
            envd_version: sandbox.envd_version.clone(),
            image: Some(image),
            ..Template::unbuilt(
                String::new(),
                sandbox.cpu_count,
                sandbox.memory_mb,
                sandbox.disk_size_mb,
                at,
            )
        }
    }

    pub fn visible_to(&self, team_id: &str) -> bool {
        self.public || self.team_id.as_deref().is_none_or(|owner| owner == team_id)
    }

    /// Full names as E2B gives them: `namespace/alias`, or the bare alias of a built-in.
    pub fn names(&self) -> Vec<String> {
        self.aliases
            .iter()
            .map(|alias| match &self.namespace {
                Some(namespace) => format!("{namespace}/{alias}"),
                None => alias.clone(),
            })
            .collect()
    }
}

/// What every sandbox of a template starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateImage {
    /// Read-only layers, the first one at the bottom of the stack.
    pub layers: Vec<String>,
    /// Environment every process in the sandbox gets (the image's and the build's `ENV`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default Linux user of the sandbox's processes and files.
    pub user: String,
    /// Default working directory.
    pub workdir: String,
    /// Runs in every new sandbox of the template, as `user` (or `start_user`) in `workdir`.
    #[serde(default)]
    pub start_cmd: Option<String>,
    /// The user `start_cmd` runs as when not `user`: a built-in template's server that must
    /// be root while the sandbox's commands run as `user` by default. No build request sets
    /// it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_user: Option<String>,
    /// Must succeed (after `start_cmd` started) before a new sandbox is handed out.
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// Set on a snapshot's image: new sandboxes are restored from a checkpoint of another
    /// sandbox's processes (on `layers`, the last one holding its files) instead of booted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotImage>,
    /// A template's sandbox captured with its memory once its start command was ready: new
    /// sandboxes are restored from it with the start command's processes running instead of
    /// booted and waited for. Apart from `snapshot`, which makes an image a snapshot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<StartedImage>,
}

/// The capture of a template's started sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedImage {
    /// The layer of its files, stacked on the image's `layers`.
    pub layer: String,
    /// The checkpoint of its processes (`checkpoint/<key>`), kept while an image names it.
    pub checkpoint: String,
    /// The build's sandbox it was taken of.
    pub sandbox_id: String,
}

impl TemplateImage {
    /// An image of `layers` that runs as `user` in its home, with no start command: what
    /// the default template is.
    pub fn of_layers(layers: Vec<String>) -> Self {
        Self {
            layers,
            env: BTreeMap::new(),
            user: "user".into(),
            workdir: "/home/user".into(),
            start_cmd: None,
            start_user: None,
            ready_cmd: None,
            snapshot: None,
            started: None,
        }
    }

    /// The image a new sandbox of this one starts from on a node that can restore: the
    /// capture's layer on top, and its checkpoint to restore as a snapshot's. `started` stays
    /// set: a runtime that cannot restore the checkpoint boots on the same layers and runs
    /// the start command instead, and the sandbox's files are on the same stack either way.
    pub fn restored_from_capture(&self) -> Option<TemplateImage> {
        if self.snapshot.is_some() {
            return None;
        }
        let started = self.started.as_ref()?;
        let mut image = self.clone();
        image.layers.push(started.layer.clone());
        image.snapshot = Some(SnapshotImage {
            checkpoint: Some(started.checkpoint.clone()),
            sandbox_id: started.sandbox_id.clone(),
            checkpoint_bytes: 0,
        });
        Some(image)
    }

    /// Everything a node needs on its disk to start a sandbox of this image, by name: the
    /// layers, and the capture's or snapshot's layer and checkpoint.
    pub fn parts(&self) -> Vec<String> {
        let mut parts = self.layers.clone();
        if let Some(started) = &self.started {
            parts.push(started.layer.clone());
            parts.push(started.checkpoint.clone());
        }
        if let Some(checkpoint) = self.snapshot.as_ref().and_then(|s| s.checkpoint.clone()) {
            parts.push(checkpoint);
        }
        let mut seen = std::collections::HashSet::new();
        parts.retain(|part| seen.insert(part.clone()));
        parts
    }

    /// Whether this image restores a template's capture rather than a snapshot.
    pub fn is_capture(&self) -> bool {
        self.started.is_some() && self.snapshot.is_some()
    }
}

/// What makes an image a snapshot of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotImage {
    /// The checkpoint of its processes the runtime restores (`checkpoint/<key>`), kept like a
    /// layer while an image names it; `None` for a snapshot of its files only, whose
    /// sandboxes boot afresh on them.
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// The sandbox the snapshot was taken of.
    pub sandbox_id: String,
    /// What its checkpoint holds on the data disk, counted against the team's cap; 0 for a
    /// snapshot of files, a template's capture or one recorded before it was counted.
    #[serde(default)]
    pub checkpoint_bytes: u64,
}

#[cfg(test)]
mod capture_tests {
    use super::*;

    /// An image of `layers`, run as `user` in its home and started by `serve`.
    fn serving(layers: [&str; 2]) -> TemplateImage {
        TemplateImage {
            layers: layers.map(str::to_owned).into(),
            env: BTreeMap::new(),
            user: "user".into(),
            workdir: "/home/user".into(),
            start_cmd: Some("serve".into()),
            start_user: None,
            ready_cmd: None,
            snapshot: None,
            started: None,
        }
    }

    #[test]
    fn the_parts_of_an_image_name_every_layer_and_checkpoint_once() {
        let image = TemplateImage {
            started: Some(StartedImage {
                layer: "layer/b".into(),
                checkpoint: "checkpoint/c".into(),
                sandbox_id: "s".into(),
            }),
            ..serving(["base/v2", "layer/a"])
        };
        let all = ["base/v2", "layer/a", "layer/b", "checkpoint/c"];
        assert_eq!(image.parts(), all);
        let restored = image.restored_from_capture().expect("a capture");
        assert_eq!(restored.parts(), all, "the capture's parts, once each");
        let plain = TemplateImage {
            started: None,
            ..image
        };
        assert_eq!(plain.parts(), ["base/v2", "layer/a"]);
    }

    #[test]
    fn a_capture_is_restored_on_its_layer_and_keeps_the_start_command() {
        let image = TemplateImage {
            ready_cmd: Some("curl".into()),
            ..serving(["interpreter/v2", "step/a"])
        };
        assert_eq!(image.restored_from_capture(), None);
        let captured = TemplateImage {
            started: Some(StartedImage {
                layer: "step/b".into(),
                checkpoint: "checkpoint/b".into(),
                sandbox_id: "build".into(),
            }),
            ..image
        };
        assert!(!captured.is_capture());
        let restored = captured.restored_from_capture().expect("restored");
        assert_eq!(restored.layers, ["interpreter/v2", "step/a", "step/b"]);
        assert_eq!(
            restored
                .snapshot
                .as_ref()
                .and_then(|s| s.checkpoint.as_deref()),
            Some("checkpoint/b")
        );
        assert!(restored.is_capture());
        assert_eq!(restored.start_cmd.as_deref(), Some("serve"));
        // Never stacked twice, and a snapshot's image is restored as the snapshot it is.
        assert_eq!(restored.restored_from_capture(), None);
        // Old records without the field read as images without a capture.
        let old: TemplateImage =
            serde_json::from_str(r#"{"layers":["base/v2"],"user":"user","workdir":"/home/user"}"#)
                .expect("old image");
        assert_eq!(old.started, None);
    }
}
