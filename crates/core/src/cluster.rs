//! Several hosts on one store: nodes that run sandboxes announce themselves with a lease, and
//! every host keeps a [`NodeDirectory`] of them, refreshed from the store, to tell live nodes
//! from lost ones and to choose where a new sandbox goes.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::model::{NodeRecord, NodeReport};
use crate::store::{Store, StoreError};

/// How often a node renews its lease, and how long a lease lasts: a node is reported lost
/// once it missed about five renewals in a row.
pub const LEASE_RENEWAL: Duration = Duration::from_secs(2);
pub const LEASE_LENGTH: Duration = Duration::from_secs(10);

/// The nodes of the cluster as the store last listed them.
pub struct NodeDirectory {
    store: Arc<Store>,
    nodes: RwLock<Vec<NodeRecord>>,
}

impl std::fmt::Debug for NodeDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeDirectory")
            .field("nodes", &self.read().len())
            .finish_non_exhaustive()
    }
}

impl NodeDirectory {
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            nodes: RwLock::new(Vec::new()),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<NodeRecord>> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the nodes from the store again.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let nodes = self.store.nodes.nodes().await?;
        *self.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes;
        Ok(())
    }

    /// Refreshes the directory every `every`, for as long as the process runs.
    pub async fn run_refresher(self: Arc<Self>, every: Duration) {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Err(e) = self.refresh().await {
                tracing::warn!(error = %e, "cannot read the cluster's nodes");
            }
        }
    }

    pub fn node(&self, id: &str) -> Option<NodeRecord> {
        self.read().iter().find(|n| n.id == id).cloned()
    }

    /// Whether the node holds a lease now. A sandbox recorded without a node (on a single
    /// host) counts as on a live one.
    pub fn is_live(&self, id: &str) -> bool {
        id.is_empty()
            || self
                .read()
                .iter()
                .any(|n| n.id == id && n.is_live(Utc::now()))
    }

    /// Every node the store lists, lost ones too.
    pub fn all(&self) -> Vec<NodeRecord> {
        self.read().clone()
    }

    pub fn live(&self) -> Vec<NodeRecord> {
        let now = Utc::now();
        self.read()
            .iter()
            .filter(|n| n.is_live(now))
            .cloned()
            .collect()
    }
}

/// What a start costs a node before its sandbox settles (its agent and first process). Placement
/// also counts it for every sandbox a node holds, on top of what the node measured: an idle
/// sandbox barely shows in free memory but may wake, and without it a node looks no fuller
/// for holding forty of them, nor does one of several nodes sharing a host's memory.
pub const START_COST_BYTES: u64 = 64 << 20;

/// The share of a node's memory, in millionths, by which a node that must fetch a
/// template's layers needs more headroom than one that holds them to be tried first: a fetch
/// costs seconds, so locality wins ties and near-ties, but a node with the layers that is
/// fuller by more than this loses to an empty one. On a 16 GiB node it is about five idle
/// sandboxes.
pub const FETCH_MARGIN_PPM: i64 = 20_000;

/// How a template's layers can reach a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateReach {
    /// Every layer is in the layer store: any node can fetch what it lacks.
    Shared,
    /// Some part is only on the nodes that made it (no layer store, a layer not published
    /// yet, or a snapshot's checkpoint).
    Local,
}

/// A node as placement weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementScore {
    /// Whether every layer of the template is on the node's disk.
    pub holds: bool,
    /// Headroom as a share of the node's memory, in millionths, less the margin when the
    /// node lacks the layers: higher is tried first.
    pub score: i64,
}

/// How a create of a template would suit a live node, or `None` when the node has no room
/// at all (its report shows less headroom than one start costs, or no memory): such a node
/// is never tried. `pending` counts the creates sent to it that its report does not show
/// yet: those sent after the report was measured.
///
/// The score is the node's headroom share: what its report measured, less
/// [`START_COST_BYTES`] for each sandbox it holds or was sent, over its memory;
/// [`FETCH_MARGIN_PPM`] is taken off when it lacks the template's layers. Shares, not bytes,
/// so that a node twice the size is not twice as attractive when both are idle, and the
/// margin means as much on a small node as on a big one.
pub fn placement_score(node: &NodeRecord, template: &str, pending: u64) -> Option<PlacementScore> {
    let report = &node.report;
    let measured = report.headroom_bytes();
    if measured < START_COST_BYTES || report.memory_total_bytes == 0 {
        return None;
    }
    let held = u64::from(report.sandboxes).saturating_add(pending);
    let headroom = measured.saturating_sub(held.saturating_mul(START_COST_BYTES));
    let share = u128::from(headroom) * 1_000_000 / u128::from(report.memory_total_bytes);
    let share = i64::try_from(share).unwrap_or(i64::MAX);
    let holds = report.templates.iter().any(|t| t == template);
    let score = if holds {
        share
    } else {
        share - FETCH_MARGIN_PPM
    };
    Some(PlacementScore { holds, score })
}

/// The live nodes with room in the order a create should try them: the highest
/// [`placement_score`] first, then by id, so every API host ranks equal nodes alike. When
/// the template is not [`TemplateReach::Shared`] and some nodes hold it, only those: the
/// others could not fetch it.
pub fn placement_order(
    nodes: &[NodeRecord],
    template: &str,
    reach: TemplateReach,
    pending: impl Fn(&NodeRecord) -> u64,
    now: DateTime<Utc>,
) -> Vec<NodeRecord> {
    let live: Vec<&NodeRecord> = nodes.iter().filter(|n| n.is_live(now)).collect();
    let holds = |n: &NodeRecord| n.report.templates.iter().any(|t| t == template);
    // Decided before room is: a full holder of a local template leaves no other node able
    // to start it.
    let holders_only = reach == TemplateReach::Local && live.iter().any(|n| holds(n));
    let mut ranked: Vec<(i64, &NodeRecord)> = live
        .into_iter()
        .filter(|n| !holders_only || holds(n))
        .filter_map(|n| placement_score(n, template, pending(n)).map(|s| (s.score, n)))
        .collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
    ranked.into_iter().map(|(_, n)| n.clone()).collect()
}

/// The live nodes in the order a template build should go to them: nodes with a free build
/// slot first, then by the share of their slots that builds hold or wait for (fewest first),
/// then by id, so every API host ranks equal nodes alike. `pending` counts the builds this
/// host sent each node that its report may not show yet. A node that reports no slots (one
/// that does not build for tenants, or predates the report) is left out; when every node is
/// full, the build still goes to the least loaded, where it waits in that node's queue.
pub fn build_placement_order(
    nodes: &[NodeRecord],
    pending: impl Fn(&str) -> u64,
    now: DateTime<Utc>,
) -> Vec<NodeRecord> {
    let mut ranked: Vec<(u64, u64, &NodeRecord)> = nodes
        .iter()
        .filter(|n| n.is_live(now) && n.report.builds.slots > 0)
        .map(|n| {
            let used = n.report.builds.used().saturating_add(pending(&n.id));
            (used, u64::from(n.report.builds.slots), n)
        })
        .collect();
    ranked.sort_by(|(used_a, slots_a, a), (used_b, slots_b, b)| {
        let full_a = used_a >= slots_a;
        let full_b = used_b >= slots_b;
        // used_a / slots_a against used_b / slots_b, without dividing.
        let share_a = u128::from(*used_a) * u128::from(*slots_b);
        let share_b = u128::from(*used_b) * u128::from(*slots_a);
        full_a
            .cmp(&full_b)
            .then(share_a.cmp(&share_b))
            .then_with(|| a.id.cmp(&b.id))
    });
    ranked.into_iter().map(|(_, _, n)| n.clone()).collect()
}

/// A node's own lease, renewed from its measurements.
#[derive(Debug, Clone)]
pub struct NodeLease {
    pub id: String,
    pub url: String,
    pub started_at: DateTime<Utc>,
}

impl NodeLease {
    /// The record that renews the lease for [`LEASE_LENGTH`] from `now`.
    pub fn record(&self, report: NodeReport, now: DateTime<Utc>) -> NodeRecord {
        NodeRecord {
            id: self.id.clone(),
            url: self.url.clone(),
            started_at: self.started_at,
            lease_until: now + TimeDelta::from_std(LEASE_LENGTH).unwrap_or(TimeDelta::seconds(10)),
            report,
        }
    }
}

/// Node ids name hosts in URLs, logs and the store: short, and only characters that need no
/// quoting anywhere.
pub fn valid_node_id(id: &str) -> bool {
    crate::ids::is_plain_name(id, 63, b"-_.")
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOTAL_GIB: u64 = 16;

    fn node(id: &str, available_gib: u64, templates: &[&str], lease_secs: i64) -> NodeRecord {
        let now = Utc::now();
        NodeRecord {
            id: id.into(),
            url: format!("http://{id}:3000"),
            started_at: now,
            lease_until: now + TimeDelta::seconds(lease_secs),
            report: NodeReport {
                memory_total_bytes: TOTAL_GIB << 30,
                memory_available_bytes: available_gib << 30,
                templates: templates.iter().map(|t| (*t).to_owned()).collect(),
                ..NodeReport::default()
            },
        }
    }

    /// A node on a host whose free memory every node sees alike (several nodes on one
    /// machine, or idle sandboxes), holding `sandboxes`.
    fn holding(id: &str, sandboxes: u32, templates: &[&str]) -> NodeRecord {
        let mut n = node(id, 12, templates, 10);
        n.report.sandboxes = sandboxes;
        n
    }

    fn ids(nodes: Vec<NodeRecord>) -> Vec<String> {
        nodes.into_iter().map(|n| n.id).collect()
    }

    use TemplateReach::{Local, Shared};

    fn first(nodes: &[NodeRecord], template: &str) -> String {
        ids(placement_order(nodes, template, Shared, |_| 0, Utc::now()))
            .into_iter()
            .next()
            .unwrap_or_default()
    }

    #[test]
    fn locality_wins_ties_and_near_ties() {
        let nodes = [holding("b", 0, &[]), holding("a", 0, &["tpl"])];
        assert_eq!(first(&nodes, "tpl"), "a");
        let reversed = [holding("a", 0, &[]), holding("b", 0, &["tpl"])];
        assert_eq!(first(&reversed, "tpl"), "b");
        // Four more sandboxes on the holder: within the margin on a 16 GiB node.
        let nodes = [holding("a", 0, &[]), holding("b", 4, &["tpl"])];
        assert_eq!(first(&nodes, "tpl"), "b");
    }

    #[test]
    fn headroom_wins_past_the_margin() {
        // 16 GiB: the margin is 2 % or about 328 MiB, past five sandboxes at 64 MiB.
        let nodes = [holding("a", 0, &[]), holding("b", 6, &["tpl"])];
        assert_eq!(first(&nodes, "tpl"), "a");
        // Less free memory measured counts the same way as sandboxes held.
        let nodes = [node("a", 12, &[], 10), node("b", 11, &["tpl"], 10)];
        assert_eq!(first(&nodes, "tpl"), "a");
        let nodes = [node("a", 12, &[], 10), node("b", 12, &["tpl"], 10)];
        assert_eq!(first(&nodes, "tpl"), "b");
    }

    #[test]
    fn creates_spread_over_nodes_that_see_the_same_free_memory() {
        // Placing one at a time, as reports catch up: the empty node takes its share once
        // the holder is past the margin, and from then on they alternate.
        let mut nodes = [holding("a", 0, &["tpl"]), holding("b", 0, &[])];
        for _ in 0..40 {
            let chosen = first(&nodes, "tpl");
            let n = nodes.iter_mut().find(|n| n.id == chosen).expect("a node");
            n.report.sandboxes += 1;
            if !n.report.templates.iter().any(|t| t == "tpl") {
                n.report.templates.push("tpl".into());
            }
        }
        let counts: Vec<u32> = nodes.iter().map(|n| n.report.sandboxes).collect();
        assert_eq!(counts, [20, 20]);
    }

    /// Four live nodes, b and d holding template `tpl`, roomiest c, a, d, b.
    fn two_holding_tpl() -> [NodeRecord; 4] {
        [
            node("a", 4, &[], 10),
            node("b", 2, &["tpl"], 10),
            node("c", 8, &[], 10),
            node("d", 3, &["tpl"], 10),
        ]
    }

    #[test]
    fn only_nodes_holding_a_local_template_are_tried_the_roomiest_first() {
        let nodes = two_holding_tpl();
        let order = placement_order(&nodes, "tpl", Local, |_| 0, Utc::now());
        assert_eq!(ids(order), ["d", "b"]);
        let unknown = placement_order(&nodes, "other", Local, |_| 0, Utc::now());
        assert_eq!(ids(unknown), ["c", "a", "d", "b"]);
    }

    #[test]
    fn a_shared_template_goes_anywhere_holders_counting_the_margin_more() {
        let nodes = two_holding_tpl();
        // The margin (a third of a GiB here) does not make up d's GiB less than a.
        let order = placement_order(&nodes, "tpl", Shared, |_| 0, Utc::now());
        assert_eq!(ids(order), ["c", "a", "d", "b"]);
    }

    #[test]
    fn lost_and_full_nodes_are_never_chosen() {
        let mut full = node("c", 8, &["x"], 10);
        full.report.memory_promised_bytes = 100 << 30;
        full.report.memory_promise_limit_bytes = 100 << 30;
        let mut silent = node("d", 8, &["x"], 10);
        silent.report = NodeReport::default();
        let nodes = [
            node("a", 4, &["x"], -1),
            node("b", 1, &[], 10),
            full,
            silent,
        ];
        assert_eq!(
            ids(placement_order(&nodes, "x", Shared, |_| 0, Utc::now())),
            ["b"]
        );
        // Of a template only they hold, b could start nothing.
        assert!(placement_order(&nodes, "x", Local, |_| 0, Utc::now()).is_empty());
        assert!(placement_order(&nodes[..1], "x", Shared, |_| 0, Utc::now()).is_empty());
    }

    #[test]
    fn creates_in_flight_count_against_a_node_until_it_reports_them() {
        let nodes = [node("a", 4, &[], 10), node("b", 3, &[], 10)];
        let busy_a = |n: &NodeRecord| if n.id == "a" { 32 } else { 0 };
        assert_eq!(
            ids(placement_order(&nodes, "x", Local, busy_a, Utc::now())),
            ["b", "a"]
        );
    }

    #[test]
    fn equal_nodes_are_tried_in_id_order() {
        let nodes = [node("b", 4, &[], 10), node("a", 4, &[], 10)];
        assert_eq!(
            ids(placement_order(&nodes, "x", Local, |_| 0, Utc::now())),
            ["a", "b"]
        );
        let held = [holding("c", 3, &["x"]), holding("b", 3, &["x"])];
        assert_eq!(
            ids(placement_order(&held, "x", Shared, |_| 0, Utc::now())),
            ["b", "c"]
        );
    }

    fn builder(id: &str, slots: u32, running: u32, waiting: u32, lease_secs: i64) -> NodeRecord {
        let mut n = node(id, 4, &[], lease_secs);
        n.report.builds = crate::model::BuildSlotUse {
            slots,
            running,
            waiting,
        };
        n
    }

    #[test]
    fn a_build_goes_to_the_node_with_the_fewest_used_slots_for_its_slots() {
        let nodes = [
            builder("a", 4, 2, 0, 10),
            builder("b", 2, 0, 1, 10),
            builder("c", 8, 1, 1, 10),
        ];
        // a: 2/4, b: 1/2, c: 2/8.
        let order = build_placement_order(&nodes, |_| 0, Utc::now());
        assert_eq!(ids(order), ["c", "a", "b"]);
    }

    #[test]
    fn full_nodes_come_after_any_with_room_and_lost_ones_never() {
        let nodes = [
            builder("a", 1, 1, 0, 10),
            builder("b", 4, 3, 0, 10),
            builder("c", 1, 0, 0, -1),
            builder("d", 2, 1, 3, 10),
        ];
        // b is three quarters full but has room; a (1/1) and d (4/2) have none.
        let order = build_placement_order(&nodes, |_| 0, Utc::now());
        assert_eq!(ids(order), ["b", "a", "d"]);
    }

    #[test]
    fn builds_in_flight_count_until_the_report_shows_them() {
        let nodes = [builder("a", 1, 0, 0, 10), builder("b", 1, 0, 0, 10)];
        let sent_to_a = |id: &str| u64::from(id == "a");
        assert_eq!(
            ids(build_placement_order(&nodes, sent_to_a, Utc::now())),
            ["b", "a"]
        );
    }

    #[test]
    fn equal_builders_are_ranked_by_id_and_silent_ones_left_out() {
        let nodes = [
            builder("b", 2, 1, 0, 10),
            builder("a", 4, 2, 0, 10),
            builder("c", 0, 0, 0, 10),
        ];
        assert_eq!(
            ids(build_placement_order(&nodes, |_| 0, Utc::now())),
            ["a", "b"]
        );
        let reversed = [nodes[2].clone(), nodes[1].clone(), nodes[0].clone()];
        assert_eq!(
            ids(build_placement_order(&reversed, |_| 0, Utc::now())),
            ["a", "b"]
        );
    }

    #[test]
    fn node_ids_are_plain_names() {
        assert!(valid_node_id("node-1.rack_2"));
        for bad in ["", "a/b", "a b", "ä", &"x".repeat(64)] {
            assert!(!valid_node_id(bad), "{bad}");
        }
    }
}

/// The runtime and builder of an API host, which runs no sandboxes and builds nothing: its
/// requests for those go to nodes before they reach the core, so whatever arrives here is
/// refused with the reason.
#[derive(Debug, Default)]
pub struct NoLocalNode;

const NO_LOCAL_NODE: &str = "this host serves the API only; sandboxes run on nodes";

#[async_trait::async_trait]
impl crate::runtime::Runtime for NoLocalNode {
    async fn launch(
        &self,
        spec: crate::runtime::LaunchSpec,
    ) -> Result<
        (crate::runtime::RuntimeHandle, crate::runtime::Endpoint),
        crate::runtime::RuntimeError,
    > {
        Err(crate::runtime::RuntimeError::NoCapacity {
            sandbox_id: spec.sandbox_id,
            message: NO_LOCAL_NODE.into(),
        })
    }

    async fn destroy(
        &self,
        _sandbox_id: &str,
        _handle: &crate::runtime::RuntimeHandle,
    ) -> Result<(), crate::runtime::RuntimeError> {
        Ok(())
    }

    fn is_alive(&self, _sandbox_id: &str, _handle: &crate::runtime::RuntimeHandle) -> bool {
        false
    }

    async fn sweep(&self, _recorded: &[String]) -> Result<usize, crate::runtime::RuntimeError> {
        Ok(0)
    }

    async fn adopt(
        &self,
        _sandbox_id: &str,
        _handle: &crate::runtime::RuntimeHandle,
    ) -> Result<Option<crate::runtime::Endpoint>, crate::runtime::RuntimeError> {
        Ok(None)
    }
}

#[async_trait::async_trait]
impl crate::builds::Builder for NoLocalNode {
    async fn build(
        &self,
        _job: crate::builds::BuildJob,
        _log: crate::builds::BuildLog,
    ) -> Result<crate::model::TemplateImage, crate::model::BuildFailure> {
        Err(crate::model::BuildFailure {
            message: NO_LOCAL_NODE.into(),
            step: None,
        })
    }

    async fn has_upload(&self, _team_id: &str, _template_id: &str, _hash: &str) -> bool {
        false
    }

    async fn store_upload(
        &self,
        _team_id: &str,
        _template_id: &str,
        hash: &str,
        _body: crate::builds::UploadBody,
        _limit: u64,
    ) -> Result<(), crate::builds::UploadError> {
        Err(crate::builds::UploadError::Failed {
            hash: hash.to_owned(),
            message: NO_LOCAL_NODE.into(),
        })
    }

    async fn collect_garbage(&self, _in_use: &[String]) {}
}
