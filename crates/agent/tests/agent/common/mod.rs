//! In-process agent on 127.0.0.1:0 and a small Connect/HTTP client for the tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

pub const TOKEN: &str = "test-token";
pub type Body = BoxBody<Bytes, std::io::Error>;

pub struct Agent {
    pub base: String,
    pub client: Client<HttpConnector, Body>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

pub fn unb64(data: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .unwrap()
}

pub fn envelope(flags: u8, msg: &Value) -> Bytes {
    let payload = serde_json::to_vec(msg).unwrap();
    let mut out = Vec::with_capacity(payload.len() + 5);
    out.push(flags);
    out.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&payload);
    out.into()
}

impl Agent {
    pub async fn start() -> Agent {
        let mut env_vars = BTreeMap::new();
        env_vars.insert("CFG_VAR".to_owned(), "from-config".to_owned());
        let config = sandbar_agent::AgentConfig {
            access_token: Some(TOKEN.to_owned()),
            default_user: "root".to_owned(),
            env_vars,
            default_workdir: None,
            memory_limit_mb: None,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            sandbar_agent::serve_tcp(listener, config).await.unwrap();
        });
        let client = Client::builder(TokioExecutor::new()).build_http();
        Agent {
            base: format!("http://{addr}"),
            client,
            server,
        }
    }

    pub fn request(&self, method: &str, path: &str) -> http::request::Builder {
        http::Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path))
            .header("x-access-token", TOKEN)
    }

    pub async fn send(
        &self,
        req: http::Request<Body>,
    ) -> (http::StatusCode, http::HeaderMap, Bytes) {
        let resp = self.client.request(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, body)
    }

    /// Unary Connect call with the JSON codec.
    pub async fn unary(&self, method: &str, msg: Value) -> (u16, Value) {
        let req = self
            .request("POST", &format!("/{method}"))
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .body(full(serde_json::to_vec(&msg).unwrap()))
            .unwrap();
        let (status, _, body) = self.send(req).await;
        let value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap()
        };
        (status.as_u16(), value)
    }

    /// Unary call that must succeed; returns its answer.
    pub async fn unary_ok(&self, method: &str, msg: Value) -> Value {
        let (status, body) = self.unary(method, msg).await;
        assert_eq!(status, 200, "{method}: {body}");
        body
    }

    /// Unary call that must be refused because what it names is not there.
    pub async fn unary_not_found(&self, method: &str, msg: Value) {
        let (status, body) = self.unary(method, msg).await;
        assert_eq!(status, 404, "{method}: {body}");
        assert_eq!(body["code"], "not_found");
    }

    /// Writes `input` to the stdin of process `pid`.
    pub async fn send_stdin(&self, pid: u64, input: &[u8]) {
        self.unary_ok(
            "process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"stdin": b64(input)}}),
        )
        .await;
    }

    /// Closes the stdin of process `pid`.
    pub async fn close_stdin(&self, pid: u64) {
        self.unary_ok(
            "process.Process/CloseStdin",
            json!({"process": {"pid": pid}}),
        )
        .await;
    }

    /// Starts the process `msg` asks for, with no extra headers, and returns a reader of its
    /// stream's envelopes.
    pub async fn start_process(&self, msg: Value) -> Frames {
        self.stream("process.Process/Start", msg, &[]).await
    }

    /// Opens a server stream and returns a reader of its envelopes.
    pub async fn stream(&self, method: &str, msg: Value, headers: &[(&str, &str)]) -> Frames {
        let mut req = self
            .request("POST", &format!("/{method}"))
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(full(envelope(0, &msg))).unwrap();
        let resp = self.client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        Frames {
            body: resp.into_body(),
            buf: BytesMut::new(),
        }
    }
}

pub struct Frames {
    body: hyper::body::Incoming,
    buf: BytesMut,
}

#[derive(Debug)]
pub enum Frame {
    Message(Value),
    EndStream(Value),
}

impl Frames {
    /// Next envelope, or None when the body ended.
    pub async fn next(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap()) as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    self.buf.advance(5);
                    let payload = self.buf.split_to(len);
                    let value: Value = serde_json::from_slice(&payload).unwrap();
                    return Some(if flags & 0x02 != 0 {
                        Frame::EndStream(value)
                    } else {
                        Frame::Message(value)
                    });
                }
            }
            let frame = tokio::time::timeout(Duration::from_secs(20), self.body.frame())
                .await
                .expect("stream stalled")?;
            if let Ok(data) = frame.unwrap().into_data() {
                self.buf.extend_from_slice(&data);
            }
        }
    }

    /// The `event` of the next message (panics on end-of-stream).
    pub async fn event(&mut self) -> Value {
        match self.next().await {
            Some(Frame::Message(v)) => v["event"].clone(),
            other => panic!("expected a message, got {other:?}"),
        }
    }

    /// The raw JSON of the next message (panics on end-of-stream).
    pub async fn event_raw(&mut self) -> Value {
        match self.next().await {
            Some(Frame::Message(v)) => v,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    /// Reads to the end: collected stdout, stderr, pty, the end event and end-of-stream JSON.
    pub async fn finish(&mut self) -> Outcome {
        let mut out = Outcome::default();
        while let Some(frame) = self.next().await {
            match frame {
                Frame::Message(v) => {
                    let ev = &v["event"];
                    if let Some(data) = ev.get("data") {
                        if let Some(s) = data.get("stdout") {
                            out.stdout.extend(unb64(s.as_str().unwrap()));
                        }
                        if let Some(s) = data.get("stderr") {
                            out.stderr.extend(unb64(s.as_str().unwrap()));
                        }
                        if let Some(s) = data.get("pty") {
                            out.pty.extend(unb64(s.as_str().unwrap()));
                        }
                    } else if let Some(end) = ev.get("end") {
                        assert!(out.end.is_none(), "two end events");
                        out.end = Some(end.clone());
                    } else if ev.get("keepalive").is_some() {
                        out.keepalives += 1;
                    } else {
                        panic!("unexpected event {v}");
                    }
                }
                Frame::EndStream(v) => {
                    out.end_stream = Some(v);
                    break;
                }
            }
        }
        out
    }
}

#[derive(Debug, Default)]
pub struct Outcome {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: Option<Value>,
    pub end_stream: Option<Value>,
    pub keepalives: usize,
}

impl Outcome {
    pub fn exit_code(&self) -> i64 {
        self.end.as_ref().unwrap()["exitCode"].as_i64().unwrap_or(0)
    }
}

pub fn bash(cmd: &str) -> Value {
    json!({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, "stdin": false})
}

/// Reads the start event and returns the pid.
pub async fn started(frames: &mut Frames) -> u64 {
    let ev = frames.event().await;
    ev["start"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("first event is not start: {ev}"))
}
