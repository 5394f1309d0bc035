//! The node's own calls to a sandbox agent over its Unix socket.

use std::path::Path;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// Waits until the agent behind `socket` answers `GET /health`, for at most `patience`.
pub(crate) async fn wait_healthy(socket: &Path, patience: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut last_error = String::from("no answer");
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, health(socket)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last_error = e,
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Err(format!("agent did not become healthy: {last_error}"))
}

async fn health(socket: &Path) -> Result<(), String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("connect {}: {e}", socket.display()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let request = hyper::Request::get("/health")
        .header(hyper::header::HOST, "agent")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("health answered {}", response.status()))
    }
}
