//! Sandbox networking: the routed network and its namespaces made ahead, egress rules, the resolver sandboxes use, and bandwidth shaping.

pub mod dns;
pub mod egress;
pub mod netns;
pub mod network;
pub mod shaping;

#[cfg(test)]
/// Runs `test` on a thread of its own network namespace, so the veth pairs it makes never
/// touch the host's, and the firewall tables it loads vanish with the namespace.
pub(crate) fn in_private_netns<F: std::future::Future<Output = ()>>(
    test: impl FnOnce() -> F + Send + 'static,
) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to make network namespaces");
        return;
    }
    std::thread::spawn(move || {
        // SAFETY: unshare of the network namespace affects only this thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(test());
    })
    .join()
    .expect("test thread");
}
