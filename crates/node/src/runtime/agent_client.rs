//! The node's own calls to a sandbox agent over its Unix socket.

use std::path::Path;
use std::time::Duration;

use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// Why a call the node made to a sandbox's agent failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AgentCallError {
    #[error("connect {socket}: {source}")]
    Connect {
        socket: String,
        source: std::io::Error,
    },
    #[error("agent did not become healthy: {last}")]
    NotHealthy { last: String },
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("{0}")]
    Request(#[from] hyper::http::Error),
    #[error("{0}")]
    Encode(#[from] serde_json::Error),
    #[error("agent answered {path} with {status}: {text}")]
    Refused {
        path: String,
        status: hyper::StatusCode,
        text: String,
    },
    #[error("the agent's current token is not a header value")]
    TokenNotAHeader,
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{0}")]
    InitAnswer(String),
    #[error("the agent did not answer {what} within {waited_ms} ms")]
    NoAnswer { what: &'static str, waited_ms: u128 },
}

fn connect_err(socket: &Path) -> impl FnOnce(std::io::Error) -> AgentCallError + '_ {
    move |source| AgentCallError::Connect {
        socket: socket.display().to_string(),
        source,
    }
}

/// Waits until the agent behind `socket` answers `GET /health`, for at most `patience`.
pub(crate) async fn wait_healthy(socket: &Path, patience: Duration) -> Result<(), AgentCallError> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut last_error = String::from("no answer");
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, health(socket)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last_error = e.to_string(),
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Err(AgentCallError::NotHealthy { last: last_error })
}

/// One connection to an agent. The agent's end of it was made in the host's network namespace
/// (a Unix socket belongs to the namespace of the side that connects), and a dump of the
/// sandbox cannot contain such a socket: every connection is ended with [`Link::hang_up`],
/// which returns once the agent has closed its end.
struct Link {
    /// Kept so that hyper does not close the connection on its own before the hang-up.
    _sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>,
    connection: tokio::task::JoinHandle<()>,
    hang_up: sandbar_core::HangUp,
}

impl Link {
    /// Ends the connection; what is left of a response still streaming is dropped.
    async fn hang_up(self) {
        self.connection.abort();
        let _ = self.connection.await;
        self.hang_up.hang_up().await;
    }
}

/// A connection to the agent behind `socket`. It outlives a rename of the socket's path.
pub(crate) async fn connect(socket: &Path) -> Result<tokio::net::UnixStream, AgentCallError> {
    tokio::net::UnixStream::connect(socket)
        .await
        .map_err(connect_err(socket))
}

/// Sends `request` to the agent behind `socket` over a connection of its own; an answer
/// other than a success is an error carrying the agent's message.
async fn call(
    socket: &Path,
    request: hyper::Request<http_body_util::Full<Bytes>>,
) -> Result<(hyper::Response<hyper::body::Incoming>, Link), AgentCallError> {
    use http_body_util::BodyExt as _;
    let stream = connect(socket).await?;
    let hang_up = sandbar_core::HangUp::of(&stream).map_err(connect_err(socket))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let connection = tokio::spawn(async move {
        let _ = conn.await;
    });
    let path = request.uri().path().to_owned();
    let sent = sender.send_request(request).await;
    let link = Link {
        _sender: sender,
        connection,
        hang_up,
    };
    let response = match sent {
        Ok(response) => response,
        Err(e) => {
            link.hang_up().await;
            return Err(e.into());
        }
    };
    if response.status().is_success() {
        return Ok((response, link));
    }
    let status = response.status();
    let text = response
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    link.hang_up().await;
    Err(AgentCallError::Refused { path, status, text })
}

/// [`call`] for a request whose answer is read whole.
async fn call_to_end(
    socket: &Path,
    request: hyper::Request<http_body_util::Full<Bytes>>,
) -> Result<Bytes, AgentCallError> {
    use http_body_util::BodyExt as _;
    let (response, link) = call(socket, request).await?;
    let body = response.into_body().collect().await;
    link.hang_up().await;
    Ok(body.map(|b| b.to_bytes())?)
}

async fn health(socket: &Path) -> Result<(), AgentCallError> {
    let request = hyper::Request::get("/health")
        .header(hyper::header::HOST, "agent")
        .body(http_body_util::Full::new(Bytes::new()))?;
    call_to_end(socket, request).await.map(|_| ())
}

/// A command to run through a sandbox agent, as `sh -c`.
#[derive(Debug, Clone)]
pub(crate) struct Exec<'a> {
    pub token: &'a str,
    pub user: &'a str,
    pub command: &'a str,
    pub envs: &'a std::collections::BTreeMap<String, String>,
    pub cwd: Option<&'a str>,
}

/// What a started process reported.
#[derive(Debug)]
pub(crate) enum ExecEvent {
    Output(Bytes),
    Exited(i32),
}

/// Longest Connect message taken from an agent. Output events carry a few dozen kilobytes;
/// a longer length is not one of them and is never buffered whole.
const MAX_ENVELOPE: usize = 16 << 20;

/// Whether the envelope at the front of `buffer` says it is longer than [`MAX_ENVELOPE`].
fn oversized(buffer: &[u8]) -> bool {
    buffer.get(1..5).is_some_and(|len| {
        u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize > MAX_ENVELOPE
    })
}

/// Takes the first whole Connect envelope (flags, message) off the front of `buffer`.
fn take_envelope(buffer: &mut Vec<u8>) -> Option<(u8, Vec<u8>)> {
    let head: [u8; 5] = buffer.get(..5)?.try_into().ok()?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if buffer.len() < 5 + len {
        return None;
    }
    Some((head[0], buffer.drain(..5 + len).skip(5).collect()))
}

/// The `process.Process/Start` request for `exec`.
fn start_request(
    exec: &Exec<'_>,
) -> Result<hyper::Request<http_body_util::Full<Bytes>>, AgentCallError> {
    use base64::Engine as _;

    let mut process = serde_json::json!({
        "cmd": "/bin/sh",
        "args": ["-c", exec.command],
        "envs": exec.envs,
    });
    if let Some(cwd) = exec.cwd {
        process["cwd"] = serde_json::Value::String(cwd.to_owned());
    }
    let message = serde_json::to_vec(&serde_json::json!({ "process": process }))?;
    let mut body = Vec::with_capacity(message.len() + 5);
    body.push(0);
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(&message);

    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{}:", exec.user));
    hyper::Request::post("/process.Process/Start")
        .header(hyper::header::HOST, "agent")
        .header(hyper::header::CONTENT_TYPE, "application/connect+json")
        .header("connect-protocol-version", "1")
        .header("x-access-token", exec.token)
        .header(hyper::header::AUTHORIZATION, format!("Basic {basic}"))
        .body(http_body_util::Full::new(Bytes::from(body)))
        .map_err(AgentCallError::from)
}

/// Starts `exec` and leaves it running on its own: returns once the agent reported it
/// started and the connection is closed.
pub(crate) async fn start_detached(socket: &Path, exec: &Exec<'_>) -> Result<(), AgentCallError> {
    use http_body_util::BodyExt as _;
    let (response, link) = call(socket, start_request(exec)?).await?;
    let mut body = response.into_body();
    // The first message is the start event (a refusal would have been an error status).
    let mut buffer: Vec<u8> = Vec::new();
    while take_envelope(&mut buffer).is_none() {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buffer.extend_from_slice(&data);
                }
            }
            Some(Err(e)) => {
                link.hang_up().await;
                return Err(e.into());
            }
            // Ended already: the command was quick.
            None => break,
        }
    }
    drop(body);
    link.hang_up().await;
    Ok(())
}

/// Starts `exec` through the agent's `process.Process/Start` stream and returns the stream
/// of its output and exit, or the agent's refusal.
pub(crate) async fn start(
    socket: &Path,
    exec: &Exec<'_>,
) -> Result<tokio::sync::mpsc::Receiver<ExecEvent>, AgentCallError> {
    use base64::Engine as _;
    use http_body_util::BodyExt as _;

    let (response, link) = call(socket, start_request(exec)?).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let mut body = response.into_body();
    tokio::spawn(async move {
        let mut buffer: Vec<u8> = Vec::new();
        let mut exit_code = None;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buffer.extend_from_slice(&data);
            if oversized(&buffer) {
                tracing::warn!("an agent sent an oversized message; its output stream is dropped");
                break;
            }
            while let Some((flags, message)) = take_envelope(&mut buffer) {
                if flags & 0x02 != 0 {
                    continue;
                }
                let Ok(value) = serde_json::from_slice::<serde_json::Value>(&message) else {
                    continue;
                };
                let event = &value["event"];
                if let Some(data) = event.get("data") {
                    for key in ["stdout", "stderr", "pty"] {
                        if let Some(text) = data.get(key).and_then(|v| v.as_str())
                            && let Ok(bytes) =
                                base64::engine::general_purpose::STANDARD.decode(text)
                        {
                            let _ = tx.send(ExecEvent::Output(Bytes::from(bytes))).await;
                        }
                    }
                } else if let Some(end) = event.get("end") {
                    // Proto3 JSON leaves a zero exit code out.
                    let code = end.get("exitCode").and_then(|v| v.as_i64()).unwrap_or(0);
                    exit_code = Some(code as i32);
                }
            }
        }
        // The exit is reported once the connection is closed: whoever waits for it may
        // freeze the sandbox next.
        link.hang_up().await;
        let _ = tx.send(ExecEvent::Exited(exit_code.unwrap_or(-1))).await;
    });
    Ok(rx)
}

/// Runs `exec` to its end, handing output to `on_output`; returns the exit code (-1 when the
/// process vanished without one, e.g. killed with its sandbox).
pub(crate) async fn run(
    socket: &Path,
    exec: &Exec<'_>,
    mut on_output: impl FnMut(&[u8]),
) -> Result<i32, AgentCallError> {
    let mut events = start(socket, exec).await?;
    while let Some(event) = events.recv().await {
        match event {
            ExecEvent::Output(bytes) => on_output(&bytes),
            ExecEvent::Exited(code) => return Ok(code),
        }
    }
    Ok(-1)
}

/// What `POST /init` gives an agent booted or restored before its sandbox was asked for: the
/// sandbox it now serves.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Init<'a> {
    pub access_token: &'a str,
    pub env_vars: &'a std::collections::BTreeMap<String, String>,
    pub default_user: &'a str,
    pub default_workdir: Option<&'a str>,
    pub memory_limit_mb: u32,
}

/// Hands the agent behind `socket` its new configuration; `current_token` is the one it
/// holds now (from the snapshot it was restored from, or the node's own).
pub(crate) async fn init(
    socket: &Path,
    current_token: &str,
    init: &Init<'_>,
) -> Result<(), AgentCallError> {
    let mut stream = connect(socket).await?;
    send_init(&mut stream, current_token, init).await?;
    init_answered(stream).await
}

/// Writes `POST /init` to the agent behind `stream` (made by [`connect`], which leaves it
/// known writable, so the write happens in this call's first poll), as HTTP/1.1 with
/// `connection: close`. The request is then in the agent's socket whatever this task does
/// next: a take goes on with blocking steps, during which a client task would wait for a
/// worker to write it. The answer is read by [`init_answered`].
pub(crate) async fn send_init(
    stream: &mut tokio::net::UnixStream,
    current_token: &str,
    init: &Init<'_>,
) -> Result<(), AgentCallError> {
    use tokio::io::AsyncWriteExt as _;
    let bytes = init_bytes(current_token, init)?;
    stream
        .write_all(&bytes)
        .await
        .map_err(|source| AgentCallError::Io {
            what: "send /init",
            source,
        })
}

fn init_bytes(current_token: &str, init: &Init<'_>) -> Result<Vec<u8>, AgentCallError> {
    // Refuses what would break the header line (CR, LF and other controls).
    hyper::header::HeaderValue::from_str(current_token)
        .map_err(|_| AgentCallError::TokenNotAHeader)?;
    let body = serde_json::to_vec(init)?;
    let mut bytes = format!(
        "POST /init HTTP/1.1\r\nhost: agent\r\ncontent-type: application/json\r\nx-access-token: {current_token}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    bytes.extend_from_slice(&body);
    Ok(bytes)
}

/// Longest answer to `/init` read: its status line and headers.
const INIT_ANSWER_MAX: usize = 16 * 1024;

/// How long an agent may take to answer `/init`. It answers within a millisecond or so; one
/// that has not answered by then is stuck (stopped, or starved), and a take of a warm sandbox
/// gives it up for a boot of its own instead of holding the create.
const INIT_PATIENCE: Duration = Duration::from_secs(5);

/// Reads the agent's answer to [`send_init`] (`Ok` for a 2xx status only) for at most
/// [`INIT_PATIENCE`], then hangs up as every call does (see [`Link`]).
pub(crate) async fn init_answered(stream: tokio::net::UnixStream) -> Result<(), AgentCallError> {
    init_answered_within(stream, INIT_PATIENCE).await
}

async fn init_answered_within(
    mut stream: tokio::net::UnixStream,
    patience: Duration,
) -> Result<(), AgentCallError> {
    let answered = tokio::time::timeout(patience, read_init_answer(&mut stream))
        .await
        .unwrap_or_else(|_| {
            Err(AgentCallError::NoAnswer {
                what: "/init",
                waited_ms: patience.as_millis(),
            })
        });
    let hang_up = sandbar_core::HangUp::of(&stream).map_err(|source| AgentCallError::Io {
        what: "connection",
        source,
    });
    drop(stream);
    hang_up?.hang_up().await;
    answered
}

async fn read_init_answer(stream: &mut tokio::net::UnixStream) -> Result<(), AgentCallError> {
    use tokio::io::AsyncReadExt as _;
    let mut buffer = Vec::with_capacity(512);
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buffer) {
            Ok(httparse::Status::Complete(_)) => {
                return match response.code {
                    Some(code) if (200..300).contains(&code) => Ok(()),
                    code => Err(AgentCallError::InitAnswer(format!(
                        "agent answered /init with {}",
                        code.map_or_else(|| "no status".to_owned(), |c| c.to_string())
                    ))),
                };
            }
            Ok(httparse::Status::Partial) if buffer.len() < INIT_ANSWER_MAX => {}
            Ok(httparse::Status::Partial) => {
                return Err(AgentCallError::InitAnswer(format!(
                    "agent's answer to /init is longer than {INIT_ANSWER_MAX} bytes"
                )));
            }
            Err(e) => {
                return Err(AgentCallError::InitAnswer(format!(
                    "agent's answer to /init: {e}"
                )));
            }
        }
        let read = stream
            .read_buf(&mut buffer)
            .await
            .map_err(|source| AgentCallError::Io {
                what: "read the answer to /init",
                source,
            })?;
        if read == 0 {
            return Err(AgentCallError::InitAnswer(
                "the agent closed the connection without answering /init".to_owned(),
            ));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{
        AgentCallError, Init, MAX_ENVELOPE, init_answered, init_answered_within, init_bytes,
        oversized, send_init, take_envelope,
    };

    /// What an agent reads of a `send_init` on `theirs`, after answering with `answer`
    /// (nothing when `None`, closing at once).
    async fn init_exchange(
        answer: Option<&'static str>,
    ) -> (
        Result<(), AgentCallError>,
        String,
        Vec<(String, String)>,
        serde_json::Value,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut ours, mut theirs) = tokio::net::UnixStream::pair().unwrap();
        let envs = std::collections::BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        let init = Init {
            access_token: "new-token",
            env_vars: &envs,
            default_user: "user",
            default_workdir: Some("/home/user"),
            memory_limit_mb: 512,
        };
        send_init(&mut ours, "node-token", &init).await.unwrap();
        let mut request = Vec::new();
        let (path, headers, body) = loop {
            theirs.read_buf(&mut request).await.unwrap();
            let mut slots = [httparse::EMPTY_HEADER; 16];
            let mut parsed = httparse::Request::new(&mut slots);
            if let httparse::Status::Complete(at) = parsed.parse(&request).unwrap() {
                let headers: Vec<(String, String)> = parsed
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_owned(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let length: usize = headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .unwrap()
                    .1
                    .parse()
                    .unwrap();
                if request.len() >= at + length {
                    let body = serde_json::from_slice(&request[at..at + length]).unwrap();
                    break (parsed.path.unwrap().to_owned(), headers, body);
                }
            }
        };
        if let Some(answer) = answer {
            theirs.write_all(answer.as_bytes()).await.unwrap();
        }
        drop(theirs);
        (init_answered(ours).await, path, headers, body)
    }

    #[tokio::test]
    async fn an_init_is_one_request_the_agent_reads_whole_and_a_2xx_answers_it() {
        let (answered, path, headers, body) =
            init_exchange(Some("HTTP/1.1 204 No Content\r\ndate: x\r\n\r\n")).await;
        answered.unwrap();
        assert_eq!(path, "/init");
        assert!(headers.contains(&("x-access-token".to_owned(), "node-token".to_owned())));
        assert_eq!(body["accessToken"], "new-token");
        assert_eq!(body["envVars"]["A"], "1");
    }

    #[tokio::test]
    async fn an_init_refused_or_unanswered_is_an_error() {
        let (refused, ..) = init_exchange(Some(
            "HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n",
        ))
        .await;
        assert!(refused.unwrap_err().to_string().contains("401"));
        let (unanswered, ..) = init_exchange(None).await;
        assert!(
            unanswered
                .unwrap_err()
                .to_string()
                .contains("without answering")
        );
        let (garbled, ..) = init_exchange(Some("not http\r\n\r\n")).await;
        assert_eq!(
            garbled.unwrap_err().to_string(),
            "agent's answer to /init: invalid HTTP version"
        );
    }

    #[tokio::test]
    async fn an_agent_that_never_answers_init_is_given_up_on() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let patience = std::time::Duration::from_millis(50);
        // Bounded here too, so that a wait without an end fails the test instead of hanging it.
        let given_up = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            init_answered_within(ours, patience),
        )
        .await
        .expect("the wait for /init ends");
        assert_eq!(
            given_up.unwrap_err().to_string(),
            "the agent did not answer /init within 50 ms"
        );
        drop(theirs);
    }

    #[test]
    fn a_token_that_would_break_the_request_is_refused() {
        let envs = std::collections::BTreeMap::new();
        let init = Init {
            access_token: "t",
            env_vars: &envs,
            default_user: "user",
            default_workdir: None,
            memory_limit_mb: 1,
        };
        assert!(matches!(
            init_bytes("a\r\nx-evil: 1", &init),
            Err(AgentCallError::TokenNotAHeader)
        ));
    }

    #[test]
    fn an_envelope_is_taken_whole_and_an_oversized_one_told_from_its_header() {
        let mut buffer = vec![0, 0, 0, 0, 3, b'a', b'b'];
        assert!(!oversized(&buffer));
        assert_eq!(take_envelope(&mut buffer), None);
        buffer.push(b'c');
        assert_eq!(take_envelope(&mut buffer), Some((0, b"abc".to_vec())));
        assert!(buffer.is_empty());
        let huge = (MAX_ENVELOPE as u32 + 1).to_be_bytes();
        assert!(oversized(&[0, huge[0], huge[1], huge[2], huge[3]]));
        assert!(!oversized(&[0, 0, 0]));
    }
}
