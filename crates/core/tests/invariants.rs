//! The core stays free of transport, storage and operating-system crates, so that each can be
//! replaced without touching the domain rules.

#[test]
fn core_depends_on_no_transport_storage_or_syscall_crate() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("read core manifest");
    for forbidden in [
        "axum",
        "hyper",
        "sqlx",
        "libc",
        "rustix",
        "nix",
        "tower",
        "connectrpc",
    ] {
        assert!(
            !manifest
                .lines()
                .any(|l| l.trim_start().split(['.', ' ', '=']).next() == Some(forbidden)),
            "sandbar-core must not depend on {forbidden}"
        );
    }
}
