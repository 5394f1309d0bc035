//! The served certificate: a PEM chain and its key, read from their files at start and again
//! on demand, behind a resolver that every new handshake asks.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why a certificate and its key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read the certificate file {path}: {source}")]
    ReadCertificate {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bad PEM in the certificate file {path}: {source}")]
    BadCertificatePem {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("no certificate in {path} (expected PEM `BEGIN CERTIFICATE` blocks)")]
    NoCertificate { path: PathBuf },
    #[error("the first certificate in {path} cannot be parsed: {detail}")]
    UnparsableCertificate { path: PathBuf, detail: String },
    #[error("cannot read the key file {path}: {source}")]
    ReadKey {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no private key in {path} (expected a PEM PKCS#8, PKCS#1 or SEC1 key): {source}")]
    NoKey {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("the private key in {path} cannot be used: {source}")]
    UnusableKey {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("the key in {key} does not belong to the certificate in {certificate}")]
    KeyMismatch { certificate: PathBuf, key: PathBuf },
}

/// What a loaded certificate is, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateInfo {
    /// The leaf's serial number, as colon-separated hex.
    pub serial: String,
    /// The leaf's subject.
    pub subject: String,
    /// When the leaf expires.
    pub not_after: time::OffsetDateTime,
    /// Certificates in the chain, the leaf included.
    pub chain_len: usize,
}

impl CertificateInfo {
    fn of(chain: &[CertificateDer<'static>], path: &Path) -> Result<Self, LoadError> {
        let leaf = chain.first().ok_or_else(|| LoadError::NoCertificate {
            path: path.to_owned(),
        })?;
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref()).map_err(|e| {
            LoadError::UnparsableCertificate {
                path: path.to_owned(),
                detail: e.to_string(),
            }
        })?;
        Ok(Self {
            serial: parsed.raw_serial_as_string(),
            subject: parsed.subject().to_string(),
            not_after: parsed.validity().not_after.to_datetime(),
            chain_len: chain.len(),
        })
    }

    /// Whether the leaf has expired.
    pub fn expired(&self) -> bool {
        self.not_after < time::OffsetDateTime::now_utc()
    }
}

/// Reads the chain in `certificate` (leaf first) and the key in `key`, and checks that the
/// key is the leaf's.
pub fn load(
    certificate: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<(CertifiedKey, CertificateInfo), LoadError> {
    let pem = std::fs::read(certificate).map_err(|source| LoadError::ReadCertificate {
        path: certificate.to_owned(),
        source,
    })?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| LoadError::BadCertificatePem {
            path: certificate.to_owned(),
            source,
        })?;
    let info = CertificateInfo::of(&chain, certificate)?;
    let pem = std::fs::read(key).map_err(|source| LoadError::ReadKey {
        path: key.to_owned(),
        source,
    })?;
    let private = PrivateKeyDer::from_pem_slice(&pem).map_err(|source| LoadError::NoKey {
        path: key.to_owned(),
        source,
    })?;
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|source| LoadError::UnusableKey {
            path: key.to_owned(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        // A key type whose public half the provider cannot tell: the handshake would fail,
        // not succeed with the wrong certificate.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok((certified, info))
        }
        Err(_) => Err(LoadError::KeyMismatch {
            certificate: certificate.to_owned(),
            key: key.to_owned(),
        }),
    }
}

/// The certificate every new handshake is given, read again from the same two files by
/// [`ReloadableCertificate::reload`]. Connections already made keep the one they began with.
#[derive(Debug)]
pub struct ReloadableCertificate {
    certificate_path: PathBuf,
    key_path: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Served>,
}

#[derive(Debug)]
struct Served {
    key: Arc<CertifiedKey>,
    info: CertificateInfo,
}

impl ReloadableCertificate {
    /// Loads the chain in `certificate` and its key in `key`.
    pub fn load(
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Result<Self, LoadError> {
        let (certificate_path, key_path) = (certificate.into(), key.into());
        let provider = crate::provider();
        let (key, info) = load(&certificate_path, &key_path, &provider)?;
        Ok(Self {
            certificate_path,
            key_path,
            provider,
            current: RwLock::new(Served {
                key: Arc::new(key),
                info,
            }),
        })
    }

    /// Reads both files again and serves what they hold from the next handshake on; on any
    /// error the certificate in use stays.
    pub fn reload(&self) -> Result<CertificateInfo, LoadError> {
        let (key, info) = load(&self.certificate_path, &self.key_path, &self.provider)?;
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        *current = Served {
            key: Arc::new(key),
            info: info.clone(),
        };
        Ok(info)
    }

    /// The certificate in use.
    pub fn info(&self) -> CertificateInfo {
        self.read().info.clone()
    }

    /// The file the chain is read from.
    pub fn certificate_path(&self) -> &Path {
        &self.certificate_path
    }

    /// The file the key is read from.
    pub fn key_path(&self) -> &Path {
        &self.key_path
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Served> {
        // The lock guards a swap of two values that cannot panic halfway.
        self.current.read().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ResolvesServerCert for ReloadableCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // One certificate for every name: the edge's names are all under one wildcard, and a
        // client that sends no SNI (one connecting by address) still gets an answer.
        Some(self.read().key.clone())
    }
}
