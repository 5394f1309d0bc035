//! Access-token checks, signed file URLs and picking the Linux user of a call.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use http::{HeaderMap, Method, StatusCode};
pub use sandbar_envd::{
    FileOperation, SignatureError, file_signature, secrets_equal, verify_file_signature,
};

use crate::AgentState;
use crate::http_error::json_error;

/// Header carrying the sandbox's envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// True when the request carries the configured token, or when no token is configured.
pub fn header_token_ok(headers: &HeaderMap, expected: Option<&str>) -> bool {
    let Some(expected) = expected else {
        return true;
    };
    headers
        .get(ACCESS_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|given| secrets_equal(given, expected))
}

/// The user named by `Authorization: Basic base64("<user>:")`, if any.
pub fn basic_auth_user(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split_once(':').map_or(text.as_str(), |(u, _)| u);
    (!user.is_empty()).then(|| user.to_owned())
}

/// Rejects calls without the access token. `/health` is open so liveness probes work without
/// secrets, and `/files` does its own check because it also accepts signed URLs.
pub async fn require_token(
    State(state): State<std::sync::Arc<AgentState>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    let open = (path == "/health" && request.method() == Method::GET) || path == "/files";
    if open || header_token_ok(request.headers(), state.config().access_token.as_deref()) {
        return next.run(request).await;
    }
    json_error(
        StatusCode::UNAUTHORIZED,
        "unauthorized access, please provide a valid access token",
    )
    .into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn signature_matches_reference_formula() {
        let expected = {
            let digest = Sha256::digest(b"/tmp/a.txt:read:user:tok:1700000000");
            format!(
                "v1_{}",
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
            )
        };
        let sig = file_signature(
            "/tmp/a.txt",
            FileOperation::Read,
            "user",
            "tok",
            Some(1_700_000_000),
        );
        assert_eq!(sig, expected);
        assert!(!sig.ends_with('='));
        let no_exp = file_signature("/x", FileOperation::Write, "", "tok", None);
        let digest = Sha256::digest(b"/x:write::tok");
        assert_eq!(
            no_exp,
            format!(
                "v1_{}",
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
            )
        );
    }

    #[test]
    fn verifies_and_rejects_signatures() {
        let sig = file_signature("/p", FileOperation::Read, "", "tok", Some(200));
        assert_eq!(
            verify_file_signature(
                &sig,
                "/p",
                FileOperation::Read,
                &["", "root"],
                "tok",
                Some(200),
                100
            ),
            Ok(())
        );
        assert_eq!(
            verify_file_signature(
                &sig,
                "/p",
                FileOperation::Write,
                &[""],
                "tok",
                Some(200),
                100
            ),
            Err(SignatureError::Mismatch("/p".into()))
        );
        assert_eq!(
            verify_file_signature(
                &sig,
                "/p",
                FileOperation::Read,
                &[""],
                "tok",
                Some(200),
                300
            ),
            Err(SignatureError::Expired("/p".into()))
        );
    }

    #[test]
    fn parses_basic_user() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::AUTHORIZATION,
            "Basic cm9vdDo=".parse().unwrap(),
        );
        assert_eq!(basic_auth_user(&headers).as_deref(), Some("root"));
        headers.insert(http::header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert_eq!(basic_auth_user(&headers), None);
    }
}
