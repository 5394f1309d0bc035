//! Requests that would write to a data disk without room for it are answered 507 before any
//! work starts, so none of them half-writes. Only to callers with valid credentials: anyone
//! else gets the handler's own 401 and learns nothing of the node.

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::AppState;
use crate::error::ApiError;

/// Writes that keep running sandboxes alive or reach them: a few bytes in the database each,
/// which the disk's reserve is there for. Refusing them would end sandboxes for want of a
/// row update.
const KEEPS_SANDBOXES_GOING: &[&str] = &[
    "/sandboxes/{sandboxID}/timeout",
    "/sandboxes/{sandboxID}/refreshes",
    "/sandboxes/{sandboxID}/connect",
    "/v2/sandboxes/{sandboxID}/connect",
    "/sandboxes/{sandboxID}/resume",
    "/sandboxes/{sandboxID}/network",
];

fn writes_data(method: &Method, route: Option<&str>) -> bool {
    let changes = matches!(*method, Method::POST | Method::PUT | Method::PATCH);
    changes && !route.is_some_and(|r| KEEPS_SANDBOXES_GOING.contains(&r))
}

pub(crate) async fn refuse_writes_without_room(
    State(state): State<AppState>,
    route: Option<MatchedPath>,
    request: Request,
    next: Next,
) -> Response {
    if writes_data(request.method(), route.as_ref().map(MatchedPath::as_str))
        && let Err(full) = state.sandboxes.health().room_to_write()
        && crate::extract::team_of(&state, request.headers())
            .await
            .is_ok()
    {
        tracing::debug!(path = %full.path.display(), "refused a write: {}", full.message);
        return ApiError::insufficient_storage(full.message).into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creations_and_uploads_write_reads_and_deletions_do_not() {
        assert!(writes_data(&Method::POST, Some("/sandboxes")));
        assert!(writes_data(&Method::POST, Some("/api-keys")));
        assert!(writes_data(&Method::PUT, Some("/volumes/{volumeID}/file")));
        assert!(writes_data(&Method::POST, None));
        assert!(!writes_data(&Method::GET, Some("/sandboxes")));
        assert!(!writes_data(
            &Method::DELETE,
            Some("/sandboxes/{sandboxID}")
        ));
    }

    #[test]
    fn what_keeps_a_sandbox_alive_is_never_refused() {
        for route in KEEPS_SANDBOXES_GOING {
            assert!(!writes_data(&Method::POST, Some(route)), "{route}");
        }
    }
}
