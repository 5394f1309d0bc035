//! HTTPS for Sandbar's API, edge and dashboard.
//!
//! [`TlsListener`] serves the same axum router as the plain listener over TLS, HTTP/1.1 and
//! HTTP/2 on one port (ALPN), each handshake in its connection's own task under a timeout.
//! [`ReloadableCertificate`] holds the certificate every new handshake gets and reads its
//! files again when asked (the server asks on SIGHUP), leaving connections already made as
//! they are. [`issue`] makes the local CA and wildcard certificate of `sandbar cert`.

mod certificate;
mod issue;
mod listener;
mod verify;

use std::sync::Arc;

pub use certificate::{CertificateInfo, LoadError, ReloadableCertificate};
pub use issue::{CA_FILE, CA_KEY_FILE, CERT_FILE, IssueError, Issued, KEY_FILE, issue};
pub use listener::{BindError, HANDSHAKE_TIMEOUT, TlsListener, server_config};
pub use verify::{VerifyError, verify_for_name};

/// The cryptography every TLS part of the workspace uses.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
