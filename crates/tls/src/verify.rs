//! A chain checked as a TLS client checks it: against chosen roots, for a server name.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// Why a chain is not one a client trusting `roots` accepts for a name.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("'{name}' is not a server name")]
    BadName { name: String },
    #[error("no certificate to verify")]
    Empty,
    #[error("unusable root certificate: {source}")]
    Root { source: rustls::Error },
    #[error("cannot build a verifier over the roots: {source}")]
    Verifier {
        source: rustls::client::VerifierBuilderError,
    },
    #[error("the certificate is not valid for '{name}': {source}")]
    Refused { name: String, source: rustls::Error },
}

/// Whether a client that trusts only `roots` accepts `chain` (leaf first) from a server it
/// reached as `name`, now.
pub fn verify_for_name(
    roots: &[CertificateDer<'static>],
    chain: &[CertificateDer<'static>],
    name: &str,
) -> Result<(), VerifyError> {
    let server_name = ServerName::try_from(name.to_owned()).map_err(|_| VerifyError::BadName {
        name: name.to_owned(),
    })?;
    let (leaf, intermediates) = chain.split_first().ok_or(VerifyError::Empty)?;
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store
            .add(root.clone())
            .map_err(|source| VerifyError::Root { source })?;
    }
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(store), crate::provider())
        .build()
        .map_err(|source| VerifyError::Verifier { source })?;
    verifier
        .verify_server_cert(leaf, intermediates, &server_name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|source| VerifyError::Refused {
            name: name.to_owned(),
            source,
        })
}
