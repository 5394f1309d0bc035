//! `sandbar-bench tls`: what HTTPS costs against a running `sandbar serve` with both
//! `--listen` and `--tls-listen`: the time of a TLS handshake, and each request's time on a
//! kept-alive connection, plain HTTP/1.1 against HTTPS over HTTP/1.1 and HTTP/2.
//!
//! Requests go one at a time (each waits for the answer before the next is sent), so the
//! difference between the series is what TLS adds to one request, not a throughput.
//! The series take turns in rounds so that whatever else the host does falls on all three.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::stats::{Summary, summarize};

#[derive(clap::Args, Debug)]
pub struct TlsArgs {
    /// The server's plain listener (--listen).
    #[arg(long, default_value = "127.0.0.1:3000")]
    plain: SocketAddr,
    /// The server's HTTPS listener (--tls-listen).
    #[arg(long, default_value = "127.0.0.1:3443")]
    https: SocketAddr,
    /// The name the client asks for (SNI) and sends as Host: api.<domain>.
    #[arg(long, default_value = "api.sandbar.localhost")]
    host: String,
    /// The CA that signed the server's certificate (`sandbar cert`'s ca.pem).
    #[arg(long)]
    ca: std::path::PathBuf,
    /// The path requested.
    #[arg(long, default_value = "/health")]
    path: String,
    /// Requests timed per series (after the warm-up).
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Rounds the requests are split into, the series taking turns.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// New connections timed per series, one after another.
    #[arg(long, default_value_t = 1000)]
    handshakes: usize,
    /// Clients making handshakes at once for the handshake rate.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Seconds the handshake rate is measured for.
    #[arg(long, default_value_t = 5)]
    rate_secs: u64,
}

type Http1 = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;
type Http2 = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;

/// One kept-alive connection of a series.
enum Kept {
    Http1(Http1),
    Http2(Http2),
}

impl Kept {
    /// One request and its whole answer.
    async fn get(&mut self, uri: &str, host: &str) -> anyhow::Result<Duration> {
        let request = Request::get(uri).header("host", host).body(Empty::new())?;
        let started = Instant::now();
        let response = match self {
            Self::Http1(sender) => {
                sender.ready().await?;
                sender.send_request(request).await?
            }
            Self::Http2(sender) => {
                sender.ready().await?;
                sender.send_request(request).await?
            }
        };
        let status = response.status();
        response.into_body().collect().await?;
        let took = started.elapsed();
        if !status.is_success() {
            bail!("{uri}: {status}");
        }
        Ok(took)
    }
}

/// The client side of TLS: trusts only `ca`, offers `alpn`, resumes sessions or not.
fn connector(
    ca: &CertificateDer<'static>,
    alpn: &[&[u8]],
    resume: bool,
) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    if !resume {
        config.resumption = rustls::client::Resumption::disabled();
    }
    Ok(TlsConnector::from(Arc::new(config)))
}

async fn tcp(address: SocketAddr) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(address)
        .await
        .with_context(|| format!("cannot connect to {address}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

async fn handshake(
    address: SocketAddr,
    connector: &TlsConnector,
    host: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = ServerName::try_from(host.to_owned())?;
    Ok(connector.connect(name, tcp(address).await?).await?)
}

async fn kept_http1(
    stream: impl hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
) -> anyhow::Result<Kept> {
    let (sender, connection) = hyper::client::conn::http1::handshake(stream).await?;
    tokio::spawn(connection);
    Ok(Kept::Http1(sender))
}

async fn kept_http2(
    stream: impl hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
) -> anyhow::Result<Kept> {
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), stream).await?;
    tokio::spawn(connection);
    Ok(Kept::Http2(sender))
}

/// How long each of `n` runs of `once` takes, one after another. What a run leaves (a
/// connection) is dropped after its time is taken.
async fn timed<T, F, Fut>(n: usize, mut once: F) -> anyhow::Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut took = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let left = once().await?;
        took.push(started.elapsed());
        drop(left);
    }
    Ok(took)
}

/// How long `n` handshakes take one after another, each on a new TCP connection (its
/// connect included, as a client pays it).
async fn handshakes(
    args: &TlsArgs,
    connector: &TlsConnector,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    timed(n, || handshake(args.https, connector, &args.host)).await
}

/// What a new client pays for its first answer: TCP connect, handshake, one HTTP/1.1 request.
/// Reading the answer also reads the session tickets the server sent after the handshake, so
/// with a resuming `connector` every connection after the first resumes a session.
async fn first_requests(
    args: &TlsArgs,
    connector: &TlsConnector,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    timed(n, || async {
        let stream = handshake(args.https, connector, &args.host).await?;
        let mut kept = kept_http1(TokioIo::new(stream)).await?;
        kept.get(&args.path, &args.host).await?;
        Ok(kept)
    })
    .await
}

/// TCP connects alone, the part of a handshake's time that is not TLS.
async fn connects(address: SocketAddr, n: usize) -> anyhow::Result<Vec<Duration>> {
    timed(n, || tcp(address)).await
}

/// Full handshakes per second with `concurrency` clients at once for `secs`.
async fn handshake_rate(args: &TlsArgs, connector: &TlsConnector) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(args.rate_secs);
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency.max(1) {
        let (connector, address, host) = (connector.clone(), args.https, args.host.clone());
        clients.spawn(async move {
            let mut done = 0usize;
            while Instant::now() < deadline {
                let stream = handshake(address, &connector, &host).await?;
                drop(stream);
                done += 1;
            }
            anyhow::Ok(done)
        });
    }
    let mut total = 0;
    while let Some(joined) = clients.join_next().await {
        total += joined??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

fn line(name: &str, s: Option<Summary>) -> String {
    match s {
        Some(s) => format!(
            "| {name} | {} | {:.3} | {:.3} | {:.3} | {:.3} |",
            s.n, s.p50, s.p95, s.p99, s.mean
        ),
        None => format!("| {name} | 0 | | | | |"),
    }
}

async fn run(args: &TlsArgs) -> anyhow::Result<()> {
    let ca = CertificateDer::from_pem_file(&args.ca)
        .with_context(|| format!("cannot read the CA certificate {}", args.ca.display()))?;
    let uri = args.path.clone();
    let h2_uri = format!("https://{}{}", args.host, args.path);

    let mut plain = kept_http1(TokioIo::new(tcp(args.plain).await?)).await?;
    let h1_tls = handshake(
        args.https,
        &connector(&ca, &[b"http/1.1"], true)?,
        &args.host,
    )
    .await?;
    let mut tls_h1 = kept_http1(TokioIo::new(h1_tls)).await?;
    let h2_tls = handshake(args.https, &connector(&ca, &[b"h2"], true)?, &args.host).await?;
    if h2_tls.get_ref().1.alpn_protocol() != Some(b"h2") {
        bail!("the server did not choose HTTP/2 by ALPN");
    }
    let mut tls_h2 = kept_http2(TokioIo::new(h2_tls)).await?;

    // Warm-up: connections, the server's first requests, the CPU's caches.
    for _ in 0..500 {
        plain.get(&uri, &args.host).await?;
        tls_h1.get(&uri, &args.host).await?;
        tls_h2.get(&h2_uri, &args.host).await?;
    }
    let rounds = args.rounds.max(1);
    let per_round = args.requests.div_ceil(rounds);
    let (mut p, mut t1, mut t2) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for _ in 0..per_round {
            p.push(plain.get(&uri, &args.host).await?);
        }
        for _ in 0..per_round {
            t1.push(tls_h1.get(&uri, &args.host).await?);
        }
        for _ in 0..per_round {
            t2.push(tls_h2.get(&h2_uri, &args.host).await?);
        }
    }

    let full = connector(&ca, &[b"h2", b"http/1.1"], false)?;
    let full_h1 = connector(&ca, &[b"http/1.1"], false)?;
    let resumed_h1 = connector(&ca, &[b"http/1.1"], true)?;
    handshakes(args, &full, 50).await?;
    first_requests(args, &resumed_h1, 50).await?;
    let tcp_only = connects(args.https, args.handshakes).await?;
    let full_took = handshakes(args, &full, args.handshakes).await?;
    let first_full = first_requests(args, &full_h1, args.handshakes).await?;
    let first_resumed = first_requests(args, &resumed_h1, args.handshakes).await?;
    let rate = handshake_rate(args, &full).await?;

    let (sp, s1, s2) = (summarize(&p), summarize(&t1), summarize(&t2));
    println!(
        "GET {} ({} requests per series in {rounds} rounds, one at a time, kept-alive), ms:",
        args.path,
        per_round * rounds
    );
    println!();
    println!("| series | n | p50 | p95 | p99 | mean |");
    println!("|---|--:|--:|--:|--:|--:|");
    println!("{}", line("plain HTTP/1.1", sp));
    println!("{}", line("HTTPS, HTTP/1.1", s1));
    println!("{}", line("HTTPS, HTTP/2", s2));
    if let Some(sp) = sp {
        for (name, s) in [("HTTP/1.1", s1), ("HTTP/2", s2)] {
            if let Some(s) = s {
                println!(
                    "TLS over plain, {name}: p50 {:+.3} ms, p95 {:+.3} ms, mean {:+.3} ms",
                    s.p50 - sp.p50,
                    s.p95 - sp.p95,
                    s.mean - sp.mean
                );
            }
        }
    }
    println!();
    println!(
        "New connections to {} ({} each, one after another), ms:",
        args.https, args.handshakes
    );
    println!();
    println!("| series | n | p50 | p95 | p99 | mean |");
    println!("|---|--:|--:|--:|--:|--:|");
    println!("{}", line("TCP connect only", summarize(&tcp_only)));
    println!(
        "{}",
        line(
            "TCP connect + full TLS 1.3 handshake",
            summarize(&full_took)
        )
    );
    println!(
        "{}",
        line(
            "connect, full handshake, first HTTP/1.1 answer",
            summarize(&first_full)
        )
    );
    println!(
        "{}",
        line(
            "connect, resumed handshake, first HTTP/1.1 answer",
            summarize(&first_resumed)
        )
    );
    println!();
    println!(
        "Full handshakes per second, {} clients at once for {} s: {rate:.0}",
        args.concurrency, args.rate_secs
    );
    Ok(())
}

pub async fn main(args: TlsArgs) -> ExitCode {
    if args.requests == 0 || args.handshakes == 0 {
        eprintln!("error: --requests and --handshakes must be at least 1");
        return ExitCode::FAILURE;
    }
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
