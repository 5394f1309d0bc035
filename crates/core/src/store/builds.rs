//! Template builds, their tags and their logs.

use super::StoreError;
use crate::model::{BuildLogEntry, BuildRecord, LogLevel};

#[async_trait::async_trait]
pub trait BuildRecords: Send + Sync {
    async fn insert_build(&self, build: &BuildRecord) -> Result<(), StoreError>;
    async fn update_build(&self, build: &BuildRecord) -> Result<(), StoreError>;
    async fn build(&self, id: &str) -> Result<Option<BuildRecord>, StoreError>;
    /// Records a build that has not started yet as to be built by node `node_id`; false
    /// when it is no longer waiting (it started, ended, or is gone).
    async fn assign_waiting_build(&self, build_id: &str, node_id: &str)
    -> Result<bool, StoreError>;
    /// A template's builds, newest first.
    async fn template_builds(&self, template_id: &str) -> Result<Vec<BuildRecord>, StoreError>;
    /// Builds still `waiting` or `building`.
    async fn unfinished_builds(&self) -> Result<Vec<BuildRecord>, StoreError>;
    async fn set_build_tags(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<(), StoreError>;
    /// Removes `tags` from every build of the template; returns how many were removed.
    async fn delete_build_tags(
        &self,
        template_id: &str,
        tags: &[String],
    ) -> Result<u64, StoreError>;
    /// Every (tag, build) pair of the template's successful builds, by tag.
    async fn template_tags(
        &self,
        template_id: &str,
    ) -> Result<Vec<(String, BuildRecord)>, StoreError>;
    /// The newest successful build of the template carrying `tag`.
    async fn tagged_build(
        &self,
        template_id: &str,
        tag: &str,
    ) -> Result<Option<BuildRecord>, StoreError>;
    async fn append_build_log(
        &self,
        build_id: &str,
        seq: u64,
        entry: &BuildLogEntry,
    ) -> Result<(), StoreError>;
    async fn build_logs(
        &self,
        build_id: &str,
        offset: u64,
        limit: u64,
        min_level: Option<LogLevel>,
    ) -> Result<Vec<BuildLogEntry>, StoreError>;
}
