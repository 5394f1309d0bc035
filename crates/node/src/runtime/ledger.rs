//! The node's resource ledger: the memory granted to sandboxes, the admission of new starts
//! against the host's memory and tasks, and the sandboxes' out-of-memory kills. Disk admission
//! is the pool's (`crate::storage::disks`), asked from here so every start passes one place.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sandbar_core::RuntimeError;

use crate::resources::memory::{HostMemory, MemoryRule};
use crate::resources::tasks::HostTasks;

/// Why the node cannot start another sandbox now.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(super) enum Refusal {
    #[error(transparent)]
    Memory(#[from] crate::resources::memory::MemoryRefusal),
    #[error(transparent)]
    Tasks(#[from] crate::resources::tasks::TasksRefusal),
}

impl Refusal {
    /// The runtime's answer to a start of sandbox `id` refused for this reason.
    pub(super) fn of_sandbox(self, id: &str) -> RuntimeError {
        RuntimeError::NoCapacity {
            sandbox_id: id.to_owned(),
            message: self.to_string(),
        }
    }
}

/// What the node has promised to live sandboxes, and the rule for promising more.
#[derive(Debug)]
pub(super) struct ResourceLedger {
    /// Memory granted to live sandboxes, by sandbox id.
    granted: Mutex<BTreeMap<String, Granted>>,
    /// The last grant's ticket.
    tickets: AtomicU64,
    /// Kills counted for sandboxes that let their memory go since this server started.
    oom_kills_ended: AtomicU64,
    memory_rule: MemoryRule,
    /// How many tasks the kernel allows (`crate::resources::tasks`), read once at start.
    pub(super) task_limit: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Granted {
    memory_mb: u32,
    /// The sandbox's cgroup out-of-memory kill count when it was granted memory (a restored
    /// or adopted sandbox's cgroup may have counted some before).
    oom_baseline: u64,
    /// Which [`MemoryGrant`] holds it: a later grant for the same sandbox replaces it, and
    /// the earlier one's drop must not take the later one back.
    ticket: u64,
}

/// Memory granted to one sandbox, given back when dropped (or by [`MemoryGrant::give_back`],
/// which also counts the sandbox's out-of-memory kills since the grant).
#[derive(Debug)]
pub(super) struct MemoryGrant {
    ledger: Arc<ResourceLedger>,
    sandbox_id: String,
    ticket: u64,
}

impl MemoryGrant {
    /// Gives the memory back; `oom_kills_now` is the sandbox's cgroup count, if still
    /// readable, whose kills since the grant go to the ended total.
    pub(super) fn give_back(self, oom_kills_now: Option<u64>) {
        self.ledger
            .release(&self.sandbox_id, self.ticket, oom_kills_now);
        // Released just above: the drop would find nothing of this ticket left.
    }
}

impl Drop for MemoryGrant {
    fn drop(&mut self) {
        self.ledger.release(&self.sandbox_id, self.ticket, None);
    }
}

impl ResourceLedger {
    pub(super) fn new(memory_rule: MemoryRule, task_limit: Option<u64>) -> Self {
        ResourceLedger {
            granted: Mutex::new(BTreeMap::new()),
            tickets: AtomicU64::new(0),
            oom_kills_ended: AtomicU64::new(0),
            memory_rule,
            task_limit,
        }
    }

    pub(super) fn memory_rule(&self) -> &MemoryRule {
        &self.memory_rule
    }

    /// Grants sandbox `id` a memory limit of `memory_mb` if the host, as `host` and `tasks`
    /// describe it, can start it; `oom_kills_now` is its cgroup's kill count so far.
    pub(super) fn grant(
        self: &Arc<Self>,
        id: &str,
        memory_mb: u32,
        host: Option<&HostMemory>,
        tasks: Option<HostTasks>,
        oom_kills_now: u64,
    ) -> Result<MemoryGrant, Refusal> {
        let mut granted = self.granted.lock().unwrap_or_else(|e| e.into_inner());
        let others = granted
            .iter()
            .filter(|(other, _)| other.as_str() != id)
            .map(|(_, g)| u64::from(g.memory_mb))
            .sum();
        self.admit(host, tasks, others, memory_mb)?;
        Ok(self.record(&mut granted, id, memory_mb, oom_kills_now))
    }

    /// Records a grant made by an earlier server (an adopted sandbox): no admission.
    pub(super) fn regrant(
        self: &Arc<Self>,
        id: &str,
        memory_mb: u32,
        oom_kills_now: u64,
    ) -> MemoryGrant {
        let mut granted = self.granted.lock().unwrap_or_else(|e| e.into_inner());
        self.record(&mut granted, id, memory_mb, oom_kills_now)
    }

    fn record(
        self: &Arc<Self>,
        granted: &mut BTreeMap<String, Granted>,
        id: &str,
        memory_mb: u32,
        oom_baseline: u64,
    ) -> MemoryGrant {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed) + 1;
        granted.insert(
            id.to_owned(),
            Granted {
                memory_mb,
                oom_baseline,
                ticket,
            },
        );
        MemoryGrant {
            ledger: Arc::clone(self),
            sandbox_id: id.to_owned(),
            ticket,
        }
    }

    /// Whether a start with a memory limit of `memory_mb` fits beside what is promised.
    pub(super) fn admit_beside_promised(
        &self,
        host: Option<&HostMemory>,
        tasks: Option<HostTasks>,
        memory_mb: u32,
    ) -> Result<(), Refusal> {
        self.admit(host, tasks, self.promised_mb(), memory_mb)
    }

    fn admit(
        &self,
        host: Option<&HostMemory>,
        tasks: Option<HostTasks>,
        promised: u64,
        memory_mb: u32,
    ) -> Result<(), Refusal> {
        if let Some(host) = host {
            self.memory_rule.admit(host, promised, memory_mb)?;
        }
        if let Some(tasks) = tasks {
            tasks.admit()?;
        }
        Ok(())
    }

    /// The memory limits granted to live sandboxes together, in MiB.
    pub(super) fn promised_mb(&self) -> u64 {
        promised_mb(&self.granted.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Takes back the grant `ticket` of sandbox `id`, if it is still the sandbox's.
    fn release(&self, id: &str, ticket: u64, oom_kills_now: Option<u64>) {
        let mut granted = self.granted.lock().unwrap_or_else(|e| e.into_inner());
        if granted.get(id).is_none_or(|g| g.ticket != ticket) {
            return;
        }
        let Some(ended) = granted.remove(id) else {
            return;
        };
        if let Some(now) = oom_kills_now {
            self.oom_kills_ended
                .fetch_add(now.saturating_sub(ended.oom_baseline), Ordering::Relaxed);
        }
    }

    /// Kills of sandboxes since this server started: those of ended grants and, for live
    /// ones, their count now (`count_now`) less their count at the grant.
    pub(super) fn oom_kills(&self, count_now: impl Fn(&str) -> Option<u64>) -> u64 {
        let baselines: Vec<(String, u64)> = self
            .granted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(id, g)| (id.clone(), g.oom_baseline))
            .collect();
        let live: u64 = baselines
            .iter()
            .filter_map(|(id, baseline)| Some(count_now(id)?.saturating_sub(*baseline)))
            .sum();
        self.oom_kills_ended.load(Ordering::Relaxed) + live
    }
}

#[cfg(test)]
impl ResourceLedger {
    /// A ledger that keeps no memory back, promises it once and minds no pressure: for
    /// tests whose host has room for all they launch.
    pub(super) fn unreserved() -> Arc<Self> {
        Arc::new(ResourceLedger::new(
            MemoryRule {
                reserve_mb: 0,
                overcommit: 1,
                pressure_limit_percent: 100.0,
            },
            None,
        ))
    }
}

fn promised_mb(granted: &BTreeMap<String, Granted>) -> u64 {
    granted.values().map(|g| u64::from(g.memory_mb)).sum()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::resources::memory::{HostMemory, MemoryRule};
    use crate::resources::tasks::HostTasks;

    use super::{MemoryGrant, Refusal, ResourceLedger};

    fn rule() -> MemoryRule {
        MemoryRule {
            reserve_mb: 1024,
            overcommit: 2,
            pressure_limit_percent: 20.0,
        }
    }

    fn host(total_mb: u64, available_mb: u64) -> HostMemory {
        HostMemory {
            total_mb,
            available_mb,
            stalled_percent: Some(0.0),
        }
    }

    #[test]
    fn grants_add_up_until_the_promise_limit() {
        let ledger = Arc::new(ResourceLedger::new(rule(), None));
        let host = host(5120, 4096);
        // (5120 - 1024) × 2 = 8192 MiB may be promised.
        let mut grants: Vec<MemoryGrant> = (0..16)
            .map(|i| {
                ledger
                    .grant(&format!("s{i}"), 512, Some(&host), None, 0)
                    .expect("room for 16 × 512 MiB")
            })
            .collect();
        assert_eq!(ledger.promised_mb(), 8192);
        let refused = ledger
            .grant("one-more", 512, Some(&host), None, 0)
            .expect_err("past the limit");
        assert!(refused.to_string().contains("8192 MiB"), "{refused}");
        drop(grants.remove(0));
        let _one_more = ledger
            .grant("one-more", 512, Some(&host), None, 0)
            .expect("a release makes room");
        drop(grants);
        assert_eq!(ledger.promised_mb(), 512);
    }

    #[test]
    fn a_refused_grant_records_nothing() {
        let ledger = Arc::new(ResourceLedger::new(rule(), None));
        let short = host(5120, 100);
        let refused = ledger
            .grant("s", 512, Some(&short), None, 0)
            .expect_err("too little memory available");
        assert!(refused.to_string().contains("MiB"), "{refused}");
        assert_eq!(ledger.promised_mb(), 0);
        assert_eq!(ledger.oom_kills(|_| Some(7)), 0);
    }

    #[test]
    fn too_many_tasks_refuse_a_start() {
        let ledger = ResourceLedger::new(rule(), Some(32768));
        let crowded = HostTasks {
            running: 32000,
            limit: 32768,
        };
        let refused = ledger
            .admit_beside_promised(None, Some(crowded), 0)
            .expect_err("too few tasks left");
        assert!(matches!(refused, Refusal::Tasks(_)), "{refused}");
    }

    #[test]
    fn oom_kills_count_from_the_grant_and_survive_the_release() {
        let ledger = Arc::new(ResourceLedger::new(rule(), None));
        let a = ledger.regrant("a", 256, 3);
        let _b = ledger.regrant("b", 256, 0);
        assert_eq!(
            ledger.oom_kills(|id| Some(if id == "a" { 5 } else { 1 })),
            3
        );
        a.give_back(Some(6));
        assert_eq!(ledger.oom_kills(|_| Some(1)), 3 + 1);
        assert_eq!(ledger.promised_mb(), 256);
    }

    #[test]
    fn an_earlier_grant_dropped_leaves_the_later_one_of_the_same_sandbox() {
        let ledger = Arc::new(ResourceLedger::new(rule(), None));
        let host = host(5120, 4096);
        let first = ledger.grant("s", 512, Some(&host), None, 0).expect("room");
        // A second grant for the same sandbox replaces the first rather than adding to it.
        let second = ledger.grant("s", 1024, Some(&host), None, 0).expect("room");
        assert_eq!(ledger.promised_mb(), 1024);
        drop(first);
        assert_eq!(ledger.promised_mb(), 1024);
        drop(second);
        assert_eq!(ledger.promised_mb(), 0);
    }
}
