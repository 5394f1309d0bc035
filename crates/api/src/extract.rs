//! Request extractors that fail with the API's JSON error body instead of axum's plain text.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::HeaderMap;
use axum::http::request::Parts;
use sandbar_core::Team;
use serde::de::DeserializeOwned;

use crate::AppState;
use crate::error::ApiError;

/// The team authenticated by the `X-API-Key` header.
pub(crate) struct ApiKeyTeam(pub Team);

/// Whether header `name` holds `secret`, compared in constant time so that a wrong guess
/// tells nothing of how much of it was right.
pub(crate) fn carries_secret(headers: &HeaderMap, name: &str, secret: &str) -> bool {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|given| sandbar_envd::secrets_equal(given, secret))
}

fn api_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// The team of the request's credentials: `X-API-Key`, or else an access token as
/// `Authorization: Bearer …`; without either, the missing API key is what is reported (what
/// most clients forgot). No rate limit is charged.
pub(crate) async fn team_of(state: &AppState, headers: &HeaderMap) -> Result<Team, ApiError> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match (api_key(headers), bearer) {
        (None, Some(token)) => Ok(state.auth.team_for_access_token(Some(token)).await?),
        (key, _) => Ok(state.auth.team_for_api_key(key).await?),
    }
}

impl FromRequestParts<AppState> for ApiKeyTeam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let team = state.auth.team_for_api_key(api_key(&parts.headers)).await?;
        state.rate_limits.check(&team)?;
        Ok(ApiKeyTeam(team))
    }
}

/// The team authenticated by `X-API-Key`, or else by an access token as
/// `Authorization: Bearer …` (routes the seed marks for either).
pub(crate) struct TeamAuth(pub Team);

impl FromRequestParts<AppState> for TeamAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let team = team_of(state, &parts.headers).await?;
        state.rate_limits.check(&team)?;
        Ok(TeamAuth(team))
    }
}

/// A path parameter; one that is not valid UTF-8 or does not parse is a 400 with the API's
/// JSON error body instead of axum's plain-text rejection.
pub(crate) struct PathParam<T>(pub T);

impl<T, S> FromRequestParts<S> for PathParam<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| PathParam(value))
            .map_err(|rejection| {
                ApiError::bad_request(format!("invalid path parameter: {}", rejection.body_text()))
            })
    }
}

/// Largest JSON body the API reads.
pub(crate) const JSON_BODY_LIMIT: usize = 2 << 20;

/// Most of an oversized body read (and dropped) before answering 413: a client still sending
/// when the connection closes sees a broken pipe, not the answer.
const OVERSIZED_DRAIN_LIMIT: usize = 64 << 20;

/// Reads a body of at most [`JSON_BODY_LIMIT`] bytes; a larger one is a 413 naming the limit.
pub(crate) async fn read_bounded_body(body: Body) -> Result<Bytes, ApiError> {
    use futures_util::StreamExt;
    let too_large = || {
        ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body is larger than the limit of {} bytes ({} MiB)",
                JSON_BODY_LIMIT,
                JSON_BODY_LIMIT >> 20
            ),
        )
    };
    let mut stream = body.into_data_stream();
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad_request(format!("cannot read request body: {e}")))?;
        if body.len() + chunk.len() > JSON_BODY_LIMIT {
            let mut seen = body.len() + chunk.len();
            let drain = async {
                while let Some(Ok(chunk)) = stream.next().await {
                    seen += chunk.len();
                    if seen > OVERSIZED_DRAIN_LIMIT {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), drain).await;
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// A JSON request body; an absent body reads as `{}` so optional bodies may be omitted.
pub(crate) struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &AppState) -> Result<Self, ApiError> {
        let bytes = read_bounded_body(req.into_body()).await?;
        json_body(&bytes).map(JsonBody)
    }
}

/// `bytes` read as a JSON request body of `T`, refused as [`JsonBody`] refuses it.
pub(crate) fn json_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// Decoded query pairs, in order, repeated keys kept.
pub(crate) struct QueryPairs(pub Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let raw = parts.uri.query().unwrap_or("");
        Ok(QueryPairs(
            url::form_urlencoded::parse(raw.as_bytes())
                .into_owned()
                .collect(),
        ))
    }
}

impl QueryPairs {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The parameter's value, with an empty one read as absent.
    pub fn non_empty(&self, key: &str) -> Option<&str> {
        self.get(key).filter(|v| !v.is_empty())
    }

    /// Every value of a list parameter, given comma-separated, repeated, or both.
    pub fn list(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .flat_map(|(_, v)| v.split(','))
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect()
    }

    /// Whether a log read goes `forward` (the default) or `backward` from its cursor.
    pub fn forward(&self) -> Result<bool, ApiError> {
        match self.get("direction") {
            None | Some("forward") => Ok(true),
            Some("backward") => Ok(false),
            Some(other) => Err(ApiError::bad_request(format!(
                "direction must be forward or backward, got '{other}'"
            ))),
        }
    }

    /// An optional integer parameter within `range`.
    pub fn int_in(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<i64>,
    ) -> Result<Option<i64>, ApiError> {
        let Some(raw) = self.get(key) else {
            return Ok(None);
        };
        let value: i64 = raw.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "query parameter {key} must be an integer, got '{raw}'"
            ))
        })?;
        if !range.contains(&value) {
            return Err(ApiError::bad_request(format!(
                "query parameter {key} must be between {} and {}, got {value}",
                range.start(),
                range.end()
            )));
        }
        Ok(Some(value))
    }
}

/// Bodies up to this size are read before the request is handled.
const READ_FIRST_LIMIT: u64 = 64 << 10;

/// Reads a small request body in full before anything answers. An answer given before the
/// body was read (a 401 from authentication, a 404, a 507) makes the HTTP/1.1 server close
/// the connection if the rest of the body arrives later, and a client that sends its next
/// request on that connection sees it dropped without an answer.
pub(crate) async fn read_small_bodies_first(
    request: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let small = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|length| length > 0 && length <= READ_FIRST_LIMIT);
    if !small {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    match axum::body::to_bytes(body, READ_FIRST_LIMIT as usize).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Err(e) => ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            format!("cannot read the request body: {e}"),
        )
        .into_response(),
    }
}
