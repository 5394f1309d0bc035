//! How a pull fails, wherever along the way: the reference, the registry's answers, the
//! address rule, unpacking, the cache's files.

use std::io;
use std::path::PathBuf;

use crate::registry_address::RegistryRefused;
use crate::unpack::UnpackError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PullError {
    #[error("bad image reference `{reference}`: {reason}")]
    BadReference { reference: String, reason: String },
    #[error(
        "not authorized to pull {reference}: wrong or missing credentials (or no such repository)"
    )]
    Unauthorized { reference: String },
    #[error("registry of {reference} is unreachable: {reason}")]
    Unreachable { reference: String, reason: String },
    /// The registry, its token service or a redirect resolves to an address the server may
    /// not contact.
    #[error(transparent)]
    Refused(#[from] RegistryRefused),
    #[error("image {reference} not found")]
    NotFound { reference: String },
    #[error("image {reference} has no manifest for {platform}")]
    NoPlatform { reference: String, platform: String },
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { expected: String, actual: String },
    #[error("image {reference} is not supported: {what}")]
    Unsupported { reference: String, what: String },
    #[error("unpacking a layer: {0}")]
    Unpack(#[source] UnpackError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The registry answered, but not with anything usable. The message never carries what
    /// the registry wrote.
    #[error("registry error pulling {reference}: {message}")]
    Registry { reference: String, message: String },
}
