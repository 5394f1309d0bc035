//! Sandboxes booted ahead of demand.
//!
//! Booting a sandbox (cgroups, disk, the boot process, PID 1 building its root, the agent
//! starting) is most of what a create costs. A warm sandbox has done all of that for an image
//! before anyone asked for it, under a name of its own and with a token only the node knows;
//! a create of that image takes one, renames its cgroups, disk, socket and log to the new
//! sandbox's id, sets its limits and hands the agent the sandbox's token and environment
//! (`POST /init`). Nothing of a tenant ever ran in it before, so it is as fresh as a cold boot.
//!
//! The pool follows demand, per image: the image most recently asked for keeps at least the
//! configured floor (`--warm-pool`), and every image asked for lately keeps as many as its
//! busiest second of creates in the last minute asked for, with a quarter more, up to the
//! pool's ceiling (`--warm-pool-max`) for all images together. When creates stop, the extra
//! ones are retired and an image not asked for in ten minutes keeps none. This module holds
//! the decisions (which image, what to boot or retire next); the runtime does the booting.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sandbar_core::{LaunchSpec, RuntimeHandle};
use sandbar_jail::IdMap;

/// Prefix of a warm sandbox's name, never the prefix of a sandbox id.
pub const NAME_PREFIX: &str = "warm-";

/// How long the pool waits after the last create before booting more, while it still holds
/// at least half its target. A boot takes a core and kernel locks (cgroups, mounts, the
/// network) for several milliseconds; started right after a take, it lands on the new
/// sandbox's first command, which a client sends within a few milliseconds of its create.
pub const QUIET: Duration = Duration::from_millis(25);

/// The wait after the last create once the pool has fallen under half its target: creates
/// one after another (create, use, kill, create) faster than [`QUIET`] must still find the
/// pool refilled rather than drained.
pub const QUIET_WHEN_LOW: Duration = Duration::from_millis(2);

/// How long a boot stays stopped after the last create it stopped for ends: a client sends
/// its new sandbox's first command within a few milliseconds of the create's answer.
pub const HOLD_AFTER_CREATE: Duration = Duration::from_millis(10);

/// The most a boot is stopped for creates in all: creates that never pause must still see the
/// pool refilled.
pub const HOLD_BUDGET: Duration = Duration::from_millis(100);

/// How far back creates count towards an image's demand.
pub const DEMAND_WINDOW: Duration = Duration::from_secs(60);
/// The span whose busiest occurrence in [`DEMAND_WINDOW`] sets an image's target: a round of
/// simultaneous creates lands within it.
pub const BURST: Duration = Duration::from_secs(1);
/// An image not asked for this long keeps no warm sandbox, unless it is the last one asked for.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);
/// Creates remembered per image: bounds the bookkeeping whatever the create rate.
const REMEMBERED_CREATES: usize = 4096;

/// The disk quota and memory limit a warm sandbox boots with, enough for its agent: nothing
/// else runs in it before a create sets the sandbox's own.
pub const BOOT_DISK_MB: u32 = 64;
pub const BOOT_MEMORY_MB: u32 = 64;

/// What a warm sandbox was booted for: a new sandbox of an image with these can take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmKey {
    pub layers: Vec<String>,
    pub user: String,
    pub workdir: String,
}

impl WarmKey {
    /// The key of a launch a warm sandbox can serve; `None` for one that needs a boot of its
    /// own: files kept from an earlier life, volumes (mounted while the root is built), no
    /// internet access (a namespace named for it), or a restore from a snapshot.
    pub fn of(spec: &LaunchSpec) -> Option<Self> {
        let fresh = spec.kept.is_none()
            && spec.volumes.is_empty()
            && spec.allow_internet_access
            && spec.image.snapshot.is_none();
        fresh.then(|| WarmKey {
            layers: spec.image.layers.clone(),
            user: spec.image.user.clone(),
            workdir: spec.image.workdir.clone(),
        })
    }
}

/// A booted sandbox waiting for its owner.
#[derive(Debug, Clone)]
pub struct WarmSandbox {
    /// Its cgroups', disk's, socket's and log's name until it is taken.
    pub name: String,
    pub key: WarmKey,
    /// Host PID of its PID 1 and that process's start time in clock ticks.
    pub pid: i32,
    pub start_ticks: u64,
    pub slot: u32,
    pub id_map: IdMap,
    /// The token its agent holds until it is handed its sandbox's.
    pub token: String,
    /// What it reads as the kernel's boot id: it booted once, whoever takes it.
    pub boot_id: String,
}

/// What the pool should do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Job {
    /// Boot one more sandbox with this key.
    Boot(WarmKey),
    /// Tear this one down (its image is no longer the one asked for, and the pool is full).
    Retire(Box<WarmSandbox>),
    /// Nothing until a create asks for something.
    Wait,
}

impl WarmSandbox {
    /// Its handle while it waits in the pool.
    pub(crate) fn handle(&self) -> RuntimeHandle {
        RuntimeHandle::warm(self.slot, self.id_map.host_base, self.pid, self.start_ticks)
    }
}

impl PartialEq for WarmSandbox {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for WarmSandbox {}

/// The creates of one image a warm sandbox could have served, lately.
#[derive(Debug)]
struct Demand {
    key: WarmKey,
    /// When each began, oldest first, within [`DEMAND_WINDOW`] (and at most
    /// [`REMEMBERED_CREATES`]).
    creates: std::collections::VecDeque<Instant>,
    last: Instant,
    /// The CPUs the last of them asked for.
    cpu_count: u32,
}

impl Demand {
    fn forget_before(&mut self, now: Instant) {
        while self
            .creates
            .front()
            .is_some_and(|at| now.saturating_duration_since(*at) > DEMAND_WINDOW)
        {
            self.creates.pop_front();
        }
    }

    /// The most creates that began within one [`BURST`] of each other.
    fn busiest_burst(&self) -> usize {
        let times = &self.creates;
        let mut start = 0;
        let mut busiest = 0;
        for (end, at) in times.iter().enumerate() {
            while at.saturating_duration_since(times[start]) > BURST {
                start += 1;
            }
            busiest = busiest.max(end + 1 - start);
        }
        busiest
    }
}

/// The boot under way, which creates stop while they run (see [`WarmPool::creating`]).
#[derive(Debug)]
struct Boot {
    name: String,
    /// Since when it is stopped, if it is.
    held_since: Option<Instant>,
    /// How long it was stopped before that.
    held_for: Duration,
}

#[derive(Debug, Default)]
struct State {
    booting: Option<Boot>,
    waiting: Vec<WarmSandbox>,
    /// The image the last create that a warm sandbox could have served asked for.
    wanted: Option<WarmKey>,
    /// Every image asked for lately, the most recent first.
    demand: Vec<Demand>,
    /// Creates under way, and when the last one began or ended.
    creating: usize,
    last_create: Option<Instant>,
    taken: u64,
    missed: u64,
}

/// The waiting sandboxes and what the pool is after.
#[derive(Debug)]
pub struct WarmPool {
    /// What the image last asked for keeps at least.
    target: usize,
    /// What all images together keep at most.
    ceiling: usize,
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    /// Raised when a create begins or ends.
    activity: tokio::sync::Notify,
    /// Held while the pool boots or retires a sandbox, so a stop can wait for that to end.
    working: tokio::sync::Mutex<()>,
    closed: std::sync::atomic::AtomicBool,
}

/// Numbers an operator watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmReport {
    pub target: usize,
    pub waiting: usize,
    /// Creates served by a warm sandbox, and creates that could have been but found none.
    pub taken: u64,
    pub missed: u64,
}

impl WarmPool {
    /// A pool that keeps at least `target` sandboxes of the image last asked for and at most
    /// `ceiling` (raised to `target` if lower) of all images together.
    pub fn new(target: usize, ceiling: usize) -> Self {
        Self {
            target,
            ceiling: ceiling.max(target),
            state: Mutex::new(State::default()),
            wake: tokio::sync::Notify::new(),
            activity: tokio::sync::Notify::new(),
            working: tokio::sync::Mutex::new(()),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Held by whoever boots or retires a warm sandbox; `None` once the pool is closed.
    pub async fn work(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        let guard = self.working.lock().await;
        (!self.closed.load(std::sync::atomic::Ordering::Acquire)).then_some(guard)
    }

    /// Stops all boots (waiting for one under way) and hands back every waiting sandbox,
    /// for the caller to tear down.
    pub async fn close(&self) -> Vec<WarmSandbox> {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        let _done = self.working.lock().await;
        self.wake.notify_one();
        std::mem::take(&mut self.state().waiting)
    }

    pub fn target(&self) -> usize {
        self.target
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A waiting sandbox for `key`, for a sandbox of `cpu_count` CPUs, if there is one; either
    /// way `key` becomes what the pool keeps ready.
    pub fn take(&self, key: &WarmKey, cpu_count: u32) -> Option<WarmSandbox> {
        if self.target == 0 || self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let mut state = self.state();
        let found = state.waiting.iter().position(|w| &w.key == key);
        let taken = found.map(|i| state.waiting.remove(i));
        if taken.is_some() {
            state.taken += 1;
        } else {
            state.missed += 1;
        }
        if state.wanted.as_ref() != Some(key) {
            state.wanted = Some(key.clone());
        }
        state.count_create(key, cpu_count, Instant::now());
        drop(state);
        self.wake.notify_one();
        taken
    }

    /// Adds a freshly booted sandbox.
    pub fn put(&self, warm: WarmSandbox) {
        self.state().waiting.push(warm);
    }

    /// Marks a create as under way until the returned guard is dropped.
    ///
    /// A boot's system calls (mounts, `pivot_root`, namespaces) hold a core for milliseconds
    /// each on a kernel that does not preempt them, and cost more the more sandboxes a host
    /// holds; a create that meets one waits. So the boot under way stops for creates: `hold`
    /// is asked to stop it (it says whether it did), unless the pool is under half its target
    /// (it must refill first) or the boot has been stopped for [`HOLD_BUDGET`] already. It runs
    /// again once creates have been quiet for [`HOLD_AFTER_CREATE`]. `hold` is called under
    /// the pool's lock, so it never lands after the boot has ended and been let go.
    pub fn creating(&self, hold: impl FnOnce(&str) -> bool) -> CreateGuard<'_> {
        let now = Instant::now();
        let mut state = self.state();
        state.creating += 1;
        state.last_create = Some(now);
        let low = state.waiting.len() * 2 < self.target;
        if let Some(boot) = state.booting.as_mut()
            && boot.held_since.is_none()
            && boot.held_for < HOLD_BUDGET
            && !low
            && hold(&boot.name)
        {
            boot.held_since = Some(now);
        }
        drop(state);
        self.activity.notify_waiters();
        CreateGuard { pool: self }
    }

    /// Makes the boot of warm sandbox `name` the one creates stop.
    pub fn boot_started(&self, name: &str) {
        self.state().booting = Some(Boot {
            name: name.to_owned(),
            held_since: None,
            held_for: Duration::ZERO,
        });
    }

    /// Ends the boot's turn; `release` lets it run again if a create had stopped it. Returns
    /// how long creates had it stopped.
    pub fn boot_ended(&self, release: impl FnOnce(&str)) -> Duration {
        let Some(boot) = self.state().booting.take() else {
            return Duration::ZERO;
        };
        match boot.held_since {
            Some(since) => {
                release(&boot.name);
                boot.held_for + since.elapsed()
            }
            None => boot.held_for,
        }
    }

    /// How long until the stopped boot may run again: `None` when it is not stopped.
    pub fn release_in(&self, now: Instant) -> Option<Duration> {
        let state = self.state();
        let boot = state.booting.as_ref()?;
        let since = boot.held_since?;
        let left = HOLD_BUDGET.saturating_sub(boot.held_for + now.saturating_duration_since(since));
        if left.is_zero() {
            return Some(Duration::ZERO);
        }
        if state.creating > 0 {
            return Some(left);
        }
        let quiet = state.last_create.map_or(HOLD_AFTER_CREATE, |last| {
            now.saturating_duration_since(last)
        });
        Some(HOLD_AFTER_CREATE.saturating_sub(quiet).min(left))
    }

    /// Lets the stopped boot run again through `release`, if it still is stopped.
    pub fn release(&self, now: Instant, release: impl FnOnce(&str)) {
        let mut state = self.state();
        if let Some(boot) = state.booting.as_mut()
            && let Some(since) = boot.held_since.take()
        {
            boot.held_for += now.saturating_duration_since(since);
            release(&boot.name);
        }
    }

    /// Raised when a create begins or ends; enable a `notified()` before looking at the
    /// pool, so that a change in between is not missed.
    pub fn activity(&self) -> &tokio::sync::Notify {
        &self.activity
    }

    /// How long to stay out of the way of creates before the next job: `None` when the
    /// pool may work now.
    pub fn hold_off(&self, now: Instant) -> Option<Duration> {
        let state = self.state();
        let quiet = if state.waiting.len() * 2 < self.target {
            QUIET_WHEN_LOW
        } else {
            QUIET
        };
        if state.creating > 0 {
            return Some(quiet);
        }
        let since = state
            .last_create
            .map_or(quiet, |last| now.saturating_duration_since(last));
        (since < quiet).then(|| quiet - since)
    }

    /// The next thing to do; see [`Job`].
    pub fn next_job(&self) -> Job {
        self.next_job_at(Instant::now())
    }

    fn next_job_at(&self, now: Instant) -> Job {
        let mut state = self.state();
        next_job(&mut state, self.target, self.ceiling, now)
    }

    /// Waits for a create to change what the pool wants, or for `timeout`.
    pub async fn wait(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.wake.notified()).await;
    }

    /// The CPUs a sandbox booted for `key` is held to: as many as the last create of `key`
    /// asked for, one when none did. The take then finds the group's CPU quota already
    /// right: writing it costs a check of every CPU group on the host (0.3 ms next to 1,000
    /// sandboxes, against 40 µs next to 10), in the create's path.
    pub fn cpu_count_for(&self, key: &WarmKey) -> u32 {
        self.state()
            .demand
            .iter()
            .find(|d| &d.key == key)
            .map_or(1, |d| d.cpu_count.max(1))
    }

    pub fn report(&self) -> WarmReport {
        let mut state = self.state();
        let target = state
            .targets(self.target, self.ceiling, Instant::now())
            .iter()
            .map(|(_, n)| n)
            .sum::<usize>()
            .max(self.target);
        WarmReport {
            target,
            waiting: state.waiting.len(),
            taken: state.taken,
            missed: state.missed,
        }
    }
}

impl State {
    fn count_create(&mut self, key: &WarmKey, cpu_count: u32, now: Instant) {
        let at = match self.demand.iter().position(|d| &d.key == key) {
            Some(i) => i,
            None => {
                self.demand.push(Demand {
                    key: key.clone(),
                    creates: std::collections::VecDeque::new(),
                    last: now,
                    cpu_count,
                });
                self.demand.len() - 1
            }
        };
        let mut demand = self.demand.remove(at);
        demand.last = now;
        demand.cpu_count = cpu_count;
        if demand.creates.len() >= REMEMBERED_CREATES {
            demand.creates.pop_front();
        }
        demand.creates.push_back(now);
        self.demand.insert(0, demand);
    }

    /// How many each image lately asked for should keep ready now, the most recent first,
    /// within the ceiling; images past [`FORGET_AFTER`] are dropped.
    fn targets(&mut self, floor: usize, ceiling: usize, now: Instant) -> Vec<(WarmKey, usize)> {
        let wanted = self.wanted.clone();
        self.demand.retain(|d| {
            Some(&d.key) == wanted.as_ref() || now.saturating_duration_since(d.last) < FORGET_AFTER
        });
        let mut left = ceiling;
        let mut targets = Vec::with_capacity(self.demand.len());
        for demand in &mut self.demand {
            demand.forget_before(now);
            let burst = demand.busiest_burst();
            let mut want = burst + burst.div_ceil(4);
            if Some(&demand.key) == wanted.as_ref() {
                want = want.max(floor);
            }
            let want = want.min(left);
            left -= want;
            targets.push((demand.key.clone(), want));
        }
        targets
    }
}

fn next_job(state: &mut State, floor: usize, ceiling: usize, now: Instant) -> Job {
    if floor == 0 {
        return Job::Wait;
    }
    let targets = state.targets(floor, ceiling, now);
    let ready =
        |state: &State, key: &WarmKey| state.waiting.iter().filter(|w| &w.key == key).count();
    let target_of = |key: &WarmKey| {
        targets
            .iter()
            .find(|(k, _)| k == key)
            .map_or(0, |(_, n)| *n)
    };
    // The oldest sandbox of an image that holds more than it should now.
    let surplus = |state: &State| {
        state
            .waiting
            .iter()
            .position(|w| ready(state, &w.key) > target_of(&w.key))
    };
    for (key, want) in &targets {
        if ready(state, key) >= *want {
            continue;
        }
        if state.waiting.len() < ceiling {
            return Job::Boot(key.clone());
        }
        return match surplus(state) {
            Some(i) => Job::Retire(Box::new(state.waiting.remove(i))),
            None => Job::Wait,
        };
    }
    match surplus(state) {
        Some(i) => Job::Retire(Box::new(state.waiting.remove(i))),
        None => Job::Wait,
    }
}

/// See [`WarmPool::creating`].
#[derive(Debug)]
pub struct CreateGuard<'a> {
    pool: &'a WarmPool,
}

impl Drop for CreateGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.pool.state();
        state.creating = state.creating.saturating_sub(1);
        state.last_create = Some(Instant::now());
        drop(state);
        self.pool.activity.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use sandbar_jail::IdMap;

    use super::{
        DEMAND_WINDOW, FORGET_AFTER, HOLD_AFTER_CREATE, HOLD_BUDGET, Job, QUIET, QUIET_WHEN_LOW,
        WarmKey, WarmPool, WarmSandbox,
    };

    fn key(layer: &str) -> WarmKey {
        WarmKey {
            layers: vec![layer.into()],
            user: "user".into(),
            workdir: "/home/user".into(),
        }
    }

    /// Records `times` creates asking for image `layer`, `apart` from each other from `from`
    /// on, as taking from the pool does: the image becomes the one last asked for.
    fn count_creates(pool: &WarmPool, layer: &str, times: u32, from: Instant, apart: Duration) {
        let mut state = pool.state();
        for i in 0..times {
            state.count_create(&key(layer), 2, from + apart * i);
        }
        state.wanted = Some(key(layer));
    }

    fn warm(name: &str, key: WarmKey) -> WarmSandbox {
        WarmSandbox {
            name: name.into(),
            key,
            pid: 1,
            start_ticks: 1,
            slot: 0,
            id_map: IdMap {
                host_base: 1 << 20,
                size: 65536,
            },
            token: "t".into(),
            boot_id: "b".into(),
        }
    }

    #[test]
    fn nothing_is_booted_before_a_create_asks() {
        let pool = WarmPool::new(2, 2);
        assert_eq!(pool.next_job(), Job::Wait);
    }

    #[test]
    fn a_miss_makes_its_image_the_one_kept_ready_up_to_the_target() {
        let pool = WarmPool::new(2, 2);
        assert!(pool.take(&key("a"), 2).is_none());
        assert_eq!(pool.next_job(), Job::Boot(key("a")));
        pool.put(warm("w1", key("a")));
        assert_eq!(pool.next_job(), Job::Boot(key("a")));
        pool.put(warm("w2", key("a")));
        assert_eq!(pool.next_job(), Job::Wait);
        let report = pool.report();
        assert_eq!((report.waiting, report.taken, report.missed), (2, 0, 1));
    }

    #[test]
    fn a_boot_is_held_to_the_cpus_the_last_create_of_its_image_asked_for() {
        let pool = WarmPool::new(2, 4);
        assert_eq!(pool.cpu_count_for(&key("a")), 1, "nothing asked yet");
        assert!(pool.take(&key("a"), 4).is_none());
        assert!(pool.take(&key("b"), 2).is_none());
        assert_eq!(pool.cpu_count_for(&key("a")), 4);
        assert_eq!(pool.cpu_count_for(&key("b")), 2);
        assert!(pool.take(&key("a"), 8).is_none());
        assert_eq!(pool.cpu_count_for(&key("a")), 8);
    }

    #[test]
    fn a_create_takes_only_a_sandbox_of_its_own_image() {
        let pool = WarmPool::new(2, 2);
        pool.put(warm("w1", key("a")));
        assert!(pool.take(&key("b"), 2).is_none());
        assert_eq!(pool.take(&key("a"), 2).map(|w| w.name), Some("w1".into()));
        assert!(pool.take(&key("a"), 2).is_none());
    }

    #[test]
    fn a_full_pool_of_another_image_retires_its_oldest_first() {
        let pool = WarmPool::new(2, 2);
        pool.put(warm("old1", key("a")));
        pool.put(warm("old2", key("a")));
        assert!(pool.take(&key("b"), 2).is_none());
        assert_eq!(
            pool.next_job(),
            Job::Retire(Box::new(warm("old1", key("a"))))
        );
        assert_eq!(pool.next_job(), Job::Boot(key("b")));
    }

    #[test]
    fn a_pool_of_size_zero_never_takes_or_boots() {
        let pool = WarmPool::new(0, 0);
        assert!(pool.take(&key("a"), 2).is_none());
        assert_eq!(pool.next_job(), Job::Wait);
    }

    #[tokio::test]
    async fn a_closed_pool_hands_back_its_sandboxes_and_does_no_more_work() {
        let pool = WarmPool::new(2, 2);
        pool.put(warm("w1", key("a")));
        assert!(pool.work().await.is_some());
        let left = pool.close().await;
        assert_eq!(left.len(), 1);
        assert!(pool.work().await.is_none());
        assert!(pool.take(&key("a"), 2).is_none());
    }

    #[test]
    fn boots_wait_until_creates_have_been_quiet_for_a_while() {
        let pool = WarmPool::new(2, 2);
        pool.put(warm("w1", key("a")));
        let now = Instant::now();
        assert_eq!(pool.hold_off(now), None, "no create yet");
        let guard = pool.creating(|_| true);
        assert_eq!(pool.hold_off(Instant::now()), Some(QUIET));
        drop(guard);
        let after = pool.hold_off(Instant::now()).expect("just ended");
        assert!(after <= QUIET && after > QUIET_WHEN_LOW);
        assert_eq!(pool.hold_off(Instant::now() + QUIET), None);
    }

    #[test]
    fn a_burst_raises_its_image_to_the_burst_and_a_quarter_more_within_the_ceiling() {
        let pool = WarmPool::new(2, 16);
        let now = Instant::now();
        count_creates(&pool, "a", 8, now, Duration::from_millis(10));
        let targets = pool
            .state()
            .targets(2, 16, now + Duration::from_millis(100));
        assert_eq!(targets, vec![(key("a"), 10)]);
        // Bounded by the ceiling, whatever the burst.
        let targets = pool.state().targets(2, 6, now + Duration::from_millis(100));
        assert_eq!(targets, vec![(key("a"), 6)]);
        for _ in 0..10 {
            assert_eq!(pool.next_job_at(now), Job::Boot(key("a")));
            pool.put(warm("w", key("a")));
        }
        assert_eq!(pool.next_job_at(now), Job::Wait);
    }

    #[test]
    fn once_creates_stop_the_extra_sandboxes_are_retired_down_to_the_floor() {
        let pool = WarmPool::new(2, 16);
        let now = Instant::now();
        count_creates(&pool, "a", 4, now, Duration::from_millis(1));
        for i in 0..5 {
            pool.put(warm(&format!("w{i}"), key("a")));
        }
        assert_eq!(pool.next_job_at(now), Job::Wait, "4 and a quarter: five");
        let later = now + DEMAND_WINDOW + Duration::from_secs(1);
        for i in 0..3 {
            assert_eq!(
                pool.next_job_at(later),
                Job::Retire(Box::new(warm(&format!("w{i}"), key("a"))))
            );
        }
        assert_eq!(pool.next_job_at(later), Job::Wait);
    }

    #[test]
    fn each_image_asked_for_lately_keeps_its_own_and_a_forgotten_one_keeps_none() {
        let pool = WarmPool::new(1, 16);
        let now = Instant::now();
        count_creates(&pool, "b", 3, now, Duration::from_millis(1));
        let latest = now + Duration::from_millis(10);
        count_creates(&pool, "a", 1, latest, Duration::ZERO);
        let soon = now + Duration::from_millis(20);
        assert_eq!(
            pool.state().targets(1, 16, soon),
            vec![(key("a"), 2), (key("b"), 4)]
        );
        pool.put(warm("b1", key("b")));
        let forgotten = now + FORGET_AFTER + Duration::from_secs(1);
        assert_eq!(pool.state().targets(1, 16, forgotten), vec![(key("a"), 1)]);
        assert_eq!(
            pool.next_job_at(forgotten),
            Job::Boot(key("a")),
            "the image last asked for comes first"
        );
        pool.put(warm("a1", key("a")));
        assert_eq!(
            pool.next_job_at(forgotten),
            Job::Retire(Box::new(warm("b1", key("b"))))
        );
    }

    #[test]
    fn a_pool_under_half_its_target_refills_after_a_short_pause() {
        let pool = WarmPool::new(4, 4);
        pool.put(warm("w1", key("a")));
        let guard = pool.creating(|_| true);
        assert_eq!(pool.hold_off(Instant::now()), Some(QUIET_WHEN_LOW));
        drop(guard);
        let after = pool.hold_off(Instant::now()).expect("just ended");
        assert!(after <= QUIET_WHEN_LOW);
        assert_eq!(pool.hold_off(Instant::now() + QUIET_WHEN_LOW), None);
    }

    /// A pool at its target with boot "b" under way.
    fn pool_booting() -> WarmPool {
        let pool = WarmPool::new(2, 2);
        pool.put(warm("w1", key("a")));
        pool.put(warm("w2", key("a")));
        pool.boot_started("b");
        pool
    }

    #[test]
    fn a_create_stops_the_boot_under_way_until_creates_are_quiet() {
        let pool = pool_booting();
        let mut held = Vec::new();
        let guard = pool.creating(|name| {
            held.push(name.to_owned());
            true
        });
        assert_eq!(held, ["b"]);
        let now = Instant::now();
        let wait = pool.release_in(now).expect("stopped");
        assert!(
            wait > HOLD_AFTER_CREATE,
            "held while the create runs: {wait:?}"
        );
        drop(guard);
        let ended = Instant::now();
        assert!(pool.release_in(ended).expect("stopped") <= HOLD_AFTER_CREATE);
        assert_eq!(
            pool.release_in(ended + HOLD_AFTER_CREATE),
            Some(Duration::ZERO)
        );
        let mut released = Vec::new();
        pool.release(ended + HOLD_AFTER_CREATE, |name| {
            released.push(name.to_owned())
        });
        assert_eq!(released, ["b"]);
        assert_eq!(pool.release_in(Instant::now()), None, "running again");
        let held = pool.boot_ended(|_| panic!("a running boot is not let go twice"));
        assert!(held >= HOLD_AFTER_CREATE, "{held:?}");
    }

    #[test]
    fn a_pool_under_half_its_target_never_stops_its_boot() {
        let pool = WarmPool::new(4, 4);
        pool.put(warm("w1", key("a")));
        pool.boot_started("b");
        let _guard = pool.creating(|_| panic!("a refill that is needed first was stopped"));
        assert_eq!(pool.release_in(Instant::now()), None);
    }

    #[test]
    fn a_boot_is_stopped_for_creates_at_most_its_budget() {
        let pool = pool_booting();
        let guard = pool.creating(|_| true);
        let start = Instant::now();
        assert_eq!(
            pool.release_in(start + HOLD_BUDGET),
            Some(Duration::ZERO),
            "released while the create still runs"
        );
        pool.release(start + HOLD_BUDGET, |_| {});
        drop(guard);
        let _next = pool.creating(|_| panic!("stopped past its budget"));
        assert_eq!(pool.release_in(Instant::now()), None);
    }

    #[test]
    fn a_boot_that_ends_while_stopped_is_let_go() {
        let pool = pool_booting();
        let _guard = pool.creating(|_| true);
        let mut released = Vec::new();
        pool.boot_ended(|name| released.push(name.to_owned()));
        assert_eq!(released, ["b"]);
        assert_eq!(pool.release_in(Instant::now()), None);
    }

    #[test]
    fn a_boot_that_could_not_be_stopped_is_not_counted_as_stopped() {
        let pool = pool_booting();
        let _guard = pool.creating(|_| false);
        assert_eq!(pool.release_in(Instant::now()), None);
        pool.boot_ended(|_| panic!("nothing to let go"));
    }
}
