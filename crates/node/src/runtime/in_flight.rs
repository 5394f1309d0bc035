//! Work a node runs in tasks of their own (a build sandbox launched or removed after its build
//! was dropped), counted so that the server's stop can wait for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Work that runs in tasks of its own, counted so that a stop can wait for it to end.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    count: AtomicUsize,
    settled: tokio::sync::Notify,
}

/// One piece of [`InFlight`] work; it ends when this drops.
#[derive(Debug)]
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(self.clone())
    }

    /// Resolves once nothing is in flight, or after `patience`; says whether it settled.
    pub(crate) async fn settle(&self, patience: Duration) -> bool {
        let settled = async {
            loop {
                let notified = self.settled.notified();
                if self.count.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(patience, settled).await.is_ok()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.settled.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::InFlight;

    #[tokio::test]
    async fn settles_once_every_guard_is_gone_and_not_before() {
        let work = Arc::new(InFlight::default());
        assert!(work.settle(Duration::ZERO).await, "nothing in flight");
        let first = work.enter();
        let second = work.enter();
        assert!(!work.settle(Duration::from_millis(20)).await);
        drop(first);
        assert!(!work.settle(Duration::from_millis(20)).await);
        let waiting = tokio::spawn({
            let work = work.clone();
            async move { work.settle(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(second);
        assert!(waiting.await.expect("the waiter ran"));
    }
}
