//! The edge: requests that name a sandbox (by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port`
//! headers, or by a Host of the form `{port}-{sandboxID}.{domain}`) are forwarded to that
//! sandbox's agent (port 49983) or to the port inside the sandbox; everything else falls
//! through to the REST API.

use std::net::SocketAddr;
use std::path::Path;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use sandbar_core::lifecycle::SandboxStatus;
use sandbar_core::{AgentLease, HangUp, Route, SandboxError, Sandboxes, WakeKeys};
use sandbar_envd::FileOperation;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::AppState;
use crate::error::ApiError;
use crate::telemetry::EdgeResponse;

/// The port the SDKs address the agent on.
pub const AGENT_PORT: u16 = 49983;

#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// Domain of Host-based routing: `{port}-{sandboxID}.{domain}`.
    pub domain: String,
}

#[derive(Debug, PartialEq, Eq)]
struct Target {
    sandbox_id: String,
    port: u16,
}

fn target_from_headers(headers: &HeaderMap) -> Option<Result<Target, ApiError>> {
    let id = headers
        .get("e2b-sandbox-id")?
        .to_str()
        .ok()?
        .trim()
        .to_owned();
    let port = match headers.get("e2b-sandbox-port") {
        None => Ok(AGENT_PORT),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| ApiError::bad_request("E2b-Sandbox-Port must be a port number")),
    };
    Some(port.map(|port| Target {
        sandbox_id: id,
        port,
    }))
}

fn target_from_host(host: &str, domain: &str) -> Option<Target> {
    let name = host.rsplit_once(':').map_or(host, |(name, port)| {
        if port.bytes().all(|c| c.is_ascii_digit()) {
            name
        } else {
            host
        }
    });
    let label = name.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    Some(Target {
        sandbox_id: id.to_owned(),
        port: port.parse().ok()?,
    })
}

fn not_found(sandbox_id: &str) -> Response {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox was not found: sandbox '{sandbox_id}' is not running"),
    )
    .into_response()
}

/// The sandbox a request is addressed to through the edge (by header or Host), if any.
pub(crate) fn sandbox_named_by(state: &AppState, request: &Request) -> Option<String> {
    match target_from_headers(request.headers()) {
        Some(Ok(target)) => Some(target.sandbox_id),
        Some(Err(_)) => None,
        None => request
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| target_from_host(h, &state.edge.domain))
            .map(|t| t.sandbox_id),
    }
}

/// Middleware in front of the API router.
pub(crate) async fn route_to_sandbox(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let target = match target_from_headers(request.headers()) {
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => return e.into_response(),
        None => request
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| target_from_host(h, &state.edge.domain)),
    };
    let (target, route) = match target {
        Some(target) => {
            // Read only when a paused sandbox would wake, not on every request.
            let (method, uri, headers) = (request.method(), request.uri(), request.headers());
            let lets_through = |keys: &WakeKeys<'_>| {
                Presented::from_parts(method, uri, headers).lets_through(target.port, keys)
            };
            match state
                .sandboxes
                .routes()
                .route_or_wake(&target.sandbox_id, lets_through)
                .await
            {
                Ok(route) => (target, route),
                // A paused sandbox that traffic would wake, but whose team has no free slot.
                // Whoever sent the traffic may be anyone: the answer names nothing of the
                // team.
                Err(SandboxError::ConcurrencyLimit {
                    retry_after_secs, ..
                }) => {
                    let busy = ApiError::retry_later(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!(
                            "sandbox '{}' is paused and cannot be resumed now; try again later",
                            target.sandbox_id
                        ),
                        retry_after_secs,
                    );
                    return mark(busy.into_response(), target.port);
                }
                Err(_) => {
                    let presented = Presented::from_parts(method, uri, headers);
                    return mark(refused_or_missing(&state, &target, &presented), target.port);
                }
            }
        }
        None => match signed_file_route(&state, &request) {
            Ok(Some(routed)) => routed,
            Ok(None) => return next.run(request).await,
            Err(refused) => return mark(refused.into_response(), AGENT_PORT),
        },
    };
    let port = target.port;
    mark(forward_to(&state, target, route, request).await, port)
}

/// What a request shows the edge's checks: its tokens and, for a signed file URL, the
/// signature's parts.
struct Presented {
    traffic_token: Option<String>,
    access_token: Option<String>,
    signed: Option<SignedFileRequest>,
    path: String,
}

impl Presented {
    #[cfg(test)]
    fn of(request: &Request) -> Self {
        Self::from_parts(request.method(), request.uri(), request.headers())
    }

    fn from_parts(method: &Method, uri: &Uri, headers: &HeaderMap) -> Self {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Self {
            traffic_token: header(crate::traffic::TRAFFIC_TOKEN_HEADER),
            access_token: header("x-access-token"),
            signed: signed_file_request(method, uri),
            path: uri.path().to_owned(),
        }
    }

    /// Whether the running sandbox would let this request through to `port`: the traffic
    /// token of a private user port, the agent's token or a valid signed file URL for the
    /// agent.
    fn lets_through(&self, port: u16, keys: &WakeKeys<'_>) -> bool {
        let matches = |given: &Option<String>, expected: &str| {
            given
                .as_deref()
                .is_some_and(|given| sandbar_envd::secrets_equal(given, expected))
        };
        if port != AGENT_PORT {
            let interpreter_admits = !crate::traffic::needs_agent_token(port, &self.path)
                || keys
                    .envd_access_token
                    .is_none_or(|expected| matches(&self.access_token, expected));
            return interpreter_admits
                && keys
                    .traffic_access_token
                    .is_none_or(|expected| matches(&self.traffic_token, expected));
        }
        let Some(token) = keys.envd_access_token else {
            return true;
        };
        matches(&self.access_token, token)
            || self
                .signed
                .as_ref()
                .is_some_and(|signed| signed.signed_with(token, chrono::Utc::now().timestamp()))
    }
}

/// What the edge answers for a sandbox it will not route to: the 403 of a private user port
/// to a request without its token, the 401 of a code interpreter execution without the
/// agent's, else "not found" as for any sandbox not running.
fn refused_or_missing(state: &AppState, target: &Target, presented: &Presented) -> Response {
    let access = state
        .sandboxes
        .routes()
        .user_port_access_any_state(&target.sandbox_id);
    if crate::traffic::needs_agent_token(target.port, &presented.path)
        && let Some(expected) = access.as_ref().and_then(|a| a.envd_access_token.as_deref())
        && !presented
            .access_token
            .as_deref()
            .is_some_and(|given| sandbar_envd::secrets_equal(given, expected))
    {
        return crate::traffic::needs_access_token(&target.sandbox_id, target.port).into_response();
    }
    if target.port != AGENT_PORT
        && access.is_some_and(|access| access.traffic_access_token.is_some())
    {
        return crate::traffic::needs_token(&target.sandbox_id, target.port).into_response();
    }
    not_found(&target.sandbox_id)
}

fn mark(mut response: Response, port: u16) -> Response {
    response.extensions_mut().insert(EdgeResponse {
        to_agent: port == AGENT_PORT,
    });
    response
}

async fn forward_to(
    state: &AppState,
    target: Target,
    route: Route,
    mut request: Request,
) -> Response {
    if target.port != AGENT_PORT
        && let Err(refused) =
            crate::traffic::admit(state, &target.sandbox_id, target.port, &mut request)
    {
        return refused.into_response();
    }
    // The node's own call to the agent (a restored snapshot's new token and environment);
    // clients never make it, whatever token they hold.
    if target.port == AGENT_PORT && request.uri().path().trim_end_matches('/') == "/init" {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "'/init' of sandbox '{}' is reserved to the server",
                target.sandbox_id
            ),
        )
        .into_response();
    }
    let Route { endpoint, agent } = route;
    let result = if target.port == AGENT_PORT {
        match tokio::net::UnixStream::connect(&endpoint.agent_socket).await {
            Ok(stream) => forward_to_agent(&state.sandboxes, &target, stream, agent, request).await,
            Err(e) => Err(unreachable(&target, &endpoint.agent_socket, e)),
        }
    } else {
        // Only connections to the agent hold up a pause.
        drop(agent);
        let addr = SocketAddr::new(endpoint.address, target.port);
        match tokio::net::TcpStream::connect(addr).await {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                forward(stream, request, None).await
            }
            Err(e) => Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "sandbox '{}' has nothing listening on port {}: {e}",
                    target.sandbox_id, target.port
                ),
            )),
        }
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// A connection to an agent. Its lease is given back only once the agent has closed its end:
/// when the exchange is over, or at once when the sandbox pauses.
struct AgentConnection {
    lease: AgentLease,
    hang_up: HangUp,
    /// Says, when asked, why the connection ended before the exchange did.
    cut: CutReason,
}

/// Tells a client why its exchange with the agent of a sandbox ended early, from what the
/// sandbox is at that moment: a kill or a timeout marks it stopping before its processes
/// end, a pause marks it pausing before the edge lets go of the connection.
#[derive(Clone)]
struct CutReason {
    sandboxes: std::sync::Arc<Sandboxes>,
    sandbox_id: String,
}

impl CutReason {
    /// A sandbox that is gone or going is "not found", the words the SDKs read as a
    /// sandbox no longer running; `None` while it runs.
    fn gone(&self) -> Option<String> {
        let id = &self.sandbox_id;
        match self.sandboxes.routes().status_of(id) {
            Some(SandboxStatus::Running | SandboxStatus::Snapshotting) => None,
            None | Some(SandboxStatus::Stopping) => Some(format!(
                "The sandbox was not found: the sandbox was killed or reached its end of life (sandbox '{id}')"
            )),
            Some(status) => Some(format!(
                "The sandbox was not found: sandbox '{id}' is {} (its commands can be attached to again once it runs)",
                status.name()
            )),
        }
    }

    /// The end of a stream cut short; one of a sandbox still running is left for the client
    /// to probe.
    fn message(&self) -> String {
        self.gone().unwrap_or_else(|| {
            format!(
                "the connection to sandbox '{}' ended before the stream completed",
                self.sandbox_id
            )
        })
    }
}

async fn forward_to_agent(
    sandboxes: &std::sync::Arc<Sandboxes>,
    target: &Target,
    stream: tokio::net::UnixStream,
    lease: AgentLease,
    request: Request,
) -> Result<Response, ApiError> {
    let pausing = || {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "The sandbox was not found: sandbox '{}' is pausing",
                target.sandbox_id
            ),
        )
    };
    let hang_up =
        HangUp::of(&stream).map_err(|e| unreachable(target, Path::new("agent socket"), e))?;
    // Paused between the lookup and the connection: closed unused, the agent seeing the end
    // before it is frozen.
    if lease.is_ending() {
        drop(stream);
        hang_up.hang_up().await;
        return Err(pausing());
    }
    let connection = AgentConnection {
        lease,
        hang_up,
        cut: CutReason {
            sandboxes: sandboxes.clone(),
            sandbox_id: target.sandbox_id.clone(),
        },
    };
    forward(stream, request, Some(connection)).await
}

/// The parts of a signed `/files` URL.
pub(crate) struct SignedFileRequest {
    signature: String,
    path: String,
    operation: FileOperation,
    /// The user the URL names; '' when it names none (what the SDKs sign then).
    user: String,
    expiration: Option<i64>,
}

impl SignedFileRequest {
    /// The signature, ready to be checked against many tokens (see
    /// [`sandbar_envd::SignatureCheck`]), whatever its expiration.
    pub(crate) fn check(&self) -> sandbar_envd::SignatureCheck {
        sandbar_envd::SignatureCheck::new(
            &self.signature,
            &self.path,
            self.operation,
            &self.user,
            self.expiration,
        )
    }

    /// Why no sandbox need be searched for this URL's signer: it has expired, which the
    /// agent would answer in these words whichever sandbox made it.
    pub(crate) fn refused_unsearched(&self, now: i64) -> Option<ApiError> {
        match self.expiration {
            Some(expiration) if expiration < now => Some(ApiError::new(
                StatusCode::UNAUTHORIZED,
                sandbar_envd::SignatureError::Expired(self.path.clone()).to_string(),
            )),
            _ => None,
        }
    }

    /// Whether the agent token `token` made this URL's signature, for exactly the user it
    /// names (constant-time, as the agent checks), and it has not expired by `now`.
    pub(crate) fn signed_with(&self, token: &str, now: i64) -> bool {
        sandbar_envd::verify_file_signature(
            &self.signature,
            &self.path,
            self.operation,
            &[self.user.as_str()],
            token,
            self.expiration,
            now,
        )
        .is_ok()
    }
}

pub(crate) fn signed_file_request(method: &Method, uri: &Uri) -> Option<SignedFileRequest> {
    if uri.path() != "/files" {
        return None;
    }
    let operation = match *method {
        Method::GET => FileOperation::Read,
        Method::POST => FileOperation::Write,
        _ => return None,
    };
    let query = uri.query()?;
    let param = |name: &str| {
        url::form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    // An unparsable expiration matches no signature; the agent would refuse it too.
    let expiration = match param("signature_expiration") {
        Some(exp) => Some(exp.parse::<i64>().ok()?),
        None => None,
    };
    Some(SignedFileRequest {
        signature: param("signature")?,
        path: param("path")?,
        operation,
        user: param("username").unwrap_or_default(),
        expiration,
    })
}

/// `download_url()` and `upload_url()` give out `/files` URLs that name no sandbox when the
/// SDK has one URL for every sandbox: the route to the sandbox whose agent token made the
/// URL's signature. `Ok(None)` for a request that is no signed file URL; refused when it is
/// one that no running sandbox signed, with what the agent answers a signature that does not
/// match, whoever the URL was for.
fn signed_file_route(
    state: &AppState,
    request: &Request,
) -> Result<Option<(Target, Route)>, ApiError> {
    let Some(signed) = signed_file_request(request.method(), request.uri()) else {
        return Ok(None);
    };
    if let Some(refused) = signed.refused_unsearched(chrono::Utc::now().timestamp()) {
        return Err(refused);
    }
    let check = signed.check();
    let (sandbox_id, route) = state
        .sandboxes
        .routes()
        .route_by_token(|token| check.made_with(token))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid signature: the file URL matches no running sandbox",
            )
        })?;
    Ok(Some((
        Target {
            sandbox_id,
            port: AGENT_PORT,
        },
        route,
    )))
}

fn unreachable(target: &Target, socket: &Path, e: std::io::Error) -> ApiError {
    tracing::warn!(sandbox_id = %target.sandbox_id, socket = %socket.display(), error = %e, "agent unreachable");
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!(
            "The sandbox was not found: the agent of sandbox '{}' does not answer",
            target.sandbox_id
        ),
    )
}

/// Headers that describe one hop's connection, not the message; an upgrade's `Connection`
/// and `Upgrade` go on to the sandbox, which answers the switch itself.
fn strip_hop_headers(headers: &mut HeaderMap, upgrading: bool) {
    if !upgrading {
        headers.remove(header::CONNECTION);
        headers.remove(header::UPGRADE);
    }
    for name in [
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

/// Sends `request` to a sandbox over `stream`: to its agent (`agent`) or to a port of its
/// own. A port's server may switch protocols (a WebSocket); the upgraded connections are
/// then joined for as long as both ends keep them.
async fn forward<S>(
    stream: S,
    mut request: Request,
    agent: Option<AgentConnection>,
) -> Result<Response, ApiError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let client_upgrade = (agent.is_none() && crate::upgrade::is_upgrade(request.headers()))
        .then(|| hyper::upgrade::on(&mut request));
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("cannot reach sandbox: {e}"),
            )
        })?;
    let cut = agent.as_ref().map(|a| a.cut.clone());
    tokio::spawn(async move {
        let ended = match agent {
            None => connection.with_upgrades().await,
            Some(AgentConnection {
                mut lease, hang_up, ..
            }) => {
                let mut connection = Box::pin(connection);
                let ended = tokio::select! {
                    ended = &mut connection => ended,
                    // The client's stream breaks here, as after a network outage.
                    () = lease.ending() => Ok(()),
                };
                drop(connection);
                hang_up.hang_up().await;
                drop(lease);
                ended
            }
        };
        if let Err(e) = ended {
            tracing::debug!(error = %e, "sandbox connection ended with an error");
        }
    });
    let (mut parts, body) = request.into_parts();
    strip_hop_headers(&mut parts.headers, client_upgrade.is_some());
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = path
        .parse()
        .map_err(|_| ApiError::bad_request("invalid request path"))?;
    let upstream = hyper::Request::from_parts(parts, body);
    let mut response = sender.send_request(upstream).await.map_err(|e| {
        let message = match cut.as_ref().and_then(CutReason::gone) {
            Some(gone) => format!("{gone}: {e}"),
            None => format!("sandbox request failed: {e}"),
        };
        ApiError::new(StatusCode::BAD_GATEWAY, message)
    })?;
    if let Some(client_upgrade) = client_upgrade
        && response.status() == StatusCode::SWITCHING_PROTOCOLS
    {
        let sandbox_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(crate::upgrade::join_upgraded(
            client_upgrade,
            sandbox_upgrade,
        ));
        let (parts, _) = response.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_headers(&mut parts.headers, false);
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let body = match cut {
        Some(cut) if crate::stream_end::is_connect_stream(content_type) => {
            Body::new(crate::stream_end::ConnectStream::new(body, move || {
                cut.message()
            }))
        }
        _ => Body::new(body),
    };
    Ok(Response::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(uri: &str, headers: &[(&str, &str)]) -> Request {
        let mut builder = Request::builder().uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(Body::empty()).expect("request")
    }

    const PRIVATE: WakeKeys<'static> = WakeKeys {
        envd_access_token: Some("agent-token"),
        traffic_access_token: Some("traffic-token"),
    };

    #[test]
    fn only_traffic_with_the_right_token_would_wake_a_private_port() {
        let without = Presented::of(&request("/", &[]));
        assert!(!without.lets_through(8000, &PRIVATE));
        let wrong = Presented::of(&request("/", &[("e2b-traffic-access-token", "guess")]));
        assert!(!wrong.lets_through(8000, &PRIVATE));
        let right = Presented::of(&request(
            "/",
            &[("e2b-traffic-access-token", "traffic-token")],
        ));
        assert!(right.lets_through(8000, &PRIVATE));
        let public = WakeKeys {
            traffic_access_token: None,
            ..PRIVATE
        };
        assert!(without.lets_through(8000, &public));
    }

    #[test]
    fn only_the_agent_token_would_wake_through_a_code_interpreter_execution() {
        let public = WakeKeys {
            traffic_access_token: None,
            ..PRIVATE
        };
        let port = sandbar_core::network::CODE_INTERPRETER_PORT;
        assert!(!Presented::of(&request("/execute", &[])).lets_through(port, &public));
        assert!(
            !Presented::of(&request("/execute/", &[("x-access-token", "guess")]))
                .lets_through(port, &public)
        );
        // The SDKs send no token with the contexts' calls.
        assert!(Presented::of(&request("/contexts", &[])).lets_through(port, &public));
        assert!(Presented::of(&request("/execute", &[])).lets_through(8000, &public));
        let right = Presented::of(&request("/execute", &[("x-access-token", "agent-token")]));
        assert!(right.lets_through(port, &public));
        // A private sandbox's interpreter needs both tokens.
        assert!(!right.lets_through(port, &PRIVATE));
        let both = Presented::of(&request(
            "/execute",
            &[
                ("x-access-token", "agent-token"),
                ("e2b-traffic-access-token", "traffic-token"),
            ],
        ));
        assert!(both.lets_through(port, &PRIVATE));
        let without_agent_token = WakeKeys {
            envd_access_token: None,
            traffic_access_token: None,
        };
        assert!(Presented::of(&request("/execute", &[])).lets_through(port, &without_agent_token));
    }

    #[test]
    fn only_the_agent_token_or_a_valid_signature_would_wake_through_the_agent_port() {
        assert!(!Presented::of(&request("/health", &[])).lets_through(AGENT_PORT, &PRIVATE));
        assert!(
            Presented::of(&request("/health", &[("x-access-token", "agent-token")]))
                .lets_through(AGENT_PORT, &PRIVATE)
        );
        let signature = sandbar_envd::file_signature(
            "/tmp/a",
            FileOperation::Read,
            "user",
            "agent-token",
            None,
        );
        let signed = format!("/files?path=/tmp/a&username=user&signature={signature}");
        assert!(Presented::of(&request(&signed, &[])).lets_through(AGENT_PORT, &PRIVATE));
        // The same signature for another user is not valid.
        let swapped = signed.replace("username=user", "username=root");
        assert!(!Presented::of(&request(&swapped, &[])).lets_through(AGENT_PORT, &PRIVATE));
        let open = WakeKeys {
            envd_access_token: None,
            ..PRIVATE
        };
        assert!(Presented::of(&request("/health", &[])).lets_through(AGENT_PORT, &open));
    }

    #[test]
    fn an_expired_signed_url_is_refused_without_a_search_and_in_the_agents_words() {
        let uri: Uri = "/files?path=/tmp/a&signature=v1_x&signature_expiration=100"
            .parse()
            .expect("uri");
        let signed = signed_file_request(&Method::GET, &uri).expect("signed");
        let refused = signed
            .refused_unsearched(101)
            .expect("refused")
            .into_response();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        assert!(signed.refused_unsearched(100).is_none());
        let unexpiring: Uri = "/files?path=/tmp/a&signature=v1_x".parse().expect("uri");
        let signed = signed_file_request(&Method::GET, &unexpiring).expect("signed");
        assert!(signed.refused_unsearched(i64::MAX).is_none());
    }

    #[test]
    fn the_signature_check_finds_the_token_that_signed() {
        let signature = sandbar_envd::file_signature(
            "/tmp/a b",
            FileOperation::Write,
            "user",
            "agent-token",
            Some(2_000_000_000),
        );
        let uri: Uri = format!(
            "/files?path=%2Ftmp%2Fa%20b&username=user&signature={signature}&signature_expiration=2000000000"
        )
        .parse()
        .expect("uri");
        let check = signed_file_request(&Method::POST, &uri)
            .expect("signed")
            .check();
        assert!(check.made_with("agent-token"));
        assert!(!check.made_with("other-token"));
        // A read of the same path is not what was signed.
        let read = signed_file_request(&Method::GET, &uri)
            .expect("signed")
            .check();
        assert!(!read.made_with("agent-token"));
    }

    #[test]
    fn host_routing_reads_port_and_id() {
        assert_eq!(
            target_from_host("49983-iabc.sandbar.localhost:3000", "sandbar.localhost"),
            Some(Target {
                sandbox_id: "iabc".into(),
                port: 49983
            })
        );
        assert_eq!(
            target_from_host("8080-iabc.sandbar.localhost", "sandbar.localhost"),
            Some(Target {
                sandbox_id: "iabc".into(),
                port: 8080
            })
        );
        assert_eq!(
            target_from_host("127.0.0.1:3000", "sandbar.localhost"),
            None
        );
        assert_eq!(
            target_from_host("sandbar.localhost", "sandbar.localhost"),
            None
        );
        assert_eq!(
            target_from_host("x.8080-iabc.sandbar.localhost", "sandbar.localhost"),
            None
        );
        assert_eq!(
            target_from_host("evilsandbar.localhost", "sandbar.localhost"),
            None
        );
    }

    #[test]
    fn header_routing_defaults_to_the_agent_port() {
        let mut headers = HeaderMap::new();
        headers.insert("e2b-sandbox-id", "iabc".parse().expect("header"));
        let target = target_from_headers(&headers)
            .expect("present")
            .expect("valid");
        assert_eq!(target.port, AGENT_PORT);
        headers.insert("e2b-sandbox-port", "nope".parse().expect("header"));
        let err = target_from_headers(&headers)
            .expect("present")
            .expect_err("not a port");
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{err:?}");
        assert!(err.message.contains("E2b-Sandbox-Port"), "{err:?}");
    }
}
