//! Task admission: a sandbox's `pids.max` is a ceiling, like its memory limit, and idle
//! sandboxes hold one or two tasks each. What runs out on a host is the kernel's table of
//! tasks (`kernel.pid_max`, `kernel.threads-max`), shared by everything on it; a new sandbox
//! is refused while the host's tasks are within a reserve of that limit, so a sandbox that
//! forks without end cannot leave the host unable to start a process.

/// Tasks a sandbox's start needs: its boot process, its agent and the agent's threads.
pub const START_COST: u64 = 16;

/// The host's tasks as counted now, and how many it can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTasks {
    pub running: u64,
    pub limit: u64,
}

impl HostTasks {
    /// The tasks running now, against `limit` (see [`task_limit`]).
    pub fn read(limit: u64) -> Option<Self> {
        let loadavg = std::fs::read_to_string("/proc/loadavg").ok()?;
        Some(Self {
            running: parse_loadavg(&loadavg)?,
            limit,
        })
    }

    /// Tasks kept for the host: a twentieth of the limit, at least 1,024.
    pub fn reserve(&self) -> u64 {
        (self.limit / 20).max(1024)
    }

    /// Whether a sandbox may start; the refusal names what is short.
    pub fn admit(&self) -> Result<(), TasksRefusal> {
        let room = self.limit.saturating_sub(self.reserve());
        if self.running + START_COST > room {
            return Err(TasksRefusal {
                running: self.running,
                limit: self.limit,
                reserve: self.reserve(),
            });
        }
        Ok(())
    }
}

/// The host's task table is too full to start another sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "this node runs {running} tasks of the {limit} it can have and keeps {reserve} for itself, too few to start a sandbox; try again when sandboxes end"
)]
pub struct TasksRefusal {
    pub running: u64,
    pub limit: u64,
    pub reserve: u64,
}

/// How many tasks the kernel allows: the lower of `kernel.pid_max` and
/// `kernel.threads-max`, which change only when an operator sets them.
pub fn task_limit() -> Option<u64> {
    ["/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok()?.trim().parse().ok())
        .min()
}

/// The number of tasks in `/proc/loadavg` (`running/total` is the fourth field).
fn parse_loadavg(text: &str) -> Option<u64> {
    text.split_whitespace()
        .nth(3)?
        .split('/')
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_task_count() {
        assert_eq!(parse_loadavg("0.52 0.58 0.59 2/1234 56789\n"), Some(1234));
        assert_eq!(parse_loadavg("0.52 0.58"), None);
    }

    #[test]
    fn a_host_near_its_task_limit_refuses_naming_it() {
        let limit = 32_768;
        let reserve = HostTasks { running: 0, limit }.reserve();
        assert_eq!(reserve, 1638);
        let last = limit - reserve - START_COST;
        assert_eq!(
            HostTasks {
                running: last,
                limit
            }
            .admit(),
            Ok(())
        );
        let refused = HostTasks {
            running: last + 1,
            limit,
        }
        .admit()
        .expect_err("refused")
        .to_string();
        assert!(refused.contains("tasks of the 32768"), "{refused}");
    }

    #[test]
    fn a_small_limit_still_keeps_a_thousand_tasks() {
        assert_eq!(
            HostTasks {
                running: 0,
                limit: 4096
            }
            .reserve(),
            1024
        );
    }

    #[test]
    fn this_host_can_be_read() {
        let limit = task_limit().expect("the kernel's task limits");
        let tasks = HostTasks::read(limit).expect("/proc/loadavg");
        assert!(
            tasks.running > 0 && tasks.limit > tasks.running,
            "{tasks:?}"
        );
    }
}
