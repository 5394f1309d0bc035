//! Requests to a sandbox's agent, made the way the edge makes them: over the agent's Unix
//! socket, holding the sandbox's agent lease so that a pause closes the connection before it
//! freezes the sandbox, and with the sandbox's own agent token.

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use sandbar_core::{HangUp, Sandboxes, Team};

use crate::error::PageError;

/// How long the dashboard waits for an agent to accept a connection or answer one unary call:
/// the agent lives in the tenant's sandbox, so its silence must not hold a page's request.
const AGENT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(20);

/// The most a unary answer may hold; a listing of a very large directory stays far below it.
const ANSWER_LIMIT: usize = 16 << 20;

/// `Authorization: Basic base64("user:")`: the dashboard acts as the sandbox's default user,
/// as the SDKs do unless told otherwise.
const AS_USER: &str = "Basic dXNlcjo=";

#[derive(Debug, thiserror::Error)]
pub(crate) enum AgentError {
    #[error(transparent)]
    Sandbox(#[from] sandbar_core::SandboxError),
    #[error("sandbox '{0}' is not running")]
    NotRunning(String),
    #[error("cannot reach the agent of sandbox '{id}': {source}")]
    Unreachable { id: String, source: std::io::Error },
    #[error("request to the agent of sandbox '{id}' failed: {source}")]
    Exchange { id: String, source: hyper::Error },
    #[error("the agent of sandbox '{id}' answered {status}: {message}")]
    Refused {
        id: String,
        status: StatusCode,
        message: String,
    },
    #[error("unexpected answer from the agent of sandbox '{id}': {detail}")]
    Malformed { id: String, detail: String },
    #[error("the agent of sandbox '{id}' did not {what} within {}s", AGENT_PATIENCE.as_secs())]
    NoAnswer { id: String, what: &'static str },
}

impl AgentError {
    /// Whether a later try may not meet this failure: the agent out of reach, silent, or
    /// failing on its side, or the sandbox not running just now. Not a refusal of the request
    /// itself, a garbled answer, or a sandbox the team does not have.
    pub(crate) fn may_pass(&self) -> bool {
        match self {
            Self::NotRunning(_)
            | Self::Unreachable { .. }
            | Self::Exchange { .. }
            | Self::NoAnswer { .. } => true,
            Self::Refused { status, .. } => !status.is_client_error(),
            Self::Sandbox(_) | Self::Malformed { .. } => false,
        }
    }
}

impl From<AgentError> for PageError {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::Sandbox(s) => s.into(),
            AgentError::NotRunning(_) => PageError::new(StatusCode::CONFLICT, e.to_string()),
            AgentError::NoAnswer { .. } => {
                PageError::new(StatusCode::GATEWAY_TIMEOUT, e.to_string())
            }
            AgentError::Refused { status, .. } => PageError::new(
                if status.is_client_error() {
                    status
                } else {
                    StatusCode::BAD_GATEWAY
                },
                e.to_string(),
            ),
            _ => PageError::new(StatusCode::BAD_GATEWAY, e.to_string()),
        }
    }
}

/// A connection to one sandbox's agent, for one team.
pub(crate) struct AgentLink {
    pub sandbox_id: String,
    token: String,
    sender: hyper::client::conn::http1::SendRequest<Body>,
}

impl AgentLink {
    /// Opens a connection to the agent of `team`'s sandbox `id`: a sandbox of another team
    /// is not found, as through the API.
    pub(crate) async fn open(
        sandboxes: &Sandboxes,
        team: &Team,
        id: &str,
    ) -> Result<Self, AgentError> {
        tokio::time::timeout(AGENT_PATIENCE, Self::open_unbounded(sandboxes, team, id))
            .await
            .map_err(|_| AgentError::NoAnswer {
                id: id.to_owned(),
                what: "accept a connection",
            })?
    }

    async fn open_unbounded(
        sandboxes: &Sandboxes,
        team: &Team,
        id: &str,
    ) -> Result<Self, AgentError> {
        let sandbox = sandboxes.registry().get(team, id).await?;
        let route = sandboxes
            .routes()
            .route(id)
            .ok_or_else(|| AgentError::NotRunning(id.to_owned()))?;
        let unreachable = |source| AgentError::Unreachable {
            id: id.to_owned(),
            source,
        };
        let stream = tokio::net::UnixStream::connect(&route.endpoint.agent_socket)
            .await
            .map_err(unreachable)?;
        let hang_up = HangUp::of(&stream).map_err(unreachable)?;
        let mut lease = route.agent;
        if lease.is_ending() {
            drop(stream);
            hang_up.hang_up().await;
            return Err(AgentError::NotRunning(id.to_owned()));
        }
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|source| AgentError::Exchange {
                id: id.to_owned(),
                source,
            })?;
        tokio::spawn(async move {
            let mut connection = Box::pin(connection.with_upgrades());
            tokio::select! {
                _ = &mut connection => {}
                () = lease.ending() => {}
            }
            drop(connection);
            hang_up.hang_up().await;
            drop(lease);
        });
        Ok(Self {
            sandbox_id: id.to_owned(),
            token: sandbox.envd_access_token,
            sender,
        })
    }

    /// Sends `request` (its path and query only) with the agent's token and user.
    pub(crate) async fn send(
        &mut self,
        mut request: Request<Body>,
    ) -> Result<Response<Incoming>, AgentError> {
        let headers = request.headers_mut();
        if let Ok(token) = HeaderValue::from_str(&self.token) {
            headers.insert("x-access-token", token);
        }
        headers.insert(
            axum::http::header::AUTHORIZATION,
            HeaderValue::from_static(AS_USER),
        );
        headers.insert(
            axum::http::header::HOST,
            HeaderValue::from_static("localhost"),
        );
        self.sender
            .ready()
            .await
            .map_err(|source| self.exchange(source))?;
        self.sender
            .send_request(request)
            .await
            .map_err(|source| self.exchange(source))
    }

    /// Sends `request`, whose body is already whole, and waits at most [`AGENT_PATIENCE`]
    /// for the answer's status and headers. [`Self::send`] has no bound: an upload's body
    /// streams through it for as long as the browser sends.
    pub(crate) async fn answer_to(
        &mut self,
        request: Request<Body>,
    ) -> Result<Response<Incoming>, AgentError> {
        tokio::time::timeout(AGENT_PATIENCE, self.send(request))
            .await
            .map_err(|_| self.no_answer("answer a request"))?
    }

    fn no_answer(&self, what: &'static str) -> AgentError {
        AgentError::NoAnswer {
            id: self.sandbox_id.clone(),
            what,
        }
    }

    fn exchange(&self, source: hyper::Error) -> AgentError {
        AgentError::Exchange {
            id: self.sandbox_id.clone(),
            source,
        }
    }

    /// A unary Connect call with a JSON body; the JSON answer.
    pub(crate) async fn call(
        &mut self,
        method: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, AgentError> {
        let request = Request::post(method)
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1")
            .body(Body::from(body.to_string()))
            .map_err(|e| self.malformed(e.to_string()))?;
        let response = self.answer_to(request).await?;
        let status = response.status();
        let bytes = read_all(response, &self.sandbox_id).await?;
        let value: serde_json::Value = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| self.malformed(e.to_string()))?
        };
        if !status.is_success() {
            return Err(self.refused(status, &value));
        }
        Ok(value)
    }

    pub(crate) fn refused(&self, status: StatusCode, body: &serde_json::Value) -> AgentError {
        let message = body
            .get("message")
            .and_then(|m| m.as_str())
            .map_or_else(|| body.to_string(), str::to_owned);
        AgentError::Refused {
            id: self.sandbox_id.clone(),
            status,
            message,
        }
    }

    pub(crate) fn malformed(&self, detail: String) -> AgentError {
        AgentError::Malformed {
            id: self.sandbox_id.clone(),
            detail,
        }
    }
}

/// The whole body of an agent's answer, refused past `ANSWER_LIMIT` or when it takes longer
/// than [`AGENT_PATIENCE`]: the answer is the tenant's to shape, the server's memory and
/// requests are not.
pub(crate) async fn read_all<B>(
    response: Response<B>,
    sandbox_id: &str,
) -> Result<bytes::Bytes, AgentError>
where
    B: hyper::body::Body<Data = bytes::Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use http_body_util::{BodyExt, LengthLimitError, Limited};
    let collected = tokio::time::timeout(
        AGENT_PATIENCE,
        Limited::new(response.into_body(), ANSWER_LIMIT).collect(),
    )
    .await
    .map_err(|_| AgentError::NoAnswer {
        id: sandbox_id.to_owned(),
        what: "finish an answer",
    })?;
    collected
        .map(|c| c.to_bytes())
        .map_err(|e| match e.downcast::<hyper::Error>() {
            Ok(source) => AgentError::Exchange {
                id: sandbox_id.to_owned(),
                source: *source,
            },
            Err(other) => AgentError::Malformed {
                id: sandbox_id.to_owned(),
                detail: if other.is::<LengthLimitError>() {
                    format!("an answer longer than {ANSWER_LIMIT} bytes")
                } else {
                    other.to_string()
                },
            },
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[test]
    fn only_failures_a_later_try_may_not_meet_are_tried_again() {
        let refused = |status| AgentError::Refused {
            id: "sb1".into(),
            status,
            message: String::new(),
        };
        assert!(AgentError::NotRunning("sb1".into()).may_pass());
        assert!(
            AgentError::NoAnswer {
                id: "sb1".into(),
                what: "answer a request"
            }
            .may_pass()
        );
        assert!(refused(StatusCode::INTERNAL_SERVER_ERROR).may_pass());
        assert!(!refused(StatusCode::NOT_FOUND).may_pass());
        assert!(
            !AgentError::Malformed {
                id: "sb1".into(),
                detail: String::new()
            }
            .may_pass()
        );
        assert!(
            !AgentError::Sandbox(sandbar_core::SandboxError::NotFound("sb1".into())).may_pass()
        );
    }

    #[tokio::test]
    async fn an_answer_is_read_whole_up_to_the_limit_and_refused_past_it() {
        let within = Response::new(Full::new(bytes::Bytes::from(vec![b'x'; ANSWER_LIMIT])));
        assert_eq!(read_all(within, "sb1").await.unwrap().len(), ANSWER_LIMIT);
        let past = Response::new(Full::new(bytes::Bytes::from(vec![b'x'; ANSWER_LIMIT + 1])));
        let error = read_all(past, "sb1").await.unwrap_err();
        assert!(
            matches!(&error, AgentError::Malformed { id, detail } if id == "sb1" && detail.contains("longer than")),
            "{error}"
        );
    }
}
