//! A sandbox's network settings as E2B's API describes them: egress rules (`allowOut`,
//! `denyOut`), and how its user ports may be reached (`allowPublicTraffic`, `maskRequestHost`).
//!
//! The settings are kept as the client sent them (so they read back unchanged) and parsed into
//! [`EgressRules`] for the runtime, which enforces them.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

/// Entries one `allowOut` or `denyOut` list may hold. Each becomes a set element or a pattern
/// the resolver checks, so the bound keeps both small; real policies name a handful of hosts.
pub const MAX_EGRESS_ENTRIES: usize = 100;
/// E2B's documented bound on `dnsServers`.
pub const MAX_DNS_SERVERS: usize = 10;
/// Longest `maskRequestHost`, placeholder included.
pub const MAX_MASK_HOST_LEN: usize = 255;
/// The placeholder of `maskRequestHost` that stands for the requested port.
pub const PORT_PLACEHOLDER: &str = "${PORT}";
/// The code interpreter's port (the SDKs' `JUPYTER_PORT`). E2B's code interpreter SDKs send
/// the sandbox's agent token (`X-Access-Token`) to it as they do to the agent, and the edge
/// requires it there: whoever may run code through the agent may run it here, nobody else.
pub const CODE_INTERPRETER_PORT: u16 = 49999;

/// Egress settings a running sandbox's owner may replace (`PUT /sandboxes/{id}/network`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressConfig {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
    /// Resolvers the sandbox may reach directly when `allow_out` names a domain; `None` when
    /// the client named none (the sandbox's own resolver, on its gateway, needs no rule).
    #[serde(default)]
    pub dns_servers: Option<Vec<String>>,
}

/// Everything a sandbox was created with about its network, beyond `allow_internet_access`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    #[serde(flatten)]
    pub egress: EgressConfig,
    /// Whether user ports answer without the sandbox's traffic access token.
    #[serde(default = "yes")]
    pub allow_public_traffic: bool,
    /// Host header sent to user ports instead of the client's, `${PORT}` replaced.
    #[serde(default)]
    pub mask_request_host: Option<String>,
}

fn yes() -> bool {
    true
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            egress: EgressConfig::default(),
            allow_public_traffic: true,
            mask_request_host: None,
        }
    }
}

impl NetworkConfig {
    /// Whether anything differs from a sandbox created without `network`.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Checks every field; the error names the offending field and entry.
    pub fn validate(&self, allow_internet_access: bool) -> Result<EgressRules, NetworkConfigError> {
        if let Some(mask) = &self.mask_request_host {
            validate_mask_host(mask)?;
        }
        self.egress.rules(allow_internet_access)
    }
}

/// The host header a user-port request is sent with under `mask`.
pub fn masked_host(mask: &str, port: u16) -> String {
    mask.replace(PORT_PLACEHOLDER, &port.to_string())
}

fn validate_mask_host(mask: &str) -> Result<(), NetworkConfigError> {
    let bad = |why: &str| NetworkConfigError::BadMaskHost {
        mask: mask.to_owned(),
        why: why.to_owned(),
    };
    if mask.is_empty() {
        return Err(bad("it is empty"));
    }
    if mask.len() > MAX_MASK_HOST_LEN {
        return Err(bad(&format!(
            "it is longer than {MAX_MASK_HOST_LEN} characters"
        )));
    }
    // What is left once the placeholder is filled in must be a valid Host header value.
    let filled = masked_host(mask, 1);
    if !filled
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b':' | b'[' | b']'))
    {
        return Err(bad(
            "a host may hold only letters, digits, '.', '-', '_', ':' and the ${PORT} placeholder",
        ));
    }
    Ok(())
}

/// A domain pattern of `allowOut`: `example.com` matches that name only, `*.example.com` every
/// name below it (at any depth) but not `example.com` itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainPattern {
    /// Lower case, without a trailing dot or the `*.` prefix.
    name: String,
    wildcard: bool,
}

impl DomainPattern {
    pub fn parse(text: &str) -> Option<Self> {
        let lower = text.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_owned()),
            None => (false, lower),
        };
        if name.is_empty() || name.len() > 253 {
            return None;
        }
        let labels: Vec<&str> = name.split('.').collect();
        let label_ok = |l: &&str| {
            crate::ids::is_plain_name(l, 63, b"-_") && !l.starts_with('-') && !l.ends_with('-')
        };
        if !labels.iter().all(label_ok) {
            return None;
        }
        // No top-level domain is numeric: `8.8.8.888` is a mistyped address, not a name.
        if labels
            .last()
            .is_some_and(|tld| tld.bytes().all(|c| c.is_ascii_digit()))
        {
            return None;
        }
        Some(Self { name, wildcard })
    }

    /// Whether `name` (any case, trailing dot or not) is covered by this pattern.
    pub fn matches(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.');
        if self.wildcard {
            name.len() > self.name.len() + 1
                && name[name.len() - self.name.len()..].eq_ignore_ascii_case(&self.name)
                && name.as_bytes()[name.len() - self.name.len() - 1] == b'.'
        } else {
            name.eq_ignore_ascii_case(&self.name)
        }
    }
}

impl std::fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            write!(f, "*.{}", self.name)
        } else {
            f.write_str(&self.name)
        }
    }
}

/// Egress rules in the form the runtime enforces them. Allowed destinations win over denied
/// ones; what neither list names is allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressRules {
    pub allow_nets: Vec<Ipv4Net>,
    pub allow_domains: Vec<DomainPattern>,
    pub deny_nets: Vec<Ipv4Net>,
}

impl EgressRules {
    /// No rule at all: the sandbox's egress is the node's default.
    pub fn is_empty(&self) -> bool {
        self.allow_nets.is_empty() && self.allow_domains.is_empty() && self.deny_nets.is_empty()
    }

    /// Whether everything not allowed is denied (`0.0.0.0/0` among the denied ranges).
    pub fn closes_all(&self) -> bool {
        self.deny_nets.iter().any(|n| n.prefix_len() == 0)
    }

    /// Whether the sandbox may reach nothing outside at all.
    pub fn is_isolated(&self) -> bool {
        self.closes_all() && self.allow_nets.is_empty() && self.allow_domains.is_empty()
    }

    /// Whether answers for `name` open the sandbox's egress to the addresses they carry.
    pub fn allows_domain(&self, name: &str) -> bool {
        self.allow_domains.iter().any(|p| p.matches(name))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetworkConfigError {
    #[error(
        "network.{field}[{index}] '{entry}' is not a CIDR block, an IPv4 address or a domain name"
    )]
    Invalid {
        field: &'static str,
        index: usize,
        entry: String,
    },
    #[error(
        "network.denyOut[{index}] '{entry}' is a domain name; deny rules take CIDR blocks and IP addresses only"
    )]
    DomainInDeny { index: usize, entry: String },
    #[error(
        "network.{field}[{index}] '{entry}' is an IPv6 destination; sandboxes have no IPv6 egress"
    )]
    Ipv6 {
        field: &'static str,
        index: usize,
        entry: String,
    },
    #[error("network.{field} has {count} entries; at most {max} are allowed")]
    TooMany {
        field: &'static str,
        count: usize,
        max: usize,
    },
    #[error("network.dnsServers[{index}] '{entry}' is not an IPv4 address")]
    BadDnsServer { index: usize, entry: String },
    #[error("network.maskRequestHost '{mask}' is invalid: {why}")]
    BadMaskHost { mask: String, why: String },
}

enum Destination {
    Net(Ipv4Net),
    Domain(DomainPattern),
}

fn parse_destination(
    field: &'static str,
    index: usize,
    entry: &str,
) -> Result<Destination, NetworkConfigError> {
    let text = entry.trim();
    if let Ok(addr) = text.parse::<Ipv4Addr>() {
        return Ok(Destination::Net(Ipv4Net::from(addr)));
    }
    if let Ok(net) = text.parse::<Ipv4Net>() {
        return Ok(Destination::Net(net.trunc()));
    }
    if text.parse::<std::net::Ipv6Addr>().is_ok() || text.parse::<ipnet::Ipv6Net>().is_ok() {
        return Err(NetworkConfigError::Ipv6 {
            field,
            index,
            entry: entry.to_owned(),
        });
    }
    DomainPattern::parse(text)
        .map(Destination::Domain)
        .ok_or_else(|| NetworkConfigError::Invalid {
            field,
            index,
            entry: entry.to_owned(),
        })
}

fn check_len(field: &'static str, count: usize, max: usize) -> Result<(), NetworkConfigError> {
    if count > max {
        return Err(NetworkConfigError::TooMany { field, count, max });
    }
    Ok(())
}

impl EgressConfig {
    /// Parses the lists. `allow_internet_access: false` denies everything not allowed, as
    /// E2B documents it (the same as `0.0.0.0/0` in `denyOut`).
    pub fn rules(&self, allow_internet_access: bool) -> Result<EgressRules, NetworkConfigError> {
        check_len("allowOut", self.allow_out.len(), MAX_EGRESS_ENTRIES)?;
        check_len("denyOut", self.deny_out.len(), MAX_EGRESS_ENTRIES)?;
        let mut rules = EgressRules::default();
        for (index, entry) in self.allow_out.iter().enumerate() {
            match parse_destination("allowOut", index, entry)? {
                Destination::Net(net) => rules.allow_nets.push(net),
                Destination::Domain(pattern) => rules.allow_domains.push(pattern),
            }
        }
        for (index, entry) in self.deny_out.iter().enumerate() {
            match parse_destination("denyOut", index, entry)? {
                Destination::Net(net) => rules.deny_nets.push(net),
                Destination::Domain(_) => {
                    return Err(NetworkConfigError::DomainInDeny {
                        index,
                        entry: entry.clone(),
                    });
                }
            }
        }
        if let Some(servers) = &self.dns_servers {
            check_len("dnsServers", servers.len(), MAX_DNS_SERVERS)?;
            let mut parsed = Vec::with_capacity(servers.len());
            for (index, entry) in servers.iter().enumerate() {
                let addr = entry.trim().parse::<Ipv4Addr>().map_err(|_| {
                    NetworkConfigError::BadDnsServer {
                        index,
                        entry: entry.clone(),
                    }
                })?;
                parsed.push(Ipv4Net::from(addr));
            }
            // As E2B documents it: named resolvers are reachable only for domain rules.
            if !rules.allow_domains.is_empty() {
                rules.allow_nets.extend(parsed);
            }
        }
        if !allow_internet_access {
            rules.deny_nets.push(Ipv4Net::default());
        }
        Ok(rules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egress(allow: &[&str], deny: &[&str]) -> EgressConfig {
        EgressConfig {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            dns_servers: None,
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("net")
    }

    #[test]
    fn entries_parse_into_nets_and_domains() {
        let rules = egress(
            &["8.8.8.8", "10.1.2.3/16", "Example.COM.", "*.example.org"],
            &["0.0.0.0/0", "1.2.3.4"],
        )
        .rules(true)
        .expect("valid");
        assert_eq!(
            rules.allow_nets,
            vec![net("8.8.8.8/32"), net("10.1.0.0/16")]
        );
        assert_eq!(
            rules
                .allow_domains
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            vec!["example.com", "*.example.org"]
        );
        assert_eq!(rules.deny_nets, vec![net("0.0.0.0/0"), net("1.2.3.4/32")]);
        assert!(rules.closes_all());
        assert!(!rules.is_isolated());
    }

    #[test]
    fn bad_entries_are_named() {
        let err = egress(&["8.8.8.8", "not a host"], &[])
            .rules(true)
            .expect_err("invalid");
        assert_eq!(
            err.to_string(),
            "network.allowOut[1] 'not a host' is not a CIDR block, an IPv4 address or a domain name"
        );
        for bad in [
            "10.0.0.0/33",
            "8.8.8.888",
            "*",
            "*.",
            "-a.com",
            "a..b",
            "1.2.3.4/x",
            "",
        ] {
            assert!(
                matches!(
                    egress(&[bad], &[]).rules(true),
                    Err(NetworkConfigError::Invalid { .. })
                ),
                "{bad} should be refused"
            );
        }
        assert!(matches!(
            egress(&[], &["example.com"]).rules(true),
            Err(NetworkConfigError::DomainInDeny { index: 0, .. })
        ));
        assert!(matches!(
            egress(&["::1"], &[]).rules(true),
            Err(NetworkConfigError::Ipv6 { .. })
        ));
        assert!(matches!(
            egress(&[], &["2001:db8::/32"]).rules(true),
            Err(NetworkConfigError::Ipv6 { .. })
        ));
        let many: Vec<String> = (0..=MAX_EGRESS_ENTRIES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(matches!(
            egress(&refs, &[]).rules(true),
            Err(NetworkConfigError::TooMany {
                field: "allowOut",
                ..
            })
        ));
    }

    #[test]
    fn no_internet_access_denies_everything_not_allowed() {
        let closed = egress(&[], &[]).rules(false).expect("valid");
        assert!(closed.is_isolated());
        let opened = egress(&["example.com"], &[]).rules(false).expect("valid");
        assert!(opened.closes_all() && !opened.is_isolated());
        assert!(egress(&[], &[]).rules(true).expect("valid").is_empty());
    }

    #[test]
    fn dns_servers_open_only_with_domain_rules() {
        let mut config = egress(&["1.1.1.1"], &["0.0.0.0/0"]);
        config.dns_servers = Some(vec!["9.9.9.9".into()]);
        assert_eq!(config.rules(true).expect("valid").allow_nets.len(), 1);
        config.allow_out.push("example.com".into());
        assert_eq!(config.rules(true).expect("valid").allow_nets.len(), 2);
        config.dns_servers = Some(vec!["resolver".into()]);
        assert!(matches!(
            config.rules(true),
            Err(NetworkConfigError::BadDnsServer { index: 0, .. })
        ));
    }

    #[test]
    fn domain_patterns_match_names_and_subdomains() {
        let exact = DomainPattern::parse("example.com").expect("pattern");
        assert!(exact.matches("example.com"));
        assert!(exact.matches("EXAMPLE.com."));
        assert!(!exact.matches("www.example.com"));
        assert!(!exact.matches("badexample.com"));
        let wild = DomainPattern::parse("*.example.com").expect("pattern");
        assert!(wild.matches("www.example.com"));
        assert!(wild.matches("a.b.Example.com."));
        assert!(!wild.matches("example.com"));
        assert!(!wild.matches("wwwexample.com"));
        assert!(!wild.matches("example.com.evil.net"));
    }

    #[test]
    fn mask_hosts_fill_in_the_port() {
        assert_eq!(
            masked_host("${PORT}-app.example.com", 8080),
            "8080-app.example.com"
        );
        let config = |mask: &str| NetworkConfig {
            mask_request_host: Some(mask.into()),
            ..NetworkConfig::default()
        };
        assert!(config("${PORT}-app.example.com").validate(true).is_ok());
        assert!(config("app.example.com:8443").validate(true).is_ok());
        assert!(matches!(
            config("evil\r\nX-Injected: 1").validate(true),
            Err(NetworkConfigError::BadMaskHost { .. })
        ));
        let empty = config("").validate(true);
        assert!(
            matches!(&empty, Err(NetworkConfigError::BadMaskHost { why, .. }) if why == "it is empty"),
            "{empty:?}"
        );
    }

    #[test]
    fn stored_form_reads_back_with_defaults() {
        let config: NetworkConfig = serde_json::from_str("{}").expect("json");
        assert!(config.is_default());
        let config = NetworkConfig {
            egress: egress(&["example.com"], &["0.0.0.0/0"]),
            allow_public_traffic: false,
            mask_request_host: Some("x.example".into()),
        };
        let text = serde_json::to_string(&config).expect("json");
        assert_eq!(
            serde_json::from_str::<NetworkConfig>(&text).expect("json"),
            config
        );
    }
}
