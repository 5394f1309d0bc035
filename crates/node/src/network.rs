//! Sandbox networking: each sandbox gets its own network namespace joined to the host by a
//! veth pair on a /30 of a private range. Traffic is routed, not bridged, so every packet
//! between sandboxes, or from a sandbox to the host, crosses the host's firewall.

use std::net::Ipv4Addr;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

/// Host-side interface names start with this; the firewall matches on it.
pub const IFACE_PREFIX: &str = "sbx";
/// Sandboxes allowed to reach the outside have host interfaces `sbxe<slot>`, isolated ones
/// `sbxi<slot>`: the firewall tells them apart by name, so starting a sandbox needs no
/// firewall change at all.
const EGRESS_MARK: char = 'e';
const ISOLATED_MARK: char = 'i';
const TABLE: &str = "sandbar";

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
    #[error("network slot {0} is outside the sandbox range")]
    SlotOutOfRange(u32),
}

/// The private range sandboxes are numbered from, one /30 per slot.
#[derive(Debug, Clone, Copy)]
pub struct Network {
    base: Ipv4Addr,
    prefix_len: u8,
}

/// Addresses of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddrs {
    pub host: Ipv4Addr,
    pub sandbox: Ipv4Addr,
}

async fn run(
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
        Self { base, prefix_len }
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
    pub async fn init(&self) -> Result<(), NetworkError> {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(NetworkError::Forwarding)?;
        let p = IFACE_PREFIX;
        let ruleset = format!(
            "table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
  chain forward {{
    type filter hook forward priority filter - 1; policy accept;
    iifname \"{p}*\" oifname \"{p}*\" drop
    oifname \"{p}*\" ct state established,related accept
    oifname \"{p}*\" drop
    iifname \"{p}*\" ip daddr {{ 169.254.0.0/16, 224.0.0.0/4 }} drop
    iifname \"{p}{e}*\" accept
    iifname \"{p}*\" drop
  }}
  chain input {{
    type filter hook input priority filter - 1; policy accept;
    iifname \"{p}*\" ct state established,related accept
    iifname \"{p}*\" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {cidr} oifname != \"{p}*\" masquerade
  }}
}}
",
            cidr = self.cidr(),
            e = EGRESS_MARK,
        );
        run("nft", &["-f", "-"], Some(&ruleset), "the sandbox firewall").await
    }

    /// Connects the network namespace of `pid` to the host through slot `slot`.
    pub async fn attach(
        &self,
        slot: u32,
        pid: i32,
        egress: bool,
    ) -> Result<SlotAddrs, NetworkError> {
        let addrs = self.addrs(slot)?;
        let iface = iface_name(slot, egress);
        let host_side = format!(
            "link add {iface} type veth peer name eth0 netns {pid}\n\
             addr add {host}/30 dev {iface}\n\
             link set {iface} up\n",
            host = addrs.host,
        );
        run("ip", &["-batch", "-"], Some(&host_side), &iface).await?;
        // Reverse-path filtering drops packets whose source address does not belong to the
        // slot they arrive on.
        let _ = std::fs::write(format!("/proc/sys/net/ipv4/conf/{iface}/rp_filter"), "1");
        let inside = format!(
            "link set lo up\n\
             addr add {sandbox}/30 dev eth0\n\
             link set eth0 up\n\
             route add default via {host}\n",
            sandbox = addrs.sandbox,
            host = addrs.host,
        );
        let netns = format!("--net=/proc/{pid}/ns/net");
        run(
            "nsenter",
            &[&netns, "ip", "-batch", "-"],
            Some(&inside),
            &format!("the namespace of pid {pid}"),
        )
        .await?;
        Ok(addrs)
    }

    /// Removes what slot `slot` holds on the host. The veth pair normally dies with the
    /// sandbox's namespace; this covers a namespace that is somehow still alive.
    pub async fn release(&self, slot: u32) {
        for egress in [true, false] {
            let iface = iface_name(slot, egress);
            if iface_exists(&iface) {
                let _ = run("ip", &["link", "del", &iface], None, &iface).await;
            }
        }
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
        assert!(net.addrs(16384).is_err());
    }
}
