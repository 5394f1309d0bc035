//! Crash points: named places in multi-step operations (pause, checkpoint, restore,
//! snapshot) where the server can be made to die on purpose, so tests can check that a
//! restart finds every sandbox whole.
//!
//! `SANDBAR_CRASH_AT=<name>` makes the process abort the first time it reaches the point of
//! that name. Nothing runs after it, as with `kill -9`: no destructors, no flushes; child
//! processes (CRIU, the sandboxes) run on.

use std::sync::OnceLock;

/// The environment variable naming the crash point to stop at.
pub const CRASH_AT_ENV: &str = "SANDBAR_CRASH_AT";

/// Every crash point, in the order an operation reaches them.
pub const CRASH_POINTS: &[&str] = &[
    "pause.frozen",
    "pause.released",
    "checkpoint.dumping",
    "checkpoint.dumped",
    "resume.thawed",
    "restore.restoring",
    "restore.restored",
    "snapshot.dumping",
    "snapshot.copied",
];

fn armed() -> Option<&'static str> {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    ARMED
        .get_or_init(|| std::env::var(CRASH_AT_ENV).ok().filter(|s| !s.is_empty()))
        .as_deref()
}

/// Aborts the process if `name` is the armed crash point.
pub fn crash_point(name: &'static str) {
    debug_assert!(CRASH_POINTS.contains(&name), "unlisted crash point {name}");
    if armed() == Some(name) {
        // Straight to stderr: a buffered log line would die with the process.
        eprintln!("crash point {name} reached; aborting");
        std::process::abort();
    }
}

/// An error naming the armed crash point if it is not one of [`CRASH_POINTS`], so a typo
/// does not silently test nothing.
pub fn check_armed() -> Result<Option<&'static str>, UnknownCrashPoint> {
    match armed() {
        Some(name) if !CRASH_POINTS.contains(&name) => Err(UnknownCrashPoint {
            name: name.to_owned(),
        }),
        armed => Ok(armed),
    }
}

/// The crash point armed in the environment is none the server has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{CRASH_AT_ENV}={name} names no crash point; known: {}", CRASH_POINTS.join(", "))]
pub struct UnknownCrashPoint {
    pub name: String,
}
