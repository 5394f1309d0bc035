//! Templates: lookup by ID or alias, visibility per team, and waiting for a build to finish.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::lookup_cache::LookupCache;
use crate::model::{BuildStatus, Team, Template};
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("invalid template reference '{0}'")]
    BadReference(String),
    #[error("template '{0}' not found")]
    NotFound(String),
    #[error("template '{id}' failed to build: {reason}")]
    BuildFailed { id: String, reason: String },
    #[error("template '{0}' is still building; try again shortly")]
    StillBuilding(String),
    #[error("template '{0}' has no build: its build was requested but never started")]
    NeverBuilt(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Clone)]
pub struct Templates {
    store: Arc<Store>,
    build_finished: Arc<Notify>,
    /// What a team's reference resolved to for a start, kept while the store's lookup
    /// generation holds (a build, a name or a visibility change moves it).
    to_start: Arc<LookupCache<(String, String), Template>>,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates").finish_non_exhaustive()
    }
}

fn valid_reference(reference: &str) -> bool {
    crate::ids::is_plain_name(reference, 256, b"-_./:")
}

/// The template `team` may use that `name` (no tag) means: an ID; `namespace/alias` in that
/// team's namespace; or a bare alias, looked up among the built-in templates, then in the
/// caller's namespace, then among other teams' public templates (when only one has it).
/// What the caller may not see is not found, exactly like what does not exist.
pub(crate) async fn find_template(
    store: &Store,
    team: &Team,
    name: &str,
) -> Result<Option<Template>, StoreError> {
    // Most creates name a template (`base`), not an ID: one statement fewer for them.
    if crate::ids::is_template_id(name)
        && let Some(template) = store.templates.template(name).await?
        && template.visible_to(&team.id)
    {
        return Ok(Some(template));
    }
    if let Some((namespace, alias)) = name.split_once('/') {
        let Some(owner) = store.teams.team_by_slug(namespace).await? else {
            return Ok(None);
        };
        let found = store
            .templates
            .template_by_name(Some(&owner.id), alias)
            .await?;
        return Ok(found.filter(|t| t.visible_to(&team.id)));
    }
    // No team may take a built-in's name, so looking there first changes no answer and
    // saves the default template's creates a query.
    if let Some(built_in) = store.templates.template_by_name(None, name).await? {
        return Ok(Some(built_in));
    }
    if let Some(own) = store
        .templates
        .template_by_name(Some(&team.id), name)
        .await?
    {
        return Ok(Some(own));
    }
    let mut public = store.templates.public_templates_named(name).await?;
    Ok(if public.len() == 1 {
        public.pop()
    } else {
        None
    })
}

/// The template `reference` (`name`, `name:default` or `name:<tag>`) names for `team`, if
/// any; with a tag, its image is the one of the newest successful build so tagged.
pub(crate) async fn find_tagged_template(
    store: &Store,
    team: &Team,
    reference: &str,
) -> Result<Option<Template>, StoreError> {
    let (name, tag) = crate::model::templates::split_name(reference);
    let Some(mut template) = find_template(store, team, name).await? else {
        return Ok(None);
    };
    if let Some(tag) = tag.filter(|t| *t != "default") {
        let Some(build) = store.builds.tagged_build(&template.id, tag).await? else {
            return Ok(None);
        };
        template.image = build.image;
    }
    Ok(Some(template))
}

impl Templates {
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            build_finished: Arc::new(Notify::new()),
            to_start: Arc::default(),
        }
    }

    /// Finds a template by ID or name (`name`, `name:default` or `name:<tag>`) that `team`
    /// may use; with a tag, the image is the one of the newest successful build so tagged.
    pub async fn resolve(&self, team: &Team, reference: &str) -> Result<Template, TemplateError> {
        if !valid_reference(reference) {
            return Err(TemplateError::BadReference(reference.to_owned()));
        }
        find_tagged_template(self.store.as_ref(), team, reference)
            .await?
            .ok_or_else(|| TemplateError::NotFound(reference.to_owned()))
    }

    /// What [`resolve`](Self::resolve) answers, for a start: kept in memory while the
    /// store's lookup generation holds, so that the creates of a template read one row, or
    /// none, instead of the template. Its spawn count and last spawn may lag; everything a
    /// start reads (image, resources, build status, names, visibility) is current.
    pub async fn resolve_to_start(
        &self,
        team: &Team,
        reference: &str,
    ) -> Result<Template, TemplateError> {
        let generation = self.store.lookups.lookup_generation().await?;
        let key = (team.id.clone(), reference.to_owned());
        match self.to_start.get(generation, &key) {
            Ok(template) => Ok(template),
            Err(miss) => {
                let template = self.resolve(team, reference).await?;
                self.to_start.put(miss, key, template.clone());
                Ok(template)
            }
        }
    }

    /// Waits until `template` has finished building, up to `patience`, and returns it fresh.
    pub async fn wait_ready(
        &self,
        template: Template,
        patience: Duration,
    ) -> Result<Template, TemplateError> {
        let deadline = tokio::time::Instant::now() + patience;
        let mut current = template;
        loop {
            // A template with a good build serves it while a newer build runs or after one
            // failed.
            if current.image.is_some() {
                return Ok(current);
            }
            match current.build_status {
                BuildStatus::Ready => return Ok(current),
                BuildStatus::Error => {
                    return Err(TemplateError::BuildFailed {
                        id: current.id.clone(),
                        reason: current.build_error.clone().unwrap_or_default(),
                    });
                }
                // Requested, its files perhaps uploaded, but not started: nothing will make
                // it ready unless its owner starts it, so nobody waits for it.
                BuildStatus::Waiting => return Err(TemplateError::NeverBuilt(current.id)),
                BuildStatus::Building => {}
            }
            let notified = self.build_finished.notified();
            // A bounded sleep as well as the notification: another process may finish a build.
            if tokio::time::timeout_at(deadline, async {
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            })
            .await
            .is_err()
            {
                return Err(TemplateError::StillBuilding(current.id));
            }
            current = self
                .store
                .templates
                .template(&current.id)
                .await?
                .ok_or_else(|| TemplateError::NotFound(current.id.clone()))?;
        }
    }

    pub async fn list(&self, team: &Team) -> Result<Vec<Template>, TemplateError> {
        Ok(self
            .store
            .templates
            .templates()
            .await?
            .into_iter()
            .filter(|t| t.visible_to(&team.id))
            // Snapshots are listed by `GET /snapshots`.
            .filter(|t| t.image.as_ref().is_none_or(|i| i.snapshot.is_none()))
            .collect())
    }

    /// Registers a template (or refreshes an existing one) before its build starts.
    pub async fn register(&self, template: &Template) -> Result<(), TemplateError> {
        self.store.templates.upsert_template(template).await?;
        Ok(())
    }

    /// Wakes callers of [`Templates::wait_ready`]; the build service calls it when a build ends.
    pub fn build_finished(&self) -> Arc<Notify> {
        self.build_finished.clone()
    }

    pub async fn template(&self, id: &str) -> Result<Option<Template>, TemplateError> {
        Ok(self.store.templates.template(id).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::valid_reference;

    #[test]
    fn references_are_checked() {
        assert!(valid_reference("base"));
        assert!(valid_reference("team/name:tag"));
        assert!(!valid_reference(""));
        assert!(!valid_reference("a b"));
        assert!(!valid_reference("x\"y"));
    }
}
