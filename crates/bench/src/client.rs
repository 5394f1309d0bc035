//! A minimal E2B client: create a sandbox, run a command through the edge as the Python SDK
//! does (Connect streaming over HTTP/1.1), and kill the sandbox.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;
use bytes::{Buf, Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

/// The body of `Sandbox.create()` for the default template.
const CREATE_BODY: &str = r#"{"templateID":"base","timeout":60}"#;
/// What `sandbox.commands.run("echo ready")` sends to `process.Process/Start`.
const START_BODY: &str =
    r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo ready"]},"stdin":false}"#;
/// Starts a busy loop that outlives the command (its output goes nowhere), then says ready.
const HOG_BODY: &str = r#"{"process":{"cmd":"/bin/sh","args":["-c","sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & echo ready"]},"stdin":false}"#;
/// The output `echo ready` must produce.
const EXPECTED_STDOUT: &[u8] = b"ready\n";
/// The agent's port, as the SDKs address it.
const AGENT_PORT: &str = "49983";
/// Upper bound on any single request, so a stuck server cannot hang the benchmark.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Connect envelope flag of the final (end-of-stream) message.
const FLAG_END_STREAM: u8 = 0x02;

/// What one command printed, and when its first stdout arrived (none when it printed nothing).
#[derive(Debug)]
pub struct Ran {
    pub first: Option<Duration>,
    pub stdout: Vec<u8>,
}

fn expect_stdout(ran: &Ran, expected: &[u8]) -> anyhow::Result<Duration> {
    if ran.stdout != expected {
        bail!(
            "unexpected stdout {:?}, wanted {:?}",
            String::from_utf8_lossy(&ran.stdout),
            String::from_utf8_lossy(expected)
        );
    }
    ran.first
        .context("process.Process/Start: no stdout arrived")
}

/// A sandbox as `POST /v2/sandboxes` returns it.
#[derive(Debug, Clone, Deserialize)]
pub struct Sandbox {
    #[serde(rename = "sandboxID")]
    pub id: String,
    #[serde(rename = "envdAccessToken")]
    pub access_token: String,
}

/// Client of one Sandbar server; keeps track of the sandboxes it created and has not killed.
#[derive(Debug, Clone)]
pub struct Api {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    key: String,
    /// Sent with every request (a cluster node's secret, to time a node without its API
    /// host in front).
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    live: Mutex<Vec<String>>,
}

/// A template as `GET /templates` lists it.
#[derive(Debug, Deserialize)]
struct TemplateInfo {
    #[serde(default)]
    aliases: Vec<String>,
    #[serde(rename = "buildStatus")]
    build_status: String,
}

impl Api {
    /// A client of the same server that keeps its own list of sandboxes to kill.
    pub fn detached(&self) -> Self {
        Self::with_headers(
            &self.inner.base,
            &self.inner.key,
            self.inner.headers.clone(),
        )
    }

    pub fn with_headers(
        base: &str,
        key: &str,
        headers: Vec<(http::HeaderName, http::HeaderValue)>,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(64)
            .build(connector);
        Api {
            inner: Arc::new(Inner {
                client,
                base: base.trim_end_matches('/').to_owned(),
                key: key.to_owned(),
                headers,
                live: Mutex::new(Vec::new()),
            }),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.inner
            .live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn request(&self, method: Method, path: &str) -> http::request::Builder {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.inner.base));
        for (name, value) in &self.inner.headers {
            request = request.header(name, value);
        }
        request
    }

    async fn send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        let what = format!("{} {}", request.method(), request.uri());
        tokio::time::timeout(REQUEST_TIMEOUT, self.inner.client.request(request))
            .await
            .with_context(|| format!("{what}: no response within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("{what} failed"))
    }

    async fn send_collect(
        &self,
        request: Request<Full<Bytes>>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let what = format!("{} {}", request.method(), request.uri());
        let response = self.send(request).await?;
        let status = response.status();
        let body = tokio::time::timeout(REQUEST_TIMEOUT, response.into_body().collect())
            .await
            .with_context(|| format!("{what}: body not complete within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("{what}: cannot read the body"))?
            .to_bytes();
        Ok((status, body))
    }

    /// Whether the server lists a template aliased `base` whose build is ready.
    pub async fn base_template_ready(&self) -> anyhow::Result<bool> {
        let request = self
            .request(Method::GET, "/templates")
            .header("X-API-Key", &self.inner.key)
            .body(Full::default())?;
        let (status, body) = self.send_collect(request).await?;
        if status != StatusCode::OK {
            bail!(
                "GET /templates answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let templates: Vec<TemplateInfo> =
            serde_json::from_slice(&body).context("GET /templates: unexpected body")?;
        Ok(templates
            .iter()
            .any(|t| t.build_status == "ready" && t.aliases.iter().any(|a| a == "base")))
    }

    /// `POST /v2/sandboxes`; the sandbox is remembered until it is killed.
    pub async fn create(&self) -> anyhow::Result<Sandbox> {
        self.create_body(Bytes::from_static(CREATE_BODY.as_bytes()))
            .await
    }

    /// `POST /v2/sandboxes` of a sandbox that lives `timeout_secs` unless killed before.
    pub async fn create_for(&self, timeout_secs: u64) -> anyhow::Result<Sandbox> {
        let body = format!(r#"{{"templateID":"base","timeout":{timeout_secs}}}"#);
        self.create_body(Bytes::from(body)).await
    }

    async fn create_body(&self, body: Bytes) -> anyhow::Result<Sandbox> {
        let request = self
            .request(Method::POST, "/v2/sandboxes")
            .header("X-API-Key", &self.inner.key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body))?;
        let (status, body) = self.send_collect(request).await?;
        if status != StatusCode::CREATED {
            bail!(
                "POST /v2/sandboxes answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let sandbox: Sandbox =
            serde_json::from_slice(&body).context("POST /v2/sandboxes: unexpected body")?;
        self.live().push(sandbox.id.clone());
        Ok(sandbox)
    }

    /// Runs `echo ready` through `process.Process/Start` and returns the time from sending the
    /// request to the arrival of the first stdout event. The stream is drained before
    /// returning, and the output and exit code are checked.
    pub async fn first_output(&self, sandbox: &Sandbox) -> anyhow::Result<Duration> {
        let ran = self.start_and_read(sandbox, START_BODY).await?;
        expect_stdout(&ran, EXPECTED_STDOUT)
    }

    /// Starts a CPU-burning loop in the sandbox, in the background, and returns once it runs.
    pub async fn start_cpu_hog(&self, sandbox: &Sandbox) -> anyhow::Result<()> {
        let ran = self.start_and_read(sandbox, HOG_BODY).await?;
        expect_stdout(&ran, EXPECTED_STDOUT).map(|_| ())
    }

    /// Runs `printf %s <text>` as the SDKs run a command and returns what it printed, with
    /// the time to its first stdout; the command must exit 0 with an end event.
    pub async fn print(&self, sandbox: &Sandbox, text: &str) -> anyhow::Result<Ran> {
        let body = serde_json::json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", format!("printf %s '{text}'")]},
            "stdin": false,
        });
        self.start_and_read(sandbox, &body.to_string()).await
    }

    async fn start_and_read(&self, sandbox: &Sandbox, body: &str) -> anyhow::Result<Ran> {
        let payload = body.as_bytes();
        let mut envelope = Vec::with_capacity(5 + payload.len());
        envelope.push(0u8);
        envelope.extend_from_slice(&u32::try_from(payload.len())?.to_be_bytes());
        envelope.extend_from_slice(payload);
        let request = self
            .request(Method::POST, "/process.Process/Start")
            .header("E2b-Sandbox-Id", &sandbox.id)
            .header("E2b-Sandbox-Port", AGENT_PORT)
            .header("X-Access-Token", &sandbox.access_token)
            .header(CONTENT_TYPE, "application/connect+json")
            .header("Connect-Protocol-Version", "1")
            .body(Full::new(Bytes::from(envelope)))?;

        let started = Instant::now();
        let response = self.send(request).await?;
        let status = response.status();
        if status != StatusCode::OK {
            let body = response.into_body().collect().await?.to_bytes();
            bail!(
                "process.Process/Start answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let mut body = response.into_body();
        let mut buf = BytesMut::new();
        let mut first: Option<Duration> = None;
        let mut stdout = Vec::new();
        let mut exit_code: Option<i64> = None;
        let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
        while let Some(frame) = tokio::time::timeout_at(deadline, body.frame())
            .await
            .context("process.Process/Start: stream not finished in time")?
        {
            let arrived = started.elapsed();
            let Ok(data) = frame
                .context("process.Process/Start: stream broke")?
                .into_data()
            else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some((flags, message)) = next_envelope(&mut buf) {
                let value: serde_json::Value = serde_json::from_slice(&message)
                    .context("process.Process/Start: a message is not JSON")?;
                if flags & FLAG_END_STREAM != 0 {
                    if let Some(error) = value.get("error") {
                        bail!("process.Process/Start ended with an error: {error}");
                    }
                    continue;
                }
                let event = value.get("event");
                if let Some(chunk) = event
                    .and_then(|e| e.pointer("/data/stdout"))
                    .and_then(serde_json::Value::as_str)
                {
                    first.get_or_insert(arrived);
                    stdout.extend(
                        base64::engine::general_purpose::STANDARD
                            .decode(chunk)
                            .context("stdout is not base64")?,
                    );
                }
                if let Some(end) = event.and_then(|e| e.get("end")) {
                    exit_code = Some(
                        end.get("exitCode")
                            .and_then(serde_json::Value::as_i64)
                            .unwrap_or(0),
                    );
                }
            }
        }
        match exit_code {
            Some(0) => Ok(Ran { first, stdout }),
            Some(code) => bail!("the command exited with code {code}"),
            None => bail!("process.Process/Start: the stream had no end event"),
        }
    }

    /// `DELETE /sandboxes/<id>`; a sandbox that is already gone counts as killed.
    pub async fn kill(&self, id: &str) -> anyhow::Result<()> {
        let request = self
            .request(Method::DELETE, &format!("/sandboxes/{id}"))
            .header("X-API-Key", &self.inner.key)
            .body(Full::default())?;
        let (status, body) = self.send_collect(request).await?;
        if !(status.is_success() || status == StatusCode::NOT_FOUND) {
            bail!(
                "DELETE /sandboxes/{id} answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        self.live().retain(|live| live != id);
        Ok(())
    }

    /// Kills every sandbox this client created and has not killed yet; returns the ones that
    /// could not be killed, with the reason.
    pub async fn kill_all(&self) -> Vec<(String, anyhow::Error)> {
        let ids: Vec<String> = self.live().clone();
        let mut tasks = tokio::task::JoinSet::new();
        for id in ids {
            let api = self.clone();
            tasks.spawn(async move {
                let outcome = api.kill(&id).await;
                (id, outcome)
            });
        }
        let mut failed = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((_, Ok(()))) => {}
                Ok((id, Err(e))) => failed.push((id, e)),
                Err(e) => failed.push(("?".into(), e.into())),
            }
        }
        failed
    }
}

/// Takes one complete Connect envelope (flags, message) off the front of `buf`.
fn next_envelope(buf: &mut BytesMut) -> Option<(u8, Bytes)> {
    if buf.len() < 5 {
        return None;
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return None;
    }
    let flags = buf[0];
    buf.advance(5);
    Some((flags, buf.split_to(len).freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_split_across_frames() {
        let mut wire = Vec::new();
        for (flags, msg) in [(0u8, &b"{\"a\":1}"[..]), (2u8, &b"{}"[..])] {
            wire.push(flags);
            wire.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            wire.extend_from_slice(msg);
        }
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&wire[..3]);
        assert!(next_envelope(&mut buf).is_none());
        buf.extend_from_slice(&wire[3..9]);
        assert!(next_envelope(&mut buf).is_none());
        buf.extend_from_slice(&wire[9..]);
        let (f, m) = next_envelope(&mut buf).expect("first envelope");
        assert_eq!((f, &m[..]), (0, &b"{\"a\":1}"[..]));
        let (f, m) = next_envelope(&mut buf).expect("second envelope");
        assert_eq!((f, &m[..]), (2, &b"{}"[..]));
        assert!(buf.is_empty());
    }
}
