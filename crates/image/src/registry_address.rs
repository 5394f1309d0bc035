//! Which registry addresses the server may connect to.
//!
//! The server pulls images as root from the host's network, on behalf of anyone holding an
//! API key. Without a rule, an image reference naming `127.0.0.1:<port>`, a link-local address
//! (cloud metadata at 169.254.169.254) or one of the host's own addresses would make the
//! server talk to services that only trust local callers. So every address a registry, a
//! token service or a redirect resolves to is checked here first: loopback, unspecified,
//! link-local, private (10/8, 172.16/12, 192.168/16, IPv6 unique local fc00::/7), shared
//! (100.64/10, carrier-grade NAT), benchmarking, documentation, reserved, multicast and
//! broadcast addresses, the host's own addresses and the sandbox network are refused unless
//! the operator allowed the registry (`--allow-registry`, or `--plain-http-registry`, which
//! names registries just as deliberately). An IPv6 address that carries an IPv4 one (mapped,
//! compatible, translated, 6to4, NAT64) reaches that IPv4 address, so it is judged as it.
//!
//! [`check_address`] is the rule as a pure function; [`RegistryPolicy`] holds its inputs
//! (the operator's list, the sandbox network, the host's addresses, refreshed now and then)
//! and resolves names through it.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use url::{Host, Url};

/// How long a list of the host's addresses is trusted before it is read again: interfaces
/// come and go (sandboxes' veth pairs, VPNs), and reading them costs one netlink dump.
const HOST_ADDRESSES_TTL: Duration = Duration::from_secs(5);

/// One entry of the operator's list: a host (name or address) on every port, or on one. An
/// address also covers the names that resolve to it: the connection ends up at the same place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedRegistry {
    /// Lower-case name, or an address without brackets.
    host: String,
    port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid registry `{0}`: expected HOST or HOST:PORT (an IPv6 address with a port in brackets)"
)]
pub struct AllowedRegistryError(String);

impl FromStr for AllowedRegistry {
    type Err = AllowedRegistryError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || AllowedRegistryError(text.to_owned());
        let trimmed = text.trim();
        let (host, port) = if let Some(rest) = trimmed.strip_prefix('[') {
            let (inside, after) = rest.split_once(']').ok_or_else(bad)?;
            inside.parse::<Ipv6Addr>().map_err(|_| bad())?;
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or_else(bad)?),
            };
            (inside, port)
        } else if trimmed.parse::<Ipv6Addr>().is_ok() {
            (trimmed, None)
        } else {
            let (host, port) = match trimmed.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (trimmed, None),
            };
            let valid_name = !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
            if !valid_name {
                return Err(bad());
            }
            (host, port)
        };
        let port = match port {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                Some(p.parse::<u16>().map_err(|_| bad())?)
            }
            Some(_) => return Err(bad()),
            None => None,
        };
        Ok(Self {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

impl fmt::Display for AllowedRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host: &str = &self.host;
        match (self.port, host.contains(':')) {
            (Some(port), true) => write!(f, "[{host}]:{port}"),
            (Some(port), false) => write!(f, "{host}:{port}"),
            (None, _) => f.write_str(host),
        }
    }
}

impl AllowedRegistry {
    fn matches(&self, host: &str, port: u16, address: IpAddr) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match self.host.parse::<IpAddr>() {
            Ok(listed) => {
                canonical(listed) == canonical(address)
                    || bare(host)
                        .parse::<IpAddr>()
                        .is_ok_and(|h| canonical(h) == canonical(listed))
            }
            Err(_) => bare(host)
                .trim_end_matches('.')
                .eq_ignore_ascii_case(self.host.trim_end_matches('.')),
        }
    }
}

/// The operator's part of the rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressRule {
    /// Registries that may be contacted whatever their addresses.
    pub allowed: Vec<AllowedRegistry>,
    /// Where sandboxes live (`--network`).
    pub sandbox_networks: Vec<IpNet>,
}

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedRange {
    Loopback,
    Unspecified,
    LinkLocal,
    /// 10/8, 172.16/12, 192.168/16 and IPv6's unique local fc00::/7.
    Private,
    /// 100.64/10, the carrier-grade NAT range.
    Shared,
    /// 198.18/15 and 2001:2::/48.
    Benchmarking,
    /// 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32 and 3fff::/20.
    Documentation,
    /// 240/4, never assigned.
    Reserved,
    Multicast,
    Broadcast,
    HostAddress,
    SandboxNetwork(IpNet),
}

impl fmt::Display for RefusedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefusedRange::Loopback => f.write_str("a loopback address"),
            RefusedRange::Unspecified => f.write_str("an unspecified address"),
            RefusedRange::LinkLocal => f.write_str("a link-local address"),
            RefusedRange::Private => f.write_str("a private address"),
            RefusedRange::Shared => f.write_str("a shared (carrier-grade NAT) address"),
            RefusedRange::Benchmarking => f.write_str("a benchmarking address"),
            RefusedRange::Documentation => f.write_str("a documentation address"),
            RefusedRange::Reserved => f.write_str("a reserved address"),
            RefusedRange::Multicast => f.write_str("a multicast address"),
            RefusedRange::Broadcast => f.write_str("the broadcast address"),
            RefusedRange::HostAddress => f.write_str("an address of this host"),
            RefusedRange::SandboxNetwork(net) => {
                write!(f, "an address in the sandbox network {net}")
            }
        }
    }
}

/// A registry (or a host a registry sent the server to) that may not be contacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "registry {registry} resolves to {address}, {range}; the operator can allow it with --allow-registry"
)]
pub struct RegistryRefused {
    /// `host:port` as the server would have contacted it.
    pub registry: String,
    pub address: IpAddr,
    pub range: RefusedRange,
}

/// Whether `address`, which `host` (a name or an address, as a URL has it) resolved to, may
/// be contacted on `port`. `host_addresses` are the host's own addresses.
pub fn check_address(
    rule: &AddressRule,
    host_addresses: &[IpAddr],
    host: &str,
    port: u16,
    address: IpAddr,
) -> Result<(), RegistryRefused> {
    if rule
        .allowed
        .iter()
        .any(|entry| entry.matches(host, port, address))
    {
        return Ok(());
    }
    let address = canonical(address);
    // The sandbox network first: it usually lies in a private range, and is the more
    // telling name.
    let judge = |address: IpAddr| {
        rule.sandbox_networks
            .iter()
            .find(|net| net.contains(&address))
            .map(|net| RefusedRange::SandboxNetwork(*net))
            .or_else(|| special_range(address))
            .or_else(|| {
                host_addresses
                    .iter()
                    .any(|own| canonical(*own) == address)
                    .then_some(RefusedRange::HostAddress)
            })
    };
    // A local-use NAT64 address carries its IPv4 address where the translator's prefix
    // length puts it, which only the translator knows: every place it may be must pass.
    let range = judge(address).or_else(|| {
        local_nat64_candidates(address)
            .into_iter()
            .find_map(|v4| judge(IpAddr::V4(v4)))
    });
    match range {
        Some(range) => Err(RegistryRefused {
            registry: label(host, port),
            address,
            range,
        }),
        None => Ok(()),
    }
}

/// IPv6 forms that reach one IPv4 address are judged as that address: mapped
/// (`::ffff:a.b.c.d`), compatible (`::a.b.c.d`), translated (`::ffff:0:a.b.c.d`), 6to4
/// (`2002:AABB:CCDD::/48`) and the well-known NAT64 prefix (`64:ff9b::a.b.c.d`).
fn canonical(address: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = address else {
        return address;
    };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    let segments = v6.segments();
    let octets = v6.octets();
    let last_four = || {
        IpAddr::V4(Ipv4Addr::new(
            octets[12], octets[13], octets[14], octets[15],
        ))
    };
    // `::` and `::1` are IPv6's own unspecified and loopback addresses, not compatible forms.
    if segments[..6] == [0; 6] && !v6.is_unspecified() && !v6.is_loopback() {
        return last_four();
    }
    if segments[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return last_four();
    }
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return last_four();
    }
    if segments[0] == 0x2002 {
        return IpAddr::V4(Ipv4Addr::new(octets[2], octets[3], octets[4], octets[5]));
    }
    address
}

/// The IPv4 addresses a local-use NAT64 address (`64:ff9b:1::/48`) may carry, one per prefix
/// length its translator may use (RFC 6052: /48, /56, /64 and /96; bits 64 to 71 are
/// skipped); none for other addresses.
fn local_nat64_candidates(address: IpAddr) -> Vec<Ipv4Addr> {
    let IpAddr::V6(v6) = address else {
        return Vec::new();
    };
    if v6.segments()[..3] != [0x64, 0xff9b, 1] {
        return Vec::new();
    }
    let o = v6.octets();
    vec![
        Ipv4Addr::new(o[6], o[7], o[9], o[10]),
        Ipv4Addr::new(o[7], o[9], o[10], o[11]),
        Ipv4Addr::new(o[9], o[10], o[11], o[12]),
        Ipv4Addr::new(o[12], o[13], o[14], o[15]),
    ]
}

/// Whether `address` lies in `net/prefix`.
fn within_v4(address: Ipv4Addr, net: [u8; 4], prefix: u32) -> bool {
    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
    u32::from(address) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

/// Whether `address` lies in `net/prefix`.
fn within_v6(address: Ipv6Addr, net: [u16; 8], prefix: u32) -> bool {
    let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
    u128::from(address) & mask == u128::from(Ipv6Addr::from(net)) & mask
}

fn special_range(address: IpAddr) -> Option<RefusedRange> {
    match address {
        IpAddr::V4(v4) => {
            let ranges: [([u8; 4], u32, RefusedRange); 14] = [
                // All of 0.0.0.0/8 rather than just 0.0.0.0: Linux connects 0.0.0.0 to itself.
                ([0, 0, 0, 0], 8, RefusedRange::Unspecified),
                ([127, 0, 0, 0], 8, RefusedRange::Loopback),
                ([169, 254, 0, 0], 16, RefusedRange::LinkLocal),
                ([10, 0, 0, 0], 8, RefusedRange::Private),
                ([172, 16, 0, 0], 12, RefusedRange::Private),
                ([192, 168, 0, 0], 16, RefusedRange::Private),
                ([100, 64, 0, 0], 10, RefusedRange::Shared),
                ([198, 18, 0, 0], 15, RefusedRange::Benchmarking),
                ([192, 0, 2, 0], 24, RefusedRange::Documentation),
                ([198, 51, 100, 0], 24, RefusedRange::Documentation),
                ([203, 0, 113, 0], 24, RefusedRange::Documentation),
                ([224, 0, 0, 0], 4, RefusedRange::Multicast),
                ([255, 255, 255, 255], 32, RefusedRange::Broadcast),
                ([240, 0, 0, 0], 4, RefusedRange::Reserved),
            ];
            ranges
                .into_iter()
                .find(|(net, prefix, _)| within_v4(v4, *net, *prefix))
                .map(|(_, _, range)| range)
        }
        IpAddr::V6(v6) => {
            let ranges: [([u16; 8], u32, RefusedRange); 8] = [
                ([0; 8], 128, RefusedRange::Unspecified),
                ([0, 0, 0, 0, 0, 0, 0, 1], 128, RefusedRange::Loopback),
                ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, RefusedRange::LinkLocal),
                ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, RefusedRange::Private),
                (
                    [0x2001, 2, 0, 0, 0, 0, 0, 0],
                    48,
                    RefusedRange::Benchmarking,
                ),
                (
                    [0x2001, 0xdb8, 0, 0, 0, 0, 0, 0],
                    32,
                    RefusedRange::Documentation,
                ),
                (
                    [0x3fff, 0, 0, 0, 0, 0, 0, 0],
                    20,
                    RefusedRange::Documentation,
                ),
                ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, RefusedRange::Multicast),
            ];
            ranges
                .into_iter()
                .find(|(net, prefix, _)| within_v6(v6, *net, *prefix))
                .map(|(_, _, range)| range)
        }
    }
}

/// `[::1]` as a URL writes it, `::1` as an address.
fn bare(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

fn label(host: &str, port: u16) -> String {
    let host = bare(host);
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Where a URL leads: its host as written and its port, and the address when the host is one
/// (such a URL is connected to without any name lookup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Destination {
    pub host: String,
    pub port: u16,
    pub literal: Option<IpAddr>,
}

impl Destination {
    /// `None` for URLs that are not http(s) or have no host.
    pub(crate) fn of(url: &Url) -> Option<Self> {
        if !matches!(url.scheme(), "http" | "https") {
            return None;
        }
        let port = url.port_or_known_default()?;
        let (host, literal) = match url.host()? {
            Host::Domain(name) => (name.to_owned(), None),
            Host::Ipv4(v4) => (v4.to_string(), Some(IpAddr::V4(v4))),
            Host::Ipv6(v6) => (v6.to_string(), Some(IpAddr::V6(v6))),
        };
        Some(Self {
            host,
            port,
            literal,
        })
    }
}

/// Why a name could not be turned into addresses the server may contact.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error(transparent)]
    Refused(#[from] RegistryRefused),
    #[error("cannot resolve {host}: {source}")]
    Lookup {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{host} resolves to no address")]
    NoAddress { host: String },
}

/// The rule with its inputs, shared by every pull and by build requests.
#[derive(Debug)]
pub struct RegistryPolicy {
    rule: AddressRule,
    plain_http_hosts: Vec<String>,
    host_addresses: Mutex<(Instant, Arc<[IpAddr]>)>,
}

impl RegistryPolicy {
    /// `allowed`: registries the operator allows whatever their addresses. `plain_http_hosts`:
    /// registries reached over plain HTTP besides localhost, 127.0.0.1 and [::1] (`host:port`
    /// names one registry, a bare `host` every port of it); the operator named them, so they
    /// are allowed too. `sandbox_networks`: the ranges sandboxes are numbered from.
    pub fn new(
        allowed: Vec<AllowedRegistry>,
        plain_http_hosts: Vec<String>,
        sandbox_networks: Vec<IpNet>,
    ) -> Result<Self, AllowedRegistryError> {
        let mut allowed = allowed;
        for host in &plain_http_hosts {
            allowed.push(host.parse()?);
        }
        let own = read_host_addresses();
        Ok(Self {
            rule: AddressRule {
                allowed,
                sandbox_networks,
            },
            plain_http_hosts,
            host_addresses: Mutex::new((Instant::now(), own.into())),
        })
    }

    pub(crate) fn plain_http_hosts(&self) -> &[String] {
        &self.plain_http_hosts
    }

    /// The host's addresses, read again when the last reading is a few seconds old.
    pub fn host_addresses(&self) -> Arc<[IpAddr]> {
        let mut cached = self
            .host_addresses
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if cached.0.elapsed() >= HOST_ADDRESSES_TTL {
            *cached = (Instant::now(), read_host_addresses().into());
        }
        Arc::clone(&cached.1)
    }

    /// [`check_address`] with this policy's inputs.
    pub fn check(&self, host: &str, port: u16, address: IpAddr) -> Result<(), RegistryRefused> {
        check_address(&self.rule, &self.host_addresses(), host, port, address)
    }

    /// Resolves `host` and keeps the addresses that may be contacted on `port`; refused when
    /// none is left.
    pub(crate) async fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        let found = tokio::net::lookup_host((bare(host), port))
            .await
            .map_err(|source| ResolveError::Lookup {
                host: host.to_owned(),
                source,
            })?;
        let mut kept = Vec::new();
        let mut refused = None;
        for address in found {
            match self.check(host, port, address.ip()) {
                Ok(()) => kept.push(address),
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        match (kept.is_empty(), refused) {
            (false, _) => Ok(kept),
            (true, Some(refused)) => Err(ResolveError::Refused(refused)),
            (true, None) => Err(ResolveError::NoAddress {
                host: host.to_owned(),
            }),
        }
    }
}

/// The addresses of the host's interfaces; none (with a warning) when they cannot be read, the
/// other ranges still apply then.
fn read_host_addresses() -> Vec<IpAddr> {
    match interface_addresses() {
        Ok(addresses) => addresses,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the host's addresses for the registry rule");
            Vec::new()
        }
    }
}

fn interface_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs only writes the head of a list it allocates, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut node = head;
    while !node.is_null() {
        // SAFETY: `node` is an element of the list getifaddrs returned, alive until
        // freeifaddrs.
        let entry = unsafe { &*node };
        if !entry.ifa_addr.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr whose family names its real type,
            // which is checked before the cast.
            let family = i32::from(unsafe { (*entry.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                addresses.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in6>() };
                addresses.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        node = entry.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and no reference into the list outlives this call.
    unsafe { libc::freeifaddrs(head) };
    addresses.sort_unstable();
    addresses.dedup();
    Ok(addresses)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Addresses outside every refused range; nothing here sends a packet.
    const PUBLIC_V4: &str = "11.0.0.5";
    const PUBLIC_V6: &str = "2a00::1";
    const HOST_V4: &str = "11.9.8.7";
    const HOST_V6: &str = "2a00::7";

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn rule(allowed: &[&str]) -> AddressRule {
        AddressRule {
            allowed: allowed.iter().map(|a| a.parse().unwrap()).collect(),
            sandbox_networks: vec!["10.213.0.0/16".parse().unwrap()],
        }
    }

    fn check(rule: &AddressRule, host: &str, port: u16, address: &str) -> Result<(), RefusedRange> {
        check_address(rule, &[ip(HOST_V4), ip(HOST_V6)], host, port, ip(address))
            .map_err(|e| e.range)
    }

    /// Checks each case of `cases` (host, port, the address it resolves to, the verdict).
    fn check_all(rule: &AddressRule, cases: &[(&str, u16, &str, Result<(), RefusedRange>)]) {
        for (host, port, address, judged) in cases {
            assert_eq!(
                check(rule, host, *port, address),
                *judged,
                "{host}:{port} at {address}"
            );
        }
    }

    #[test]
    fn special_addresses_are_refused() {
        let rule = rule(&[]);
        let cases = [
            ("127.0.0.1", RefusedRange::Loopback),
            ("127.45.6.7", RefusedRange::Loopback),
            ("::1", RefusedRange::Loopback),
            ("0.0.0.0", RefusedRange::Unspecified),
            ("0.1.2.3", RefusedRange::Unspecified),
            ("::", RefusedRange::Unspecified),
            ("169.254.169.254", RefusedRange::LinkLocal),
            ("169.254.0.1", RefusedRange::LinkLocal),
            ("fe80::1", RefusedRange::LinkLocal),
            ("febf::1", RefusedRange::LinkLocal),
            ("224.0.0.1", RefusedRange::Multicast),
            ("ff02::1", RefusedRange::Multicast),
            ("255.255.255.255", RefusedRange::Broadcast),
        ];
        for (address, range) in cases {
            assert_eq!(
                check(&rule, address, 5000, address),
                Err(range),
                "{address}"
            );
        }
    }

    #[test]
    fn ipv4_written_as_ipv6_is_judged_as_ipv4() {
        let rule = rule(&[]);
        for (address, range) in [
            ("::ffff:127.0.0.1", RefusedRange::Loopback),
            ("::ffff:169.254.169.254", RefusedRange::LinkLocal),
            ("::ffff:0.0.0.0", RefusedRange::Unspecified),
            ("::127.0.0.1", RefusedRange::Loopback),
            ("::169.254.169.254", RefusedRange::LinkLocal),
            (
                "::ffff:10.213.4.2",
                RefusedRange::SandboxNetwork("10.213.0.0/16".parse().unwrap()),
            ),
            ("::ffff:11.9.8.7", RefusedRange::HostAddress),
        ] {
            assert_eq!(
                check(&rule, "registry.test", 443, address),
                Err(range),
                "{address}"
            );
        }
        assert_eq!(
            check(&rule, "registry.test", 443, "::ffff:11.0.0.5"),
            Ok(())
        );
    }

    #[test]
    fn host_and_sandbox_addresses_are_refused() {
        let sandboxes = "10.213.0.0/16".parse().unwrap();
        check_all(
            &rule(&[]),
            &[
                ("x.test", 443, HOST_V4, Err(RefusedRange::HostAddress)),
                ("x.test", 443, HOST_V6, Err(RefusedRange::HostAddress)),
                (
                    "x.test",
                    443,
                    "10.213.0.1",
                    Err(RefusedRange::SandboxNetwork(sandboxes)),
                ),
                // Private ranges that are neither the host's nor the sandboxes' are private
                // still.
                ("x.test", 443, "10.214.0.1", Err(RefusedRange::Private)),
            ],
        );
    }

    /// Each range by an address at each of its edges and the addresses just outside them.
    #[test]
    fn every_range_is_refused_up_to_its_edges() {
        use RefusedRange::*;
        let rule = AddressRule::default();
        let cases: &[(&str, &str, &str, &str, RefusedRange)] = &[
            // (just below, first, last, just above, range)
            (
                "9.255.255.255",
                "10.0.0.0",
                "10.255.255.255",
                "11.0.0.0",
                Private,
            ),
            (
                "172.15.255.255",
                "172.16.0.0",
                "172.31.255.255",
                "172.32.0.0",
                Private,
            ),
            (
                "192.167.255.255",
                "192.168.0.0",
                "192.168.255.255",
                "192.169.0.0",
                Private,
            ),
            (
                "100.63.255.255",
                "100.64.0.0",
                "100.127.255.255",
                "100.128.0.0",
                Shared,
            ),
            (
                "198.17.255.255",
                "198.18.0.0",
                "198.19.255.255",
                "198.20.0.0",
                Benchmarking,
            ),
            (
                "192.0.1.255",
                "192.0.2.0",
                "192.0.2.255",
                "192.0.3.0",
                Documentation,
            ),
            (
                "198.51.99.255",
                "198.51.100.0",
                "198.51.100.255",
                "198.51.101.0",
                Documentation,
            ),
            (
                "203.0.112.255",
                "203.0.113.0",
                "203.0.113.255",
                "203.0.114.0",
                Documentation,
            ),
            (
                "223.255.255.255",
                "224.0.0.0",
                "239.255.255.255",
                "240.0.0.0",
                Multicast,
            ),
            (
                "239.255.255.255",
                "240.0.0.0",
                "255.255.255.254",
                "255.255.255.255",
                Reserved,
            ),
            (
                "1.0.0.0",
                "0.0.0.0",
                "0.255.255.255",
                "1.0.0.1",
                Unspecified,
            ),
            (
                "fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fc00::",
                "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fe00::",
                Private,
            ),
            (
                "2001:1:ffff:ffff:ffff:ffff:ffff:ffff",
                "2001:2::",
                "2001:2:0:ffff:ffff:ffff:ffff:ffff",
                "2001:2:1::",
                Benchmarking,
            ),
            (
                "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
                "2001:db8::",
                "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff",
                "2001:db9::",
                Documentation,
            ),
            (
                "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "3fff::",
                "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff",
                "3fff:1000::",
                Documentation,
            ),
            (
                "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "ff00::",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fe00::1",
                Multicast,
            ),
        ];
        for (below, first, last, above, range) in cases {
            for inside in [first, last] {
                assert_eq!(check(&rule, inside, 443, inside), Err(*range), "{inside}");
            }
            for outside in [below, above] {
                assert_ne!(
                    check(&rule, outside, 443, outside),
                    Err(*range),
                    "{outside}"
                );
            }
        }
        // The broadcast address is named as such, not as the reserved range around it.
        assert_eq!(
            check(&rule, "x.test", 443, "255.255.255.255"),
            Err(Broadcast)
        );
    }

    #[test]
    fn ipv6_forms_of_ipv4_addresses_are_judged_by_the_ipv4_address() {
        use RefusedRange::*;
        let rule = AddressRule::default();
        for (address, judged) in [
            // IPv4-mapped, compatible and translated.
            ("::ffff:10.1.2.3", Err(Private)),
            ("::ffff:11.1.2.3", Ok(())),
            ("::100.64.0.1", Err(Shared)),
            ("::100.128.0.1", Ok(())),
            ("::ffff:0:192.168.0.1", Err(Private)),
            ("::ffff:0:192.169.0.1", Ok(())),
            // 6to4: the IPv4 address follows 2002:.
            ("2002:a00:1::1", Err(Private)),
            ("2002:b00:1::1", Ok(())),
            ("2002:a9fe:a9fe::", Err(LinkLocal)),
            ("2002:7f00:1::", Err(Loopback)),
            ("2002:c612:1::", Err(Benchmarking)),
            ("2002:c614:1::", Ok(())),
            // The well-known NAT64 prefix: the last 32 bits.
            ("64:ff9b::10.0.0.1", Err(Private)),
            ("64:ff9b::169.254.169.254", Err(LinkLocal)),
            ("64:ff9b::127.0.0.1", Err(Loopback)),
            ("64:ff9b::11.0.0.1", Ok(())),
            // Just outside the /96.
            ("64:ff9b:0:0:0:1:a00:1", Ok(())),
            // Local-use NAT64: every place the IPv4 address may be, by prefix length.
            // 10.x where a /48 translator puts it, 11.x wherever the others would.
            ("64:ff9b:1:a0b:b:b0b:b00:1", Err(Private)),
            // ... where a /56 one does.
            ("64:ff9b:1:b0a:b:b0b:b00:1", Err(Private)),
            // ... where a /64 one does.
            ("64:ff9b:1:b0b:a:b0b:b00:1", Err(Private)),
            // ... where a /96 one does.
            ("64:ff9b:1:b0b:b:b0b:a00:1", Err(Private)),
            ("64:ff9b:1:b0b:b:b0b:b00:1", Ok(())),
            // Just outside the /48.
            ("64:ff9b:2::10.0.0.1", Ok(())),
        ] {
            assert_eq!(check(&rule, "x.test", 443, address), judged, "{address}");
        }
        // What a refusal names is the IPv4 address the IPv6 one reaches.
        let err = check_address(&rule, &[], "x.test", 443, ip("2002:a00:1::1")).unwrap_err();
        assert_eq!(err.address, ip("10.0.0.1"));
    }

    #[test]
    fn the_operator_list_allows_the_new_ranges_too() {
        let rule = rule(&["registry.lan", "10.0.0.9:5000", "[fd12::1]"]);
        check_all(
            &rule,
            &[
                ("registry.lan", 443, "192.168.1.2", Ok(())),
                ("10.0.0.9", 5000, "10.0.0.9", Ok(())),
                ("10.0.0.9", 5001, "10.0.0.9", Err(RefusedRange::Private)),
                ("mirror.test", 80, "fd12::1", Ok(())),
                ("mirror.test", 80, "fd12::2", Err(RefusedRange::Private)),
            ],
        );
    }

    #[test]
    fn public_looking_addresses_pass() {
        let rule = rule(&[]);
        assert_eq!(check(&rule, PUBLIC_V4, 443, PUBLIC_V4), Ok(()));
        assert_eq!(check(&rule, "registry.test", 5000, PUBLIC_V6), Ok(()));
    }

    #[test]
    fn the_operator_list_overrides() {
        let host_wide = rule(&["127.0.0.1", "Registry.LAN", "[::1]:5000"]);
        check_all(
            &host_wide,
            &[
                ("127.0.0.1", 1, "127.0.0.1", Ok(())),
                ("127.0.0.1", 65535, "127.0.0.1", Ok(())),
                // A name the operator listed may resolve to anything, on any port.
                ("registry.lan", 5000, "10.213.0.9", Ok(())),
                ("REGISTRY.lan.", 443, HOST_V4, Ok(())),
                // A listed address also covers other names resolving to it.
                ("elsewhere.test", 80, "::ffff:127.0.0.1", Ok(())),
                ("[::1]", 5000, "::1", Ok(())),
                ("[::1]", 5001, "::1", Err(RefusedRange::Loopback)),
            ],
        );

        let one_port = rule(&["127.0.0.1:5000", "localhost:6000"]);
        check_all(
            &one_port,
            &[
                ("127.0.0.1", 5000, "127.0.0.1", Ok(())),
                ("127.0.0.1", 5001, "127.0.0.1", Err(RefusedRange::Loopback)),
                ("localhost", 6000, "::1", Ok(())),
                ("localhost", 6001, "127.0.0.1", Err(RefusedRange::Loopback)),
                // Other hosts are not allowed by someone else's entry.
                (
                    "metadata.test",
                    80,
                    "169.254.169.254",
                    Err(RefusedRange::LinkLocal),
                ),
            ],
        );
    }

    #[test]
    fn refusals_name_the_registry_the_address_and_the_rule() {
        let err = check_address(&rule(&[]), &[], "127.0.0.1", 5000, ip("127.0.0.1")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "registry 127.0.0.1:5000 resolves to 127.0.0.1, a loopback address; the operator can allow it with --allow-registry"
        );
        let err = check_address(&rule(&[]), &[], "::1", 443, ip("::1")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("registry [::1]:443 resolves to ::1,"),
            "{err}"
        );
        let err = check_address(
            &rule(&[]),
            &[],
            "meta.test",
            80,
            ip("::ffff:169.254.169.254"),
        )
        .unwrap_err();
        assert_eq!(err.address, ip("169.254.169.254"));
        assert!(err.to_string().contains("a link-local address"), "{err}");
    }

    #[test]
    fn allowed_registries_parse() {
        let parsed = |text: &str| text.parse::<AllowedRegistry>().map(|a| a.to_string());
        assert_eq!(parsed("127.0.0.1:5000").unwrap(), "127.0.0.1:5000");
        assert_eq!(parsed(" Registry.LAN ").unwrap(), "registry.lan");
        assert_eq!(parsed("[::1]:5000").unwrap(), "[::1]:5000");
        assert_eq!(parsed("[fd00::1]").unwrap(), "fd00::1");
        assert_eq!(parsed("fd00::1").unwrap(), "fd00::1");
        for bad in [
            "",
            ":5000",
            "host:",
            "host:99999",
            "host:5x",
            "http://host",
            "a/b",
            "a:b:5000",
            "[::1",
            "[x]:1",
            "[::1]5000",
        ] {
            assert_eq!(
                parsed(bad),
                Err(AllowedRegistryError(bad.to_owned())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn destinations_come_from_urls() {
        let of = |url: &str| Destination::of(&Url::parse(url).unwrap());
        let d = of("https://ghcr.io/v2/").unwrap();
        assert_eq!((d.host.as_str(), d.port, d.literal), ("ghcr.io", 443, None));
        assert_eq!(label(&d.host, d.port), "ghcr.io:443");
        let d = of("http://127.0.0.1:5000/v2/").unwrap();
        assert_eq!((d.port, d.literal), (5000, Some(ip("127.0.0.1"))));
        // Numeric spellings of an address are addresses, not names to look up.
        assert_eq!(
            of("http://2130706433/").unwrap().literal,
            Some(ip("127.0.0.1"))
        );
        assert_eq!(
            of("http://0x7f.1:80/").unwrap().literal,
            Some(ip("127.0.0.1"))
        );
        let d = of("http://[::ffff:127.0.0.1]:80/").unwrap();
        assert_eq!(label(&d.host, d.port), "[::ffff:127.0.0.1]:80");
        assert!(of("ftp://example.test/").is_none());
        assert!(of("file:///etc/passwd").is_none());
    }

    #[test]
    fn the_host_has_addresses() {
        // Every Linux host has a loopback interface.
        let own = interface_addresses().unwrap();
        assert!(own.contains(&ip("127.0.0.1")), "{own:?}");
    }

    #[tokio::test]
    async fn plain_http_registries_count_as_allowed() {
        let policy = RegistryPolicy::new(vec![], vec!["127.0.0.1:5000".into()], vec![]).unwrap();
        assert!(policy.check("127.0.0.1", 5000, ip("127.0.0.1")).is_ok());
        // Only the listed port is let through.
        assert_eq!(
            policy.check("127.0.0.1", 5001, ip("127.0.0.1")),
            Err(RegistryRefused {
                registry: "127.0.0.1:5001".into(),
                address: ip("127.0.0.1"),
                range: RefusedRange::Loopback,
            })
        );
        let Err(refused) = RegistryPolicy::new(vec![], vec!["bad/host".into()], vec![]) else {
            panic!("a plain-HTTP host that is not a host was taken");
        };
        assert_eq!(refused, AllowedRegistryError("bad/host".into()));
    }

    #[tokio::test]
    async fn references_are_checked_without_contacting_anyone() {
        let policy =
            RegistryPolicy::new(vec!["127.0.0.1:5000".parse().unwrap()], vec![], vec![]).unwrap();
        let err = policy
            .check_reference("127.0.0.1:5001/x/y:1")
            .await
            .unwrap_err();
        assert_eq!(err.registry, "127.0.0.1:5001");
        assert_eq!(err.range, RefusedRange::Loopback);
        let err = policy
            .check_reference("2130706433:80/x/y")
            .await
            .unwrap_err();
        assert_eq!(
            (err.registry.as_str(), err.range),
            ("127.0.0.1:80", RefusedRange::Loopback)
        );
        // `localhost` is a name: resolved (by the hosts file), then refused on ports the listed
        // address does not cover.
        let err = policy
            .check_reference("localhost:5002/x/y")
            .await
            .unwrap_err();
        assert_eq!(err.range, RefusedRange::Loopback);
        policy
            .check_reference("127.0.0.1:5000/x/y:1")
            .await
            .unwrap();
        // Unparseable references are the pull's to report.
        policy.check_reference("Not A Reference").await.unwrap();
    }
}
