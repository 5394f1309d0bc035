//! The web dashboard served under `/dashboard` on the API's listener.
//!
//! Pages are rendered on the server (maud escapes every value it interpolates) and updated
//! with htmx; the front-end libraries come from npm at build time and are embedded in the
//! binary. Every action is a typed call into `sandbar-core` scoped to the team of the
//! signed-in session: the dashboard never calls the HTTP API. The session cookie is only
//! ever read here: the API and the edge authenticate by `X-API-Key`, access tokens and agent
//! tokens alone, and the cookie's `Path=/dashboard` keeps browsers from sending it elsewhere.

mod agent;
mod assets;
mod error;
mod files;
mod pages;
mod session;
mod terminal;
mod views;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use sandbar_core::{Auth, Builds, Sandboxes, Templates};

pub use error::error_answer;
pub use session::{SESSION_COOKIE, VouchedSession};

/// What the dashboard's handlers share.
#[derive(Clone, Debug)]
pub struct Dashboard {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    auth: Auth,
    sandboxes: Arc<Sandboxes>,
    templates: Templates,
    builds: Builds,
    sessions: session::Sessions,
}

impl Dashboard {
    /// The dashboard over the same services the API handlers use.
    pub fn new(
        auth: Auth,
        sandboxes: Arc<Sandboxes>,
        templates: Templates,
        builds: Builds,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                auth,
                sandboxes,
                templates,
                builds,
                sessions: session::Sessions::default(),
            }),
        }
    }

    /// The dashboard's routes, to be nested under `/dashboard`.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(pages::overview))
            .route("/login", get(pages::login_form).post(pages::login))
            .route("/logout", post(pages::logout))
            .route(
                "/sandboxes",
                get(pages::sandboxes).post(pages::create_sandbox),
            )
            .route("/sandboxes/rows", get(pages::sandbox_rows))
            .route("/sandboxes/{id}", get(pages::sandbox))
            .route("/sandboxes/{id}/state", get(pages::sandbox_state))
            .route("/sandboxes/{id}/chart", get(pages::sandbox_chart))
            .route("/sandboxes/{id}/log", get(pages::sandbox_log))
            .route("/sandboxes/{id}/pause", post(pages::pause))
            .route("/sandboxes/{id}/resume", post(pages::resume))
            .route("/sandboxes/{id}/extend", post(pages::extend))
            .route("/sandboxes/{id}/kill", post(pages::kill))
            .route("/sandboxes/{id}/snapshot", post(pages::snapshot))
            .route("/sandboxes/{id}/fork", post(pages::fork))
            .route("/snapshots", get(pages::snapshots))
            .route("/snapshots/{template}/delete", post(pages::delete_snapshot))
            .route("/usage", get(pages::usage))
            .route("/nodes", get(pages::nodes))
            .route("/volumes", get(pages::volumes).post(pages::create_volume))
            .route("/volumes/{id}", get(pages::volume))
            .route("/volumes/{id}/download", get(pages::volume_download))
            .route("/volumes/{id}/delete", post(pages::delete_volume))
            .route("/events", get(pages::events))
            .route(
                "/webhooks",
                get(pages::webhooks).post(pages::create_webhook),
            )
            .route("/webhooks/{id}/delete", post(pages::delete_webhook))
            .route("/sandboxes/{id}/files", get(files::list))
            .route("/sandboxes/{id}/files/download", get(files::download))
            .route(
                "/sandboxes/{id}/files/upload",
                // Streamed to the agent as it arrives: the sandbox's disk quota bounds it,
                // not the 2 MB axum holds other bodies to.
                post(files::upload).layer(axum::extract::DefaultBodyLimit::disable()),
            )
            .route("/sandboxes/{id}/files/delete", post(files::delete))
            .route("/sandboxes/{id}/terminal", get(terminal::open))
            .route(
                "/templates",
                get(pages::templates).post(pages::create_template),
            )
            .route("/templates/{template}/builds/{build}", get(pages::build))
            .route(
                "/templates/{template}/builds/{build}/log",
                get(pages::build_log),
            )
            .route("/keys", get(pages::keys).post(pages::create_key))
            .route("/keys/{key}/revoke", post(pages::revoke_key))
            .route("/assets/{name}", get(assets::serve))
            .fallback(pages::not_found)
            .method_not_allowed_fallback(pages::method_not_allowed)
            .layer(axum::middleware::from_fn(security_headers))
            .layer(axum::middleware::from_fn(gzip_pages))
            .with_state(self)
    }
}

/// Content-Security-Policy of every dashboard answer: scripts only from the dashboard's own
/// assets (no inline script, no eval); xterm.js sets its cell styles at run time, hence inline
/// styles; the terminal's WebSocket goes to the same origin.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Pages and fragments smaller than this go as they are: gzip would save little.
const GZIP_FROM_BYTES: usize = 2 << 10;
/// Pages are rendered whole in memory; nothing the dashboard renders comes near this.
const PAGE_BYTES_LIMIT: usize = 16 << 20;

/// Gzips the HTML the dashboard renders for a browser that accepts it: a list of a few hundred
/// sandboxes, polled every second, shrinks about tenfold. Assets are gzipped at build time
/// and downloads are not HTML, so neither passes through here.
async fn gzip_pages(request: Request, next: Next) -> Response {
    let accepts_gzip = request
        .headers()
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| coding.split(';').next().is_some_and(|c| c.trim() == "gzip"));
    let response = next.run(request).await;
    let is_html = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if !accepts_gzip || !is_html || response.headers().contains_key(header::CONTENT_ENCODING) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = match axum::body::to_bytes(body, PAGE_BYTES_LIMIT).await {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::error!(error = %e, "dashboard: cannot read a rendered page to compress it");
            return error::error_answer(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "the page could not be sent",
            );
        }
    };
    parts
        .headers
        .append(header::VARY, HeaderValue::from_static("accept-encoding"));
    if bytes.len() < GZIP_FROM_BYTES {
        return Response::from_parts(parts, axum::body::Body::from(bytes));
    }
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(bytes.len() / 4),
        flate2::Compression::fast(),
    );
    let gzipped = std::io::Write::write_all(&mut encoder, &bytes).and_then(|()| encoder.finish());
    match gzipped {
        Ok(gzipped) => {
            parts.headers.remove(header::CONTENT_LENGTH);
            parts
                .headers
                .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            Response::from_parts(parts, axum::body::Body::from(gzipped))
        }
        // Writing into memory does not fail; were it to, the page goes as it is.
        Err(_) => Response::from_parts(parts, axum::body::Body::from(bytes)),
    }
}

async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use axum::body::Body;
    use std::io::Read;
    use tower::ServiceExt;

    fn app() -> Router {
        Router::new()
            .route(
                "/big",
                get(|| async { axum::response::Html("<p>row</p>".repeat(1000)) }),
            )
            .route("/small", get(|| async { axum::response::Html("<p>x</p>") }))
            .route("/data", get(|| async { "plain ".repeat(1000) }))
            .layer(axum::middleware::from_fn(gzip_pages))
    }

    async fn fetch(path: &str, accept: Option<&str>) -> Response {
        let mut request = Request::builder().uri(path);
        if let Some(accept) = accept {
            request = request.header(header::ACCEPT_ENCODING, accept);
        }
        app()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    async fn body_of(response: Response) -> Vec<u8> {
        axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec()
    }

    #[tokio::test]
    async fn large_pages_go_gzipped_to_browsers_that_accept_it() {
        let response = fetch("/big", Some("gzip, deflate, br")).await;
        assert_eq!(response.headers()[header::CONTENT_ENCODING], "gzip");
        assert_eq!(response.headers()[header::VARY], "accept-encoding");
        let gzipped = body_of(response).await;
        let mut page = String::new();
        flate2::read::GzDecoder::new(gzipped.as_slice())
            .read_to_string(&mut page)
            .unwrap();
        assert_eq!(page, "<p>row</p>".repeat(1000));
        assert!(gzipped.len() * 10 < page.len(), "{} bytes", gzipped.len());
    }

    #[tokio::test]
    async fn small_pages_other_types_and_other_browsers_go_as_they_are() {
        for (path, accept) in [
            ("/big", None),
            ("/big", Some("br, gzipx")),
            ("/small", Some("gzip")),
            ("/data", Some("gzip")),
        ] {
            let response = fetch(path, accept).await;
            assert!(
                !response.headers().contains_key(header::CONTENT_ENCODING),
                "{path} with {accept:?} was encoded"
            );
            assert!(!body_of(response).await.is_empty());
        }
    }
}
