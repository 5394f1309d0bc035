//! Sandbox networking: each sandbox gets its own network namespace joined to the host by a
//! veth pair on a /30 of a private range. Traffic is routed, not bridged, so every packet
//! between sandboxes, or from a sandbox to the host, crosses the host's firewall.

use std::net::Ipv4Addr;
use std::process::Stdio;

use futures_util::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec};

use tokio::io::AsyncWriteExt;

/// Host-side interface names start with this; the firewall matches on it.
pub const IFACE_PREFIX: &str = "sbx";
/// Sandboxes allowed to reach the outside have host interfaces `sbxe<slot>`, isolated ones
/// `sbxi<slot>`: the firewall tells them apart by name, so starting a sandbox needs no
/// firewall change at all.
const EGRESS_MARK: char = 'e';
const ISOLATED_MARK: char = 'i';
pub(crate) const TABLE: &str = "sandbar";
/// The verdict map the forward chain looks sandboxes' interfaces up in.
pub const EGRESS_MAP: &str = "egress";

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed for {what}: {stderr}")]
    Command {
        program: String,
        what: String,
        stderr: String,
    },
    #[error("cannot enable ip forwarding: {0}")]
    Forwarding(std::io::Error),
    #[error("netlink: {what}: {message}")]
    Netlink { what: String, message: String },
    #[error(
        "cannot shape {iface} with a tbf qdisc (--sandbox-bandwidth-mbit 0 turns shaping off): {message}"
    )]
    Shaping { iface: String, message: String },
    #[error("cannot open a netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("network slot {0} is outside the sandbox range")]
    SlotOutOfRange(u32),
    #[error("'{0}' is not an IPv4 range like 10.1.0.0/16")]
    BadRange(String),
}

/// Destinations sandboxes may not reach even with internet access: private, shared, loopback,
/// link-local, documentation, benchmark, multicast and reserved ranges, and the cloud metadata
/// addresses outside them. Beyond the host these lead to the operator's own networks.
pub const REFUSED_RANGES: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "168.63.129.16/32",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// Parses `a.b.c.d/len` (or a bare address, as /32) into its network address and length.
pub fn parse_range(text: &str) -> Result<(Ipv4Addr, u8), NetworkError> {
    let bad = || NetworkError::BadRange(text.to_owned());
    let (addr, len) = match text.trim().split_once('/') {
        Some((addr, len)) => (addr, len.parse::<u8>().map_err(|_| bad())?),
        None => (text.trim(), 32),
    };
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
    if len > 32 {
        return Err(bad());
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((Ipv4Addr::from(u32::from(addr) & mask), len))
}

/// What the firewall needs beyond the sandbox range.
#[derive(Debug, Clone, Default)]
pub struct FirewallConfig {
    /// Port of the server's sandbox resolver, to which sandboxes' DNS traffic to their
    /// gateway is redirected.
    pub resolver_port: u16,
    /// Ranges of [`REFUSED_RANGES`] the operator lets sandboxes with internet access reach.
    pub allowed_private: Vec<(Ipv4Addr, u8)>,
}

/// The private range sandboxes are numbered from, one /30 per slot.
#[derive(Debug)]
pub struct Network {
    base: Ipv4Addr,
    prefix_len: u8,
    /// Rate limit set on both ends of every veth pair this node makes; `None`: unlimited.
    shaping: Option<crate::net::shaping::Shaping>,
    host: tokio::sync::OnceCell<Handle>,
}

/// Addresses of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddrs {
    pub host: Ipv4Addr,
    pub sandbox: Ipv4Addr,
}

pub(crate) async fn run(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
    what: &str,
) -> Result<(), NetworkError> {
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| NetworkError::Spawn {
            program: program.into(),
            source,
        })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .await
            .map_err(|source| NetworkError::Spawn {
                program: program.into(),
                source,
            })?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|source| NetworkError::Spawn {
            program: program.into(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetworkError::Command {
            program: program.into(),
            what: what.into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// Host-side interface of slot `slot`.
pub fn iface_name(slot: u32, egress: bool) -> String {
    let mark = if egress { EGRESS_MARK } else { ISOLATED_MARK };
    format!("{IFACE_PREFIX}{mark}{slot}")
}

fn iface_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

/// Whether anything on the host already uses slot `slot`'s interface names (a sandbox of
/// this node, a leftover, or another process).
pub fn slot_in_use(slot: u32) -> bool {
    iface_exists(&iface_name(slot, true)) || iface_exists(&iface_name(slot, false))
}

impl Network {
    pub fn new(base: Ipv4Addr, prefix_len: u8) -> Self {
        Self {
            base,
            prefix_len,
            shaping: None,
            host: tokio::sync::OnceCell::new(),
        }
    }

    /// Limits the bandwidth of each sandbox prepared from now on, in both directions.
    pub fn with_shaping(mut self, shaping: Option<crate::net::shaping::Shaping>) -> Self {
        self.shaping = shaping;
        self
    }

    pub fn shaping(&self) -> Option<crate::net::shaping::Shaping> {
        self.shaping
    }

    pub fn capacity(&self) -> u32 {
        1u32 << (32 - u32::from(self.prefix_len)).saturating_sub(2)
    }

    pub fn addrs(&self, slot: u32) -> Result<SlotAddrs, NetworkError> {
        if slot >= self.capacity() {
            return Err(NetworkError::SlotOutOfRange(slot));
        }
        let net = u32::from(self.base) + slot * 4;
        Ok(SlotAddrs {
            host: Ipv4Addr::from(net + 1),
            sandbox: Ipv4Addr::from(net + 2),
        })
    }

    fn cidr(&self) -> String {
        format!("{}/{}", self.base, self.prefix_len)
    }

    /// Enables forwarding and (re)creates the firewall table.
    pub async fn init(&self, firewall: &FirewallConfig) -> Result<(), NetworkError> {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(NetworkError::Forwarding)?;
        run(
            "nft",
            &["-f", "-"],
            Some(&self.ruleset(firewall)),
            "the sandbox firewall",
        )
        .await
    }

    /// The node's whole nftables table. Sandboxes are told apart by interface name; the only
    /// part that changes per sandbox is the `egress` map, for sandboxes with their own rules
    /// (see `egress.rs`). Order for a new connection out of a sandbox: refused ranges, the
    /// sandbox's own allowed then denied destinations, then the node's default by name.
    /// The table stays when the server stops, to keep running sandboxes fenced in; the rules
    /// for the resolver therefore match its sockets (see `dns::tag_for_firewall`) as well as
    /// its port, which another program may hold once the server is gone.
    fn ruleset(&self, firewall: &FirewallConfig) -> String {
        let p = IFACE_PREFIX;
        let e = EGRESS_MARK;
        let refused = REFUSED_RANGES.join(", ");
        let allowed = if firewall.allowed_private.is_empty() {
            String::new()
        } else {
            let ranges: Vec<String> = firewall
                .allowed_private
                .iter()
                .map(|(addr, len)| format!("{addr}/{len}"))
                .collect();
            // Exempt from the refusal only: a sandbox's own deny rules still apply to them.
            format!("ip daddr != {{ {} }} ", ranges.join(", "))
        };
        let dns = firewall.resolver_port;
        format!(
            "table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  map {map} {{
    type ifname : verdict;
  }}
  chain forward {{
    type filter hook forward priority filter - 1; policy accept;
    iifname \"{p}*\" oifname \"{p}*\" drop
    oifname \"{p}*\" ct state established,related accept
    oifname \"{p}*\" drop
    iifname \"{p}*\" ct state established,related accept
    iifname \"{p}*\" meta nfproto ipv6 drop
    iifname \"{p}*\" {allowed}ip daddr {{ {refused} }} drop
    iifname vmap @{map}
    iifname \"{p}{e}*\" accept
    iifname \"{p}*\" drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"{p}{e}*\" ip daddr {cidr} meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}
  }}
  chain input {{
    type filter hook input priority filter - 1; policy accept;
    iifname \"{p}*\" ct state established,related accept
    iifname \"{p}{e}*\" meta l4proto {{ tcp, udp }} th dport {dns} socket transparent 1 accept
    iifname \"{p}*\" drop
    meta l4proto {{ tcp, udp }} th dport {dns} socket transparent 1 drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {cidr} oifname != \"{p}*\" masquerade
  }}
}}
",
            cidr = self.cidr(),
            map = EGRESS_MAP,
        )
    }

    /// Renames slot `slot`'s host interface to mark it for egress or isolation (the firewall
    /// and the resolver go by that name), when a running sandbox's rules change which it is.
    pub async fn set_egress(&self, slot: u32, egress: bool) -> Result<(), NetworkError> {
        let wanted = iface_name(slot, egress);
        if iface_exists(&wanted) {
            return Ok(());
        }
        let current = iface_name(slot, !egress);
        let fail = |step: &str| {
            let what = format!("{step} {current} to {wanted}");
            move |e: rtnetlink::Error| NetworkError::Netlink {
                what,
                message: e.to_string(),
            }
        };
        let host = self.host_netlink().await?;
        let index = link_index(&host, &current).await.map_err(fail("find"))?;
        // A link must be down to be renamed; its address stays, its route returns with it.
        host.link()
            .set(LinkUnspec::new_with_index(index).down().build())
            .execute()
            .await
            .map_err(fail("bring down"))?;
        let renamed = host
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .name(wanted.clone())
                    .build(),
            )
            .execute()
            .await
            .map_err(fail("rename"));
        host.link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(fail("bring up"))?;
        renamed
    }

    /// One netlink connection in the host's namespace, opened on first use and shared.
    pub(crate) async fn host_netlink(&self) -> Result<Handle, NetworkError> {
        self.host
            .get_or_try_init(|| async { netlink_connection().map_err(NetworkError::Socket) })
            .await
            .cloned()
    }

    /// Removes what slot `slot` holds on the host. The veth pair normally dies with the
    /// sandbox's namespace; this covers a namespace that is somehow still alive.
    pub async fn release(&self, slot: u32) {
        let Ok(host) = self.host_netlink().await else {
            return;
        };
        for egress in [true, false] {
            let iface = iface_name(slot, egress);
            if iface_exists(&iface)
                && let Ok(index) = link_index(&host, &iface).await
            {
                let _ = host.link().del(index).execute().await;
            }
        }
    }
}

/// The runtime that serves every netlink socket of the node, on a thread of its own.
///
/// The kernel handles a netlink request inside the `sendmsg` that carries it, and adding or
/// removing a veth pair waits there for RCU grace periods: several milliseconds, longer on a
/// host with a thousand interfaces. Polled on the server's async runtime, those waits held
/// one of its worker threads each time, and the requests queued on it. Here they hold only
/// this thread; the callers await answers over a channel.
pub(crate) fn netlink_runtime() -> std::io::Result<&'static tokio::runtime::Handle> {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Handle> = std::sync::OnceLock::new();
    static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if let Some(handle) = RUNTIME.get() {
        return Ok(handle);
    }
    let _one_start = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = RUNTIME.get() {
        return Ok(handle);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("netlink".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    Ok(RUNTIME.get_or_init(|| handle))
}

/// A netlink connection in the calling thread's network namespace, served by the node's
/// netlink thread (see [`netlink_runtime`]).
pub(crate) fn netlink_connection() -> std::io::Result<Handle> {
    let runtime = netlink_runtime()?;
    // The socket registers with the reactor of the runtime entered as it is created.
    let _entered = runtime.enter();
    let (connection, handle, _) = rtnetlink::new_connection()?;
    runtime.spawn(connection);
    Ok(handle)
}

pub(crate) async fn link_index(handle: &Handle, name: &str) -> Result<u32, rtnetlink::Error> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await? {
        Some(link) => Ok(link.header.index),
        None => Err(rtnetlink::Error::RequestFailed),
    }
}

/// The index of the link named `name` in the calling thread's network namespace.
pub(crate) fn if_index(name: &str) -> std::io::Result<u32> {
    let name = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(std::io::Error::last_os_error()),
        index => Ok(index),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_map_to_distinct_30s() {
        let net = Network::new(Ipv4Addr::new(10, 213, 0, 0), 16);
        assert_eq!(net.capacity(), 16384);
        let a = net.addrs(0).expect("slot 0");
        assert_eq!(a.host, Ipv4Addr::new(10, 213, 0, 1));
        assert_eq!(a.sandbox, Ipv4Addr::new(10, 213, 0, 2));
        let b = net.addrs(64).expect("slot 64");
        assert_eq!(b.host, Ipv4Addr::new(10, 213, 1, 1));
        let past = net.addrs(16384);
        assert!(
            matches!(past, Err(NetworkError::SlotOutOfRange(16384))),
            "{past:?}"
        );
    }

    #[test]
    fn ranges_parse_to_their_network() {
        assert_eq!(
            parse_range("10.1.2.3/16").expect("range"),
            (Ipv4Addr::new(10, 1, 0, 0), 16)
        );
        assert_eq!(
            parse_range("168.63.129.16").expect("bare address"),
            (Ipv4Addr::new(168, 63, 129, 16), 32)
        );
        for bad in ["10.0.0.0/33", "example.com"] {
            let parsed = parse_range(bad);
            assert!(
                matches!(&parsed, Err(NetworkError::BadRange(text)) if text == bad),
                "{parsed:?}"
            );
        }
        for range in REFUSED_RANGES {
            parse_range(range).expect("refused ranges are valid");
        }
    }

    /// Whether a TCP connection from loopback to `port` is accepted within a second.
    async fn loopback_connects(port: u16) -> bool {
        let connect = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port));
        matches!(
            tokio::time::timeout(std::time::Duration::from_secs(1), connect).await,
            Ok(Ok(_))
        )
    }

    #[test]
    fn the_firewall_fences_the_resolver_and_nothing_else_on_its_port() {
        crate::net::in_private_netns(|| async {
            let lo = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .expect("run ip");
            assert!(lo.success());
            // The server's lifetime: a runtime of its own, on a thread that inherits this
            // namespace, so that its end closes the resolver's sockets as a stop would.
            let port = std::thread::spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(async {
                    let egress = crate::net::egress::Egress::new();
                    let resolver = crate::net::dns::Resolver::start(vec![], egress)
                        .await
                        .expect("resolver");
                    Network::new(Ipv4Addr::new(10, 251, 0, 0), 24)
                        .init(&FirewallConfig {
                            resolver_port: resolver.port,
                            allowed_private: vec![],
                        })
                        .await
                        .expect("firewall");
                    assert!(
                        !loopback_connects(resolver.port).await,
                        "the resolver answers a host connection on {}",
                        resolver.port
                    );
                    resolver.port
                })
            })
            .join()
            .expect("server thread");

            // The table stays behind, as it does for a stopped server; another program that
            // now listens on the port is reached, over TCP and over UDP.
            let tcp = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).expect("tcp");
            assert!(loopback_connects(port).await, "port {port} stays fenced");
            drop(tcp);
            let udp = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))
                .await
                .expect("udp");
            let sender = tokio::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .expect("sender");
            sender
                .send_to(b"x", (Ipv4Addr::LOCALHOST, port))
                .await
                .expect("send");
            let mut buf = [0u8; 4];
            let received =
                tokio::time::timeout(std::time::Duration::from_secs(1), udp.recv(&mut buf)).await;
            assert!(matches!(received, Ok(Ok(1))), "{received:?}");
        });
    }

    #[test]
    fn ruleset_refuses_private_ranges_and_redirects_dns() {
        let net = Network::new(Ipv4Addr::new(10, 213, 0, 0), 16);
        let rules = net.ruleset(&FirewallConfig {
            resolver_port: 40053,
            allowed_private: vec![(Ipv4Addr::new(10, 9, 0, 0), 16)],
        });
        assert!(rules.contains("ip daddr != { 10.9.0.0/16 } ip daddr { 0.0.0.0/8,"));
        assert!(rules.contains("iifname vmap @egress\n"));
        assert!(rules.contains("100.64.0.0/10"));
        assert!(rules.contains("168.63.129.16/32"));
        assert!(rules.contains("redirect to :40053"));
        // The resolver's rules name its sockets, not only its port.
        assert!(rules.contains("th dport 40053 socket transparent 1 accept"));
        assert!(rules.contains("th dport 40053 socket transparent 1 drop"));
        // Refused ranges first, then the sandbox's own rules, then the default.
        let refuse = rules.find("0.0.0.0/8").expect("refuse rule");
        let own = rules.find("vmap @egress").expect("per-sandbox rules");
        let default = rules.find("iifname \"sbxe*\" accept").expect("default");
        assert!(refuse < own && own < default);
    }
}
