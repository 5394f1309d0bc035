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

pub use session::SESSION_COOKIE;

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
            .route("/sandboxes/{id}/pause", post(pages::pause))
            .route("/sandboxes/{id}/resume", post(pages::resume))
            .route("/sandboxes/{id}/extend", post(pages::extend))
            .route("/sandboxes/{id}/kill", post(pages::kill))
            .route("/sandboxes/{id}/snapshot", post(pages::snapshot))
            .route("/sandboxes/{id}/fork", post(pages::fork))
            .route("/snapshots", get(pages::snapshots))
            .route("/snapshots/{template}/delete", post(pages::delete_snapshot))
            .route("/usage", get(pages::usage))
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
            .with_state(self)
    }
}

/// Content-Security-Policy of every dashboard answer: scripts only from the dashboard's own
/// assets (no inline script, no eval); xterm.js sets its cell styles at run time, hence inline
/// styles; the terminal's WebSocket goes to the same origin.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

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
