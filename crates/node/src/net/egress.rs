//! Per-sandbox egress rules (`allowOut`, `denyOut`) in nftables, and the resolver's part in
//! them.
//!
//! A sandbox with rules gets a chain `e<slot>` and three sets in the node's table: allowed
//! ranges, denied ranges, and addresses its allowed domains resolved to. The forward chain
//! reaches the chain through the verdict map `egress` keyed by the sandbox's interface name,
//! so sandboxes without rules cost nothing but one failed map lookup per new connection.
//! Creating, replacing and removing a sandbox's rules is one `nft -f -` batch each.
//!
//! Domain rules are enforced through the sandbox's resolver (on its gateway): when a name that
//! an `allowOut` pattern matches is answered, the A records of the answer are added to the
//! sandbox's resolved set before the answer is returned, for at least the answer's TTL. Names
//! resolved any other way are not added, so they stay blocked when `denyOut` closes everything.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RData;
use sandbar_core::EgressRules;

use crate::net::network::{EGRESS_MAP, NetworkError, TABLE, run};

/// A resolved address stays allowed at least this long, even with a shorter TTL: clients
/// commonly connect a little after resolving, and many cache answers past tiny TTLs.
const MIN_RESOLVED_LIFETIME: Duration = Duration::from_secs(60);
/// And at most this long, whatever the TTL says.
const MAX_RESOLVED_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// Resolved addresses one sandbox may hold; beyond that new ones are not added (and so stay
/// blocked where everything else is), which bounds the set a sandbox can make the host keep.
const MAX_RESOLVED_PER_SANDBOX: usize = 4096;
/// How often expired resolved addresses are removed.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

fn chain(slot: u32) -> String {
    format!("e{slot}")
}

/// The batch that gives slot `slot` (host interface `iface`) its rules.
pub fn apply_batch(slot: u32, iface: &str, rules: &EgressRules) -> String {
    let c = chain(slot);
    let set = |name: &str, nets: &[ipnet::Ipv4Net]| {
        let elements = if nets.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = nets.iter().map(ToString::to_string).collect();
            format!(" elements = {{ {} }};", list.join(", "))
        };
        format!(
            "add set inet {TABLE} {c}_{name} {{ type ipv4_addr; flags interval; auto-merge;{elements} }}\n"
        )
    };
    let mut batch = String::new();
    batch.push_str(&format!("add chain inet {TABLE} {c}\n"));
    batch.push_str(&set("allow", &rules.allow_nets));
    batch.push_str(&set("deny", &rules.deny_nets));
    batch.push_str(&format!(
        "add set inet {TABLE} {c}_dns {{ type ipv4_addr; }}\n"
    ));
    // Allowed before denied: E2B's allow entries always win.
    batch.push_str(&format!(
        "add rule inet {TABLE} {c} ip daddr @{c}_allow accept\n"
    ));
    batch.push_str(&format!(
        "add rule inet {TABLE} {c} ip daddr @{c}_dns accept\n"
    ));
    batch.push_str(&format!(
        "add rule inet {TABLE} {c} ip daddr @{c}_deny drop\n"
    ));
    batch.push_str(&format!(
        "add element inet {TABLE} {EGRESS_MAP} {{ \"{iface}\" : jump {c} }}\n"
    ));
    batch
}

/// The batch that takes slot `slot`'s rules away (map entry first: a chain that is jumped to
/// cannot be deleted).
pub fn remove_batch(slot: u32, iface: &str) -> String {
    let c = chain(slot);
    format!(
        "delete element inet {TABLE} {EGRESS_MAP} {{ \"{iface}\" }}
flush chain inet {TABLE} {c}
delete chain inet {TABLE} {c}
delete set inet {TABLE} {c}_allow
delete set inet {TABLE} {c}_deny
delete set inet {TABLE} {c}_dns
"
    )
}

fn elements_batch(verb: &str, slot: u32, addrs: &[Ipv4Addr]) -> String {
    let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    format!(
        "{verb} element inet {TABLE} {}_dns {{ {} }}\n",
        chain(slot),
        list.join(", ")
    )
}

/// What the resolver does with a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryVerdict {
    Forward,
    /// Answer REFUSED without asking upstream.
    Refuse,
}

#[derive(Debug)]
struct Installed {
    slot: u32,
    iface: String,
    /// Addresses in the slot's resolved set, with when each may be removed.
    resolved: HashMap<Ipv4Addr, Instant>,
}

/// The rules this node has installed, by sandbox address.
#[derive(Debug, Default)]
pub struct Egress {
    /// Serialises batches and holds what is installed.
    installed: tokio::sync::Mutex<HashMap<Ipv4Addr, Installed>>,
    /// What the resolver reads on every query, without waiting on a batch.
    policies: RwLock<HashMap<Ipv4Addr, Arc<EgressRules>>>,
}

impl Egress {
    pub fn new() -> Arc<Self> {
        let egress = Arc::new(Self::default());
        let weak = Arc::downgrade(&egress);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                let Some(egress) = weak.upgrade() else {
                    return;
                };
                egress.expire().await;
            }
        });
        egress
    }

    fn policy(&self, client: IpAddr) -> Option<Arc<EgressRules>> {
        let IpAddr::V4(addr) = client else {
            return None;
        };
        self.policies
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&addr)
            .cloned()
    }

    /// Gives the sandbox at `sandbox` (slot `slot`, host interface `iface`) exactly `rules`,
    /// replacing what it had; empty rules remove its chain.
    pub async fn apply(
        &self,
        slot: u32,
        sandbox: Ipv4Addr,
        iface: &str,
        rules: &EgressRules,
    ) -> Result<(), NetworkError> {
        let mut installed = self.installed.lock().await;
        let mut batch = String::new();
        if let Some(old) = installed.get(&sandbox) {
            batch.push_str(&remove_batch(old.slot, &old.iface));
        }
        let enforce = !rules.is_empty();
        if enforce {
            batch.push_str(&apply_batch(slot, iface, rules));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        run("nft", &["-f", "-"], Some(&batch), "sandbox egress rules").await?;
        tracing::debug!(
            slot,
            batch_us = started.elapsed().as_micros() as u64,
            "egress rules applied"
        );
        installed.remove(&sandbox);
        let mut policies = self.policies.write().unwrap_or_else(|e| e.into_inner());
        policies.remove(&sandbox);
        if enforce {
            policies.insert(sandbox, Arc::new(rules.clone()));
            installed.insert(
                sandbox,
                Installed {
                    slot,
                    iface: iface.to_owned(),
                    resolved: HashMap::new(),
                },
            );
        }
        Ok(())
    }

    /// Removes whatever rules the sandbox at `sandbox` has (when it stops).
    pub async fn remove(&self, sandbox: Ipv4Addr) {
        let mut installed = self.installed.lock().await;
        let Some(old) = installed.remove(&sandbox) else {
            return;
        };
        self.policies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&sandbox);
        if let Err(e) = run(
            "nft",
            &["-f", "-"],
            Some(&remove_batch(old.slot, &old.iface)),
            "sandbox egress rules",
        )
        .await
        {
            tracing::error!(slot = old.slot, error = %e, "cannot remove egress rules");
        }
    }

    /// Whether the resolver should forward `query` from `client`. A sandbox whose egress is
    /// closed only gets names its allowed domains match resolved: any other query would still
    /// carry data out (in the name asked for) to whoever serves that name.
    pub fn admit(&self, client: IpAddr, query: &[u8]) -> QueryVerdict {
        let Some(rules) = self.policy(client) else {
            return QueryVerdict::Forward;
        };
        if !rules.closes_all() {
            return QueryVerdict::Forward;
        }
        let allowed = Message::from_vec(query).is_ok_and(|m| {
            !m.queries.is_empty()
                && m.queries
                    .iter()
                    .all(|q| rules.allows_domain(&q.name().to_ascii()))
        });
        if allowed {
            QueryVerdict::Forward
        } else {
            QueryVerdict::Refuse
        }
    }

    /// Called with each upstream answer before it goes back to `client`: opens the sandbox's
    /// egress to the addresses of names its allowed domains match.
    pub async fn answered(&self, client: IpAddr, answer: &[u8]) {
        let Some(rules) = self.policy(client) else {
            return;
        };
        if rules.allow_domains.is_empty() {
            return;
        }
        let IpAddr::V4(sandbox) = client else {
            return;
        };
        let Some(found) = resolved_addresses(&rules, answer) else {
            return;
        };
        let now = Instant::now();
        let mut installed = self.installed.lock().await;
        let Some(entry) = installed.get_mut(&sandbox) else {
            return;
        };
        let mut new = Vec::new();
        for (addr, ttl) in found {
            let until = now + ttl.clamp(MIN_RESOLVED_LIFETIME, MAX_RESOLVED_LIFETIME);
            let room = entry.resolved.len() < MAX_RESOLVED_PER_SANDBOX;
            match entry.resolved.get_mut(&addr) {
                Some(known) => *known = (*known).max(until),
                None if room => {
                    entry.resolved.insert(addr, until);
                    new.push(addr);
                }
                None => {
                    tracing::warn!(slot = entry.slot, %addr, "too many resolved addresses; not allowing more");
                }
            }
        }
        if new.is_empty() {
            return;
        }
        if let Err(e) = run(
            "nft",
            &["-f", "-"],
            Some(&elements_batch("add", entry.slot, &new)),
            "resolved egress addresses",
        )
        .await
        {
            for addr in &new {
                entry.resolved.remove(addr);
            }
            tracing::error!(slot = entry.slot, error = %e, "cannot allow resolved addresses");
        }
    }

    /// Removes resolved addresses whose time is up.
    async fn expire(&self) {
        let now = Instant::now();
        let mut installed = self.installed.lock().await;
        let mut batch = String::new();
        for entry in installed.values_mut() {
            let expired: Vec<Ipv4Addr> = entry
                .resolved
                .iter()
                .filter(|(_, until)| **until <= now)
                .map(|(addr, _)| *addr)
                .collect();
            if expired.is_empty() {
                continue;
            }
            for addr in &expired {
                entry.resolved.remove(addr);
            }
            batch.push_str(&elements_batch("delete", entry.slot, &expired));
        }
        if batch.is_empty() {
            return;
        }
        if let Err(e) = run(
            "nft",
            &["-f", "-"],
            Some(&batch),
            "expired egress addresses",
        )
        .await
        {
            tracing::error!(error = %e, "cannot remove expired resolved addresses");
        }
    }
}

/// The A records of `answer`, with their TTLs, if the question is a name `rules` allow.
fn resolved_addresses(rules: &EgressRules, answer: &[u8]) -> Option<Vec<(Ipv4Addr, Duration)>> {
    let message = Message::from_vec(answer).ok()?;
    if message.metadata.response_code != ResponseCode::NoError {
        return None;
    }
    let asked = message.queries.first()?.name().to_ascii();
    if !rules.allows_domain(&asked) {
        return None;
    }
    // Every A record counts, also those of CNAME targets: the chain was asked for by name.
    Some(
        message
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some((a.0, Duration::from_secs(u64::from(r.ttl)))),
                _ => None,
            })
            .collect(),
    )
}

/// A REFUSED answer to `query`, or nothing if the query cannot be read.
pub fn refusal(query: &[u8]) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    let mut answer = Message::error_msg(
        query.metadata.id,
        query.metadata.op_code,
        ResponseCode::Refused,
    );
    answer.add_queries(query.queries);
    answer.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, Record, RecordType, rdata};
    use sandbar_core::EgressConfig;

    fn rules(allow: &[&str], deny: &[&str]) -> EgressRules {
        EgressConfig {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            dns_servers: None,
        }
        .rules(true)
        .expect("valid rules")
    }

    fn query(name: &str) -> Message {
        let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
        m.add_query(Query::query(
            Name::from_ascii(name).expect("name"),
            RecordType::A,
        ));
        m
    }

    fn answer(name: &str, addrs: &[(Ipv4Addr, u32)]) -> Vec<u8> {
        let mut m = query(name);
        m.metadata.message_type = MessageType::Response;
        for (addr, ttl) in addrs {
            m.add_answer(Record::from_rdata(
                Name::from_ascii(name).expect("name"),
                *ttl,
                RData::A(rdata::A(*addr)),
            ));
        }
        m.to_vec().expect("encode")
    }

    #[test]
    fn apply_batch_orders_allow_before_deny_and_maps_the_interface() {
        let batch = apply_batch(
            7,
            "sbxe7",
            &rules(&["1.2.3.4", "10.0.0.0/8"], &["0.0.0.0/0"]),
        );
        assert!(batch.contains("add chain inet sandbar e7\n"));
        assert!(batch.contains("add set inet sandbar e7_allow { type ipv4_addr; flags interval; auto-merge; elements = { 1.2.3.4/32, 10.0.0.0/8 }; }"));
        assert!(batch.contains("add set inet sandbar e7_deny { type ipv4_addr; flags interval; auto-merge; elements = { 0.0.0.0/0 }; }"));
        let allow = batch.find("@e7_allow accept").expect("allow rule");
        let dns = batch.find("@e7_dns accept").expect("dns rule");
        let deny = batch.find("@e7_deny drop").expect("deny rule");
        assert!(allow < deny && dns < deny);
        assert!(batch.ends_with("add element inet sandbar egress { \"sbxe7\" : jump e7 }\n"));
        // Empty lists make empty sets rather than invalid `elements = { }`.
        let only_deny = apply_batch(1, "sbxe1", &rules(&[], &["1.1.1.1"]));
        assert!(only_deny.contains(
            "add set inet sandbar e1_allow { type ipv4_addr; flags interval; auto-merge; }"
        ));
    }

    #[test]
    fn remove_batch_unmaps_before_deleting() {
        let batch = remove_batch(3, "sbxe3");
        let lines: Vec<&str> = batch.lines().collect();
        assert_eq!(lines[0], "delete element inet sandbar egress { \"sbxe3\" }");
        assert_eq!(lines[1], "flush chain inet sandbar e3");
        assert_eq!(lines[2], "delete chain inet sandbar e3");
        assert_eq!(lines.len(), 6);
    }

    #[test]
    fn answers_for_allowed_names_yield_their_addresses() {
        let r = rules(&["*.example.com"], &["0.0.0.0/0"]);
        let addr = Ipv4Addr::new(192, 0, 2, 7);
        let found = resolved_addresses(&r, &answer("www.example.com.", &[(addr, 30)]))
            .expect("allowed name");
        assert_eq!(found, vec![(addr, Duration::from_secs(30))]);
        assert!(resolved_addresses(&r, &answer("www.example.org.", &[(addr, 30)])).is_none());
        assert!(resolved_addresses(&r, b"garbage").is_none());
    }

    #[tokio::test]
    async fn closed_sandboxes_resolve_only_allowed_names() {
        let egress = Egress::default();
        let sandbox = Ipv4Addr::new(10, 213, 0, 2);
        let closed = rules(&["example.com"], &["0.0.0.0/0"]);
        egress
            .policies
            .write()
            .expect("lock")
            .insert(sandbox, Arc::new(closed));
        let client = IpAddr::V4(sandbox);
        let allowed = query("example.com.").to_vec().expect("encode");
        let other = query("exfil.attacker.net.").to_vec().expect("encode");
        assert_eq!(egress.admit(client, &allowed), QueryVerdict::Forward);
        assert_eq!(egress.admit(client, &other), QueryVerdict::Refuse);
        // Sandboxes without rules, or whose egress is open, resolve anything.
        let elsewhere = IpAddr::V4(Ipv4Addr::new(10, 213, 0, 6));
        assert_eq!(egress.admit(elsewhere, &other), QueryVerdict::Forward);
        let refused = Message::from_vec(&refusal(&other).expect("refusal")).expect("decode");
        assert_eq!(refused.metadata.id, 0x1234);
        assert_eq!(refused.metadata.response_code, ResponseCode::Refused);
        assert_eq!(refused.queries.len(), 1);
    }
}
