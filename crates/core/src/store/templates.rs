//! Templates, their names and the image new sandboxes get.

use chrono::{DateTime, Utc};

use super::StoreError;
use crate::model::{BuildStatus, Template, TemplateImage};

#[async_trait::async_trait]
pub trait TemplateRecords: Send + Sync {
    async fn upsert_template(&self, template: &Template) -> Result<(), StoreError>;
    async fn template(&self, id: &str) -> Result<Option<Template>, StoreError>;
    /// The template named `alias` in a team's namespace (`None`: the built-in templates).
    async fn template_by_name(
        &self,
        team_id: Option<&str>,
        alias: &str,
    ) -> Result<Option<Template>, StoreError>;
    /// Public templates of any team named `alias`, oldest first.
    async fn public_templates_named(&self, alias: &str) -> Result<Vec<Template>, StoreError>;
    async fn templates(&self) -> Result<Vec<Template>, StoreError>;
    /// Records the status of the template's latest build.
    async fn set_template_build(
        &self,
        id: &str,
        status: BuildStatus,
        error: Option<&str>,
    ) -> Result<(), StoreError>;
    /// Makes `build_id`'s image the one new sandboxes of the template get.
    async fn set_template_image(
        &self,
        id: &str,
        build_id: &str,
        image: &TemplateImage,
    ) -> Result<(), StoreError>;
    /// Removes a template with its names, builds, tags and logs.
    async fn delete_template(&self, id: &str) -> Result<(), StoreError>;
    /// Adds `count` spawns of template `id`, the latest at `last`.
    async fn record_template_spawns(
        &self,
        id: &str,
        count: u32,
        last: DateTime<Utc>,
    ) -> Result<(), StoreError>;
    /// Every layer named by a successful build that a template or tag still points at, or
    /// that a recorded sandbox booted from.
    async fn layers_in_use(&self) -> Result<Vec<String>, StoreError>;
}
