//! `sandbar cert`: a local CA and a wildcard certificate for one domain, for trials and
//! tests, where no public CA can vouch for the domain.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The CA's certificate, the one file clients are told to trust.
pub const CA_FILE: &str = "ca.pem";
/// The CA's private key, needed only to issue again.
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// The served chain: the leaf, then the CA.
pub const CERT_FILE: &str = "cert.pem";
/// The leaf's private key.
pub const KEY_FILE: &str = "key.pem";

/// How long the leaf is valid: within what browsers accept of a certificate.
const LEAF_DAYS: i64 = 365;
/// How long the CA is valid: long enough that trusting it is done once.
const CA_DAYS: i64 = 3650;

/// Why `sandbar cert` made nothing. Nothing is written before everything has been made and
/// checked.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("'{domain}' is not a domain a certificate can name")]
    BadDomain { domain: String },
    #[error("{path} already exists")]
    Exists { path: PathBuf },
    #[error("{present} exists but {missing} does not: a CA is reused only with its key")]
    HalfCa { present: PathBuf, missing: PathBuf },
    #[error("cannot create the directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} must hold exactly one PEM certificate, the CA's")]
    CaPem { path: PathBuf },
    #[error("the CA certificate in {path} cannot be used: {detail}")]
    CaCertificate { path: PathBuf, detail: String },
    #[error("{path} is not a CA certificate")]
    NotACa { path: PathBuf },
    #[error("the CA key in {path} cannot be used: {source}")]
    CaKey { path: PathBuf, source: rcgen::Error },
    #[error("the key in {key} does not belong to the CA certificate in {certificate}")]
    CaKeyMismatch { certificate: PathBuf, key: PathBuf },
    #[error("cannot make the {what} for {domain} in {dir}: {source}")]
    Generate {
        what: &'static str,
        domain: String,
        dir: PathBuf,
        source: rcgen::Error,
    },
    #[error(
        "the CA in {path} does not vouch for a certificate of {domain} (made for another domain?): {source}"
    )]
    NotCovered {
        path: PathBuf,
        domain: String,
        source: Box<crate::VerifyError>,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`issue`] wrote.
#[derive(Debug, Clone)]
pub struct Issued {
    pub ca: PathBuf,
    pub ca_key: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA was already in the directory and signed the new leaf.
    pub ca_reused: bool,
    /// The names the leaf holds.
    pub names: Vec<String>,
    pub leaf_not_after: time::OffsetDateTime,
}

/// Makes, in `dir`, a CA (unless `ca.pem` and `ca-key.pem` are there already, which then
/// sign) and a certificate for `*.<domain>` and `<domain>` signed by it. Refuses to replace
/// `cert.pem` or `key.pem` unless `force`.
pub fn issue(domain: &str, dir: &Path, force: bool) -> Result<Issued, IssueError> {
    let domain = checked_domain(domain)?;
    let files = Issued {
        ca: dir.join(CA_FILE),
        ca_key: dir.join(CA_KEY_FILE),
        cert: dir.join(CERT_FILE),
        key: dir.join(KEY_FILE),
        ca_reused: false,
        names: vec![format!("*.{domain}"), domain.clone()],
        leaf_not_after: time::OffsetDateTime::UNIX_EPOCH,
    };
    if !force {
        for path in [&files.cert, &files.key] {
            if exists(path)? {
                return Err(IssueError::Exists { path: path.clone() });
            }
        }
    }
    let failed = |what: &'static str| {
        let (domain, dir) = (domain.clone(), dir.to_owned());
        move |source| IssueError::Generate {
            what,
            domain,
            dir,
            source,
        }
    };
    let now = time::OffsetDateTime::now_utc();
    // A client whose clock is a little behind still accepts a certificate made just now.
    let not_before = now - time::Duration::hours(1);

    let (ca, made_ca) = match ca_on_disk(&files, force)? {
        Some(ca) => (ca, None),
        None => {
            let key = KeyPair::generate().map_err(failed("CA key"))?;
            let params = ca_params(
                &domain,
                &key,
                not_before,
                now + time::Duration::days(CA_DAYS),
            );
            let certificate = params.self_signed(&key).map_err(failed("CA certificate"))?;
            let pem = certificate.pem();
            let der = certificate.der().clone();
            let key_pem = key.serialize_pem();
            (
                Ca {
                    der,
                    pem,
                    issuer: Issuer::new(params, key),
                },
                Some(key_pem),
            )
        }
    };

    let key = KeyPair::generate().map_err(failed("key"))?;
    let mut params = CertificateParams::new(files.names.clone()).map_err(failed("certificate"))?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, &domain);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = now + time::Duration::days(LEAF_DAYS);
    let leaf_not_after = params.not_after;
    let leaf = params
        .signed_by(&key, &ca.issuer)
        .map_err(failed("certificate"))?;

    // A reused CA may be bound to another domain by its name constraints; better to say so
    // now than to leave a certificate every client refuses.
    let chain = [leaf.der().clone(), ca.der.clone()];
    for name in [format!("api.{domain}"), domain.clone()] {
        crate::verify_for_name(std::slice::from_ref(&ca.der), &chain, &name).map_err(|source| {
            IssueError::NotCovered {
                path: files.ca.clone(),
                domain: domain.clone(),
                source: Box::new(source),
            }
        })?;
    }

    std::fs::create_dir_all(dir).map_err(|source| IssueError::CreateDir {
        path: dir.to_owned(),
        source,
    })?;
    let ca_reused = made_ca.is_none();
    if let Some(ca_key_pem) = made_ca {
        write_file(&files.ca_key, ca_key_pem.as_bytes(), 0o600)?;
        write_file(&files.ca, ca.pem.as_bytes(), 0o644)?;
    }
    // The key before the chain: a server that reloads between the two keeps its old pair,
    // the new key not matching the old certificate.
    write_file(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
    let chain_pem = format!("{}{}", leaf.pem(), ca.pem);
    write_file(&files.cert, chain_pem.as_bytes(), 0o644)?;
    Ok(Issued {
        ca_reused,
        leaf_not_after,
        ..files
    })
}

/// The CA already in the directory, if both its files are there. With only one of them, an
/// error naming both, unless `force` (then a new CA replaces the half one).
fn ca_on_disk(files: &Issued, force: bool) -> Result<Option<Ca>, IssueError> {
    match (exists(&files.ca)?, exists(&files.ca_key)?) {
        (true, true) => Ok(Some(existing_ca(&files.ca, &files.ca_key)?)),
        (true, false) if !force => Err(IssueError::HalfCa {
            present: files.ca.clone(),
            missing: files.ca_key.clone(),
        }),
        (false, true) if !force => Err(IssueError::HalfCa {
            present: files.ca_key.clone(),
            missing: files.ca.clone(),
        }),
        _ => Ok(None),
    }
}

/// A CA that signs: its certificate as given, and its issuer.
struct Ca {
    der: CertificateDer<'static>,
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca_params(
    domain: &str,
    key: &KeyPair,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
) -> CertificateParams {
    let mut params = CertificateParams::default();
    // Each CA's name is its own (a piece of its key's identifier): clients find a leaf's
    // issuer by name, and two CAs of one name (one made after another, both trusted) would
    // have them try the wrong one.
    let id: String = params
        .key_identifier(key)
        .iter()
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("Sandbar local CA for {domain} ({id})"),
    );
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Sandbar");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    // Trusting this CA then trusts it for this domain only, whoever gets hold of its key.
    params.name_constraints = Some(NameConstraints {
        permitted_subtrees: vec![GeneralSubtree::DnsName(domain.to_owned())],
        excluded_subtrees: Vec::new(),
    });
    params.not_before = not_before;
    params.not_after = not_after;
    params
}

/// The CA of an earlier run, checked: one certificate, a CA's, with its own key.
fn existing_ca(certificate: &Path, key: &Path) -> Result<Ca, IssueError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| IssueError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let pem = read(certificate)?;
    let certificates = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| IssueError::CaPem {
            path: certificate.to_owned(),
        })?;
    let [der] =
        <[CertificateDer<'static>; 1]>::try_from(certificates).map_err(|_| IssueError::CaPem {
            path: certificate.to_owned(),
        })?;
    let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| {
        IssueError::CaCertificate {
            path: certificate.to_owned(),
            detail: e.to_string(),
        }
    })?;
    let is_ca = parsed
        .basic_constraints()
        .ok()
        .flatten()
        .is_some_and(|constraints| constraints.value.ca);
    if !is_ca {
        return Err(IssueError::NotACa {
            path: certificate.to_owned(),
        });
    }
    let key_pair = KeyPair::from_pem(&read(key)?).map_err(|source| IssueError::CaKey {
        path: key.to_owned(),
        source,
    })?;
    if rcgen::PublicKeyData::subject_public_key_info(&key_pair) != parsed.public_key().raw {
        return Err(IssueError::CaKeyMismatch {
            certificate: certificate.to_owned(),
            key: key.to_owned(),
        });
    }
    let issuer =
        Issuer::from_ca_cert_der(&der, key_pair).map_err(|e| IssueError::CaCertificate {
            path: certificate.to_owned(),
            detail: e.to_string(),
        })?;
    let pem = pem.trim_end().to_owned() + "\n";
    Ok(Ca { der, pem, issuer })
}

/// `domain`, lower-cased, if it is a DNS name (not an address, no wildcard).
fn checked_domain(domain: &str) -> Result<String, IssueError> {
    let domain = domain.trim().trim_end_matches('.').to_ascii_lowercase();
    let bad = || IssueError::BadDomain {
        domain: domain.clone(),
    };
    if domain.parse::<std::net::IpAddr>().is_ok() || domain.contains('*') {
        return Err(bad());
    }
    rustls::pki_types::DnsName::try_from(domain.as_str()).map_err(|_| bad())?;
    Ok(domain)
}

fn exists(path: &Path) -> Result<bool, IssueError> {
    path.try_exists().map_err(|source| IssueError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Writes `contents` beside `path` and renames it over, so a server reloading meanwhile
/// reads the old file or the new one, never half of one.
fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), IssueError> {
    let failed = |source| IssueError::Write {
        path: path.to_owned(),
        source,
    };
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let staged = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    // Left by a run that died: made again, so that it gets `mode` (a key's 0600) for sure.
    let _ = std::fs::remove_file(&staged);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&staged)
        .and_then(|mut file| {
            file.write_all(contents)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&staged, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&staged);
        return Err(failed(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn chain_in(dir: &Path) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(dir.join(CERT_FILE))
            .expect("cert.pem")
            .collect::<Result<_, _>>()
            .expect("chain")
    }

    fn ca_in(dir: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(dir.join(CA_FILE)).expect("ca.pem")
    }

    #[test]
    fn the_leaf_verifies_against_the_ca_for_names_under_the_domain_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let issued = issue("Example.Test", dir.path(), false).expect("issue");
        assert!(!issued.ca_reused);
        assert_eq!(issued.names, ["*.example.test", "example.test"]);
        let chain = chain_in(dir.path());
        assert_eq!(chain.len(), 2, "cert.pem holds the leaf, then the CA");
        let ca = ca_in(dir.path());
        assert_eq!(chain[1], ca);
        for name in ["api.example.test", "49983-abc.example.test", "example.test"] {
            verify_for(&ca, &chain, name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        for name in ["api.example.org", "example.org", "a.b.example.test"] {
            assert!(verify_for(&ca, &chain, name).is_err(), "{name} must fail");
        }
        let other = tempfile::tempdir().expect("tempdir");
        issue("example.test", other.path(), false).expect("issue");
        assert!(
            verify_for(&ca_in(other.path()), &chain, "api.example.test").is_err(),
            "another CA must not vouch for it"
        );
    }

    fn verify_for(
        ca: &CertificateDer<'static>,
        chain: &[CertificateDer<'static>],
        name: &str,
    ) -> Result<(), crate::VerifyError> {
        crate::verify_for_name(std::slice::from_ref(ca), chain, name)
    }

    #[test]
    fn keys_are_private_and_nothing_is_replaced_unless_forced() {
        let dir = tempfile::tempdir().expect("tempdir");
        issue("example.test", dir.path(), false).expect("issue");
        for (file, mode) in [
            (KEY_FILE, 0o600),
            (CA_KEY_FILE, 0o600),
            (CERT_FILE, 0o644),
            (CA_FILE, 0o644),
        ] {
            let meta = std::fs::metadata(dir.path().join(file)).expect("metadata");
            assert_eq!(meta.permissions().mode() & 0o077, mode & 0o077, "{file}");
            assert_eq!(meta.permissions().mode() & 0o600, 0o600, "{file}");
        }
        let before = std::fs::read(dir.path().join(CERT_FILE)).expect("cert");
        match issue("example.test", dir.path(), false) {
            Err(IssueError::Exists { path }) => assert_eq!(path, dir.path().join(CERT_FILE)),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(
            std::fs::read(dir.path().join(CERT_FILE)).expect("cert"),
            before
        );
        let no_temporaries = std::fs::read_dir(dir.path()).expect("dir").all(|e| {
            !e.expect("entry")
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        });
        assert!(no_temporaries);
    }

    #[test]
    fn a_forced_renewal_reuses_the_ca_so_the_new_leaf_stays_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        issue("example.test", dir.path(), false).expect("issue");
        let ca = std::fs::read(dir.path().join(CA_FILE)).expect("ca");
        let ca_key = std::fs::read(dir.path().join(CA_KEY_FILE)).expect("ca key");
        let first = chain_in(dir.path());
        let issued = issue("example.test", dir.path(), true).expect("renew");
        assert!(issued.ca_reused);
        assert_eq!(std::fs::read(dir.path().join(CA_FILE)).expect("ca"), ca);
        assert_eq!(
            std::fs::read(dir.path().join(CA_KEY_FILE)).expect("ca key"),
            ca_key
        );
        let second = chain_in(dir.path());
        assert_ne!(first[0], second[0], "a new leaf");
        verify_for(&ca_in(dir.path()), &second, "api.example.test").expect("trusted");
    }

    #[test]
    fn a_ca_of_another_domain_is_not_used_for_this_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        issue("example.org", dir.path(), false).expect("issue");
        match issue("example.test", dir.path(), true) {
            Err(IssueError::NotCovered { path, domain, .. }) => {
                assert_eq!(path, dir.path().join(CA_FILE));
                assert_eq!(domain, "example.test");
            }
            other => panic!("expected NotCovered, got {other:?}"),
        }
    }

    #[test]
    fn a_ca_without_its_key_or_a_key_of_another_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        issue("example.test", dir.path(), false).expect("issue");
        std::fs::remove_file(dir.path().join(CA_KEY_FILE)).expect("rm");
        std::fs::remove_file(dir.path().join(CERT_FILE)).expect("rm");
        std::fs::remove_file(dir.path().join(KEY_FILE)).expect("rm");
        assert!(matches!(
            issue("example.test", dir.path(), false),
            Err(IssueError::HalfCa { .. })
        ));
        // The leaf's key is no CA's.
        std::fs::copy(dir.path().join(CA_FILE), dir.path().join("ca-copy.pem")).expect("copy");
        let other = tempfile::tempdir().expect("tempdir");
        issue("example.test", other.path(), false).expect("issue");
        std::fs::copy(other.path().join(CA_KEY_FILE), dir.path().join(CA_KEY_FILE)).expect("copy");
        assert!(matches!(
            issue("example.test", dir.path(), false),
            Err(IssueError::CaKeyMismatch { .. })
        ));
        // A leaf is not a CA.
        std::fs::copy(other.path().join(KEY_FILE), dir.path().join(CA_KEY_FILE)).expect("copy");
        let leaf = chain_in(other.path()).remove(0);
        let leaf_pem = std::fs::read_to_string(other.path().join(CERT_FILE)).expect("cert");
        let first_block = leaf_pem
            .split_inclusive("-----END CERTIFICATE-----\n")
            .next()
            .expect("leaf block");
        std::fs::write(dir.path().join(CA_FILE), first_block).expect("write");
        assert_eq!(
            CertificateDer::from_pem_file(dir.path().join(CA_FILE)).expect("pem"),
            leaf
        );
        assert!(matches!(
            issue("example.test", dir.path(), false),
            Err(IssueError::NotACa { .. })
        ));
    }

    #[test]
    fn only_dns_names_are_accepted() {
        let dir = tempfile::tempdir().expect("tempdir");
        for domain in ["", "10.0.0.1", "*.example.test", "exa mple.test", "::1"] {
            assert!(
                matches!(
                    issue(domain, dir.path(), false),
                    Err(IssueError::BadDomain { .. })
                ),
                "{domain:?}"
            );
        }
        assert!(
            std::fs::read_dir(dir.path()).expect("dir").next().is_none(),
            "nothing written"
        );
    }
}
