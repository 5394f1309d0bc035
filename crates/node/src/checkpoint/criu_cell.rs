//! CRIU as the node knows it now. The server probes CRIU at start; one installed later
//! (`scripts/install-criu.sh` run while the server runs) is noticed the next time a
//! checkpoint, restore, snapshot or fork needs it, by probing again at most once per period
//! (`--criu-reprobe-secs`, 30 s by default), so that a missing CRIU costs a failed `exec` now
//! and then, not one per request.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::checkpoint::Criu;

/// Whether a probe may run now: at most one per period, whoever asks.
#[derive(Debug)]
struct ProbeSchedule {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl ProbeSchedule {
    fn new(every: Duration, last: Option<Instant>) -> Self {
        Self {
            every,
            last: Mutex::new(last),
        }
    }

    /// True, once per period, for the caller that is to probe; the others are told no at
    /// once rather than wait for that probe.
    fn claim(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some(at) if now.saturating_duration_since(at) < self.every => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// The CRIU that passed its probe, if any, and how to probe again.
#[derive(Debug)]
pub struct CriuCell(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    /// The configured binary; `None` when checkpoints were turned off.
    path: Option<PathBuf>,
    kdat_dir: PathBuf,
    current: RwLock<Option<Arc<Criu>>>,
    schedule: ProbeSchedule,
}

impl CriuCell {
    /// Probes the configured CRIU (off the async workers) and logs whether checkpoints are
    /// on; later probes come at most once per `every`.
    pub async fn at_start(path: Option<PathBuf>, kdat_dir: PathBuf, every: Duration) -> Self {
        let current = match &path {
            None => {
                tracing::info!("checkpoints are off: paused sandboxes stay in memory");
                None
            }
            Some(path) => match probe(path.clone(), kdat_dir.clone()).await {
                Ok(criu) => {
                    tracing::info!(criu = %criu.path.display(), version = %criu.version, "paused sandboxes are checkpointed to disk");
                    Some(Arc::new(criu))
                }
                Err(error) => {
                    tracing::warn!(%error, "checkpoints are off: paused sandboxes stay in memory until CRIU passes its probe");
                    None
                }
            },
        };
        Self::with(path, kdat_dir, current, Some(Instant::now()), every)
    }

    fn with(
        path: Option<PathBuf>,
        kdat_dir: PathBuf,
        current: Option<Arc<Criu>>,
        last_probe: Option<Instant>,
        every: Duration,
    ) -> Self {
        Self(Arc::new(Shared {
            path,
            kdat_dir,
            current: RwLock::new(current),
            schedule: ProbeSchedule::new(every, last_probe),
        }))
    }

    /// The CRIU checkpoints use, if one passed its probe.
    pub fn get(&self) -> Option<Arc<Criu>> {
        self.0.get()
    }

    /// The CRIU checkpoints use, probing the configured binary again first when none passed
    /// yet and the last probe is old enough. Callers that find a probe under way are not
    /// held up by it.
    pub async fn get_or_probe(&self) -> Option<Arc<Criu>> {
        if let Some(criu) = self.get() {
            return Some(criu);
        }
        let path = self.0.path.clone()?;
        if !self.0.schedule.claim(Instant::now()) {
            return None;
        }
        // Its own task: a caller that goes away (a client hanging up) must not take the
        // result with it, or the next chance would be a whole period later.
        let shared = self.0.clone();
        tokio::spawn(async move { shared.probe_again(path).await })
            .await
            .ok()
            .flatten()
    }
}

impl Shared {
    fn get(&self) -> Option<Arc<Criu>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    async fn probe_again(&self, path: PathBuf) -> Option<Arc<Criu>> {
        match probe(path, self.kdat_dir.clone()).await {
            Ok(criu) => {
                tracing::info!(criu = %criu.path.display(), version = %criu.version, "CRIU passed its probe: paused sandboxes are checkpointed to disk from now on");
                let criu = Arc::new(criu);
                let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
                Some(current.get_or_insert(criu).clone())
            }
            Err(error) => {
                tracing::debug!(%error, "checkpoints stay off");
                None
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ReprobeError {
    #[error(transparent)]
    Probe(#[from] crate::checkpoint::ProbeError),
    #[error("the criu probe did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}

async fn probe(path: PathBuf, kdat_dir: PathBuf) -> Result<Criu, ReprobeError> {
    Ok(tokio::task::spawn_blocking(move || crate::checkpoint::probe(&path, &kdat_dir)).await??)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_runs_at_most_once_per_period() {
        let start = Instant::now();
        let schedule = ProbeSchedule::new(Duration::from_secs(30), None);
        assert!(schedule.claim(start), "the first probe runs at once");
        assert!(!schedule.claim(start));
        assert!(!schedule.claim(start + Duration::from_secs(29)));
        assert!(schedule.claim(start + Duration::from_secs(30)));
        assert!(!schedule.claim(start + Duration::from_secs(31)));
        assert!(schedule.claim(start + Duration::from_secs(61)));
    }

    #[test]
    fn the_probe_at_start_counts() {
        let start = Instant::now();
        let schedule = ProbeSchedule::new(Duration::from_secs(30), Some(start));
        assert!(!schedule.claim(start + Duration::from_secs(1)));
        assert!(schedule.claim(start + Duration::from_secs(30)));
    }

    #[test]
    fn of_many_callers_at_once_one_probes() {
        let schedule = Arc::new(ProbeSchedule::new(Duration::from_secs(30), None));
        let now = Instant::now();
        let claims: usize = (0..8)
            .map(|_| {
                let schedule = schedule.clone();
                std::thread::spawn(move || usize::from(schedule.claim(now)))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("the thread ran"))
            .sum();
        assert_eq!(claims, 1);
    }

    fn fake_criu(path: &std::path::Path, script: &str) {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(path, format!("#!/bin/sh\n{script}\n")).expect("write the fake");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    fn cell(path: Option<PathBuf>, every: Duration) -> CriuCell {
        CriuCell::with(path, std::env::temp_dir(), None, None, every)
    }

    #[tokio::test]
    async fn a_missing_criu_is_probed_again_only_after_the_period() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("criu");
        let cell = cell(Some(path.clone()), Duration::from_secs(3600));
        assert!(cell.get_or_probe().await.is_none());
        // A fake that would fail the version check anyway: what counts is that it is not
        // even run within the period.
        fake_criu(&path, "touch \"$0.ran\"");
        assert!(cell.get_or_probe().await.is_none());
        assert!(!dir.path().join("criu.ran").exists());
    }

    #[tokio::test]
    async fn a_criu_that_fails_its_probe_leaves_checkpoints_off() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("criu");
        fake_criu(&path, "echo Version: 0.1");
        let cell = cell(Some(path), Duration::ZERO);
        assert!(cell.get_or_probe().await.is_none());
        assert!(cell.get().is_none());
    }

    #[tokio::test]
    async fn a_criu_installed_later_is_found_by_the_next_probe() {
        // Needs the real, patched CRIU and root; elsewhere there is nothing to install.
        let installed = std::path::Path::new("/usr/local/sbin/criu");
        let kdat = tempfile::tempdir().expect("a temporary directory");
        if crate::checkpoint::probe(installed, kdat.path()).is_err() {
            eprintln!("skipped: no CRIU here that passes its probe");
            return;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("criu");
        let cell = CriuCell::with(
            Some(path.clone()),
            kdat.path().to_owned(),
            None,
            None,
            Duration::ZERO,
        );
        assert!(cell.get_or_probe().await.is_none());
        std::fs::copy(installed, &path).expect("install the copy");
        let found = cell.get_or_probe().await.expect("found once installed");
        assert_eq!(found.path, path);
        assert!(cell.get().is_some());
    }

    #[tokio::test]
    async fn without_a_configured_criu_nothing_is_probed() {
        let cell = cell(None, Duration::ZERO);
        assert!(cell.get_or_probe().await.is_none());
        assert!(
            cell.0.schedule.claim(Instant::now()),
            "no probe took the slot"
        );
    }
}
