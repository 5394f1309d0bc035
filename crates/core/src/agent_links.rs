//! The connections the edge holds open to a sandbox's agent.
//!
//! A pause or a snapshot with memory ends them before the sandbox is frozen. A Unix socket
//! belongs to the network namespace of the side that connects, so the agent's end of each
//! of these connections lives in the host's namespace; a checkpoint of the sandbox cannot
//! include it and would fail. Clients see their stream end, as after a network outage, and
//! attach again once the sandbox runs (`commands.connect(pid)`).

use std::time::Duration;

use tokio::sync::watch;

/// The side the core keeps: one per running period of a sandbox.
#[derive(Debug, Clone)]
pub(crate) struct AgentLinks(watch::Sender<bool>);

impl AgentLinks {
    pub(crate) fn new() -> Self {
        AgentLinks(watch::Sender::new(false))
    }

    /// A lease for one connection (or one about to be made).
    pub(crate) fn lease(&self) -> AgentLease {
        AgentLease(self.0.subscribe())
    }

    /// Tells every lease holder to close its connection and waits until all leases are given
    /// back, for at most `patience`. False if some were still held then.
    pub(crate) async fn end(self, patience: Duration) -> bool {
        self.0.send_replace(true);
        tokio::time::timeout(patience, self.0.closed())
            .await
            .is_ok()
    }
}

/// Held by the edge for as long as a connection to the agent is open; given back by dropping
/// it once the agent has closed its end.
#[derive(Debug)]
pub struct AgentLease(watch::Receiver<bool>);

impl AgentLease {
    /// Whether the sandbox is pausing: a connection must not be used, only closed.
    pub fn is_ending(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the sandbox starts pausing.
    pub async fn ending(&mut self) {
        // An error means the core forgot the sandbox (it was stopped): end as well.
        let _ = self.0.wait_for(|ending| *ending).await;
    }
}

/// How long a hang-up waits for the agent to close its end.
const HANG_UP_PATIENCE: Duration = Duration::from_secs(1);

/// A second descriptor of a connection to an agent, to end it with [`HangUp::hang_up`] once
/// hyper, which owns the first, is done with it (or told to stop).
#[derive(Debug)]
pub struct HangUp(std::os::unix::net::UnixStream);

impl HangUp {
    pub fn of(stream: &tokio::net::UnixStream) -> std::io::Result<Self> {
        std::os::fd::AsFd::as_fd(stream)
            .try_clone_to_owned()
            .map(|fd| HangUp(std::os::unix::net::UnixStream::from(fd)))
    }

    /// Ends the connection from our side and returns once the agent has closed its end, or
    /// after a second; whatever the agent still sends is read and dropped. Nothing else may
    /// read the connection meanwhile. False (and logged) if the agent did not close in time.
    pub async fn hang_up(self) -> bool {
        use tokio::io::AsyncReadExt as _;
        let socket = self.0;
        let _ = socket.shutdown(std::net::Shutdown::Write);
        let Ok(mut socket) = socket
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(socket))
        else {
            return false;
        };
        let closed = async {
            let mut sink = [0u8; 4096];
            // An error (a reset) means the agent's end is gone as well.
            while let Ok(1..) = socket.read(&mut sink).await {}
        };
        let in_time = tokio::time::timeout(HANG_UP_PATIENCE, closed).await.is_ok();
        if !in_time {
            tracing::warn!("an agent did not close a connection in time");
        }
        in_time
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ending_waits_for_every_lease_to_be_given_back() {
        let links = AgentLinks::new();
        let mut first = links.lease();
        let second = links.lease();
        assert!(!first.is_ending());
        let holder = tokio::spawn(async move {
            first.ending().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(first);
        });
        let started = std::time::Instant::now();
        let ended = {
            let end = links.end(Duration::from_secs(5));
            tokio::pin!(end);
            // The second lease is still held: the end cannot complete yet.
            assert!(
                tokio::time::timeout(Duration::from_millis(50), &mut end)
                    .await
                    .is_err()
            );
            assert!(second.is_ending());
            drop(second);
            end.await
        };
        assert!(ended);
        assert!(started.elapsed() >= Duration::from_millis(20));
        holder.await.expect("the holder task ran to its end");
    }

    #[tokio::test]
    async fn a_lease_kept_past_the_patience_is_reported() {
        let links = AgentLinks::new();
        let kept = links.lease();
        assert!(!links.end(Duration::from_millis(10)).await);
        assert!(kept.is_ending());
    }

    #[tokio::test]
    async fn a_hang_up_returns_once_the_other_end_is_closed() {
        use tokio::io::AsyncReadExt as _;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        let ours = HangUp(ours);
        theirs.set_nonblocking(true).expect("non-blocking");
        let mut theirs = tokio::net::UnixStream::from_std(theirs).expect("a tokio socket");
        let agent = tokio::spawn(async move {
            // The agent sees the end of the request stream, then closes.
            let mut rest = Vec::new();
            theirs
                .read_to_end(&mut rest)
                .await
                .expect("read to the end");
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(theirs);
        });
        let started = std::time::Instant::now();
        assert!(ours.hang_up().await);
        assert!(started.elapsed() >= Duration::from_millis(30));
        agent.await.expect("the agent task ran to its end");
    }

    #[tokio::test]
    async fn a_hang_up_gives_up_on_an_agent_that_keeps_its_end_open() {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        assert!(!HangUp(ours).hang_up().await);
    }

    #[tokio::test]
    async fn ending_without_leases_is_immediate() {
        assert!(AgentLinks::new().end(Duration::from_millis(1)).await);
    }

    #[tokio::test]
    async fn a_forgotten_sandbox_ends_its_leases() {
        let links = AgentLinks::new();
        let mut lease = links.lease();
        drop(links);
        tokio::time::timeout(Duration::from_secs(1), lease.ending())
            .await
            .expect("the lease ends with its sandbox");
    }
}
