//! A sandbox's status and the transitions between them. The registry keeps the current
//! status of every live sandbox; the store keeps the same status for those a restart must
//! see ([`SandboxStatus::is_recorded`]), so a restarted server knows which sandboxes are
//! paused, and how, rather than dead, and finishes a checkpoint or release it died in.

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
    /// Paused without memory: its processes ended and its network slot and memory were
    /// released; only its files are kept. Resuming boots it again on them.
    Shelved,
    /// Being thawed, or booted again on its kept files.
    Resuming,
    /// Paused, being written to disk (a checkpoint) while frozen.
    Checkpointing,
    /// Paused on disk: its processes and their memory are in a checkpoint, they hold no
    /// memory on the host.
    Checkpointed,
    /// Being restored from its checkpoint.
    Restoring,
    /// Running, held still for a moment while its files and memory are copied into a
    /// snapshot; it runs on afterwards.
    Snapshotting,
    /// Being destroyed; gone for every caller.
    Stopping,
}

impl SandboxStatus {
    pub const ALL: [SandboxStatus; 11] = [
        SandboxStatus::Starting,
        SandboxStatus::Running,
        SandboxStatus::Pausing,
        SandboxStatus::Paused,
        SandboxStatus::Shelved,
        SandboxStatus::Resuming,
        SandboxStatus::Checkpointing,
        SandboxStatus::Checkpointed,
        SandboxStatus::Restoring,
        SandboxStatus::Snapshotting,
        SandboxStatus::Stopping,
    ];

    /// Lower-case name, as logs and metrics labels show it.
    pub fn name(self) -> &'static str {
        match self {
            SandboxStatus::Starting => "starting",
            SandboxStatus::Running => "running",
            SandboxStatus::Pausing => "pausing",
            SandboxStatus::Paused => "paused",
            SandboxStatus::Shelved => "shelved",
            SandboxStatus::Resuming => "resuming",
            SandboxStatus::Checkpointing => "checkpointing",
            SandboxStatus::Checkpointed => "checkpointed",
            SandboxStatus::Restoring => "restoring",
            SandboxStatus::Snapshotting => "snapshotting",
            SandboxStatus::Stopping => "stopping",
        }
    }

    /// The status named `name` (as [`Self::name`] gives it).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Whether the store records this status when a sandbox enters it. The settled ones do,
    /// and checkpointing, so a restart after a crash mid-dump looks at what the dump left. A
    /// stored `pausing` is a pause without memory under way (its processes being ended to
    /// keep its files), which a restart finishes; it is written only by that release, since
    /// a pause with memory is recorded once frozen. The other transient statuses are not
    /// recorded: a restart finds the sandbox as it was before them.
    pub fn is_recorded(self) -> bool {
        matches!(
            self,
            SandboxStatus::Running
                | SandboxStatus::Paused
                | SandboxStatus::Shelved
                | SandboxStatus::Checkpointing
                | SandboxStatus::Checkpointed
        )
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
                | (Pausing, Shelved)
                | (Paused, Resuming)
                | (Paused, Stopping)
                | (Shelved, Resuming)
                | (Shelved, Stopping)
                | (Resuming, Running)
                // A resume that failed leaves it paused, the way it was.
                | (Resuming, Paused)
                | (Resuming, Shelved)
                | (Paused, Checkpointing)
                | (Checkpointing, Checkpointed)
                // A checkpoint that failed leaves it frozen in memory.
                | (Checkpointing, Paused)
                | (Checkpointed, Restoring)
                | (Checkpointed, Stopping)
                | (Restoring, Running)
                // A restore that failed leaves it checkpointed.
                | (Restoring, Checkpointed)
                // A restore whose memory was dropped (a resume without it) or cannot be
                // restored any more (after a restart) wakes on the files alone; failing that,
                // the files are what is left.
                | (Restoring, Shelved)
                // Whether the snapshot succeeded or not.
                | (Running, Snapshotting)
                | (Snapshotting, Running)
                // A destroy that failed leaves the sandbox as it was.
                | (Stopping, Running)
                | (Stopping, Paused)
                | (Stopping, Shelved)
                | (Stopping, Checkpointed)
        )
    }

    /// The statuses a sandbox passes through from `self` to `to`, `to` last, by the fewest
    /// transitions the table allows; empty when it is there already, `None` when it cannot
    /// get there. After a restart, recovery moves a sandbox from what the store recorded to
    /// what its processes show this way.
    pub fn path_to(self, to: SandboxStatus) -> Option<Vec<SandboxStatus>> {
        let mut came_from: Vec<(SandboxStatus, SandboxStatus)> = Vec::new();
        let mut frontier = std::collections::VecDeque::from([self]);
        let mut seen = vec![self];
        while let Some(at) = frontier.pop_front() {
            if at == to {
                let mut path = Vec::new();
                let mut step = at;
                while step != self {
                    path.push(step);
                    step = came_from.iter().find(|(next, _)| *next == step)?.1;
                }
                path.reverse();
                return Some(path);
            }
            for next in Self::ALL.into_iter().filter(|next| at.can_become(*next)) {
                if !seen.contains(&next) {
                    seen.push(next);
                    came_from.push((next, at));
                    frontier.push_back(next);
                }
            }
        }
        None
    }

    pub fn can_pause(self) -> bool {
        self.can_become(SandboxStatus::Pausing)
    }

    pub fn can_resume(self) -> bool {
        self.can_become(SandboxStatus::Resuming)
    }

    pub fn can_snapshot(self) -> bool {
        self.can_become(SandboxStatus::Snapshotting)
    }

    /// Whether traffic goes through to it. Not while a snapshot is taken: a connection to
    /// the agent made then would be in the dump; requests wait for it instead.
    pub fn is_routable(self) -> bool {
        self == SandboxStatus::Running
    }

    pub fn can_stop(self) -> bool {
        self.can_become(SandboxStatus::Stopping)
    }

    /// On its way from one settled status to another: whoever wants it settled (a kill, a
    /// connect) waits for it rather than fail.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            SandboxStatus::Starting
                | SandboxStatus::Pausing
                | SandboxStatus::Resuming
                | SandboxStatus::Checkpointing
                | SandboxStatus::Restoring
                | SandboxStatus::Snapshotting
        )
    }

    /// Counted against the team's concurrency limit.
    pub fn holds_a_slot(self) -> bool {
        !matches!(
            self,
            SandboxStatus::Paused
                | SandboxStatus::Shelved
                | SandboxStatus::Checkpointing
                | SandboxStatus::Checkpointed
                | SandboxStatus::Stopping
        )
    }

    /// Paused in any way: listed as paused.
    pub fn is_paused(self) -> bool {
        matches!(
            self,
            SandboxStatus::Paused
                | SandboxStatus::Shelved
                | SandboxStatus::Checkpointing
                | SandboxStatus::Checkpointed
        )
    }

    /// The status a resume goes through from `self`, if it may start now.
    pub fn waking(self) -> Option<SandboxStatus> {
        [SandboxStatus::Resuming, SandboxStatus::Restoring]
            .into_iter()
            .find(|to| self.can_become(*to))
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxStatus::{self, *};

    const ALL: [SandboxStatus; 11] = SandboxStatus::ALL;

    /// What each status may become, in the order of `ALL`.
    const BECOMES: [(SandboxStatus, &[SandboxStatus]); 11] = [
        // A starting sandbox runs or stops.
        (Starting, &[Running, Stopping]),
        // A running sandbox pauses, snapshots or stops.
        (Running, &[Pausing, Snapshotting, Stopping]),
        // A pause ends frozen, released or running again.
        (Pausing, &[Paused, Shelved, Running]),
        // A frozen sandbox resumes, checkpoints or stops.
        (Paused, &[Resuming, Checkpointing, Stopping]),
        // A sandbox paused without its memory resumes or stops.
        (Shelved, &[Resuming, Stopping]),
        // A resume ends running, or paused as it was.
        (Resuming, &[Running, Paused, Shelved]),
        // A checkpoint ends on disk, or frozen in memory.
        (Checkpointing, &[Checkpointed, Paused]),
        // A checkpointed sandbox restores or stops.
        (Checkpointed, &[Restoring, Stopping]),
        // A restore ends running, checkpointed or with its files.
        (Restoring, &[Running, Checkpointed, Shelved]),
        // A snapshot ends running.
        (Snapshotting, &[Running]),
        // A failed stop leaves a settled status.
        (Stopping, &[Running, Paused, Shelved, Checkpointed]),
    ];

    #[test]
    fn the_transition_table_is_exactly_this() {
        assert_eq!(BECOMES.map(|(from, _)| from), ALL);
        for (from, allowed) in BECOMES {
            for to in ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&to),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn a_failed_stop_leaves_a_settled_status() {
        for s in ALL.into_iter().filter(|s| Stopping.can_become(*s)) {
            assert!(!s.is_transient() && s.can_stop(), "{s:?}");
        }
    }

    #[test]
    fn only_running_sandboxes_pause_and_only_paused_ones_resume() {
        assert!(Running.can_pause());
        for s in ALL.into_iter().filter(|s| *s != Running) {
            assert!(!s.can_pause(), "{s:?}");
        }
        assert!(Paused.can_resume() && Shelved.can_resume());
        assert_eq!(Paused.waking(), Some(Resuming));
        assert_eq!(Shelved.waking(), Some(Resuming));
        assert_eq!(Checkpointed.waking(), Some(Restoring));
        for s in [
            Starting,
            Running,
            Pausing,
            Resuming,
            Checkpointing,
            Restoring,
            Snapshotting,
            Stopping,
        ] {
            assert_eq!(s.waking(), None, "{s:?}");
            assert!(!s.can_resume(), "{s:?}");
        }
    }

    #[test]
    fn paths_take_the_fewest_transitions() {
        assert_eq!(Running.path_to(Running), Some(vec![]));
        assert_eq!(Pausing.path_to(Shelved), Some(vec![Shelved]));
        assert_eq!(Paused.path_to(Running), Some(vec![Resuming, Running]));
        assert_eq!(Running.path_to(Paused), Some(vec![Pausing, Paused]));
        assert_eq!(
            Checkpointed.path_to(Shelved),
            Some(vec![Restoring, Shelved])
        );
        assert_eq!(Checkpointing.path_to(Running).map(|p| p.len()), Some(3));
        // Nothing comes back to starting: it is where a sandbox enters the registry.
        assert_eq!(Running.path_to(Starting), None);
        for from in ALL {
            for to in ALL
                .into_iter()
                .filter(|to| *to != Starting || from == Starting)
            {
                let path = from
                    .path_to(to)
                    .expect("every status but starting is reachable");
                let mut at = from;
                for next in path {
                    assert!(at.can_become(next), "{at:?} -> {next:?}");
                    at = next;
                }
                assert_eq!(at, to);
            }
        }
    }

    #[test]
    fn transitional_states_cannot_be_stopped_midway() {
        assert!(!Pausing.can_stop());
        assert!(!Resuming.can_stop());
        assert!(!Stopping.can_stop());
        assert!(!Checkpointing.can_stop() && !Restoring.can_stop());
        assert!(Checkpointed.can_stop());
        assert!(Running.can_stop() && Paused.can_stop() && Starting.can_stop());
        assert!(Shelved.can_stop());
    }

    #[test]
    fn every_status_that_cannot_be_stopped_is_on_its_way_to_one_that_can() {
        assert!(!Stopping.is_transient());
        for s in ALL.into_iter().filter(|s| *s != Stopping && !s.can_stop()) {
            assert!(s.is_transient(), "{s:?}");
        }
        // A sandbox still starting could be stopped, but its create would run on over it.
        assert!(Starting.is_transient());
        for s in [Running, Paused, Shelved, Checkpointed] {
            assert!(!s.is_transient(), "{s:?}");
        }
    }

    #[test]
    fn only_running_sandboxes_are_snapshotted_and_they_stay_reachable() {
        assert!(Running.can_snapshot());
        for s in ALL.into_iter().filter(|s| *s != Running) {
            assert!(!s.can_snapshot(), "{s:?}");
        }
        assert!(!Snapshotting.can_stop() && !Snapshotting.can_pause());
        assert!(Snapshotting.holds_a_slot() && !Snapshotting.is_paused());
        assert!(!Snapshotting.is_routable() && Running.is_routable());
        assert!(!Paused.is_routable() && !Starting.is_routable());
    }

    #[test]
    fn every_status_reads_back_by_its_name() {
        for s in ALL {
            assert_eq!(SandboxStatus::parse(s.name()), Some(s));
        }
        assert_eq!(SandboxStatus::parse("frozen"), None);
    }

    #[test]
    fn settled_statuses_and_checkpointing_are_recorded() {
        for s in ALL {
            let recorded = !s.is_transient() && s != Stopping || s == Checkpointing;
            assert_eq!(s.is_recorded(), recorded, "{s:?}");
        }
    }

    #[test]
    fn paused_sandboxes_free_their_slot() {
        assert!(!Paused.holds_a_slot() && !Shelved.holds_a_slot());
        assert!(!Checkpointing.holds_a_slot() && !Checkpointed.holds_a_slot());
        assert!(Restoring.holds_a_slot());
        assert!(Running.holds_a_slot() && Starting.holds_a_slot() && Resuming.holds_a_slot());
    }
}
