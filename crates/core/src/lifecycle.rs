//! A sandbox's status and the transitions between them. The registry keeps the current
//! status of every live sandbox; the store keeps the settled ones (running, paused), so a
//! restarted server knows which sandboxes are paused rather than dead.

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxStatus {
    /// Being launched; counts against the team's limit, not routed to.
    Starting,
    Running,
    /// Being frozen.
    Pausing,
    /// Frozen with its memory; not routed to, not counted against the team's limit, never
    /// expires.
    Paused,
    /// Being thawed.
    Resuming,
    /// Being destroyed; gone for every caller.
    Stopping,
}

impl SandboxStatus {
    pub const ALL: [SandboxStatus; 6] = [
        SandboxStatus::Starting,
        SandboxStatus::Running,
        SandboxStatus::Pausing,
        SandboxStatus::Paused,
        SandboxStatus::Resuming,
        SandboxStatus::Stopping,
    ];

    /// Lower-case name, as logs and metrics labels show it.
    pub fn name(self) -> &'static str {
        match self {
            SandboxStatus::Starting => "starting",
            SandboxStatus::Running => "running",
            SandboxStatus::Pausing => "pausing",
            SandboxStatus::Paused => "paused",
            SandboxStatus::Resuming => "resuming",
            SandboxStatus::Stopping => "stopping",
        }
    }

    /// Whether `self → next` is a transition the lifecycle allows.
    pub fn can_become(self, next: SandboxStatus) -> bool {
        use SandboxStatus::*;
        matches!(
            (self, next),
            (Starting, Running)
                | (Starting, Stopping)
                | (Running, Pausing)
                | (Running, Stopping)
                | (Pausing, Paused)
                // A pause that failed leaves the sandbox running.
                | (Pausing, Running)
                | (Paused, Resuming)
                | (Paused, Stopping)
                | (Resuming, Running)
                // A resume that failed leaves it paused.
                | (Resuming, Paused)
        )
    }

    pub fn can_pause(self) -> bool {
        self.can_become(SandboxStatus::Pausing)
    }

    pub fn can_resume(self) -> bool {
        self.can_become(SandboxStatus::Resuming)
    }

    pub fn can_stop(self) -> bool {
        self.can_become(SandboxStatus::Stopping)
    }

    /// Counted against the team's concurrency limit.
    pub fn holds_a_slot(self) -> bool {
        !matches!(self, SandboxStatus::Paused | SandboxStatus::Stopping)
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxStatus::{self, *};

    const ALL: [SandboxStatus; 6] = SandboxStatus::ALL;

    #[test]
    fn the_transition_table_is_exactly_this() {
        let allowed = [
            (Starting, Running),
            (Starting, Stopping),
            (Running, Pausing),
            (Running, Stopping),
            (Pausing, Paused),
            (Pausing, Running),
            (Paused, Resuming),
            (Paused, Stopping),
            (Resuming, Running),
            (Resuming, Paused),
        ];
        for from in ALL {
            for to in ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn only_running_sandboxes_pause_and_only_paused_ones_resume() {
        assert!(Running.can_pause());
        for s in [Starting, Pausing, Paused, Resuming, Stopping] {
            assert!(!s.can_pause(), "{s:?}");
        }
        assert!(Paused.can_resume());
        for s in [Starting, Running, Pausing, Resuming, Stopping] {
            assert!(!s.can_resume(), "{s:?}");
        }
    }

    #[test]
    fn transitional_states_cannot_be_stopped_midway() {
        assert!(!Pausing.can_stop());
        assert!(!Resuming.can_stop());
        assert!(!Stopping.can_stop());
        assert!(Running.can_stop() && Paused.can_stop() && Starting.can_stop());
    }

    #[test]
    fn paused_sandboxes_free_their_slot() {
        assert!(!Paused.holds_a_slot());
        assert!(Running.holds_a_slot() && Starting.holds_a_slot() && Resuming.holds_a_slot());
    }
}
