//! What the server's sampling last found of each sandbox, so that a host full of idle
//! sandboxes costs one small read each per round instead of a dozen path walks.
//!
//! Every few seconds the server reads each sandbox's use (CPU, memory, OOM kills, its disk's
//! qgroup) and the new lines of its agent log. In full that is about ten opens per sandbox:
//! at a thousand sandboxes, thousands of path walks through cgroupfs, sysfs and btrfs a
//! second, contending for the kernel's locks with the creates in flight. Most sandboxes on a
//! full host are idle, and one cheap read tells which are not:
//!
//! - Use: a sandbox whose CPU time has not moved has not allocated, written or been killed
//!   (a killed process's exit runs in its cgroup too), so its last full reading still holds.
//!   Page cache the host reclaims from it and a disk commit that lands late are picked up by
//!   a full reading at least every [`FULL_READING_EVERY`].
//! - Agent log: the agent only appends, and only the node rotates it, so a log whose size and
//!   modification time are those of the last read that reached its end holds nothing new.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use sandbar_core::runtime::RuntimeStats;

/// The longest a sandbox goes without a full reading of its use, even when idle.
pub(super) const FULL_READING_EVERY: Duration = Duration::from_secs(30);

/// How long a sandbox's memo outlives the last time it was asked for: well past the
/// sampling period, so only sandboxes no longer sampled (gone) lose theirs.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// One value per sandbox, dropped once nobody asked for it for [`FORGET_AFTER`].
#[derive(Debug)]
struct SandboxMemo<V> {
    inner: Mutex<Memo<V>>,
}

#[derive(Debug)]
struct Memo<V> {
    by_sandbox: HashMap<String, (V, Instant)>,
    last_pruned: Option<Instant>,
}

impl<V> Default for SandboxMemo<V> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Memo {
                by_sandbox: HashMap::new(),
                last_pruned: None,
            }),
        }
    }
}

impl<V: Copy> SandboxMemo<V> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Memo<V>> {
        // A panic while the map was held leaves it consistent: entries are replaced whole.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The sandbox's value, marked as asked for at `now`.
    fn get(&self, sandbox_id: &str, now: Instant) -> Option<V> {
        let mut memo = self.lock();
        let (value, asked) = memo.by_sandbox.get_mut(sandbox_id)?;
        *asked = now;
        Some(*value)
    }

    fn put(&self, sandbox_id: &str, value: V, now: Instant) {
        let mut memo = self.lock();
        memo.by_sandbox.insert(sandbox_id.to_owned(), (value, now));
        // At most one pass over the map per period, whatever the number of sandboxes.
        if memo
            .last_pruned
            .is_none_or(|at| now.saturating_duration_since(at) >= FORGET_AFTER)
        {
            memo.last_pruned = Some(now);
            memo.by_sandbox
                .retain(|_, (_, asked)| now.saturating_duration_since(*asked) < FORGET_AFTER);
        }
    }

    fn forget(&self, sandbox_id: &str) {
        self.lock().by_sandbox.remove(sandbox_id);
    }

    #[cfg(test)]
    fn ids(&self) -> Vec<String> {
        self.lock().by_sandbox.keys().cloned().collect()
    }
}

/// Each sandbox's last full reading of its use.
#[derive(Debug, Default)]
pub(super) struct UsageReadings {
    memo: SandboxMemo<(RuntimeStats, Instant)>,
}

impl UsageReadings {
    /// The sandbox's use at `now`: its last full reading when `cpu_ns` (its CPU time now) has
    /// not moved since and that reading is recent, a new one from `read_in_full` (given that
    /// CPU time, so it is read once) otherwise. `None` when the sandbox is gone.
    pub(super) fn read(
        &self,
        sandbox_id: &str,
        now: Instant,
        cpu_ns: Option<u64>,
        read_in_full: impl FnOnce(u64) -> Option<RuntimeStats>,
    ) -> Option<RuntimeStats> {
        let cpu_ns = cpu_ns?;
        if let Some((stats, at)) = self.memo.get(sandbox_id, now)
            && stats.cpu_ns == cpu_ns
            && now.saturating_duration_since(at) < FULL_READING_EVERY
        {
            return Some(stats);
        }
        let Some(stats) = read_in_full(cpu_ns) else {
            self.memo.forget(sandbox_id);
            return None;
        };
        self.memo.put(sandbox_id, (stats, now), now);
        Some(stats)
    }
}

/// A log file as `stat` shows it: the agent appends, so any write changes one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LogShape {
    pub(super) len: u64,
    pub(super) modified: SystemTime,
}

/// Where each sandbox's last read of its agent log ended, and the file as it was then.
#[derive(Debug, Default)]
pub(super) struct LogMarks {
    memo: SandboxMemo<(LogShape, u64)>,
}

impl LogMarks {
    /// Whether a read from `offset` of a log now shaped `shape` would find nothing: the last
    /// read reached the end of the file at this very shape and ended at `offset`.
    pub(super) fn nothing_new(
        &self,
        sandbox_id: &str,
        now: Instant,
        shape: LogShape,
        offset: u64,
    ) -> bool {
        self.memo
            .get(sandbox_id, now)
            .is_some_and(|(seen, end)| seen == shape && end == offset)
    }

    /// Records a read that reached the end of a log shaped `shape` (taken before the read;
    /// an append in between changes the shape, so the next read goes to the file) at `end`.
    pub(super) fn read_to_end(&self, sandbox_id: &str, now: Instant, shape: LogShape, end: u64) {
        self.memo.put(sandbox_id, (shape, end), now);
    }

    pub(super) fn forget(&self, sandbox_id: &str) {
        self.memo.forget(sandbox_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(cpu_ns: u64, memory_used: u64) -> RuntimeStats {
        RuntimeStats {
            cpu_ns,
            memory_used,
            ..RuntimeStats::default()
        }
    }

    #[test]
    fn an_idle_sandbox_is_read_in_full_once_per_period() {
        let readings = UsageReadings::default();
        let start = Instant::now();
        let first = readings.read("a", start, Some(10), |_| Some(stats(10, 1)));
        assert_eq!(first, Some(stats(10, 1)));
        let later = start + Duration::from_secs(2);
        let kept = readings.read("a", later, Some(10), |_| panic!("read in full while idle"));
        assert_eq!(kept, Some(stats(10, 1)));
        let due = start + FULL_READING_EVERY;
        assert_eq!(
            readings.read("a", due, Some(10), |_| Some(stats(10, 2))),
            Some(stats(10, 2))
        );
    }

    #[test]
    fn a_sandbox_that_used_cpu_is_read_in_full() {
        let readings = UsageReadings::default();
        let start = Instant::now();
        readings.read("a", start, Some(10), |_| Some(stats(10, 1)));
        // The full reading is handed the CPU time already read rather than reading it again.
        let moved = readings.read("a", start + Duration::from_secs(2), Some(11), |cpu_ns| {
            Some(stats(cpu_ns, 5))
        });
        assert_eq!(moved, Some(stats(11, 5)));
    }

    #[test]
    fn a_gone_sandbox_reads_nothing_and_is_forgotten() {
        let readings = UsageReadings::default();
        let start = Instant::now();
        readings.read("a", start, Some(10), |_| Some(stats(10, 1)));
        assert_eq!(
            readings.read("a", start, None, |_| Some(stats(10, 1))),
            None
        );
        let soon = start + Duration::from_secs(1);
        assert_eq!(readings.read("a", soon, Some(12), |_| None), None);
        assert!(readings.memo.ids().is_empty());
    }

    #[test]
    fn memos_of_sandboxes_no_longer_asked_for_are_dropped() {
        let memo = SandboxMemo::default();
        let start = Instant::now();
        memo.put("gone", 1, start);
        memo.put("live", 1, start);
        let later = start + FORGET_AFTER / 2;
        assert_eq!(memo.get("live", later), Some(1));
        memo.put("new", 1, start + FORGET_AFTER + Duration::from_secs(1));
        let mut kept = memo.ids();
        kept.sort();
        assert_eq!(kept, vec!["live".to_owned(), "new".to_owned()]);
    }

    #[test]
    fn a_log_is_unchanged_only_at_the_shape_and_offset_its_last_read_ended() {
        let marks = LogMarks::default();
        let now = Instant::now();
        let shape = LogShape {
            len: 100,
            modified: SystemTime::UNIX_EPOCH + Duration::from_secs(5),
        };
        assert!(!marks.nothing_new("a", now, shape, 100), "never read");
        marks.read_to_end("a", now, shape, 100);
        assert!(marks.nothing_new("a", now, shape, 100));
        // The server kept a partial line back: it asks from before it.
        assert!(!marks.nothing_new("a", now, shape, 90));
        let appended = LogShape { len: 120, ..shape };
        assert!(!marks.nothing_new("a", now, appended, 100));
        let rewritten = LogShape {
            modified: shape.modified + Duration::from_nanos(1),
            ..shape
        };
        assert!(!marks.nothing_new("a", now, rewritten, 100));
        marks.forget("a");
        assert!(!marks.nothing_new("a", now, shape, 100));
    }
}
