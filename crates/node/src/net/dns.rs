//! The resolver sandboxes use: a DNS forwarder in the server, reached by sandboxes on their
//! gateway address (the firewall redirects port 53 there to this forwarder's port).
//!
//! Hosts often resolve through a private address (a cloud's resolver, a LAN router), which
//! sandboxes may not reach since private destinations are refused to them; the forwarder runs
//! on the host and reaches the upstream resolvers on the sandboxes' behalf. Messages are relayed
//! unchanged over UDP and TCP.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;

use crate::net::egress::{Egress, QueryVerdict, refusal};

/// Longest wait for an upstream answer before trying the next resolver.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Queries in flight at once, over all sandboxes: a sandbox flooding the resolver cannot make
/// the server hold unbounded tasks and sockets.
const MAX_IN_FLIGHT: usize = 256;
/// DNS messages over TCP carry a 16-bit length.
const MAX_MESSAGE: usize = 65_535;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("cannot bind the sandbox resolver: {0}")]
    Bind(std::io::Error),
    #[error("cannot tag the sandbox resolver's {socket} socket for the firewall: {source}")]
    Tag {
        socket: &'static str,
        source: std::io::Error,
    },
    #[error("sandbox resolver upstream '{0}' is not an IP address")]
    Upstream(String),
}

/// The forwarder's listening port, shared by its UDP and TCP sockets.
#[derive(Debug, Clone, Copy)]
pub struct Resolver {
    pub port: u16,
}

/// Parses upstream resolvers (`1.2.3.4`, `[::1]:5353`, `10.0.0.1:53`); port 53 by default.
pub fn parse_upstreams(names: &[String]) -> Result<Vec<SocketAddr>, DnsError> {
    names
        .iter()
        .map(|name| {
            name.parse::<SocketAddr>()
                .or_else(|_| name.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
                .map_err(|_| DnsError::Upstream(name.clone()))
        })
        .collect()
}

impl Resolver {
    /// Binds UDP and TCP on one free port of every host address and serves until the process
    /// ends. The firewall lets only sandbox interfaces reach these sockets, which it tells
    /// apart by [`tag_for_firewall`].
    /// `egress` decides which queries of sandboxes with rules are answered, and learns the
    /// addresses their allowed domains resolve to.
    pub async fn start(upstreams: Vec<SocketAddr>, egress: Arc<Egress>) -> Result<Self, DnsError> {
        let mut last_error = None;
        for _ in 0..16 {
            let udp = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                .await
                .map_err(DnsError::Bind)?;
            let port = udp.local_addr().map_err(DnsError::Bind)?.port();
            match TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await {
                Ok(tcp) => {
                    tag_for_firewall(&udp, "UDP")?;
                    tag_for_firewall(&tcp, "TCP")?;
                    let upstreams: Arc<[SocketAddr]> = upstreams.into();
                    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
                    tokio::spawn(serve_udp(
                        Arc::new(udp),
                        upstreams.clone(),
                        limit.clone(),
                        egress.clone(),
                    ));
                    tokio::spawn(serve_tcp(tcp, upstreams, limit, egress));
                    tracing::info!(port, "sandbox resolver listening");
                    return Ok(Self { port });
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(DnsError::Bind(last_error.unwrap_or_else(|| {
            std::io::Error::other("no port free for both UDP and TCP")
        })))
    }
}

/// Marks a resolver socket so that the firewall's rules for the resolver match it and no
/// other socket on its port. The firewall table outlives the server (sandboxes keep running
/// through a restart and must stay fenced in), so a rule that went by the port alone would,
/// once the server is gone, drop or admit traffic of whatever host process gets that port
/// next. `IP_TRANSPARENT` is the tag because it changes nothing for a socket that no
/// transparent-proxy rule sends packets to, and nftables can match it (`socket transparent`).
fn tag_for_firewall(
    socket: &impl std::os::fd::AsRawFd,
    kind: &'static str,
) -> Result<(), DnsError> {
    let on: libc::c_int = 1;
    // SAFETY: the descriptor is a live socket owned by the caller, and the option's value is
    // a c_int that lives across the call, with its size passed along.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_IP,
            libc::IP_TRANSPARENT,
            std::ptr::from_ref(&on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(DnsError::Tag {
            socket: kind,
            source: std::io::Error::last_os_error(),
        })
    }
}

/// Answers one query: refused, or relayed with `ask` after which `egress` sees the answer
/// before the client does (so allowed addresses are open by the time it connects).
async fn answer<F>(egress: &Egress, client: SocketAddr, query: &[u8], ask: F) -> Option<Vec<u8>>
where
    F: std::future::Future<Output = Option<Vec<u8>>>,
{
    match egress.admit(client.ip(), query) {
        QueryVerdict::Refuse => refusal(query),
        QueryVerdict::Forward => {
            let answer = ask.await?;
            egress.answered(client.ip(), &answer).await;
            Some(answer)
        }
    }
}

async fn serve_udp(
    socket: Arc<UdpSocket>,
    upstreams: Arc<[SocketAddr]>,
    limit: Arc<Semaphore>,
    egress: Arc<Egress>,
) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let Ok((len, client)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        // Over the limit a query is dropped, as a busy resolver would; the client retries.
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue;
        };
        let query = buf[..len].to_vec();
        let socket = socket.clone();
        let upstreams = upstreams.clone();
        let egress = egress.clone();
        tokio::spawn(async move {
            let reply = answer(&egress, client, &query, ask_udp(&upstreams, &query)).await;
            if let Some(answer) = reply {
                let _ = socket.send_to(&answer, client).await;
            }
            drop(permit);
        });
    }
}

async fn ask_udp(upstreams: &[SocketAddr], query: &[u8]) -> Option<Vec<u8>> {
    for upstream in upstreams {
        let bind: SocketAddr = if upstream.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let Ok(socket) = UdpSocket::bind(bind).await else {
            continue;
        };
        if socket.connect(upstream).await.is_err() || socket.send(query).await.is_err() {
            continue;
        }
        let mut buf = vec![0u8; MAX_MESSAGE];
        // A reply must echo the query's id; anything else on the socket is ignored.
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        while let Ok(Ok(len)) = tokio::time::timeout_at(deadline, socket.recv(&mut buf)).await {
            if len >= 2 && query.len() >= 2 && buf[..2] == query[..2] {
                buf.truncate(len);
                return Some(buf);
            }
        }
    }
    None
}

async fn serve_tcp(
    listener: TcpListener,
    upstreams: Arc<[SocketAddr]>,
    limit: Arc<Semaphore>,
    egress: Arc<Egress>,
) {
    loop {
        let Ok((stream, client)) = listener.accept().await else {
            continue;
        };
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue;
        };
        let upstreams = upstreams.clone();
        let egress = egress.clone();
        tokio::spawn(async move {
            let relay = relay_tcp(stream, client, &upstreams, &egress);
            let _ = tokio::time::timeout(UPSTREAM_TIMEOUT * 4, relay).await;
            drop(permit);
        });
    }
}

async fn read_message(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u16().await? as usize;
    let mut message = vec![0u8; len];
    stream.read_exact(&mut message).await?;
    Ok(message)
}

async fn write_message(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(message.len()).map_err(std::io::Error::other)?;
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(message);
    stream.write_all(&framed).await
}

/// Answers queries on one client connection, one at a time, until the client closes it.
async fn relay_tcp(
    mut client: TcpStream,
    peer: SocketAddr,
    upstreams: &[SocketAddr],
    egress: &Egress,
) -> std::io::Result<()> {
    loop {
        let query = read_message(&mut client).await?;
        match answer(egress, peer, &query, ask_tcp(upstreams, &query)).await {
            Some(reply) => write_message(&mut client, &reply).await?,
            None => return Ok(()),
        }
    }
}

async fn ask_tcp(upstreams: &[SocketAddr], query: &[u8]) -> Option<Vec<u8>> {
    for upstream in upstreams {
        let Ok(Ok(mut server)) =
            tokio::time::timeout(UPSTREAM_TIMEOUT, TcpStream::connect(upstream)).await
        else {
            continue;
        };
        if write_message(&mut server, query).await.is_err() {
            continue;
        }
        if let Ok(Ok(answer)) =
            tokio::time::timeout(UPSTREAM_TIMEOUT, read_message(&mut server)).await
        {
            return Some(answer);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_default_to_port_53() {
        let parsed = parse_upstreams(&["10.0.0.1".into(), "127.0.0.1:5353".into()])
            .expect("valid upstreams");
        assert_eq!(parsed[0], "10.0.0.1:53".parse().expect("addr"));
        assert_eq!(parsed[1], "127.0.0.1:5353".parse().expect("addr"));
        // A name would need a resolver of its own to be reached.
        let named = parse_upstreams(&["resolver.example".into()]);
        assert!(
            matches!(&named, Err(DnsError::Upstream(name)) if name == "resolver.example"),
            "{named:?}"
        );
    }

    #[tokio::test]
    async fn relays_udp_and_tcp_queries_to_an_upstream() {
        // A fake upstream on loopback that answers every query with the query itself plus a
        // marker byte.
        // The port the system picks for UDP may be taken for TCP: picked again until both bind.
        let mut bound = None;
        for _ in 0..100 {
            let udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
            let port = udp.local_addr().expect("addr").port();
            if let Ok(tcp) = TcpListener::bind(("127.0.0.1", port)).await {
                bound = Some((udp, tcp, port));
                break;
            }
        }
        let (upstream_udp, upstream_tcp, port) = bound.expect("a port free for UDP and TCP");
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((len, from)) = upstream_udp.recv_from(&mut buf).await {
                let mut answer = buf[..len].to_vec();
                answer.push(0xAA);
                let _ = upstream_udp.send_to(&answer, from).await;
            }
        });
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = upstream_tcp.accept().await {
                if let Ok(query) = read_message(&mut stream).await {
                    let mut answer = query.clone();
                    answer.push(0xBB);
                    let _ = write_message(&mut stream, &answer).await;
                }
            }
        });
        let resolver = Resolver::start(
            vec![SocketAddr::from(([127, 0, 0, 1], port))],
            Arc::new(Egress::default()),
        )
        .await
        .expect("start");

        let client = UdpSocket::bind("127.0.0.1:0").await.expect("client");
        client
            .send_to(&[0x12, 0x34, 1, 2, 3], ("127.0.0.1", resolver.port))
            .await
            .expect("send");
        let mut buf = [0u8; 64];
        let (len, _) = tokio::time::timeout(Duration::from_secs(5), client.recv_from(&mut buf))
            .await
            .expect("udp answer in time")
            .expect("recv");
        assert_eq!(&buf[..len], &[0x12, 0x34, 1, 2, 3, 0xAA]);

        let mut stream = TcpStream::connect(("127.0.0.1", resolver.port))
            .await
            .expect("connect");
        write_message(&mut stream, &[0x56, 0x78, 9])
            .await
            .expect("write");
        let answer = tokio::time::timeout(Duration::from_secs(5), read_message(&mut stream))
            .await
            .expect("tcp answer in time")
            .expect("read");
        assert_eq!(answer, vec![0x56, 0x78, 9, 0xBB]);
    }
}
