//! The order template builds start in: at most a few running per team, teams with waiting
//! builds served in turn, a team's own builds first come first served.
//!
//! One team queuing many long builds must not keep another team's build from starting, so
//! the queue never lets a team take more than its share of the node's build slots, and a
//! freed slot goes to the next team in turn rather than to the oldest build overall.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// Whose build waits or runs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BuildOwner {
    /// The server's own built-in templates (`base`, the code interpreter): they take none of
    /// the tenants' slots and wait for none, since sandboxes of every team wait for them and
    /// there are only two, built at start (the interpreter's first build takes minutes).
    Server,
    Team(String),
}

impl BuildOwner {
    pub fn of(team_id: Option<&str>) -> Self {
        match team_id {
            Some(id) => Self::Team(id.to_owned()),
            None => Self::Server,
        }
    }
}

/// How many builds may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildLimits {
    /// On the node, all teams together (the server's own builds aside).
    pub total: usize,
    /// Of one team.
    pub per_team: usize,
}

/// Memory one build is counted to need when the default is chosen: package managers and
/// compilers in build steps peak in the gigabytes, and a build may ask for up to 8 GiB.
const MEMORY_MB_PER_BUILD: u64 = 4096;
/// Cores one build is counted to take: twice its default 2 vCPUs, so builds at their default
/// size use at most half the host's CPUs and leave the rest to sandboxes.
const CORES_PER_BUILD: usize = 4;
/// The fewest builds run at once: with one build per team, two teams always build at once.
const MIN_CONCURRENT_BUILDS: usize = 2;

/// How many builds run at once on a host with `cores` CPUs and `memory_mb` of memory, when
/// the operator does not say: `max(2, min(cores / 4, memory GiB / 4))`.
pub fn default_concurrent_builds(cores: usize, memory_mb: u64) -> usize {
    let by_memory = usize::try_from(memory_mb / MEMORY_MB_PER_BUILD).unwrap_or(usize::MAX);
    (cores / CORES_PER_BUILD)
        .min(by_memory)
        .max(MIN_CONCURRENT_BUILDS)
}

/// The owner whose oldest waiting build starts next, if any may start now.
///
/// `waiting` holds each owner's builds in arrival order. Owners take turns in a fixed cyclic
/// order (their sort order), starting after `last_served`, so each owner with a waiting build
/// under its cap is served within one turn of every other such owner however many builds any
/// of them queued.
pub fn next_build<'a, B>(
    running: &BTreeMap<BuildOwner, usize>,
    waiting: &'a BTreeMap<BuildOwner, VecDeque<B>>,
    last_served: Option<&BuildOwner>,
    limits: BuildLimits,
) -> Option<(&'a BuildOwner, &'a B)> {
    let tenants_running: usize = running
        .iter()
        .filter(|(owner, _)| **owner != BuildOwner::Server)
        .map(|(_, count)| count)
        .sum();
    let room = tenants_running < limits.total.max(1);
    let eligible = |(owner, queue): &(&'a BuildOwner, &'a VecDeque<B>)| {
        !queue.is_empty()
            && (**owner == BuildOwner::Server
                || room && running.get(*owner).copied().unwrap_or(0) < limits.per_team.max(1))
    };
    let after_last = waiting
        .iter()
        .filter(|(owner, _)| last_served.is_some_and(|last| *owner > last))
        .find(eligible);
    let (owner, queue) = after_last.or_else(|| waiting.iter().find(eligible))?;
    Some((owner, queue.front()?))
}

/// A running build's place among the node's slots; dropping it frees the slot.
#[derive(Debug)]
pub struct BuildSlot {
    queue: Arc<BuildQueue>,
    owner: BuildOwner,
}

impl Drop for BuildSlot {
    fn drop(&mut self) {
        self.queue.release(&self.owner);
    }
}

#[derive(Debug)]
struct Waiter {
    build_id: String,
    turn: oneshot::Sender<BuildSlot>,
}

#[derive(Debug, Default)]
struct QueueState {
    running: BTreeMap<BuildOwner, usize>,
    waiting: BTreeMap<BuildOwner, VecDeque<Waiter>>,
    last_served: Option<BuildOwner>,
}

/// The node's build slots and the builds waiting for one.
#[derive(Debug)]
pub struct BuildQueue {
    limits: BuildLimits,
    state: Mutex<QueueState>,
}

impl BuildQueue {
    pub fn new(limits: BuildLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            state: Mutex::new(QueueState::default()),
        })
    }

    pub fn limits(&self) -> BuildLimits {
        self.limits
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        crate::lock(&self.state)
    }

    /// Queues build `build_id`; the receiver gets its slot when its turn comes.
    pub fn enqueue(
        self: &Arc<Self>,
        owner: BuildOwner,
        build_id: &str,
    ) -> oneshot::Receiver<BuildSlot> {
        let (turn, receiver) = oneshot::channel();
        self.lock()
            .waiting
            .entry(owner)
            .or_default()
            .push_back(Waiter {
                build_id: build_id.to_owned(),
                turn,
            });
        self.dispatch();
        receiver
    }

    /// Takes build `build_id` out of the queue; whether it was waiting there.
    pub fn withdraw(&self, build_id: &str) -> bool {
        let mut state = self.lock();
        let mut found = false;
        state.waiting.retain(|_, queue| {
            let before = queue.len();
            queue.retain(|w| w.build_id != build_id);
            found |= queue.len() != before;
            !queue.is_empty()
        });
        found
    }

    /// Builds waiting for a slot and builds running, all owners together.
    pub fn counts(&self) -> (usize, usize) {
        let state = self.lock();
        (
            state.waiting.values().map(VecDeque::len).sum(),
            state.running.values().sum(),
        )
    }

    /// The tenants' slots and their builds running and waiting, as a node reports them: the
    /// server's own builds take no tenant slot, so they are left out.
    pub fn slot_use(&self) -> crate::model::BuildSlotUse {
        let state = self.lock();
        let tenant = |owner: &&BuildOwner| **owner != BuildOwner::Server;
        let running: usize = state
            .running
            .iter()
            .filter(|(o, _)| tenant(o))
            .map(|(_, n)| n)
            .sum();
        let waiting: usize = state
            .waiting
            .iter()
            .filter(|(o, _)| tenant(o))
            .map(|(_, q)| q.len())
            .sum();
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        crate::model::BuildSlotUse {
            slots: count(self.limits.total.max(1)),
            running: count(running),
            waiting: count(waiting),
        }
    }

    fn release(self: &Arc<Self>, owner: &BuildOwner) {
        {
            let mut state = self.lock();
            if let Some(count) = state.running.get_mut(owner) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    state.running.remove(owner);
                }
            }
        }
        self.dispatch();
    }

    /// Hands free slots to the builds whose turn it is.
    fn dispatch(self: &Arc<Self>) {
        let mut handed = Vec::new();
        {
            let mut state = self.lock();
            loop {
                let state = &mut *state;
                let Some((owner, _)) = next_build(
                    &state.running,
                    &state.waiting,
                    state.last_served.as_ref(),
                    self.limits,
                ) else {
                    break;
                };
                let owner = owner.clone();
                let Some(queue) = state.waiting.get_mut(&owner) else {
                    break;
                };
                let waiter = queue.pop_front();
                if queue.is_empty() {
                    state.waiting.remove(&owner);
                }
                let Some(waiter) = waiter else { continue };
                *state.running.entry(owner.clone()).or_default() += 1;
                state.last_served = Some(owner.clone());
                handed.push((waiter, owner));
            }
        }
        // Outside the lock: a build that went away drops its slot, which frees it at once.
        for (waiter, owner) in handed {
            let slot = BuildSlot {
                queue: self.clone(),
                owner,
            };
            let _ = waiter.turn.send(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    fn team(name: &str) -> BuildOwner {
        BuildOwner::Team(name.to_owned())
    }

    const LIMITS: BuildLimits = BuildLimits {
        total: 2,
        per_team: 1,
    };

    /// One build at a time in all.
    const ONE_SLOT: BuildLimits = BuildLimits {
        total: 1,
        per_team: 1,
    };

    /// What the scheduler keeps between choices: the builds running and waiting, and whose
    /// started last.
    #[derive(Default)]
    struct Queue {
        running: BTreeMap<BuildOwner, usize>,
        waiting: BTreeMap<BuildOwner, VecDeque<String>>,
        last: Option<BuildOwner>,
    }

    impl Queue {
        /// Team `name`'s builds `{name}0` to `{name}{count - 1}` wait, in that order.
        fn queue(&mut self, name: &str, count: usize) {
            self.waiting.insert(
                team(name),
                (0..count).map(|i| format!("{name}{i}")).collect(),
            );
        }

        /// The server's `builds` wait, in that order.
        fn queue_server(&mut self, builds: &[&str]) {
            let builds = builds.iter().map(|b| (*b).to_owned()).collect();
            self.waiting.insert(BuildOwner::Server, builds);
        }

        /// Starts builds as `next_build` chooses until none may start; returns them in order.
        fn start_all(&mut self, limits: BuildLimits) -> Vec<String> {
            let mut started = Vec::new();
            while let Some((owner, _)) =
                next_build(&self.running, &self.waiting, self.last.as_ref(), limits)
            {
                let owner = owner.clone();
                let build = self
                    .waiting
                    .get_mut(&owner)
                    .and_then(VecDeque::pop_front)
                    .expect("the chosen owner has a waiting build");
                *self.running.entry(owner.clone()).or_default() += 1;
                self.last = Some(owner);
                started.push(build);
            }
            started
        }

        fn finish(&mut self, owner: &BuildOwner) {
            let count = self
                .running
                .get_mut(owner)
                .expect("the owner has a running build");
            *count -= 1;
        }
    }

    #[test]
    fn a_team_with_a_hundred_waiting_builds_delays_another_team_by_at_most_one_turn() {
        let mut queue = Queue::default();
        queue.queue("a", 100);
        assert_eq!(queue.start_all(ONE_SLOT), ["a0"]);
        // b's one build arrives behind a's hundred.
        queue.queue("b", 1);
        queue.finish(&team("a"));
        assert_eq!(
            queue.start_all(ONE_SLOT),
            ["b0"],
            "the freed slot goes to b, whose turn it is"
        );
        // b may also come before a in the order: it is still served within one turn.
        let mut queue = Queue::default();
        queue.queue("z", 100);
        queue.start_all(ONE_SLOT);
        queue.queue("b", 1);
        queue.finish(&team("z"));
        assert_eq!(queue.start_all(ONE_SLOT), ["b0"]);
    }

    #[test]
    fn with_free_slots_another_team_starts_at_once_whatever_one_team_queued() {
        let mut queue = Queue::default();
        queue.queue("a", 100);
        assert_eq!(
            queue.start_all(LIMITS),
            ["a0"],
            "one team holds one slot, the other stays free"
        );
        queue.queue("b", 1);
        assert_eq!(queue.start_all(LIMITS), ["b0"]);
        assert_eq!(queue.waiting[&team("a")].len(), 99);
    }

    #[test]
    fn the_per_team_cap_holds_and_builds_of_a_team_start_in_arrival_order() {
        let limits = BuildLimits {
            total: 8,
            per_team: 2,
        };
        let mut queue = Queue::default();
        queue.queue("a", 5);
        queue.queue("b", 3);
        let started = queue.start_all(limits);
        assert_eq!(started, ["a0", "b0", "a1", "b1"]);
        assert_eq!(queue.running[&team("a")], 2);
        assert_eq!(queue.running[&team("b")], 2);
        queue.finish(&team("a"));
        assert_eq!(
            queue.start_all(limits),
            ["a2"],
            "a's next build, in arrival order; b stays at its cap"
        );
        queue.finish(&team("b"));
        queue.finish(&team("b"));
        assert_eq!(queue.start_all(limits), ["b2"]);
        assert!(queue.waiting[&team("a")].iter().eq(["a3", "a4"]));
    }

    #[test]
    fn teams_take_turns_for_freed_slots() {
        let mut queue = Queue::default();
        for name in ["a", "b", "c"] {
            queue.queue(name, 3);
        }
        let mut order = Vec::new();
        loop {
            let started = queue.start_all(ONE_SLOT);
            let Some(build) = started.first() else { break };
            order.push(build.clone());
            queue.finish(&team(&build[..1]));
        }
        assert_eq!(
            order,
            ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
        );
    }

    #[test]
    fn server_builds_take_no_tenant_slot_and_wait_for_none() {
        let mut queue = Queue::default();
        queue.queue_server(&["base", "interpreter"]);
        queue.queue("a", 3);
        queue.queue("b", 1);
        let mut started = queue.start_all(LIMITS);
        started.sort();
        assert_eq!(started, ["a0", "b0", "base", "interpreter"]);
        assert_eq!(queue.running[&BuildOwner::Server], 2);
        let mut queue = Queue {
            running: BTreeMap::from([(team("a"), 1), (team("b"), 1)]),
            ..Queue::default()
        };
        queue.queue_server(&["base", "interpreter"]);
        assert_eq!(queue.start_all(LIMITS), ["base", "interpreter"]);
    }

    #[test]
    fn the_default_build_slots_follow_cores_and_memory() {
        assert_eq!(default_concurrent_builds(2, 8 << 10), 2);
        assert_eq!(default_concurrent_builds(16, 64 << 10), 4);
        assert_eq!(
            default_concurrent_builds(64, 16 << 10),
            4,
            "memory bounds it"
        );
        assert_eq!(default_concurrent_builds(8, 256 << 10), 2, "cores bound it");
        assert_eq!(default_concurrent_builds(1, 512), 2);
    }

    #[test]
    fn nothing_starts_when_every_slot_is_taken() {
        let running = BTreeMap::from([(team("a"), 1), (team("b"), 1)]);
        let waiting = BTreeMap::from([(team("c"), VecDeque::from(["c0"]))]);
        assert!(next_build(&running, &waiting, None, LIMITS).is_none());
    }

    #[tokio::test]
    async fn the_queue_hands_out_slots_in_turn_and_frees_them_when_dropped() {
        let queue = BuildQueue::new(LIMITS);
        let mut a0 = queue.enqueue(team("a"), "a0");
        let mut a1 = queue.enqueue(team("a"), "a1");
        let mut b0 = queue.enqueue(team("b"), "b0");
        let a0_slot = a0.try_recv().expect("a0 starts at once");
        assert_eq!(
            a1.try_recv().err(),
            Some(TryRecvError::Empty),
            "a1 waits behind a's cap"
        );
        let b0_slot = b0.try_recv().expect("b0 takes the second slot");
        assert_eq!(queue.counts(), (1, 2));
        drop(b0_slot);
        assert_eq!(
            a1.try_recv().err(),
            Some(TryRecvError::Empty),
            "a is still at its cap"
        );
        drop(a0_slot);
        let _a1_slot = a1.try_recv().expect("a1 starts once a0 ended");
        assert_eq!(queue.counts(), (0, 1));
    }

    #[tokio::test]
    async fn the_reported_slot_use_leaves_the_server_s_builds_out() {
        let queue = BuildQueue::new(ONE_SLOT);
        let _base = queue.enqueue(BuildOwner::Server, "base");
        let _a0 = queue.enqueue(team("a"), "a0");
        let _a1 = queue.enqueue(team("a"), "a1");
        let _b0 = queue.enqueue(team("b"), "b0");
        let used = queue.slot_use();
        assert_eq!((used.slots, used.running, used.waiting), (1, 1, 2));
        assert!(!used.has_room());
    }

    #[tokio::test]
    async fn a_withdrawn_or_abandoned_build_never_holds_a_slot() {
        let queue = BuildQueue::new(ONE_SLOT);
        let mut a0 = queue.enqueue(team("a"), "a0");
        let slot = a0.try_recv().expect("a0 starts at once");
        let b0 = queue.enqueue(team("b"), "b0");
        let mut c0 = queue.enqueue(team("c"), "c0");
        let mut d0 = queue.enqueue(team("d"), "d0");
        assert!(queue.withdraw("c0"));
        assert!(!queue.withdraw("c0"));
        // b0's task went away without withdrawing: its turn passes on to the next build.
        drop(b0);
        drop(slot);
        // Withdrawn, c0 is out of the queue for good: its turn is closed, not just pending.
        assert_eq!(c0.try_recv().err(), Some(TryRecvError::Closed));
        let _d0 = d0.try_recv().expect("d0 gets the slot b0 and c0 left");
        assert_eq!(queue.counts(), (0, 1));
    }
}
