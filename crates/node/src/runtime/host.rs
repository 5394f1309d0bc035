//! The host calls that freeze, thaw and dump a sandbox, behind [`HostOps`], and the
//! sequences made of them. The sequences are where ordering matters (a sandbox must not be
//! frozen while its agent still holds a connection from the host; a failed dump gets one
//! thaw to let it go), so they are written against the trait and unit-tested with a
//! recording fake, without root.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::checkpoint::HostSocket;
use crate::resources::cgroups::CgroupDriver;

/// What the pause and checkpoint sequences ask of the host for one sandbox.
pub(super) trait HostOps {
    fn freeze(&self, sandbox_id: &str) -> impl Future<Output = Result<(), String>> + Send;
    fn thaw(&self, sandbox_id: &str) -> Result<(), String>;
    /// Unix sockets of the host's network namespace that the sandbox's processes hold.
    fn host_sockets(&self, sandbox_id: &str) -> Vec<HostSocket>;
}

/// [`HostOps`] on this host's cgroups and `/proc`.
pub(super) struct LinuxHost<'a>(pub(super) &'a CgroupDriver);

impl HostOps for LinuxHost<'_> {
    async fn freeze(&self, sandbox_id: &str) -> Result<(), String> {
        self.0.freeze(sandbox_id).await.map_err(|e| e.to_string())
    }

    fn thaw(&self, sandbox_id: &str) -> Result<(), String> {
        self.0.thaw(sandbox_id).map_err(|e| e.to_string())
    }

    fn host_sockets(&self, sandbox_id: &str) -> Vec<HostSocket> {
        crate::checkpoint::host_unix_sockets(&self.0.members(sandbox_id))
    }
}

/// How often a settling sandbox is looked at.
const SETTLE_POLL: Duration = Duration::from_millis(5);

/// Waits, for at most `patience`, until the sandbox's processes hold no connection from the
/// host; returns those still held then (empty when it settled).
pub(super) async fn settle(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
) -> Vec<HostSocket> {
    let deadline = Instant::now() + patience;
    loop {
        let held = host.host_sockets(sandbox_id);
        if held.is_empty() || Instant::now() >= deadline {
            return held;
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// Freezes a running sandbox once its agent has closed its ends of connections from the
/// host (or `patience` ran out: it is frozen anyway, and what it holds is logged and
/// returned).
pub(super) async fn settle_and_freeze(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
) -> Result<Vec<HostSocket>, String> {
    let held = settle(host, sandbox_id, patience).await;
    host.freeze(sandbox_id).await?;
    if !held.is_empty() {
        tracing::warn!(
            sandbox_id,
            held = %crate::checkpoint::describe_host_sockets(&held),
            "frozen with connections from the host still open; a dump of it may fail"
        );
    }
    Ok(held)
}

/// Runs `dump` on a frozen sandbox. When it fails while the sandbox holds a connection from
/// the host (CRIU cannot dump such a socket), the sandbox is thawed for the moment its agent
/// needs to close it, frozen again and dumped once more.
pub(super) async fn dump_frozen<T, E, F, Fut>(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
    host_error: impl Fn(String) -> E,
    mut dump: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let err = match dump().await {
        Ok(done) => return Ok(done),
        Err(err) => err,
    };
    if host.host_sockets(sandbox_id).is_empty() {
        return Err(err);
    }
    tracing::info!(sandbox_id, error = %err, "thawing the paused sandbox briefly to let connections from the host close");
    host.thaw(sandbox_id).map_err(&host_error)?;
    settle_and_freeze(host, sandbox_id, patience)
        .await
        .map_err(&host_error)?;
    dump().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::cell::RefCell;
    use std::collections::VecDeque;

    use super::*;

    /// Records each call; `held` answers successive `host_sockets` calls (empty once used
    /// up).
    #[derive(Default)]
    struct Recording {
        calls: RefCell<Vec<&'static str>>,
        held: RefCell<VecDeque<usize>>,
    }

    impl Recording {
        fn holding(counts: &[usize]) -> Self {
            Recording {
                held: RefCell::new(counts.iter().copied().collect()),
                ..Default::default()
            }
        }

        fn calls(&self) -> Vec<&'static str> {
            self.calls.borrow().clone()
        }
    }

    fn socket(inode: u64) -> HostSocket {
        HostSocket {
            pid: 1,
            fd: "3".into(),
            inode,
        }
    }

    impl HostOps for Recording {
        fn freeze(&self, _: &str) -> impl Future<Output = Result<(), String>> + Send {
            self.calls.borrow_mut().push("freeze");
            std::future::ready(Ok(()))
        }

        fn thaw(&self, _: &str) -> Result<(), String> {
            self.calls.borrow_mut().push("thaw");
            Ok(())
        }

        fn host_sockets(&self, _: &str) -> Vec<HostSocket> {
            self.calls.borrow_mut().push("sockets");
            let count = self.held.borrow_mut().pop_front().unwrap_or(0);
            (0..count as u64).map(socket).collect()
        }
    }

    const PATIENCE: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn a_settled_sandbox_is_frozen_at_once() {
        let host = Recording::holding(&[]);
        let held = settle_and_freeze(&host, "s", PATIENCE).await.unwrap();
        assert!(held.is_empty());
        assert_eq!(host.calls(), ["sockets", "freeze"]);
    }

    #[tokio::test]
    async fn the_freeze_waits_for_connections_from_the_host_to_close() {
        let host = Recording::holding(&[2, 1]);
        let held = settle_and_freeze(&host, "s", PATIENCE).await.unwrap();
        assert!(held.is_empty());
        assert_eq!(host.calls(), ["sockets", "sockets", "sockets", "freeze"]);
    }

    #[tokio::test]
    async fn a_connection_held_past_the_patience_is_frozen_and_reported() {
        let host = Recording::holding(&[1; 1000]);
        let held = settle_and_freeze(&host, "s", Duration::from_millis(20))
            .await
            .unwrap();
        assert_eq!(held, vec![socket(0)]);
        assert_eq!(host.calls().last(), Some(&"freeze"));
    }

    #[tokio::test]
    async fn a_dump_that_works_touches_nothing_else() {
        let host = Recording::default();
        let out: Result<u8, String> =
            dump_frozen(&host, "s", PATIENCE, String::from, || async { Ok(7) }).await;
        assert_eq!(out, Ok(7));
        assert!(host.calls().is_empty());
    }

    #[tokio::test]
    async fn a_failed_dump_without_host_connections_is_not_tried_again() {
        let host = Recording::holding(&[0]);
        let tries = RefCell::new(0);
        let out: Result<u8, String> = dump_frozen(&host, "s", PATIENCE, String::from, || {
            *tries.borrow_mut() += 1;
            async { Err("dump failed".to_owned()) }
        })
        .await;
        assert_eq!(out, Err("dump failed".to_owned()));
        assert_eq!(*tries.borrow(), 1);
        assert_eq!(host.calls(), ["sockets"]);
    }

    #[tokio::test]
    async fn a_dump_failed_on_a_host_connection_thaws_settles_and_dumps_again() {
        // Held at the failure, still held at the first look after the thaw, then closed.
        let host = Recording::holding(&[1, 1, 0]);
        let tries = RefCell::new(0);
        let out: Result<u8, String> = dump_frozen(&host, "s", PATIENCE, String::from, || {
            *tries.borrow_mut() += 1;
            let first = *tries.borrow() == 1;
            async move {
                if first {
                    Err("unix: Unix socket 0 not found".to_owned())
                } else {
                    Ok(1)
                }
            }
        })
        .await;
        assert_eq!(out, Ok(1));
        assert_eq!(*tries.borrow(), 2);
        assert_eq!(
            host.calls(),
            ["sockets", "thaw", "sockets", "sockets", "freeze"]
        );
    }
}
