//! Who may read `/metrics`: nobody by default, a scrape with the operator's token, or anyone
//! reaching the metrics listener (with the token too, when one is set).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use sandbar_api::{AppState, MetricsAccess, Routers, router, routers};
use sandbar_core::{Auth, SandboxesConfig, Templates};
use tower::ServiceExt;

use crate::common;

const TOKEN: &str = "metrics-token-5b1f";

async fn state(dir: &tempfile::TempDir) -> AppState {
    let store = common::open_store(dir).await;
    let templates = Templates::new(store.clone());
    let sandboxes = common::sandboxes(
        &store,
        Arc::new(common::FakeRuntime::default()),
        &templates,
        SandboxesConfig::default(),
    );
    let builds = common::builds(store.clone(), &templates);
    common::state(Auth::new(store), Arc::new(sandboxes), builds, templates)
}

/// Status, `WWW-Authenticate` and body of `GET /metrics` with `authorization`, if any.
async fn scrape(
    app: &axum::Router,
    authorization: Option<&str>,
) -> (StatusCode, Option<String>, String) {
    let mut request = Request::builder().uri("/metrics");
    if let Some(value) = authorization {
        request = request.header(header::AUTHORIZATION, value);
    }
    let answer = common::send(app, request.body(Body::empty()).expect("request")).await;
    let challenge = answer
        .headers
        .get(header::WWW_AUTHENTICATE)
        .map(|v| v.to_str().expect("header").to_owned());
    (
        answer.status,
        challenge,
        String::from_utf8_lossy(&answer.bytes).into_owned(),
    )
}

#[tokio::test]
async fn metrics_are_served_to_nobody_by_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let app = router(state(&dir).await);
    let (status, _, body) = scrape(&app, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(body.contains("--metrics-token"), "{body}");
    assert!(!body.contains("sandbar_"), "{body}");
    let Routers { metrics, .. } = routers(state(&dir).await, &MetricsAccess::default());
    assert!(metrics.is_none());
}

#[tokio::test]
async fn a_token_guards_metrics_on_the_main_listener() {
    let dir = tempfile::tempdir().expect("tempdir");
    let access = MetricsAccess {
        token: Some(TOKEN.into()),
        own_listener: false,
    };
    let Routers { main, metrics } = routers(state(&dir).await, &access);
    assert!(metrics.is_none());
    for refused in [
        None,
        Some("Bearer wrong"),
        Some("Basic bWV0cmljczo="),
        Some(TOKEN),
    ] {
        let (status, challenge, body) = scrape(&main, refused).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{refused:?}: {body}");
        assert_eq!(challenge.as_deref(), Some("Bearer realm=\"metrics\""));
        assert!(!body.contains("sandbar_"), "{body}");
    }
    let (status, _, body) = scrape(&main, Some(&format!("Bearer {TOKEN}"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("sandbar_sandboxes"), "{body}");
    let (status, _, _) = scrape(&main, Some(&format!("bearer {TOKEN}"))).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_listener_of_its_own_takes_metrics_off_the_main_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    for token in [None, Some(TOKEN)] {
        let access = MetricsAccess {
            token: token.map(Arc::from),
            own_listener: true,
        };
        let Routers { main, metrics } = routers(state(&dir).await, &access);
        let metrics = metrics.expect("a metrics router");
        let bearer = format!("Bearer {TOKEN}");
        let (status, _, _) = scrape(&main, Some(&bearer)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{token:?}");
        let (status, _, body) = scrape(&metrics, Some(&bearer)).await;
        assert_eq!(status, StatusCode::OK, "{token:?}: {body}");
        assert!(body.contains("sandbar_sandboxes"), "{body}");
        let (status, _, _) = scrape(&metrics, None).await;
        let expected = if token.is_some() {
            StatusCode::UNAUTHORIZED
        } else {
            StatusCode::OK
        };
        assert_eq!(status, expected, "{token:?}");
        // The metrics listener serves nothing else.
        let response = metrics
            .clone()
            .oneshot(
                Request::builder()
                    .uri("/v2/sandboxes")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("call");
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
    }
}
