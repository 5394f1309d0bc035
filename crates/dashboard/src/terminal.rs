//! The sandbox terminal: a WebSocket from xterm.js's attach addon, bridged to a shell the
//! agent runs in a PTY (its `process.Process` Connect service, as the SDKs' `pty` uses it).
//!
//! Output frames of the agent's `Start` stream go to the browser as binary messages; what
//! the browser sends is written to the PTY with `SendInput`. A binary message that starts
//! with [`RESIZE`] carries `cols,rows` instead. When either side ends, the shell is killed.

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;

use crate::Dashboard;
use crate::agent::{AgentError, AgentLink};
use crate::error::PageError;
use crate::session::{Signed, csrf_matches};

/// Marks a resize message from the page (bytes no terminal input starts with).
pub(crate) const RESIZE: &[u8] = b"\xffR";

/// How long the agent may take to start the shell: the sandbox decides how fast its agent
/// answers, so the wait is bounded like every other wait on a sandbox.
const SHELL_START: std::time::Duration = std::time::Duration::from_secs(20);

#[derive(Debug, Deserialize)]
pub(crate) struct TerminalQuery {
    csrf: String,
    #[serde(default)]
    cols: Option<u16>,
    #[serde(default)]
    rows: Option<u16>,
}

/// Whether the upgrade comes from a page of this server: browsers send cookies with
/// cross-site WebSocket handshakes that `SameSite` does not cover in every case, so the
/// origin is checked as well as the CSRF token.
fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin = headers.get(header::ORIGIN).and_then(|h| h.to_str().ok());
    match (host, origin) {
        (Some(host), Some(origin)) => origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest.trim_end_matches('/') == host),
        _ => false,
    }
}

/// `GET /sandboxes/{id}/terminal?csrf=&cols=&rows=` (WebSocket).
pub(crate) async fn open(
    State(state): State<Dashboard>,
    signed: Signed,
    Path(id): Path<String>,
    Query(query): Query<TerminalQuery>,
    headers: HeaderMap,
    upgrade: WebSocketUpgrade,
) -> Response {
    if !csrf_matches(&query.csrf, &signed.csrf) || !same_origin(&headers) {
        return PageError::new(
            StatusCode::FORBIDDEN,
            "terminal refused: not from this dashboard",
        )
        .into_response();
    }
    let size = (
        query.cols.unwrap_or(80).clamp(10, 500),
        query.rows.unwrap_or(24).clamp(4, 200),
    );
    let start = async {
        let mut output = AgentLink::open(&state.inner.sandboxes, &signed.team, &id).await?;
        let input = AgentLink::open(&state.inner.sandboxes, &signed.team, &id).await?;
        let stream = start_shell(&mut output, size).await?;
        Ok::<_, AgentError>((output, input, stream))
    };
    let started = match tokio::time::timeout(SHELL_START, start).await {
        Ok(started) => started.map_err(PageError::from),
        Err(_) => Err(PageError::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "the agent of sandbox '{id}' did not start a shell within {}s",
                SHELL_START.as_secs()
            ),
        )),
    };
    match started {
        Ok((output, input, stream)) => upgrade.on_upgrade(move |socket| async move {
            bridge(socket, stream, input).await;
            // The output link goes with the shell.
            drop(output);
        }),
        Err(e) => {
            // The browser sees only a failed handshake, so the reason goes to the log.
            tracing::warn!(sandbox_id = %id, error = %e.message, "terminal not opened");
            e.into_response()
        }
    }
}

/// A Connect envelope: flags, big-endian length, message.
fn envelope(message: &serde_json::Value) -> Vec<u8> {
    let json = message.to_string().into_bytes();
    let mut out = Vec::with_capacity(json.len() + 5);
    out.push(0);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

async fn start_shell(
    link: &mut AgentLink,
    (cols, rows): (u16, u16),
) -> Result<Incoming, AgentError> {
    let start = serde_json::json!({
        "process": {
            "cmd": "/bin/bash",
            "args": ["-i", "-l"],
            "envs": { "TERM": "xterm-256color", "LANG": "C.UTF-8" },
        },
        "pty": { "size": { "cols": cols, "rows": rows } },
    });
    let request = Request::post("/process.Process/Start")
        .header(header::CONTENT_TYPE, "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(Body::from(envelope(&start)))
        .map_err(|e| link.malformed(e.to_string()))?;
    let answer = link.send(request).await?;
    let status = answer.status();
    if !status.is_success() {
        let body = crate::agent::read_all(answer, &link.sandbox_id).await?;
        let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        return Err(link.refused(status, &json));
    }
    Ok(answer.into_body())
}

/// One decoded message of the agent's stream.
#[derive(Debug, PartialEq)]
enum Event {
    Started(u32),
    Output(Vec<u8>),
    Ended(String),
    Other,
}

/// Takes the complete envelopes off the front of `buffer`.
fn decode(buffer: &mut BytesMut) -> Vec<Event> {
    let mut events = Vec::new();
    while buffer.len() >= 5 {
        let flags = buffer[0];
        let len = u32::from_be_bytes([buffer[1], buffer[2], buffer[3], buffer[4]]) as usize;
        if buffer.len() < 5 + len {
            break;
        }
        buffer.advance(5);
        let message = buffer.split_to(len);
        let json: serde_json::Value = serde_json::from_slice(&message).unwrap_or_default();
        if flags & 0x02 != 0 {
            let why = json
                .pointer("/error/message")
                .and_then(|m| m.as_str())
                .unwrap_or("the shell ended")
                .to_owned();
            events.push(Event::Ended(why));
            continue;
        }
        let event = &json["event"];
        if let Some(pid) = event.pointer("/start/pid").and_then(|p| p.as_u64()) {
            events.push(Event::Started(pid as u32));
        } else if let Some(data) = event.pointer("/data/pty").and_then(|d| d.as_str()) {
            events.push(Event::Output(BASE64.decode(data).unwrap_or_default()));
        } else if event.get("end").is_some() {
            let status = event
                .pointer("/end/status")
                .and_then(|s| s.as_str())
                .unwrap_or("exited");
            events.push(Event::Ended(format!("the shell ended ({status})")));
        } else {
            events.push(Event::Other);
        }
    }
    events
}

async fn bridge(mut socket: WebSocket, mut output: Incoming, mut input: AgentLink) {
    let mut buffer = BytesMut::new();
    let mut pid: Option<u32> = None;
    let ended = loop {
        tokio::select! {
            frame = output.frame() => {
                let data = match frame {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => data,
                        Err(_) => continue,
                    },
                    Some(Err(e)) => break format!("the sandbox's terminal stream broke: {e}"),
                    None => break "the sandbox's terminal stream ended".to_owned(),
                };
                buffer.extend_from_slice(&data);
                let mut ended = None;
                for event in decode(&mut buffer) {
                    match event {
                        Event::Started(p) => pid = Some(p),
                        Event::Output(bytes) => {
                            if socket.send(Message::Binary(bytes.into())).await.is_err() {
                                ended = Some(String::new());
                            }
                        }
                        Event::Ended(why) => ended = Some(why),
                        Event::Other => {}
                    }
                }
                if let Some(why) = ended {
                    break why;
                }
            }
            message = socket.recv() => {
                let bytes: Vec<u8> = match message {
                    Some(Ok(Message::Text(text))) => text.as_str().as_bytes().to_vec(),
                    Some(Ok(Message::Binary(bytes))) => bytes.to_vec(),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break String::new(),
                };
                let Some(pid) = pid else { continue };
                let result = if let Some(size) = bytes.strip_prefix(RESIZE) {
                    resize(&mut input, pid, size).await
                } else {
                    input
                        .call(
                            "/process.Process/SendInput",
                            &serde_json::json!({
                                "process": { "pid": pid },
                                "input": { "pty": BASE64.encode(&bytes) },
                            }),
                        )
                        .await
                        .map(drop)
                };
                if let Err(e) = result {
                    break e.to_string();
                }
            }
        }
    };
    if let Some(pid) = pid {
        let _ = input
            .call(
                "/process.Process/SendSignal",
                &serde_json::json!({ "process": { "pid": pid }, "signal": "SIGNAL_SIGKILL" }),
            )
            .await;
    }
    if !ended.is_empty() {
        let _ = socket
            .send(Message::Text(format!("\r\n[{ended}]\r\n").into()))
            .await;
    }
    let _ = socket.send(Message::Close(None)).await;
}

async fn resize(input: &mut AgentLink, pid: u32, size: &[u8]) -> Result<(), AgentError> {
    let text = String::from_utf8_lossy(size);
    let Some((cols, rows)) = text.split_once(',') else {
        return Ok(());
    };
    let (Ok(cols), Ok(rows)) = (cols.trim().parse::<u16>(), rows.trim().parse::<u16>()) else {
        return Ok(());
    };
    input
        .call(
            "/process.Process/Update",
            &serde_json::json!({
                "process": { "pid": pid },
                "pty": { "size": { "cols": cols.clamp(10, 500), "rows": rows.clamp(4, 200) } },
            }),
        )
        .await
        .map(drop)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_decode_across_reads() {
        let start = envelope(&serde_json::json!({"event": {"start": {"pid": 7}}}));
        let data = envelope(&serde_json::json!({"event": {"data": {"pty": BASE64.encode("hi")}}}));
        let mut end = envelope(&serde_json::json!({}));
        end[0] = 0x02;
        let all = [start, data, end].concat();
        let mut buffer = BytesMut::from(&all[..9]);
        assert!(decode(&mut buffer).is_empty());
        buffer.extend_from_slice(&all[9..]);
        assert_eq!(
            decode(&mut buffer),
            vec![
                Event::Started(7),
                Event::Output(b"hi".to_vec()),
                Event::Ended("the shell ended".into())
            ]
        );
        assert!(buffer.is_empty());
    }

    #[test]
    fn only_same_origin_upgrades_pass() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, "127.0.0.1:3000".parse().unwrap());
        assert!(!same_origin(&headers));
        headers.insert(header::ORIGIN, "http://127.0.0.1:3000".parse().unwrap());
        assert!(same_origin(&headers));
        headers.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(!same_origin(&headers));
    }
}
