//! `sandbar serve --tls-listen …` and `sandbar cert`: the flags of the HTTPS listener, the
//! certificate read again on SIGHUP, and the local CA for trials.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use sandbar_tls::ReloadableCertificate;

#[derive(clap::Args, Debug, Default)]
pub struct TlsArgs {
    /// Address for HTTPS (say 0.0.0.0:443): the same API, edge and dashboard as --listen, over
    /// TLS with HTTP/1.1 and HTTP/2. The SDKs, given only E2B_DOMAIN, call
    /// https://api.<domain> and https://<port>-<sandboxID>.<domain> on port 443. Needs
    /// --tls-cert and --tls-key; --listen keeps serving plain HTTP.
    #[arg(long, env = "SANDBAR_TLS_LISTEN")]
    pub tls_listen: Option<SocketAddr>,
    /// PEM certificate chain for --tls-listen, its certificate first (for `*.<domain>` and
    /// `<domain>`), then any intermediates. Read again on SIGHUP (see `sandbar cert` for a
    /// local one).
    #[arg(long, env = "SANDBAR_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1). Read again on SIGHUP.
    #[arg(long, env = "SANDBAR_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
}

/// The HTTPS listener to start: where, and the certificate it serves.
#[derive(Debug)]
pub struct Https {
    pub address: SocketAddr,
    pub certificate: Arc<ReloadableCertificate>,
}

impl Https {
    /// Binds the HTTPS listener and serves `app` on it until `shutdown`, in a task of its own.
    pub async fn start(
        self,
        app: axum::Router,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let Self {
            address,
            certificate,
        } = self;
        let listener = sandbar_tls::TlsListener::bind(address, certificate.clone()).await?;
        let info = certificate.info();
        tracing::info!(
            address = %listener.local_addr().unwrap_or(address),
            cert = %certificate.certificate_path().display(),
            serial = %info.serial,
            subject = %info.subject,
            not_after = %info.not_after.date(),
            "serving HTTPS (HTTP/1.1 and HTTP/2); SIGHUP reads the certificate again"
        );
        Ok(tokio::spawn(listener.serve(app, shutdown)))
    }
}

impl TlsArgs {
    /// The HTTPS listener the flags ask for, its certificate loaded; none without
    /// --tls-listen.
    pub fn load(&self) -> anyhow::Result<Option<Https>> {
        let Some(address) = self.tls_listen else {
            if let Some(flag) = [
                self.tls_cert.as_ref().map(|_| "--tls-cert"),
                self.tls_key.as_ref().map(|_| "--tls-key"),
            ]
            .into_iter()
            .flatten()
            .next()
            {
                bail!("{flag} is given without --tls-listen, which says where to serve HTTPS");
            }
            return Ok(None);
        };
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            let missing = match (&self.tls_cert, &self.tls_key) {
                (None, None) => "--tls-cert and --tls-key",
                (None, Some(_)) => "--tls-cert",
                _ => "--tls-key",
            };
            bail!(
                "--tls-listen {address} needs {missing} (the PEM certificate chain and its \
                 private key; `sandbar cert` makes a local pair)"
            );
        };
        let certificate = ReloadableCertificate::load(cert, key)
            .with_context(|| format!("cannot serve HTTPS on {address}"))?;
        let info = certificate.info();
        if info.expired() {
            tracing::warn!(path = %cert.display(), not_after = %info.not_after.date(), "the TLS certificate has expired; clients will refuse it");
        }
        Ok(Some(Https {
            address,
            certificate: Arc::new(certificate),
        }))
    }
}

/// From now on SIGHUP reads the certificate files again (or, with no HTTPS listener, is only
/// logged): its default action would end the server.
pub fn reload_on_hangup(certificate: Option<Arc<ReloadableCertificate>>) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // The handler is in place when `signal` returns, before any task runs.
    let mut hangups = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let Some(certificate) = &certificate else {
                tracing::info!("SIGHUP: no --tls-listen, so no certificate to read again");
                continue;
            };
            let (cert, key) = (certificate.certificate_path(), certificate.key_path());
            match certificate.reload() {
                Ok(info) => tracing::info!(
                    cert = %cert.display(),
                    serial = %info.serial,
                    subject = %info.subject,
                    not_after = %info.not_after.date(),
                    "SIGHUP: new TLS handshakes get the certificate read again"
                ),
                Err(e) => tracing::error!(
                    error = %e,
                    cert = %cert.display(),
                    key = %key.display(),
                    "SIGHUP: the TLS certificate in use stays, the files cannot be used"
                ),
            }
        }
    });
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct CertArgs {
    /// The domain of `sandbar serve --domain`: the certificate names `*.<domain>` (which
    /// covers `api.<domain>` and every `<port>-<sandboxID>.<domain>`) and `<domain>`.
    #[arg(long, env = "SANDBAR_DOMAIN")]
    domain: String,
    /// Directory for ca.pem, ca-key.pem, cert.pem (the certificate, then the CA) and key.pem.
    /// A CA already there (ca.pem with ca-key.pem) signs the new certificate, so clients that
    /// trust it keep trusting.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Replace cert.pem and key.pem if they exist.
    #[arg(long)]
    force: bool,
}

/// `sandbar cert`: a local CA and a wildcard certificate for trials, and how to trust them.
pub fn cert(args: &CertArgs) -> anyhow::Result<()> {
    let issued = match sandbar_tls::issue(&args.domain, &args.out, args.force) {
        Ok(issued) => issued,
        Err(e @ sandbar_tls::IssueError::Exists { .. }) => {
            bail!("{e}; pass --force to replace the certificate and its key")
        }
        Err(e) => return Err(e.into()),
    };
    let absolute = |path: &Path| std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let (ca, cert, key) = (
        absolute(&issued.ca),
        absolute(&issued.cert),
        absolute(&issued.key),
    );
    let domain = issued
        .names
        .last()
        .map_or(args.domain.as_str(), String::as_str);
    let made = if issued.ca_reused {
        "signed by the CA already there"
    } else {
        "signed by a new local CA"
    };
    println!(
        "wrote {} for {} ({made}, valid until {})",
        cert.display(),
        issued.names.join(", "),
        issued.leaf_not_after.date()
    );
    println!("      {} (its key, owner-only)", key.display());
    if !issued.ca_reused {
        println!("      {} (the CA clients trust)", ca.display());
        println!(
            "      {} (the CA's key, owner-only: whoever holds it can make certificates under {domain})",
            absolute(&issued.ca_key).display()
        );
    }
    println!();
    println!("Serve HTTPS with:");
    println!(
        "  sandbar serve --domain {domain} --tls-listen 0.0.0.0:443 --tls-cert {} --tls-key {}",
        cert.display(),
        key.display()
    );
    println!("(after renewing the certificate, `kill -HUP` the server: no restart needed)");
    println!();
    println!("Trust the CA on each client:");
    println!(
        "  Python (e2b, httpx):  export SSL_CERT_FILE={}   (replaces the default CA bundle for that process)",
        ca.display()
    );
    println!(
        "  Node.js:              export NODE_EXTRA_CA_CERTS={}",
        ca.display()
    );
    println!(
        "  Debian/Ubuntu system: cp {} /usr/local/share/ca-certificates/sandbar-{domain}.crt && update-ca-certificates",
        ca.display()
    );
    println!();
    println!(
        "Then: export E2B_DOMAIN={domain} E2B_API_KEY=…  (with *.{domain} and {domain} resolving to this host)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(listen: bool, cert: bool, key: bool) -> TlsArgs {
        TlsArgs {
            tls_listen: listen.then(|| "127.0.0.1:0".parse().expect("address")),
            tls_cert: cert.then(|| PathBuf::from("/nonexistent/cert.pem")),
            tls_key: key.then(|| PathBuf::from("/nonexistent/key.pem")),
        }
    }

    fn refusal(args: &TlsArgs) -> String {
        format!("{:#}", args.load().expect_err("refused"))
    }

    #[test]
    fn each_missing_flag_is_named() {
        assert!(args(false, false, false).load().expect("none").is_none());
        assert!(refusal(&args(true, false, true)).contains("needs --tls-cert ("));
        assert!(refusal(&args(true, true, false)).contains("needs --tls-key ("));
        assert!(refusal(&args(true, false, false)).contains("needs --tls-cert and --tls-key"));
        assert!(refusal(&args(false, true, false)).contains("--tls-cert is given without"));
        assert!(refusal(&args(false, false, true)).contains("--tls-key is given without"));
        // Files that are not there: the error names the file.
        assert!(refusal(&args(true, true, true)).contains("/nonexistent/cert.pem"));
    }
}
