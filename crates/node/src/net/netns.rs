//! Network namespaces made before sandboxes ask for them.
//!
//! Making a sandbox's network (a namespace, a veth pair, addresses, a route) costs a few
//! milliseconds of netlink round trips, most of them the veth pair itself. None of it depends
//! on the sandbox, only on its slot, so the node keeps a few namespaces wired and waiting: a
//! new sandbox takes one and its PID 1 joins it. The namespaces belong to the host's user
//! namespace, not to the sandbox's, so sandbox root cannot reconfigure its own interfaces and
//! the namespace can outlive the sandbox's processes while the node holds it.
//!
//! A waiting namespace is held only by a descriptor of this process: if the server exits, the
//! kernel removes it with its veth pair, and nothing is left to sweep.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rtnetlink::packet_route::link::{InfoData, InfoVeth};
use rtnetlink::{LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::net::network::{
    Network, NetworkError, SlotAddrs, if_index, iface_name, link_index, netlink_connection,
    netlink_runtime,
};

/// Per-namespace settings that give sandbox users what owning the namespace used to: low
/// ports (web servers on 80) and unprivileged ICMP sockets (`ping`).
const SYSCTLS: &[(&str, &str)] = &[
    ("net/ipv4/ip_unprivileged_port_start", "0"),
    ("net/ipv4/ping_group_range", "0 2147483647"),
];

/// A wired network namespace for one slot, waiting for a sandbox.
#[derive(Debug)]
pub struct PreparedNetns {
    pub slot: u32,
    pub netns: OwnedFd,
    /// An unbound Unix stream socket created inside the namespace: the agent's listener once
    /// bound. Made there so that everything the sandbox's processes hold belongs to their own
    /// network namespace (a checkpoint collects sockets by namespace).
    pub agent_socket: OwnedFd,
}

impl PreparedNetns {
    /// Binds the agent socket at `path` and starts listening, non-blocking: the agent polls
    /// its listener and accepts from one request thread, and this open file is what it gets,
    /// flags and all (through the boot's hand-off, or from CRIU at a restore). On a blocking
    /// listener its `accept` would wait for the next connection with the one just accepted
    /// unserved.
    pub fn listen_at(&self, path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
        // SAFETY: sockaddr_un is plain old data; all-zero is a valid value to fill in.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_os_str().as_bytes();
        if bytes.len() >= addr.sun_path.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("socket path {} is too long", path.display()),
            ));
        }
        for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
            *dst = *src as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        let fd = self.agent_socket.as_raw_fd();
        // SAFETY: `addr` is an initialised sockaddr_un and `len` does not exceed its size.
        let bound = unsafe {
            libc::bind(
                fd,
                &addr as *const libc::sockaddr_un as *const libc::sockaddr,
                len as libc::socklen_t,
            )
        };
        // SAFETY: listen on a socket we own.
        if bound != 0 || unsafe { libc::listen(fd, 128) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let listener = std::os::unix::net::UnixListener::from(self.agent_socket.try_clone()?);
        listener.set_nonblocking(true)?;
        Ok(listener)
    }
}

impl Network {
    /// Makes a network namespace for slot `slot` and connects it to the host: a veth pair whose
    /// host end is the slot's interface (named for egress or isolation), the sandbox end `eth0`
    /// with the slot's address and a default route through the host end. With a rate limit,
    /// both ends get it as their root qdisc (see `shaping`).
    pub async fn prepare(&self, slot: u32, egress: bool) -> Result<PreparedNetns, NetworkError> {
        let started = std::time::Instant::now();
        let addrs = self.addrs(slot)?;
        let iface = iface_name(slot, egress);
        let host = self.host_netlink().await?;
        let inside = new_namespace().await?;
        let shaping = self.shaping();
        let index = create_veth(&host, &iface, &inside, shaping).await?;
        let (host_side, sandbox_side) = tokio::join!(
            wire_host_end(&host, index, &iface, addrs, shaping),
            wire_sandbox_end(&inside, &iface, addrs, shaping)
        );
        if let Err(err) = host_side.and(sandbox_side) {
            // The namespace goes with its descriptor; the host end may outlive it briefly.
            drop(inside);
            self.release(slot).await;
            return Err(err);
        }
        tracing::debug!(
            slot,
            shaped = shaping.is_some(),
            prepare_us = started.elapsed().as_micros() as u64,
            "network namespace prepared"
        );
        Ok(PreparedNetns {
            slot,
            netns: inside.netns,
            agent_socket: inside.agent_socket,
        })
    }
}

/// Maps a failed netlink request of `step` on the slot's interface `iface` to the error
/// that names both.
fn netlink_fail(step: &str, iface: &str) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    let what = format!("{step} for {iface}");
    move |e: rtnetlink::Error| NetworkError::Netlink {
        what,
        message: e.to_string(),
    }
}

/// Maps a failure to set `link`'s rate limit to the error that names it.
fn shaping_fail(link: String) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    move |e: rtnetlink::Error| NetworkError::Shaping {
        iface: link,
        message: e.to_string(),
    }
}

/// Creates the slot's veth pair, its peer directly inside the new namespace and already
/// named eth0, and returns the host end's index.
async fn create_veth(
    host: &rtnetlink::Handle,
    iface: &str,
    inside: &NewNamespace,
    shaping: Option<crate::net::shaping::Shaping>,
) -> Result<u32, NetworkError> {
    // The host end comes up as it is made, unless it is to be shaped: a root qdisc set on a
    // running link waits for an RCU grace period while the link is deactivated, so both ends
    // get theirs before they come up. The peer cannot come up with its creation (a veth
    // refuses to open before its pair is complete), so it is brought up inside, alongside its
    // address.
    let peer = LinkUnspec::new_with_name("eth0")
        .setns_by_fd(inside.netns.as_raw_fd())
        .build();
    let veth = LinkVeth::new(iface, "eth0");
    let veth = if shaping.is_some() { veth } else { veth.up() }
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    host.link()
        .add(veth)
        .execute()
        .await
        .map_err(netlink_fail("create veth", iface))?;
    let index = if_index(iface).map_err(|e| NetworkError::Netlink {
        what: format!("find veth {iface}"),
        message: e.to_string(),
    })?;
    // Reverse-path filtering drops packets whose source address does not belong to the slot
    // they arrive on.
    let _ = write_host_sysctl(&format!("net/ipv4/conf/{iface}/rp_filter"), "1");
    // Sandboxes have no IPv6 beyond their own namespace (the firewall drops it), so the host
    // end needs no link-local address. Without one, bringing a link up or down no longer
    // walks the host's IPv6 routing table, which holds routes for every sandbox link: each
    // start and stop would cost time in proportion to the sandboxes running.
    let _ = write_host_sysctl(&format!("net/ipv6/conf/{iface}/disable_ipv6"), "1");
    Ok(index)
}

/// Writes a sysctl of the host's network namespace (the caller's) through the node's own
/// procfs instance (see `Sysctls`), made on first use: the one way every sysctl is written,
/// as a new namespace's are.
fn write_host_sysctl(name: &str, value: &str) -> std::io::Result<()> {
    static HOST: std::sync::OnceLock<Option<sandbar_jail::host::Sysctls>> =
        std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        sandbar_jail::host::Sysctls::new()
            .inspect_err(|e| tracing::warn!("cannot make a procfs instance for host sysctls: {e}"))
            .ok()
    })
    .as_ref()
    .ok_or_else(|| std::io::Error::other(format!("/proc/sys/{name}: no procfs instance")))?
    .write(name, value)
}

/// Gives the host end its address and, when shaped, its rate limit before it comes up.
async fn wire_host_end(
    host: &rtnetlink::Handle,
    index: u32,
    iface: &str,
    addrs: SlotAddrs,
    shaping: Option<crate::net::shaping::Shaping>,
) -> Result<(), NetworkError> {
    let address = host
        .address()
        .add(index, IpAddr::V4(addrs.host), 30)
        .execute();
    // Traffic to the sandbox leaves through the host end.
    let shaped_and_up = async {
        let Some(shaping) = shaping else {
            return Ok(());
        };
        shaping
            .apply(host, index)
            .await
            .map_err(shaping_fail(iface.to_owned()))?;
        host.link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(netlink_fail("bring up veth", iface))
    };
    let (address, shaped_and_up) = tokio::join!(address, shaped_and_up);
    address.map_err(netlink_fail("address veth", iface))?;
    shaped_and_up
}

/// Brings up `lo` and `eth0` inside the namespace, with eth0's address, rate limit and the
/// default route through the host end.
async fn wire_sandbox_end(
    inside: &NewNamespace,
    iface: &str,
    addrs: SlotAddrs,
    shaping: Option<crate::net::shaping::Shaping>,
) -> Result<(), NetworkError> {
    let handle = &inside.handle;
    let eth0 = link_index(handle, "eth0")
        .await
        .map_err(netlink_fail("find eth0", iface))?;
    let lo_up = handle
        .link()
        .set(LinkUnspec::new_with_index(inside.lo).up().build())
        .execute();
    let eth0_address = handle
        .address()
        .add(eth0, IpAddr::V4(addrs.sandbox), 30)
        .execute();
    // One netlink socket, whose requests the kernel handles in the order they are sent (the
    // order of `join!`): the qdisc is set while eth0 is still down.
    let eth0_shaped = async {
        match shaping {
            Some(shaping) => shaping.apply(handle, eth0).await,
            None => Ok(()),
        }
    };
    let eth0_up = handle
        .link()
        .set(LinkUnspec::new_with_index(eth0).up().build())
        .execute();
    let (lo_up, eth0_address, eth0_shaped, eth0_up) =
        tokio::join!(lo_up, eth0_address, eth0_shaped, eth0_up);
    lo_up.map_err(netlink_fail("bring up lo", iface))?;
    eth0_address.map_err(netlink_fail("address eth0", iface))?;
    eth0_shaped.map_err(shaping_fail(format!("eth0 behind {iface}")))?;
    eth0_up.map_err(netlink_fail("bring up eth0", iface))?;
    // The gateway must be on a connected, up subnet, so this waits for both.
    handle
        .route()
        .add(
            RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(addrs.host)
                .build(),
        )
        .execute()
        .await
        .map_err(netlink_fail("add default route", iface))
}

/// A new network namespace, with a netlink connection and an unbound Unix socket made inside it.
struct NewNamespace {
    netns: OwnedFd,
    handle: rtnetlink::Handle,
    lo: u32,
    agent_socket: OwnedFd,
}

/// Creates a network namespace from a short-lived thread: a thread may unshare its network
/// namespace alone, and sockets stay in the namespace they were made in, so the thread opens
/// everything the node needs there and ends. No other thread of the server changes namespace.
async fn new_namespace() -> Result<NewNamespace, NetworkError> {
    // Started here, if not yet, rather than from the thread below: a thread starts in its
    // creator's network namespace, and the netlink thread must not hold a sandbox's.
    netlink_runtime().map_err(NetworkError::Socket)?;
    let (sender, receiver) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("netns-new".into())
        .spawn(move || {
            let made = (|| -> std::io::Result<_> {
                // SAFETY: unshare of the network namespace affects only this thread.
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let netns: OwnedFd = std::fs::File::open("/proc/thread-self/ns/net")?.into();
                let sysctls = sandbar_jail::host::Sysctls::new()?;
                for (name, value) in SYSCTLS {
                    sysctls.write(name, value)?;
                }
                let lo = if_index("lo")?;
                // SAFETY: socket() with constant arguments; the result is checked before it is
                // owned.
                let raw = unsafe {
                    libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
                };
                if raw < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: a new descriptor nothing else owns.
                let agent_socket = unsafe { OwnedFd::from_raw_fd(raw) };
                let handle = netlink_connection()?;
                Ok((netns, lo, agent_socket, handle))
            })();
            let _ = sender.send(made);
        })
        .map_err(NetworkError::Socket)?;
    let (netns, lo, agent_socket, handle) = receiver
        .await
        .map_err(|_| {
            NetworkError::Socket(std::io::Error::other(
                "network namespace thread ended without a result",
            ))
        })?
        .map_err(NetworkError::Socket)?;
    Ok(NewNamespace {
        netns,
        handle,
        lo,
        agent_socket,
    })
}

/// A new unbound Unix stream socket inside the network namespace `netns`, made by a thread
/// that joins it and ends (a restored sandbox's agent gets one in place of its old listener).
pub fn socket_in(netns: &OwnedFd) -> std::io::Result<OwnedFd> {
    let netns = netns.try_clone()?;
    std::thread::Builder::new()
        .name("netns-socket".into())
        .spawn(move || -> std::io::Result<OwnedFd> {
            // SAFETY: setns on a descriptor we own; only this thread moves.
            if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: socket() with constant arguments; the result is checked before it is
            // owned.
            let raw =
                unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
            if raw < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a new descriptor nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        })?
        .join()
        .map_err(|_| std::io::Error::other("the socket thread panicked"))?
}

/// Slots handed out by this node; shared by the pool and the runtime.
pub type SlotSet = Arc<Mutex<std::collections::BTreeSet<u32>>>;

/// Takes the lowest slot that neither this node nor anything else on the host uses.
pub fn take_slot(slots: &SlotSet, capacity: u32) -> Option<u32> {
    let mut slots = slots.lock().unwrap_or_else(|e| e.into_inner());
    let free = lowest_free(&slots, capacity, crate::net::network::slot_in_use)?;
    slots.insert(free);
    Some(free)
}

/// The lowest slot below `capacity` that is not in `taken` and that `in_use_elsewhere` does
/// not claim. The set is walked once in order, the gaps between its slots being the only
/// candidates: a lookup per slot of a full host cost a tree search for each of its sandboxes.
fn lowest_free(
    taken: &std::collections::BTreeSet<u32>,
    capacity: u32,
    in_use_elsewhere: impl Fn(u32) -> bool,
) -> Option<u32> {
    let mut candidate = 0;
    for &next_taken in taken.iter().chain(std::iter::once(&capacity)) {
        while candidate < next_taken.min(capacity) {
            if !in_use_elsewhere(candidate) {
                return Some(candidate);
            }
            candidate += 1;
        }
        candidate = candidate.max(next_taken.saturating_add(1));
        if candidate >= capacity {
            return None;
        }
    }
    None
}

pub fn free_slot(slots: &SlotSet, slot: u32) {
    slots
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&slot);
}

/// Namespaces wired for sandboxes with internet access (the usual kind), kept topped up to a
/// target by a background task.
#[derive(Debug)]
pub struct NetnsPool {
    network: Arc<Network>,
    slots: SlotSet,
    ready: Mutex<Vec<PreparedNetns>>,
    target: usize,
    refilling: std::sync::atomic::AtomicBool,
}

impl NetnsPool {
    pub fn new(network: Arc<Network>, slots: SlotSet, target: usize) -> Arc<Self> {
        Arc::new(Self {
            network,
            slots,
            ready: Mutex::new(Vec::new()),
            target,
            refilling: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// A namespace for a new sandbox: a waiting one when there is one (renamed for an isolated
    /// sandbox), else one made now. `None` when no slot is free.
    pub async fn claim(
        self: &Arc<Self>,
        egress: bool,
    ) -> Option<Result<PreparedNetns, NetworkError>> {
        let waiting = self.ready.lock().unwrap_or_else(|e| e.into_inner()).pop();
        self.refill();
        match waiting {
            Some(prepared) if egress => Some(Ok(prepared)),
            Some(prepared) => Some(match self.network.set_egress(prepared.slot, false).await {
                Ok(()) => Ok(prepared),
                Err(err) => {
                    self.discard(prepared).await;
                    Err(err)
                }
            }),
            None => {
                let slot = take_slot(&self.slots, self.network.capacity())?;
                let made = self.network.prepare(slot, egress).await;
                if made.is_err() {
                    free_slot(&self.slots, slot);
                }
                Some(made)
            }
        }
    }

    /// Gives up a namespace no sandbox joined.
    pub async fn discard(&self, prepared: PreparedNetns) {
        let slot = prepared.slot;
        drop(prepared);
        self.network.release(slot).await;
        free_slot(&self.slots, slot);
    }

    /// Starts topping the pool up in the background unless that is already under way.
    pub fn refill(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.target == 0 || self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let mut filled = false;
            loop {
                if pool.waiting() >= pool.target {
                    filled = true;
                    break;
                }
                let Some(slot) = take_slot(&pool.slots, pool.network.capacity()) else {
                    break;
                };
                match pool.network.prepare(slot, true).await {
                    Ok(prepared) => pool
                        .ready
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(prepared),
                    Err(err) => {
                        free_slot(&pool.slots, slot);
                        tracing::warn!(slot, error = %err, "cannot prepare a network namespace");
                        break;
                    }
                }
            }
            pool.refilling.store(false, Ordering::Release);
            // A claim between the last count and the flag's reset found the refill running.
            if filled && pool.waiting() < pool.target {
                pool.refill();
            }
        });
    }

    /// Waiting namespaces, for tests and logs.
    pub fn waiting(&self) -> usize {
        self.ready.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::in_private_netns;

    fn in_netns<T: Send + 'static>(netns: &OwnedFd, f: impl FnOnce() -> T + Send + 'static) -> T {
        let netns = netns.try_clone().expect("dup netns");
        std::thread::spawn(move || {
            // SAFETY: setns on a descriptor we own; only this thread moves.
            let rc = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            f()
        })
        .join()
        .expect("netns thread")
    }

    #[test]
    fn the_lowest_free_slot_is_found_between_taken_ones() {
        let taken = |slots: &[u32]| {
            slots
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
        };
        let nowhere = |_| false;
        assert_eq!(lowest_free(&taken(&[]), 4, nowhere), Some(0));
        assert_eq!(lowest_free(&taken(&[0, 1, 3]), 4, nowhere), Some(2));
        assert_eq!(lowest_free(&taken(&[0, 1, 2]), 4, nowhere), Some(3));
        assert_eq!(lowest_free(&taken(&[0, 1, 2, 3]), 4, nowhere), None);
        assert_eq!(lowest_free(&taken(&[]), 0, nowhere), None);
        // A slot someone else on the host holds is passed over like a taken one.
        assert_eq!(lowest_free(&taken(&[1]), 4, |s| s == 0 || s == 2), Some(3));
        assert_eq!(lowest_free(&taken(&[1]), 3, |s| s != 1), None);
        // Slots of the set past the capacity (a smaller network after a restart) do not count.
        assert_eq!(lowest_free(&taken(&[0, 7]), 2, nowhere), Some(1));
        assert_eq!(lowest_free(&taken(&[0, 1, 7]), 2, nowhere), None);
    }

    #[test]
    fn a_prepared_namespace_is_wired_and_vanishes_with_its_descriptor() {
        in_private_netns(|| async {
            let network = Network::new(Ipv4Addr::new(10, 250, 0, 0), 28);
            let prepared = network.prepare(2, true).await.expect("prepare slot 2");
            assert_eq!(prepared.slot, 2);
            assert!(if_index("sbxe2").is_ok(), "host end exists");
            let host_sysctl = |name: &str| {
                let path = format!("/proc/sys/net/{name}");
                std::fs::read_to_string(&path)
                    .expect(&path)
                    .trim()
                    .to_owned()
            };
            assert_eq!(host_sysctl("ipv4/conf/sbxe2/rp_filter"), "1");
            assert_eq!(host_sysctl("ipv6/conf/sbxe2/disable_ipv6"), "1");

            let (port_start, ping, eth0, route) = in_netns(&prepared.netns, || {
                let read = |p: &str| std::fs::read_to_string(p).expect(p).trim().to_owned();
                (
                    read("/proc/sys/net/ipv4/ip_unprivileged_port_start"),
                    read("/proc/sys/net/ipv4/ping_group_range"),
                    if_index("eth0").is_ok(),
                    read("/proc/net/route"),
                )
            });
            assert_eq!(port_start, "0");
            assert_eq!(
                ping.split_whitespace().collect::<Vec<_>>(),
                ["0", "2147483647"]
            );
            assert!(eth0, "eth0 inside");
            // The default route (destination 00000000) through the slot's host end.
            assert!(
                route
                    .lines()
                    .any(|l| l.split_whitespace().nth(1) == Some("00000000")),
                "{route}"
            );

            let dir = std::env::temp_dir().join(format!("netns-test-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            let path = dir.join("agent.sock");
            let _ = std::fs::remove_file(&path);
            let listener = prepared.listen_at(&path).expect("listen");
            // SAFETY: F_GETFL on a descriptor the listener owns.
            let flags = unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_GETFL) };
            assert_ne!(
                flags & libc::O_NONBLOCK,
                0,
                "the agent's listener is non-blocking"
            );
            std::os::unix::net::UnixStream::connect(&path).expect("connect from outside");
            drop(listener);
            std::fs::remove_dir_all(&dir).expect("cleanup");

            drop(prepared);
            let gone = async {
                while if_index("sbxe2").is_ok() {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            };
            tokio::time::timeout(std::time::Duration::from_secs(10), gone)
                .await
                .expect("the veth goes with the namespace");
        });
    }

    #[test]
    fn both_ends_are_shaped_and_keep_it_through_a_rename() {
        use crate::net::shaping::{Shaping, tests::root_qdisc};
        use futures_util::TryStreamExt;
        in_private_netns(|| async {
            let shaping = Shaping::from_mbit(50).expect("50 mbit");
            let network =
                Network::new(Ipv4Addr::new(10, 250, 0, 0), 28).with_shaping(Some(shaping));
            let prepared = network.prepare(3, true).await.expect("prepare slot 3");
            let host = network.host_netlink().await.expect("netlink");
            let host_end = if_index("sbxe3").expect("host end");
            let (kind, tbf) = root_qdisc(&host, host_end).await;
            assert_eq!(kind, "tbf");
            let tbf = tbf.expect("tbf parameters");
            assert_eq!(tbf.bits_per_sec, shaping.bits_per_sec());
            // The host end is made down to be shaped, and must come up afterwards.
            let link = host
                .link()
                .get()
                .match_index(host_end)
                .execute()
                .try_next()
                .await
                .expect("link dump")
                .expect("host end");
            assert!(
                link.header
                    .flags
                    .contains(rtnetlink::packet_route::link::LinkFlags::Up),
                "{:?}",
                link.header.flags
            );
            assert_eq!(tbf.mpu, 1500);
            assert!(tbf.limit > 0);

            let inside = in_netns(&prepared.netns, || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(async {
                        let (connection, handle, _) =
                            rtnetlink::new_connection().expect("netlink inside");
                        tokio::spawn(connection);
                        root_qdisc(&handle, if_index("eth0").expect("eth0")).await
                    })
            });
            assert_eq!(inside.0, "tbf");
            assert_eq!(inside.1, Some(tbf));

            // Closing a sandbox's internet access renames (and bounces) the host end.
            network.set_egress(3, false).await.expect("isolate");
            let (kind, tbf) = root_qdisc(&host, if_index("sbxi3").expect("renamed")).await;
            assert_eq!(kind, "tbf");
            assert_eq!(tbf.map(|t| t.bits_per_sec), Some(50_000_000));
        });
    }

    /// Prints what `prepare` costs with and without shaping, alternating the two 200 times in a
    /// private namespace: `cargo test --release -p sandbar-node --lib -- --ignored
    /// prepare_cost --nocapture`.
    #[test]
    #[ignore = "a benchmark"]
    fn prepare_cost() {
        use crate::net::shaping::Shaping;
        in_private_netns(|| async {
            let plain = Network::new(Ipv4Addr::new(10, 250, 0, 0), 28);
            let shaped = Network::new(Ipv4Addr::new(10, 250, 0, 16), 28)
                .with_shaping(Shaping::from_mbit(100));
            let mut times = [Vec::new(), Vec::new()];
            for _ in 0..200 {
                for (i, network) in [&plain, &shaped].into_iter().enumerate() {
                    let started = std::time::Instant::now();
                    let prepared = network.prepare(1, true).await.expect("prepare");
                    times[i].push(started.elapsed().as_micros() as u64);
                    drop(prepared);
                    // The host end goes with the namespace, asynchronously.
                    while if_index("sbxe1").is_ok() {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                }
            }
            for (name, mut t) in ["unshaped", "shaped"].into_iter().zip(times) {
                t.sort_unstable();
                println!(
                    "prepare, {name}: p50 {} us, p90 {} us, n {}",
                    t[t.len() / 2],
                    t[t.len() * 9 / 10],
                    t.len()
                );
            }
        });
    }

    #[test]
    fn without_a_rate_nothing_is_shaped() {
        use crate::net::shaping::tests::root_qdisc;
        in_private_netns(|| async {
            let network = Network::new(Ipv4Addr::new(10, 250, 0, 0), 28);
            let _prepared = network.prepare(0, true).await.expect("prepare slot 0");
            let host = network.host_netlink().await.expect("netlink");
            let (kind, _) = root_qdisc(&host, if_index("sbxe0").expect("host end")).await;
            assert_ne!(kind, "tbf");
        });
    }

    #[test]
    fn root_of_another_user_namespace_cannot_remove_the_shaping() {
        use crate::net::shaping::Shaping;
        let tools = ["unshare", "tc"].iter().all(|tool| {
            std::process::Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        if !tools {
            eprintln!("skipped: needs unshare and tc");
            return;
        }
        in_private_netns(|| async {
            let network =
                Network::new(Ipv4Addr::new(10, 250, 0, 0), 28).with_shaping(Shaping::from_mbit(20));
            let prepared = network.prepare(0, true).await.expect("prepare slot 0");
            // As a sandbox's root is: root of a user namespace of its own, in a network
            // namespace owned by the host's.
            let (attempt, after) = in_netns(&prepared.netns, || {
                let sh = |script: &str| {
                    std::process::Command::new("sh")
                        .args(["-c", script])
                        .output()
                        .expect("spawn")
                };
                let attempt = sh("unshare --user --map-root-user tc qdisc del dev eth0 root");
                (attempt, sh("tc qdisc show dev eth0"))
            });
            assert!(!attempt.status.success(), "{attempt:?}");
            // Refused by the kernel, not failed for another reason.
            assert!(
                String::from_utf8_lossy(&attempt.stderr).contains("Operation not permitted"),
                "{attempt:?}"
            );
            let after = String::from_utf8_lossy(&after.stdout);
            assert!(after.contains("qdisc tbf 1: root"), "{after}");
        });
    }

    #[test]
    fn socket_paths_longer_than_sun_path_are_refused() {
        in_private_netns(|| async {
            let network = Network::new(Ipv4Addr::new(10, 250, 0, 0), 28);
            let prepared = network.prepare(1, false).await.expect("prepare slot 1");
            assert!(if_index("sbxi1").is_ok(), "isolated host end");
            let long = std::path::PathBuf::from(format!("/tmp/{}", "x".repeat(200)));
            let err = prepared.listen_at(&long).expect_err("too long");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        });
    }
}
