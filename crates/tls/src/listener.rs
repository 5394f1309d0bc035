//! The HTTPS listener: accepts TCP connections, hands each to a task of its own for the TLS
//! handshake and then HTTP/1.1 or HTTP/2 on the same router as the plain listener.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::header::{HOST, HeaderValue};
use http::{Uri, Version};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::ReloadableCertificate;

/// How long a client may take to finish its handshake before its connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the HTTPS listener could not start.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("cannot listen on {address} for HTTPS: {source}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot configure TLS for the certificate in {path}: {source}")]
    Config {
        path: std::path::PathBuf,
        source: rustls::Error,
    },
}

/// A bound HTTPS listener, ready to serve.
pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("tcp", &self.tcp)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Listens on `address`; every handshake is given what `certificate` holds at that moment.
    pub async fn bind(
        address: SocketAddr,
        certificate: Arc<ReloadableCertificate>,
    ) -> Result<Self, BindError> {
        let config = server_config(certificate.clone()).map_err(|source| BindError::Config {
            path: certificate.certificate_path().to_owned(),
            source,
        })?;
        let tcp = TcpListener::bind(address)
            .await
            .map_err(|source| BindError::Listen { address, source })?;
        Ok(Self {
            tcp,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            handshake_timeout: HANDSHAKE_TIMEOUT,
        })
    }

    /// Gives up on handshakes that take longer than `timeout` (default [`HANDSHAKE_TIMEOUT`]).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The address bound (the port chosen, when asked for port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Serves `app` until `shutdown` completes, then stops accepting, lets every connection
    /// finish the requests it has begun (as the plain listener does), and returns once all
    /// have closed.
    pub async fn serve(self, app: Router, shutdown: impl Future<Output = ()> + Send) {
        let Self {
            tcp,
            acceptor,
            handshake_timeout,
        } = self;
        // Every connection task holds a receiver: `closed` tells when the last has ended.
        let (stop, stopping) = watch::channel(false);
        let builder = Arc::new(auto::Builder::new(TokioExecutor::new()));
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                accepted = tcp.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        accept_failed(e).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            // Small request/response exchanges stall ~40 ms on Nagle + delayed ACK otherwise.
            let _ = stream.set_nodelay(true);
            // The handshake runs in the connection's own task, so a client that is slow or
            // silent holds up no one but itself.
            tokio::spawn(connection(
                Connection {
                    acceptor: acceptor.clone(),
                    builder: builder.clone(),
                    app: app.clone(),
                    handshake_timeout,
                    stopping: stopping.clone(),
                },
                stream,
                peer,
            ));
        }
        drop(tcp);
        drop(stopping);
        let _ = stop.send(true);
        stop.closed().await;
    }
}

/// The server side of TLS: the certificate from `certificate`, ALPN offering HTTP/2 and
/// HTTP/1.1, on the ring provider the workspace uses.
pub fn server_config(
    certificate: Arc<ReloadableCertificate>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(crate::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(certificate);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// What a connection task needs besides its socket.
struct Connection {
    acceptor: TlsAcceptor,
    builder: Arc<auto::Builder<TokioExecutor>>,
    app: Router,
    handshake_timeout: Duration,
    stopping: watch::Receiver<bool>,
}

async fn connection(connection: Connection, stream: TcpStream, peer: SocketAddr) {
    let Connection {
        acceptor,
        builder,
        app,
        handshake_timeout,
        mut stopping,
    } = connection;
    let handshake = tokio::time::timeout(handshake_timeout, acceptor.accept(stream));
    let tls = tokio::select! {
        done = handshake => match done {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
        () = stop_asked(&mut stopping) => return,
    };
    let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
        tower::ServiceExt::oneshot(app.clone(), as_served(request))
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = stop_asked(&mut stopping) => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(%peer, error = %e, "HTTPS connection ended with an error");
    }
}

/// Completes once the listener stops (or is gone).
async fn stop_asked(stopping: &mut watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// A request as the handlers read it on the plain listener: HTTP/1.1. The app passes requests
/// on to sandboxes and nodes as they came, over HTTP/1.1 connections, and hyper sends no body
/// at all on such a connection for a request that says HTTP/2 and has no length (a streamed
/// one, as a Connect call's); and HTTP/2 names the host in the `:authority` pseudo-header,
/// not in `Host`, which Host-based routing to sandboxes reads. So an HTTP/2 request becomes
/// the HTTP/1.1 request it stands for: `Host` from the authority, the path alone as its
/// target, version 1.1. The answer still goes back over HTTP/2. `X-Forwarded-Proto` says the
/// request came over HTTPS, for the URLs the API hands back, whatever a client claims.
fn as_served(mut request: http::Request<Incoming>) -> http::Request<Body> {
    if !request.headers().contains_key(HOST)
        && let Some(host) = request
            .uri()
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    {
        request.headers_mut().insert(HOST, host);
    }
    if request.version() == Version::HTTP_2 {
        if let Some(target) = request.uri().path_and_query().cloned() {
            *request.uri_mut() = Uri::from(target);
        }
        *request.version_mut() = Version::HTTP_11;
    }
    request
        .headers_mut()
        .insert("x-forwarded-proto", HeaderValue::from_static("https"));
    request.map(Body::new)
}

/// As the plain listener (axum's) does: a connection that failed before it was accepted is
/// the client's problem; anything else (say, out of file descriptors) waits a moment.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "HTTPS accept failed");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
