//! The HTTPS listener on 127.0.0.1, reached by a rustls client as the SDKs reach it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, Response, StatusCode, Uri, Version};
use axum::routing::{get, post};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use sandbar_tls::{CERT_FILE, KEY_FILE, ReloadableCertificate, TlsListener};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

const DOMAIN: &str = "example.test";
const API: &str = "api.example.test";

/// What the handlers saw of a request: its version, Host, X-Forwarded-Proto and target.
async fn echo(version: Version, uri: Uri, headers: HeaderMap) -> String {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    format!(
        "{version:?} {} {} {uri}",
        header("host"),
        header("x-forwarded-proto")
    )
}

/// Answers `Upgrade: echo` with 101 and then sends back whatever it reads.
async fn upgrade(request: Request<Body>) -> axum::response::Response {
    let upgrade = hyper::upgrade::on(request);
    tokio::spawn(async move {
        if let Ok(upgraded) = upgrade.await {
            let mut io = TokioIo::new(upgraded);
            let mut buf = [0u8; 64];
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    axum::response::Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("connection", "upgrade")
        .header("upgrade", "echo")
        .body(Body::empty())
        .expect("response")
}

/// Passes the request on as the edge passes one to a sandbox: as it came, over an HTTP/1.1
/// connection of its own.
async fn forward(State(upstream): State<SocketAddr>, request: Request<Body>) -> Response<Body> {
    let stream = TcpStream::connect(upstream).await.expect("upstream");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let answer = sender.send_request(request).await.expect("forwarded");
    answer.map(Body::new)
}

fn app(upstream: SocketAddr) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/echo", get(echo))
        .route("/upgrade", get(upgrade))
        .route("/forward", post(forward))
        .with_state(upstream)
}

/// What a sandbox answers: the body it was sent.
async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let app = Router::new().route("/forward", post(|body: Bytes| async move { body }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

/// A CA and its leaf for [`DOMAIN`] in a directory of their own.
fn issued() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    sandbar_tls::issue(DOMAIN, dir.path(), false).expect("issue");
    dir
}

/// A server on 127.0.0.1:0 serving the certificate in `dir`; stops when the sender is
/// dropped or sent to.
struct Server {
    address: SocketAddr,
    certificate: Arc<ReloadableCertificate>,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
}

async fn serve(dir: &Path, handshake_timeout: Duration) -> Server {
    let certificate = Arc::new(
        ReloadableCertificate::load(dir.join(CERT_FILE), dir.join(KEY_FILE)).expect("load"),
    );
    let listener = TlsListener::bind(([127, 0, 0, 1], 0).into(), certificate.clone())
        .await
        .expect("bind")
        .with_handshake_timeout(handshake_timeout);
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(listener.serve(app(upstream().await), async move {
        let _ = stopped.await;
    }));
    Server {
        address,
        certificate,
        stop: Some(stop),
        served,
    }
}

fn trusting(ca_dir: &Path, alpn: &[&[u8]]) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca_dir.join(sandbar_tls::CA_FILE)).expect("ca"))
        .expect("root");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TlsConnector::from(Arc::new(config))
}

async fn handshake(
    address: SocketAddr,
    connector: &TlsConnector,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(address).await?;
    let name = ServerName::try_from(API).expect("name");
    connector.connect(name, tcp).await
}

/// An HTTP/1.1 connection over TLS trusting the CA in `ca_dir`.
async fn http1(
    address: SocketAddr,
    ca_dir: &Path,
) -> std::io::Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>> {
    let tls = handshake(address, &trusting(ca_dir, &[b"http/1.1"])).await?;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(connection.with_upgrades());
    Ok(sender)
}

async fn get_http1(
    sender: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    path: &str,
) -> String {
    sender.ready().await.expect("ready");
    let request = Request::get(path)
        .header("host", API)
        .header("x-forwarded-proto", "http")
        .body(Empty::new())
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    String::from_utf8(body_of(response).await.to_vec()).expect("utf-8")
}

/// The whole body of `response`.
async fn body_of(response: Response<hyper::body::Incoming>) -> Bytes {
    response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
}

/// An HTTP/2 connection over `tls`.
async fn http2<B>(tls: TlsStream<TcpStream>) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("http/2");
    tokio::spawn(connection);
    sender
}

#[tokio::test]
async fn http1_and_http2_answer_on_one_port_with_the_host_the_edge_reads() {
    let dir = issued();
    let server = serve(dir.path(), Duration::from_secs(10)).await;

    let mut h1 = http1(server.address, dir.path()).await.expect("http/1.1");
    assert_eq!(get_http1(&mut h1, "/health").await, "ok");
    // A client's own claim of the scheme is replaced by what the connection is.
    assert_eq!(
        get_http1(&mut h1, "/echo").await,
        format!("HTTP/1.1 {API} https /echo")
    );

    let tls = handshake(server.address, &trusting(dir.path(), &[b"h2", b"http/1.1"]))
        .await
        .expect("handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let mut h2 = http2(tls).await;
    // HTTP/2 names the host in :authority only.
    let request = Request::get(format!("https://{API}/echo?x=1"))
        .body(Empty::<Bytes>::new())
        .expect("request");
    assert!(!request.headers().contains_key("host"));
    let response = h2.send_request(request).await.expect("response");
    assert_eq!(response.version(), Version::HTTP_2);
    let body = body_of(response).await;
    // The app reads the HTTP/1.1 request it stands for.
    assert_eq!(body, format!("HTTP/1.1 {API} https /echo?x=1").as_bytes());
}

#[tokio::test]
async fn a_streamed_http2_body_reaches_what_the_app_forwards_over_http1() {
    let dir = issued();
    let server = serve(dir.path(), Duration::from_secs(10)).await;
    let tls = handshake(server.address, &trusting(dir.path(), &[b"h2"]))
        .await
        .expect("handshake");
    let mut h2 = http2(tls).await;
    // No length known: a Connect call's body, as the SDKs stream it.
    let chunks = ["a message ", "in two parts"]
        .map(|chunk| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(chunk))));
    let body = StreamBody::new(futures_util::stream::iter(chunks));
    let request = Request::post(format!("https://{API}/forward"))
        .body(body)
        .expect("request");
    let response = h2.send_request(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let body = body_of(response).await;
    assert_eq!(body, "a message in two parts");
}

#[tokio::test]
async fn an_http1_upgrade_carries_bytes_both_ways() {
    let dir = issued();
    let server = serve(dir.path(), Duration::from_secs(10)).await;
    let mut h1 = http1(server.address, dir.path()).await.expect("http/1.1");
    let request = Request::get("/upgrade")
        .header("host", API)
        .header("connection", "upgrade")
        .header("upgrade", "echo")
        .body(Empty::new())
        .expect("request");
    let response = h1.send_request(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut io = TokioIo::new(hyper::upgrade::on(response).await.expect("upgraded"));
    io.write_all(b"ping").await.expect("write");
    let mut buf = [0u8; 4];
    io.read_exact(&mut buf).await.expect("read");
    assert_eq!(&buf, b"ping");
}

#[tokio::test]
async fn a_client_that_trusts_another_ca_is_refused() {
    let (dir, other) = (issued(), issued());
    let server = serve(dir.path(), Duration::from_secs(10)).await;
    let refused = handshake(server.address, &trusting(other.path(), &[b"h2"]))
        .await
        .expect_err("another CA's client must refuse the certificate");
    assert!(
        refused.to_string().contains("UnknownIssuer"),
        "unexpected error: {refused}"
    );
}

#[tokio::test]
async fn a_reload_serves_new_handshakes_the_new_certificate_and_leaves_open_connections_be() {
    let (served, old, new) = (tempfile::tempdir().expect("tempdir"), issued(), issued());
    let copy = |from: &Path, file: &str| {
        std::fs::copy(from.join(file), served.path().join(file)).expect("copy");
    };
    copy(old.path(), CERT_FILE);
    copy(old.path(), KEY_FILE);
    let server = serve(served.path(), Duration::from_secs(10)).await;
    let before = server.certificate.info();

    let mut kept = http1(server.address, old.path()).await.expect("old CA");
    assert_eq!(get_http1(&mut kept, "/health").await, "ok");

    // A key that is not the certificate's is refused, naming both files, and nothing changes.
    copy(new.path(), CERT_FILE);
    match server.certificate.reload() {
        Err(sandbar_tls::LoadError::KeyMismatch { certificate, key }) => {
            assert_eq!(certificate, served.path().join(CERT_FILE));
            assert_eq!(key, served.path().join(KEY_FILE));
        }
        other => panic!("expected a key mismatch, got {other:?}"),
    }
    assert_eq!(server.certificate.info(), before);
    http1(server.address, old.path())
        .await
        .expect("still the old certificate");

    copy(new.path(), KEY_FILE);
    let after = server.certificate.reload().expect("reload");
    assert_ne!(after.serial, before.serial);
    assert_eq!(server.certificate.info(), after);

    // The connection made before the reload goes on.
    assert_eq!(get_http1(&mut kept, "/health").await, "ok");
    // A new handshake gets the new certificate, which the old CA did not sign.
    let refused = http1(server.address, old.path())
        .await
        .expect_err("the old CA must not verify the new certificate");
    assert!(
        matches!(
            refused
                .get_ref()
                .and_then(|e| e.downcast_ref::<rustls::Error>()),
            Some(rustls::Error::InvalidCertificate(_))
        ),
        "refused for another reason: {refused}"
    );
    let mut fresh = http1(server.address, new.path()).await.expect("new CA");
    assert_eq!(get_http1(&mut fresh, "/health").await, "ok");

    // Garbage in the key file: refused, naming it, and the new certificate stays.
    std::fs::write(served.path().join(KEY_FILE), "not a key\n").expect("write");
    let refused = server.certificate.reload().expect_err("garbage");
    assert!(
        refused
            .to_string()
            .contains(&served.path().join(KEY_FILE).display().to_string()),
        "{refused}"
    );
    http1(server.address, new.path())
        .await
        .expect("the new certificate stays");
}

#[tokio::test]
async fn a_silent_client_holds_up_no_other_handshake_and_is_dropped_after_the_timeout() {
    let dir = issued();
    let server = serve(dir.path(), Duration::from_millis(1500)).await;
    // One that connects and sends nothing, one that sends half a record.
    let mut silent = TcpStream::connect(server.address).await.expect("connect");
    let mut partial = TcpStream::connect(server.address).await.expect("connect");
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .expect("write");

    let started = Instant::now();
    let mut h1 = http1(server.address, dir.path()).await.expect("http/1.1");
    assert_eq!(get_http1(&mut h1, "/health").await, "ok");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the handshake waited {:?}",
        started.elapsed()
    );

    for stream in [&mut silent, &mut partial] {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("closed within the timeout");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
}

#[tokio::test]
async fn a_stop_closes_idle_connections_and_ends_the_server() {
    let dir = issued();
    let mut server = serve(dir.path(), Duration::from_secs(10)).await;
    let mut h1 = http1(server.address, dir.path()).await.expect("http/1.1");
    assert_eq!(get_http1(&mut h1, "/health").await, "ok");
    let silent = TcpStream::connect(server.address).await.expect("connect");
    let _ = server.stop.take().expect("stop").send(());
    tokio::time::timeout(Duration::from_secs(5), &mut server.served)
        .await
        .expect("the server ends")
        .expect("joined");
    let refused = TcpStream::connect(server.address)
        .await
        .expect_err("nothing listens once the server ended");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    drop(silent);
}
