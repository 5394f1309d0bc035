//! Access to a sandbox's user ports: with `allowPublicTraffic: false` a request must carry the
//! sandbox's traffic access token, and `maskRequestHost` replaces the Host header the sandbox
//! sees. The agent port has its own token (`X-Access-Token`) and is not affected; the code
//! interpreter's executions need that token too on a sandbox that has one.

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use sandbar_core::network::{CODE_INTERPRETER_PORT, masked_host};

use crate::AppState;
use crate::error::ApiError;
use crate::extract::carries_secret;

/// The header E2B's proxy reads the traffic access token from.
pub(crate) const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// The refusal of a request to a private user port without the sandbox's traffic token.
pub(crate) fn needs_token(sandbox_id: &str, port: u16) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        format!(
            "sandbox '{sandbox_id}' does not allow public traffic: port {port} needs the sandbox's traffic access token in the {TRAFFIC_TOKEN_HEADER} header"
        ),
    )
}

/// The refusal of a request to the code interpreter's port without the agent's token.
pub(crate) fn needs_access_token(sandbox_id: &str, port: u16) -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        format!(
            "sandbox '{sandbox_id}' is secure: executions on port {port} (the code interpreter) need the sandbox's access token in the {ACCESS_TOKEN_HEADER} header"
        ),
    )
}

/// The header E2B's SDKs send the agent's token in.
pub(crate) const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// Whether a request to `port` and `path` runs code in the code interpreter, which needs the
/// agent's token like the agent's own process calls. E2B's code interpreter SDKs send the
/// token with executions only, not with the contexts' calls, which therefore stay open.
pub(crate) fn needs_agent_token(port: u16, path: &str) -> bool {
    port == CODE_INTERPRETER_PORT && path.trim_end_matches('/') == "/execute"
}

/// Admits a request for `port` of `sandbox_id` and rewrites its Host when the sandbox asks for
/// it, or answers why not.
pub(crate) fn admit(
    state: &AppState,
    sandbox_id: &str,
    port: u16,
    request: &mut Request,
) -> Result<(), ApiError> {
    let Some(access) = state.sandboxes.routes().user_port_access(sandbox_id) else {
        return Ok(());
    };
    if let Some(expected) = &access.traffic_access_token {
        if !carries_secret(request.headers(), TRAFFIC_TOKEN_HEADER, expected) {
            return Err(needs_token(sandbox_id, port));
        }
        // The token is for the edge; the service in the sandbox has no use for it.
        request.headers_mut().remove(TRAFFIC_TOKEN_HEADER);
    }
    if needs_agent_token(port, request.uri().path())
        && let Some(expected) = &access.envd_access_token
        && !carries_secret(request.headers(), ACCESS_TOKEN_HEADER, expected)
    {
        return Err(needs_access_token(sandbox_id, port));
    }
    if let Some(mask) = &access.mask_request_host {
        let host = HeaderValue::from_str(&masked_host(mask, port)).map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("sandbox '{sandbox_id}' has an unusable maskRequestHost '{mask}'"),
            )
        })?;
        request.headers_mut().insert(header::HOST, host);
    }
    Ok(())
}
