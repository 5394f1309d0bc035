//! Sign-in sessions: a random id in an `HttpOnly; SameSite=Strict; Path=/dashboard` cookie,
//! mapped on the server to the credential that signed in and the session's CSRF token.
//!
//! The credential is checked again on every request, so a revoked key or token ends its
//! sessions at once, and the team it names scopes every call the request makes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use rand::RngCore;
use sandbar_core::Team;
use subtle::ConstantTimeEq;

use crate::Dashboard;
use crate::error::PageError;

/// The cookie's name.
pub const SESSION_COOKIE: &str = "sandbar_dashboard";
/// The header htmx sends the CSRF token in (set once on `<body>` with `hx-headers`).
pub(crate) const CSRF_HEADER: &str = "x-csrf-token";
/// A session ends this long after sign-in, whatever its use.
const LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most; the oldest goes first past it, so sign-ins cannot grow the map
/// without bound.
const MAX_SESSIONS: usize = 10_000;

/// What signed in: the dashboard keeps it to check again on each request.
#[derive(Clone)]
pub(crate) enum Credential {
    ApiKey(String),
    AccessToken(String),
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Credential::ApiKey(_) => "ApiKey(..)",
            Credential::AccessToken(_) => "AccessToken(..)",
        })
    }
}

impl Credential {
    /// An access token (`sk_e2b_…`) or else an API key, as the API tells them apart.
    pub(crate) fn parse(secret: &str) -> Self {
        let secret = secret.trim().to_owned();
        if secret.starts_with("sk_e2b_") {
            Credential::AccessToken(secret)
        } else {
            Credential::ApiKey(secret)
        }
    }

    pub(crate) async fn team(
        &self,
        auth: &sandbar_core::Auth,
    ) -> Result<Team, sandbar_core::AuthError> {
        match self {
            Credential::ApiKey(key) => auth.team_for_api_key(Some(key)).await,
            Credential::AccessToken(token) => auth.team_for_access_token(Some(token)).await,
        }
    }
}

#[derive(Debug)]
struct Session {
    credential: Credential,
    csrf: String,
    started: Instant,
}

#[derive(Debug, Default)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

fn random_hex() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // A panic while holding the lock leaves the map itself consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new session for `credential`: its id, for the cookie.
    pub(crate) fn start(&self, credential: Credential) -> String {
        let id = random_hex();
        let mut map = self.lock();
        map.retain(|_, s| s.started.elapsed() < LIFETIME);
        if map.len() >= MAX_SESSIONS
            && let Some(oldest) = map
                .iter()
                .min_by_key(|(_, s)| s.started)
                .map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
        map.insert(
            id.clone(),
            Session {
                credential,
                csrf: random_hex(),
                started: Instant::now(),
            },
        );
        id
    }

    fn find(&self, id: &str) -> Option<(Credential, String)> {
        let mut map = self.lock();
        match map.get(id) {
            Some(s) if s.started.elapsed() < LIFETIME => {
                Some((s.credential.clone(), s.csrf.clone()))
            }
            Some(_) => {
                map.remove(id);
                None
            }
            None => None,
        }
    }

    pub(crate) fn end(&self, id: &str) {
        self.lock().remove(id);
    }
}

/// The `Set-Cookie` value that carries a new session.
pub(crate) fn cookie(id: &str) -> HeaderValue {
    let value = format!(
        "{SESSION_COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/dashboard; Max-Age={}",
        LIFETIME.as_secs()
    );
    HeaderValue::from_str(&value).unwrap_or(HeaderValue::from_static(""))
}

/// The `Set-Cookie` value that removes the session cookie.
pub(crate) fn cleared_cookie() -> HeaderValue {
    HeaderValue::from_static(
        "sandbar_dashboard=; HttpOnly; SameSite=Strict; Path=/dashboard; Max-Age=0",
    )
}

fn session_id(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == SESSION_COOKIE)
        .map(|(_, value)| value)
}

/// A signed-in request: the session's team, freshly checked.
#[derive(Debug)]
pub(crate) struct Signed {
    pub team: Team,
    /// What signed in, checked again for this request.
    pub credential: Credential,
    pub session_id: String,
    pub csrf: String,
}

/// How a request without a valid session is answered: a page load goes to the sign-in form;
/// an htmx request is told to go there; anything else gets 401.
pub(crate) fn sign_in_first(headers: &HeaderMap) -> Response {
    if headers.contains_key("hx-request") {
        let mut response = StatusCode::UNAUTHORIZED.into_response();
        response
            .headers_mut()
            .insert("hx-redirect", HeaderValue::from_static("/dashboard/login"));
        return response;
    }
    let wants_page = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if wants_page {
        Redirect::to("/dashboard/login").into_response()
    } else {
        PageError::new(StatusCode::UNAUTHORIZED, "sign in first").into_response()
    }
}

/// A session that an API host of a cluster checked (its cookie and, for a change, its CSRF
/// token) before forwarding the request to the node that holds the sandbox: sessions live in
/// the API host's memory, so the node is handed what the session holds and checks the
/// credential again itself, as it checks the API key of a forwarded API request.
///
/// It travels in headers that the API host sets on every forwarded request (removing any the
/// client sent) and that a node reads only once the cluster's secret was presented, so only
/// an API host can vouch for a session.
#[derive(Clone)]
pub struct VouchedSession {
    credential: Credential,
    session_id: String,
    csrf: String,
}

impl std::fmt::Debug for VouchedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VouchedSession")
            .field("credential", &self.credential)
            .finish_non_exhaustive()
    }
}

const VOUCHED_CREDENTIAL: &str = "x-sandbar-dashboard-credential";
const VOUCHED_SESSION: &str = "x-sandbar-dashboard-session";
const VOUCHED_CSRF: &str = "x-sandbar-dashboard-csrf";

impl VouchedSession {
    /// The headers that carry a vouched session, for an API host to remove from what a client
    /// sent before it forwards anything.
    pub const HEADERS: [&'static str; 3] = [VOUCHED_CREDENTIAL, VOUCHED_SESSION, VOUCHED_CSRF];

    /// Writes the session into a forwarded request's headers.
    pub fn write_to(&self, headers: &mut HeaderMap) {
        let secret = match &self.credential {
            Credential::ApiKey(s) | Credential::AccessToken(s) => s,
        };
        for (name, value) in [
            (VOUCHED_CREDENTIAL, secret.as_str()),
            (VOUCHED_SESSION, self.session_id.as_str()),
            (VOUCHED_CSRF, self.csrf.as_str()),
        ] {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        }
    }

    /// Takes a vouched session out of a request's headers; a node calls it only after the
    /// cluster's secret was checked.
    pub fn take_from(headers: &mut HeaderMap) -> Option<Self> {
        let mut take = |name| {
            headers
                .remove(name)
                .and_then(|v| v.to_str().ok().map(str::to_owned))
        };
        let credential = take(VOUCHED_CREDENTIAL);
        let session_id = take(VOUCHED_SESSION);
        let csrf = take(VOUCHED_CSRF);
        Some(Self {
            credential: Credential::parse(&credential?),
            session_id: session_id?,
            csrf: csrf?,
        })
    }
}

impl Dashboard {
    /// Checks a request's session as the dashboard's own handlers would (the cookie, the
    /// credential still valid and, for anything but a read, the CSRF token), for an API host
    /// about to forward it to a node, with the session's team. The error is the answer to
    /// give instead.
    pub async fn vouch(
        &self,
        method: &Method,
        headers: &HeaderMap,
    ) -> Result<(VouchedSession, Team), Response> {
        let mut parts = Request::new(()).into_parts().0;
        parts.method = method.clone();
        parts.headers = headers.clone();
        let signed = if method == Method::GET || method == Method::HEAD {
            Signed::from_request_parts(&mut parts, self).await?
        } else {
            Mutating::from_request_parts(&mut parts, self).await?.0
        };
        let vouched = VouchedSession {
            credential: signed.credential,
            session_id: signed.session_id,
            csrf: signed.csrf,
        };
        Ok((vouched, signed.team))
    }
}

impl FromRequestParts<Dashboard> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &Dashboard) -> Result<Self, Response> {
        let sessions = &state.inner.sessions;
        let (credential, session_id, csrf) = match parts.extensions.get::<VouchedSession>() {
            Some(vouched) => (
                vouched.credential.clone(),
                vouched.session_id.clone(),
                vouched.csrf.clone(),
            ),
            None => {
                let Some(id) = session_id(&parts.headers) else {
                    return Err(sign_in_first(&parts.headers));
                };
                let Some((credential, csrf)) = sessions.find(id) else {
                    return Err(sign_in_first(&parts.headers));
                };
                (credential, id.to_owned(), csrf)
            }
        };
        match credential.team(&state.inner.auth).await {
            Ok(team) => Ok(Signed {
                team,
                credential,
                session_id,
                csrf,
            }),
            Err(sandbar_core::AuthError::Store(e)) => {
                tracing::error!(error = %e, "dashboard: cannot check a session's credential");
                Err(PageError::internal().into_response())
            }
            // Revoked since sign-in: the session goes with it (a node, handed the session by
            // an API host, holds none to end).
            Err(_) => {
                sessions.end(&session_id);
                Err(sign_in_first(&parts.headers))
            }
        }
    }
}

/// A signed-in request that changes something: it must carry the session's CSRF token in
/// the `X-CSRF-Token` header.
#[derive(Debug)]
pub(crate) struct Mutating(pub Signed);

impl FromRequestParts<Dashboard> for Mutating {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &Dashboard) -> Result<Self, Response> {
        let signed = Signed::from_request_parts(parts, state).await?;
        let given = parts
            .headers
            .get(CSRF_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !csrf_matches(given, &signed.csrf) {
            return Err(PageError::new(
                StatusCode::FORBIDDEN,
                "the request's CSRF token does not match this session; reload the page",
            )
            .into_response());
        }
        Ok(Mutating(signed))
    }
}

pub(crate) fn csrf_matches(given: &str, expected: &str) -> bool {
    given.len() == expected.len() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

impl Dashboard {
    pub(crate) fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cookie_is_http_only_strict_and_scoped_to_the_dashboard() {
        let value = cookie("abc");
        let text = value.to_str().unwrap();
        assert!(text.starts_with("sandbar_dashboard=abc;"));
        for part in ["HttpOnly", "SameSite=Strict", "Path=/dashboard"] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
    }

    #[test]
    fn session_id_is_read_among_other_cookies() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; sandbar_dashboard=xyz; b=2"),
        );
        assert_eq!(session_id(&headers), Some("xyz"));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("sandbar_dashboardx=1"),
        );
        assert_eq!(session_id(&headers), None);
    }

    #[test]
    fn sessions_end_and_tokens_are_distinct() {
        let sessions = Sessions::default();
        let a = sessions.start(Credential::parse("e2b_x"));
        let b = sessions.start(Credential::parse("sk_e2b_y"));
        assert_ne!(a, b);
        let (_, csrf_a) = sessions.find(&a).unwrap();
        let (_, csrf_b) = sessions.find(&b).unwrap();
        assert_ne!(csrf_a, csrf_b);
        assert!(csrf_matches(&csrf_a, &csrf_a));
        assert!(!csrf_matches(&csrf_a, &csrf_b));
        assert!(!csrf_matches("", &csrf_a));
        sessions.end(&a);
        assert!(sessions.find(&a).is_none());
        assert!(matches!(
            sessions.find(&b).unwrap().0,
            Credential::AccessToken(_)
        ));
    }

    #[test]
    fn a_vouched_session_goes_through_headers_whole_or_not_at_all() {
        let vouched = VouchedSession {
            credential: Credential::parse("sk_e2b_abc"),
            session_id: "s1".into(),
            csrf: "c1".into(),
        };
        let mut headers = HeaderMap::new();
        vouched.write_to(&mut headers);
        let read = VouchedSession::take_from(&mut headers).unwrap();
        assert!(matches!(&read.credential, Credential::AccessToken(t) if t == "sk_e2b_abc"));
        assert_eq!((read.session_id.as_str(), read.csrf.as_str()), ("s1", "c1"));
        assert!(headers.is_empty(), "taken out: {headers:?}");

        // A part missing vouches for nothing, and the rest is still removed.
        vouched.write_to(&mut headers);
        headers.remove(VOUCHED_CSRF);
        assert!(VouchedSession::take_from(&mut headers).is_none());
        assert!(headers.is_empty(), "taken out: {headers:?}");
    }
}
