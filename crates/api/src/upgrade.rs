//! Protocol upgrades (WebSockets) carried through a hop: the edge's to a sandbox's port, and
//! an API host's to a node. The request keeps its `Connection: upgrade` and `Upgrade`
//! headers, and once the far side switches protocols the two upgraded connections are joined.

use axum::http::{HeaderMap, header};

/// Whether a request asks to switch protocols (`Connection: upgrade` with an `Upgrade`).
pub(crate) fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Copies both ways between a client's upgraded connection and the far side's, until either
/// side closes.
pub(crate) async fn join_upgraded(
    client: hyper::upgrade::OnUpgrade,
    far: hyper::upgrade::OnUpgrade,
) {
    let (client, far) = match tokio::try_join!(client, far) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(error = %e, "an upgraded connection did not open");
            return;
        }
    };
    let mut client = hyper_util::rt::TokioIo::new(client);
    let mut far = hyper_util::rt::TokioIo::new(far);
    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut far).await {
        tracing::debug!(error = %e, "an upgraded connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upgrade_needs_both_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, "websocket".parse().expect("value"));
        assert!(!is_upgrade(&headers));
        headers.insert(
            header::CONNECTION,
            "keep-alive, Upgrade".parse().expect("value"),
        );
        assert!(is_upgrade(&headers));
        headers.remove(header::UPGRADE);
        assert!(!is_upgrade(&headers));
    }
}
