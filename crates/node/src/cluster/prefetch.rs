//! Layers of the templates the cluster uses, fetched ahead of demand: a node that joins, or
//! restarts with an empty disk, would otherwise fetch a template's layers while its first
//! create of it waits, and placement would keep sending that template's creates to the nodes
//! that already hold it. Every so often a node counts the sandboxes running on the other
//! nodes by template, and fetches from the layer store what it lacks of the busiest few,
//! one template at a time, through the same verified fetch a create uses (size and digest
//! checked, unpacked with the hardened reader). Layer names come from the templates' records
//! and are checked against where layers live; nothing a tenant sends names a path.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sandbar_core::{DiskReport, Runtime, SandboxState, Store, Template};

use crate::LinuxRuntime;
use crate::cluster::shared_layers::SharedLayers;

/// How often a node looks for templates to fetch.
pub const PREFETCH_EVERY: Duration = Duration::from_secs(15);
/// Templates fetched at most per pass, the busiest first.
pub const PREFETCH_MOST: usize = 4;
/// Free space a fetch leaves on the data disk beyond its reserve: layers are not worth
/// running a node's disk short for before anyone asks for them.
const DISK_MARGIN_BYTES: u64 = 1 << 30;

/// A template to fetch and the layers of it this node lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub template_id: String,
    pub missing: Vec<String>,
}

/// The templates with the most sandboxes running on nodes other than `node_id`, at most
/// `most`, whose image this node lacks part of (`has` tells which parts it has); ties by id.
pub fn templates_to_fetch<'a>(
    running_on: impl IntoIterator<Item = (&'a str, &'a str)>,
    templates: &[Template],
    node_id: &str,
    has: impl Fn(&str) -> bool,
    most: usize,
) -> Vec<Wanted> {
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for (template, node) in running_on {
        if !node.is_empty() && node != node_id {
            *counts.entry(template).or_default() += 1;
        }
    }
    let mut busiest: Vec<(&str, u64)> = counts.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    busiest
        .into_iter()
        .filter_map(|(id, _)| {
            let template = templates.iter().find(|t| t.id == id)?;
            let missing: Vec<String> = template
                .image
                .as_ref()?
                .parts()
                .into_iter()
                .filter(|part| !has(part))
                .collect();
            (!missing.is_empty()).then(|| Wanted {
                template_id: template.id.clone(),
                missing,
            })
        })
        .take(most)
        .collect()
}

/// Whether the node's disks leave room to fetch `bytes` of layers: the data disk, where
/// layers live, keeps its reserve and [`DISK_MARGIN_BYTES`] beyond twice the bytes (an
/// archive and what it unpacks to are both there for a moment), and the sandboxes' disk pool
/// is not short already.
pub fn room_to_fetch(disks: &DiskReport, bytes: u64) -> bool {
    let Some(data) = &disks.data else {
        return false;
    };
    let needed = data
        .reserve_bytes
        .saturating_add(DISK_MARGIN_BYTES)
        .saturating_add(bytes.saturating_mul(2));
    let pool_short = disks
        .pool
        .as_ref()
        .is_some_and(|p| p.read_only || p.free_bytes < p.reserve_bytes);
    !data.read_only && data.free_bytes >= needed && !pool_short
}

/// Fetches the layers of templates in use elsewhere, every [`PREFETCH_EVERY`], for as long
/// as the process runs.
pub async fn run(
    store: Arc<Store>,
    runtime: Arc<LinuxRuntime>,
    shared: Arc<SharedLayers>,
    node_id: String,
) {
    let mut ticks = tokio::time::interval(PREFETCH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Err(e) = pass(store.as_ref(), &runtime, &shared, &node_id).await {
            tracing::warn!(node_id = %node_id, error = %e, "cannot look for layers to fetch ahead");
        }
    }
}

/// One look: fetches what it finds one template at a time, so a create's own fetch never
/// waits behind more than one of these.
async fn pass(
    store: &Store,
    runtime: &LinuxRuntime,
    shared: &SharedLayers,
    node_id: &str,
) -> Result<(), sandbar_core::StoreError> {
    let sandboxes = store.sandboxes.all_sandboxes().await?;
    let running = sandboxes
        .iter()
        .filter(|s| s.state() == SandboxState::Running)
        .map(|s| (s.template_id.as_str(), s.node_id.as_str()));
    let templates = store.templates.templates().await?;
    let layers = runtime.layers().layer_store();
    let wanted = templates_to_fetch(
        running,
        &templates,
        node_id,
        |part| layers.exists(part),
        PREFETCH_MOST,
    );
    for want in wanted {
        let published = store.layer_blobs.layer_blobs(&want.missing).await?;
        if published.len() < want.missing.len() {
            // Part of it lives only on the node that made it: a create there is the way.
            continue;
        }
        let bytes = published.iter().map(|b| b.size_bytes).sum();
        if !room_to_fetch(&runtime.disks(), bytes) {
            tracing::info!(template_id = %want.template_id, bytes, "not fetching a template's layers ahead: the node's disks are short");
            continue;
        }
        match shared.ensure(&want.missing).await {
            Ok(()) => {
                tracing::info!(template_id = %want.template_id, layers = want.missing.len(), bytes, "fetched a template's layers ahead of its creates")
            }
            Err(e) => {
                tracing::warn!(template_id = %want.template_id, error = %e, "cannot fetch a template's layers ahead")
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbar_core::DiskSpace;

    fn template(id: &str, layers: &[&str]) -> Template {
        Template {
            build_status: sandbar_core::BuildStatus::Ready,
            image: Some(sandbar_core::TemplateImage::of_layers(
                layers.iter().map(|l| (*l).to_owned()).collect(),
            )),
            ..Template::unbuilt(id.into(), 1, 512, 512, chrono::Utc::now())
        }
    }

    #[test]
    fn the_busiest_templates_elsewhere_that_this_node_lacks() {
        let templates = [
            template("a", &["layer/1", "layer/2"]),
            template("b", &["layer/1", "layer/3"]),
            template("c", &["layer/4"]),
            template("d", &["layer/5"]),
        ];
        let running = [
            ("a", "n2"),
            ("b", "n2"),
            ("b", "n3"),
            ("c", "n3"),
            ("c", "n3"),
            ("c", "n1"),
            ("d", "n1"),
            ("d", "n1"),
            ("d", "n1"),
            ("gone", "n2"),
            ("gone", "n2"),
            ("gone", "n2"),
        ];
        let has = |l: &str| l == "layer/1" || l == "layer/4";
        let wanted = templates_to_fetch(running, &templates, "n1", has, 4);
        // c is held already, d runs here only and "gone" is no template; b runs twice.
        assert_eq!(
            wanted,
            [
                Wanted {
                    template_id: "b".into(),
                    missing: vec!["layer/3".into()]
                },
                Wanted {
                    template_id: "a".into(),
                    missing: vec!["layer/2".into()]
                },
            ]
        );
        let one = templates_to_fetch(running, &templates, "n1", has, 1);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].template_id, "b");
    }

    #[test]
    fn ties_go_by_id_and_sandboxes_of_no_node_do_not_count() {
        let templates = [template("y", &["layer/y"]), template("x", &["layer/x"])];
        let running = [("y", "n2"), ("x", "n2"), ("x", "")];
        let wanted = templates_to_fetch(running, &templates, "n1", |_| false, 4);
        let ids: Vec<&str> = wanted.iter().map(|w| w.template_id.as_str()).collect();
        assert_eq!(ids, ["x", "y"]);
    }

    fn disk(free_gib: u64, reserve_gib: u64) -> DiskSpace {
        DiskSpace {
            path: "/d".into(),
            size_bytes: 100 << 30,
            free_bytes: free_gib << 30,
            reserve_bytes: reserve_gib << 30,
            read_only: false,
        }
    }

    #[test]
    fn a_fetch_ahead_leaves_the_disks_their_reserve_and_a_margin() {
        let roomy = DiskReport {
            data: Some(disk(10, 1)),
            ..DiskReport::default()
        };
        assert!(room_to_fetch(&roomy, 4 << 30));
        assert!(!room_to_fetch(&roomy, 5 << 30));
        let read_only = DiskReport {
            data: Some(DiskSpace {
                read_only: true,
                ..disk(10, 1)
            }),
            ..DiskReport::default()
        };
        assert!(!room_to_fetch(&read_only, 1));
        let pool_short = DiskReport {
            data: Some(disk(10, 1)),
            pool: Some(disk(1, 2)),
            ..DiskReport::default()
        };
        assert!(!room_to_fetch(&pool_short, 1));
        assert!(!room_to_fetch(&DiskReport::default(), 1));
    }
}
