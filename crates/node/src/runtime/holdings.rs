//! What the node holds for each sandbox, in one owner per sandbox.
//!
//! A sandbox on this node may hold a network slot, a memory grant, a disk promise and the
//! template layers its files sit on. Each is a value that gives itself back when dropped
//! ([`SlotHold`], [`MemoryGrant`], [`DiskPromise`]), and a sandbox's are kept together in
//! its [`NodeSandbox`]. The node's indexes (the slot set, the ledger's grants, the pool's
//! promises, the layers the collector keeps) change only through these values, so a path
//! that forgets to give something back cannot exist: removing the owner gives back all.
//!
//! An operation that takes resources for a sandbox does it through an [`Opening`]: what it
//! adds is visible at once (the collector sees the layers a boot is about to mount), and
//! if the operation fails before [`Opening::commit`], dropping the opening takes back
//! exactly what it added and leaves what the sandbox held before.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::ledger::MemoryGrant;
use crate::net::netns::SlotSet;
use crate::storage::disks::DiskPromise;

/// A network slot this node's sandbox uses: its namespace, addresses and id range.
#[derive(Debug)]
pub(super) struct SlotHold {
    slots: SlotSet,
    slot: u32,
    /// Cleared when another hold of the same slot replaces this one: the slot stays taken.
    armed: bool,
}

impl SlotHold {
    /// Owns `slot`, which the namespace pool has just taken from `slots`.
    pub(super) fn taken(slots: &SlotSet, slot: u32) -> Self {
        SlotHold {
            slots: slots.clone(),
            slot,
            armed: true,
        }
    }

    /// Takes `slot` again for a sandbox an earlier server started in it.
    pub(super) fn retaken(slots: &SlotSet, slot: u32) -> Self {
        slots.lock().unwrap_or_else(|e| e.into_inner()).insert(slot);
        Self::taken(slots, slot)
    }

    pub(super) fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        if self.armed {
            crate::net::netns::free_slot(&self.slots, self.slot);
        }
    }
}

/// Puts `new` in `held`, returning what it replaces; a replaced hold of the same slot no
/// longer frees it.
fn replace_slot(held: &mut Option<SlotHold>, new: SlotHold) -> Option<SlotHold> {
    let mut replaced = held.replace(new);
    if let (Some(old), Some(new)) = (replaced.as_mut(), held.as_ref())
        && old.slot == new.slot
    {
        old.armed = false;
    }
    replaced
}

/// Everything the node holds for one sandbox.
#[derive(Debug, Default)]
pub(super) struct NodeSandbox {
    pub(super) slot: Option<SlotHold>,
    pub(super) memory: Option<MemoryGrant>,
    pub(super) disk: Option<DiskPromise>,
    /// Template layers its files sit on: the collector keeps them while it is held.
    pub(super) layers: Vec<String>,
}

impl NodeSandbox {
    fn holds_nothing(&self) -> bool {
        self.slot.is_none()
            && self.memory.is_none()
            && self.disk.is_none()
            && self.layers.is_empty()
    }
}

/// What ending a sandbox's processes takes from its owner: the slot they ran in (to be
/// unwired, then given back) and their memory grant.
#[derive(Debug, Default)]
pub(super) struct Ended {
    pub(super) slot: Option<SlotHold>,
    pub(super) memory: Option<MemoryGrant>,
}

/// The owners of the sandboxes on this node, by sandbox id.
#[derive(Debug, Default)]
pub(super) struct Holdings {
    by_id: Mutex<BTreeMap<String, NodeSandbox>>,
}

impl Holdings {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, NodeSandbox>) -> T) -> T {
        f(&mut self.by_id.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Starts an operation that adds to what sandbox `id` holds.
    pub(super) fn opening(&self, id: &str) -> Opening<'_> {
        Opening {
            holdings: self,
            id: id.to_owned(),
            added: Added::default(),
            earlier_layers: None,
            committed: false,
        }
    }

    /// Gives sandbox `id` what an earlier server or another node left it, with no admission
    /// (adoption after a restart, a take-over): each part replaces what it held.
    pub(super) fn adopt(&self, id: &str, adopted: NodeSandbox) {
        let replaced = self.with(|by_id| {
            let held = by_id.entry(id.to_owned()).or_default();
            let replaced = NodeSandbox {
                slot: adopted
                    .slot
                    .and_then(|slot| replace_slot(&mut held.slot, slot)),
                memory: replace_if(&mut held.memory, adopted.memory),
                disk: replace_if(&mut held.disk, adopted.disk),
                layers: std::mem::replace(&mut held.layers, adopted.layers),
            };
            if held.holds_nothing() {
                by_id.remove(id);
            }
            replaced
        });
        drop(replaced);
    }

    /// Takes from sandbox `id` what its processes held; its disk and layers stay.
    pub(super) fn end_processes(&self, id: &str) -> Ended {
        self.with(|by_id| {
            let Some(held) = by_id.get_mut(id) else {
                return Ended::default();
            };
            let ended = Ended {
                slot: held.slot.take(),
                memory: held.memory.take(),
            };
            if held.holds_nothing() {
                by_id.remove(id);
            }
            ended
        })
    }

    /// Takes sandbox `id`'s memory grant (its processes went to disk; its slot stays).
    pub(super) fn take_memory(&self, id: &str) -> Option<MemoryGrant> {
        self.with(|by_id| by_id.get_mut(id)?.memory.take())
    }

    /// Takes sandbox `id`'s slot (it moves to the sandbox a warm one became).
    pub(super) fn take_slot(&self, id: &str) -> Option<SlotHold> {
        self.with(|by_id| {
            let held = by_id.get_mut(id)?;
            let slot = held.slot.take();
            if held.holds_nothing() {
                by_id.remove(id);
            }
            slot
        })
    }

    /// Removes sandbox `id`'s owner: everything it held goes back.
    pub(super) fn remove(&self, id: &str) -> Option<NodeSandbox> {
        self.with(|by_id| by_id.remove(id))
    }

    /// The sandbox that holds `slot`, if one does.
    pub(super) fn holder_of_slot(&self, slot: u32) -> Option<String> {
        self.with(|by_id| {
            by_id
                .iter()
                .find(|(_, held)| held.slot.as_ref().is_some_and(|s| s.slot == slot))
                .map(|(id, _)| id.clone())
        })
    }

    /// Layers held sandboxes sit on.
    pub(super) fn layers_in_use(&self) -> Vec<String> {
        self.with(|by_id| {
            by_id
                .values()
                .flat_map(|held| held.layers.iter().cloned())
                .collect()
        })
    }

    /// How many sandboxes hold anything, and what they hold: slots, grants, promises.
    #[cfg(test)]
    pub(super) fn held_slots(&self) -> Vec<u32> {
        let mut slots: Vec<u32> = self.with(|by_id| {
            by_id
                .values()
                .filter_map(|h| h.slot.as_ref().map(SlotHold::slot))
                .collect()
        });
        slots.sort_unstable();
        slots
    }

    #[cfg(test)]
    pub(super) fn counts(&self) -> (usize, usize, usize, usize) {
        self.with(|by_id| {
            (
                by_id.len(),
                by_id.values().filter(|h| h.slot.is_some()).count(),
                by_id.values().filter(|h| h.memory.is_some()).count(),
                by_id.values().filter(|h| h.disk.is_some()).count(),
            )
        })
    }
}

fn replace_if<T>(held: &mut Option<T>, new: Option<T>) -> Option<T> {
    match new {
        Some(new) => held.replace(new),
        None => None,
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Added {
    slot: bool,
    memory: bool,
    disk: bool,
}

/// An operation adding to what one sandbox holds; dropped before [`Opening::commit`], it
/// takes back what it added (see the module's documentation).
#[derive(Debug)]
pub(super) struct Opening<'a> {
    holdings: &'a Holdings,
    id: String,
    added: Added,
    /// The layers the sandbox held before this operation set its own.
    earlier_layers: Option<Vec<String>>,
    committed: bool,
}

impl Opening<'_> {
    fn held<T>(&self, f: impl FnOnce(&mut NodeSandbox) -> T) -> T {
        self.holdings
            .with(|by_id| f(by_id.entry(self.id.clone()).or_default()))
    }

    pub(super) fn hold_slot(&mut self, slot: SlotHold) {
        self.added.slot = true;
        drop(self.held(|held| replace_slot(&mut held.slot, slot)));
    }

    pub(super) fn hold_memory(&mut self, grant: MemoryGrant) {
        self.added.memory = true;
        drop(self.held(|held| held.memory.replace(grant)));
    }

    pub(super) fn hold_disk(&mut self, promise: DiskPromise) {
        self.added.disk = true;
        drop(self.held(|held| held.disk.replace(promise)));
    }

    /// Marks `layers` in use by the sandbox from now on (what it used before comes back if
    /// the operation fails).
    pub(super) fn use_layers(&mut self, layers: Vec<String>) {
        let earlier = self.held(|held| std::mem::replace(&mut held.layers, layers));
        if self.earlier_layers.is_none() {
            self.earlier_layers = Some(earlier);
        }
    }

    pub(super) fn sandbox_id(&self) -> &str {
        &self.id
    }

    /// The operation succeeded: what it added stays the sandbox's.
    pub(super) fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let (added, earlier_layers) = (self.added, self.earlier_layers.take());
        let taken_back = self.holdings.with(|by_id| {
            let held = by_id.get_mut(&self.id)?;
            let taken_back = NodeSandbox {
                slot: held.slot.take_if(|_| added.slot),
                memory: held.memory.take_if(|_| added.memory),
                disk: held.disk.take_if(|_| added.disk),
                layers: match earlier_layers {
                    Some(earlier) => std::mem::replace(&mut held.layers, earlier),
                    None => Vec::new(),
                },
            };
            if held.holds_nothing() {
                by_id.remove(&self.id);
            }
            Some(taken_back)
        });
        drop(taken_back);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::ledger::ResourceLedger;
    use crate::net::netns::SlotSet;

    use super::{Holdings, NodeSandbox, SlotHold};

    /// A node's holdings, slots and ledger with nothing held yet.
    fn fresh() -> (Holdings, SlotSet, Arc<ResourceLedger>) {
        (
            Holdings::default(),
            SlotSet::default(),
            ResourceLedger::unreserved(),
        )
    }

    fn slots_taken(slots: &SlotSet) -> Vec<u32> {
        slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect()
    }

    fn take(slots: &SlotSet, slot: u32) -> SlotHold {
        SlotHold::retaken(slots, slot)
    }

    #[test]
    fn a_failed_opening_gives_back_what_it_added_and_only_that() {
        let (holdings, slots, ledger) = fresh();
        // A released sandbox: files on two layers, no slot, no memory.
        holdings.adopt(
            "s",
            NodeSandbox {
                layers: vec!["layer/a".into(), "layer/b".into()],
                ..NodeSandbox::default()
            },
        );
        {
            let mut boot = holdings.opening("s");
            boot.hold_memory(ledger.regrant("s", 512, 0));
            boot.hold_slot(take(&slots, 3));
            boot.use_layers(vec!["layer/c".into()]);
            assert_eq!(holdings.layers_in_use(), vec!["layer/c".to_owned()]);
            assert_eq!(ledger.promised_mb(), 512);
            // Dropped without a commit: the boot failed.
        }
        assert_eq!(
            holdings.layers_in_use(),
            vec!["layer/a".to_owned(), "layer/b".to_owned()]
        );
        assert_eq!(ledger.promised_mb(), 0);
        assert!(slots_taken(&slots).is_empty());
        assert_eq!(holdings.counts(), (1, 0, 0, 0));
    }

    #[test]
    fn a_committed_opening_keeps_all_until_the_owner_is_removed() {
        let (holdings, slots, ledger) = fresh();
        let mut boot = holdings.opening("s");
        boot.hold_memory(ledger.regrant("s", 256, 0));
        boot.hold_slot(take(&slots, 7));
        boot.use_layers(vec!["layer/a".into()]);
        boot.commit();
        assert_eq!(holdings.holder_of_slot(7).as_deref(), Some("s"));
        assert_eq!(holdings.counts(), (1, 1, 1, 0));

        // Its processes end (a release): the slot and memory go, the layers stay.
        let ended = holdings.end_processes("s");
        assert_eq!(ended.slot.as_ref().map(SlotHold::slot), Some(7));
        drop(ended);
        assert!(slots_taken(&slots).is_empty());
        assert_eq!(ledger.promised_mb(), 0);
        assert_eq!(holdings.layers_in_use(), vec!["layer/a".to_owned()]);

        drop(holdings.remove("s"));
        assert_eq!(holdings.counts(), (0, 0, 0, 0));
        assert!(holdings.layers_in_use().is_empty());
    }

    #[test]
    fn a_slot_held_again_stays_taken_when_the_earlier_hold_goes() {
        let (holdings, slots) = (Holdings::default(), SlotSet::default());
        let mut boot = holdings.opening("s");
        boot.hold_slot(take(&slots, 2));
        boot.commit();
        // A restart's adoption finds the same sandbox in the same slot.
        holdings.adopt(
            "s",
            NodeSandbox {
                slot: Some(take(&slots, 2)),
                ..NodeSandbox::default()
            },
        );
        assert_eq!(slots_taken(&slots), vec![2]);
        drop(holdings.remove("s"));
        assert!(slots_taken(&slots).is_empty());
    }

    #[test]
    fn an_opening_dropped_after_its_owner_was_removed_touches_nothing_else() {
        let (holdings, slots, ledger) = fresh();
        let mut boot = holdings.opening("s");
        boot.hold_memory(ledger.regrant("s", 256, 0));
        boot.hold_slot(take(&slots, 1));
        // The failed boot's teardown removed the owner before the opening was dropped.
        drop(holdings.remove("s"));
        // Another sandbox takes the same slot meanwhile.
        let mut other = holdings.opening("t");
        other.hold_slot(take(&slots, 1));
        other.commit();
        drop(boot);
        assert_eq!(slots_taken(&slots), vec![1]);
        assert_eq!(holdings.holder_of_slot(1).as_deref(), Some("t"));
        assert_eq!(ledger.promised_mb(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// An operation on sandbox `id` that takes memory, a slot and layers as asked, then
        /// succeeds or fails.
        Open {
            id: usize,
            memory: bool,
            slot: bool,
            layers: bool,
            succeeds: bool,
        },
        EndProcesses(usize),
        Checkpoint(usize),
        Adopt(usize),
        Remove(usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (
                0..3usize,
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                any::<bool>()
            )
                .prop_map(|(id, memory, slot, layers, succeeds)| Step::Open {
                    id,
                    memory,
                    slot,
                    layers,
                    succeeds
                }),
            (0..3usize).prop_map(Step::EndProcesses),
            (0..3usize).prop_map(Step::Checkpoint),
            (0..3usize).prop_map(Step::Adopt),
            (0..3usize).prop_map(Step::Remove),
        ]
    }

    fn free_slot_of(slots: &SlotSet) -> u32 {
        let taken = slots_taken(slots);
        (0..).find(|s| !taken.contains(s)).unwrap_or(0)
    }

    proptest::proptest! {
        /// Whatever operations run and fail, the indexes say exactly what the owners hold,
        /// and nothing is left once every owner is removed.
        #[test]
        fn the_indexes_follow_the_owners(steps in proptest::collection::vec(step(), 1..40)) {
            let (holdings, slots, ledger) = fresh();
            for step in steps {
                match step {
                    Step::Open { id, memory, slot, layers, succeeds } => {
                        let id = format!("s{id}");
                        let mut opening = holdings.opening(&id);
                        if memory {
                            opening.hold_memory(ledger.regrant(&id, 100, 0));
                        }
                        if slot {
                            let free = free_slot_of(&slots);
                            opening.hold_slot(take(&slots, free));
                        }
                        if layers {
                            opening.use_layers(vec![format!("layer/{id}")]);
                        }
                        if succeeds {
                            opening.commit();
                        }
                    }
                    Step::EndProcesses(id) => drop(holdings.end_processes(&format!("s{id}"))),
                    Step::Checkpoint(id) => {
                        if let Some(grant) = holdings.take_memory(&format!("s{id}")) {
                            grant.give_back(Some(0));
                        }
                    }
                    Step::Adopt(id) => {
                        let id = format!("s{id}");
                        let free = free_slot_of(&slots);
                        holdings.adopt(&id, NodeSandbox {
                            slot: Some(take(&slots, free)),
                            memory: Some(ledger.regrant(&id, 100, 0)),
                            disk: None,
                            layers: vec![format!("layer/{id}")],
                        });
                    }
                    Step::Remove(id) => drop(holdings.remove(&format!("s{id}"))),
                }
                let (_, _, with_memory, _) = holdings.counts();
                proptest::prop_assert_eq!(ledger.promised_mb(), 100 * with_memory as u64);
                proptest::prop_assert_eq!(holdings.held_slots(), slots_taken(&slots));
            }
            for id in 0..3 {
                drop(holdings.remove(&format!("s{id}")));
            }
            proptest::prop_assert_eq!(holdings.counts(), (0, 0, 0, 0));
            proptest::prop_assert_eq!(ledger.promised_mb(), 0);
            proptest::prop_assert!(slots_taken(&slots).is_empty());
            proptest::prop_assert!(holdings.layers_in_use().is_empty());
        }
    }
}
