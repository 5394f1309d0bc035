//! The OpenAPI document of the REST API, served at `GET /openapi.json`.
//!
//! It is generated from the handlers' `#[utoipa::path]` attributes and the DTOs' `ToSchema`
//! derives as the router is built (see [`crate::rest_routes`]), so a route cannot be served
//! without being described. The edge (agent and user-port traffic), the operator's
//! `/metrics` and the volume content API are not part of it.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use axum::handler::Handler;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::on;
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::HttpMethod;
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{IntoParams, IntoResponses, Modify, OpenApi};
use utoipa_axum::PathItemExt;
use utoipa_axum::router::OpenApiRouter;

use crate::AppState;
use crate::error::ErrorBody;

/// The document's fixed parts; paths and their schemas are added by the router.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Sandbar REST API",
        description = "E2B's control-plane API as Sandbar serves it: sandboxes, templates and \
            their builds, volumes, API keys, access tokens, teams, logs and metrics. Every error \
            body is `{code, message}`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    components(schemas(ErrorBody)),
    modifiers(&SecuritySchemes),
    tags(
        (name = "sandboxes", description = "Sandbox lifecycle, logs and metrics"),
        (name = "events", description = "Sandbox lifecycle events"),
        (name = "templates", description = "Templates, builds and tags"),
        (name = "volumes", description = "Persistent volumes"),
        (name = "auth", description = "API keys, access tokens and teams"),
        (name = "service", description = "Health and this document"),
    )
)]
pub(crate) struct ApiDoc;

/// E2B's scheme names, so that clients generated from either document agree.
struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "ApiKeyAuth",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-API-Key"))),
        );
        let bearer = || {
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("access_token")
                    .build(),
            )
        };
        components.add_security_scheme("AccessTokenAuth", bearer());
        components.add_security_scheme("AuthProviderBearerAuth", bearer());
        components.add_security_scheme(
            "AuthProviderTeamAuth",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-Team-ID"))),
        );
    }
}

/// Errors every authenticated operation can answer with: bad credentials, the team's request
/// rate or sandbox limit (429 with `Retry-After`) or a cap on what it keeps (429 without),
/// and unexpected failures.
pub(crate) struct CommonErrors;

impl IntoResponses for CommonErrors {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        let error = |description: &str| {
            ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Error")))
                    .build(),
            )
        };
        let retry_after = HeaderBuilder::new()
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0)),
            ))
            .description(Some("Seconds to wait before retrying"))
            .build();
        BTreeMap::from([
            (
                "401".to_owned(),
                error("Missing or invalid credentials").build().into(),
            ),
            (
                "429".to_owned(),
                error(
                    "The team's request rate, sandbox limit or a cap on what it keeps is reached",
                )
                .header("Retry-After", retry_after)
                .build()
                .into(),
            ),
            (
                "500".to_owned(),
                error("An unexpected server error").build().into(),
            ),
        ])
    }
}

/// Another API version's route to an operation documented at a path of its own: the same
/// handler serves both, and the document repeats that operation under this route's ID.
pub(crate) struct OtherVersion {
    pub method: HttpMethod,
    pub documented_at: &'static str,
    pub path: &'static str,
    pub operation_id: &'static str,
    /// Replaces the documented operation's summary.
    pub summary: Option<&'static str>,
}

pub(crate) trait RouteOtherVersion {
    /// Routes `handler` at `route.path` and documents it there; the documented operation must
    /// already be routed. A route list that names an undocumented one is a mistake in this
    /// crate, and stops the server at its start (and every test) rather than serving a path
    /// `/openapi.json` does not describe.
    fn other_version<H, T>(self, handler: H, route: OtherVersion) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static;
}

impl RouteOtherVersion for OpenApiRouter<AppState> {
    fn other_version<H, T>(mut self, handler: H, route: OtherVersion) -> Self
    where
        H: Handler<T, AppState>,
        T: 'static,
    {
        let paths = &mut self.get_openapi_mut().paths;
        let Some(documented) = paths.get_path_operation(route.documented_at, route.method.clone())
        else {
            panic!(
                "{} is routed as another version of {}, which is not documented",
                route.path, route.documented_at
            );
        };
        let mut operation = documented.clone();
        operation.operation_id = Some(route.operation_id.to_owned());
        operation.summary = route.summary.map(str::to_owned);
        paths.add_path_operation(route.path, vec![route.method.clone()], operation);
        self.route(route.path, on(route.method.to_method_filter(), handler))
    }
}

// The path parameters below are never constructed: handlers take them as a `PathParam`,
// and these only describe them, once for every path they stand in.

/// The `{sandboxID}` of a sandbox's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct SandboxPath {
    /// The sandbox's ID
    #[param(rename = "sandboxID")]
    sandbox_id: String,
}

/// The `{templateID}` of a template's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct TemplatePath {
    /// The template's ID or alias
    #[param(rename = "templateID")]
    template_id: String,
}

/// The `{templateID}` and `{hash}` of a template's files' path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct FilesPath {
    /// The template's ID or alias
    #[param(rename = "templateID")]
    template_id: String,
    /// SHA-256 of the files
    #[param(pattern = "^[0-9a-fA-F]{64}$")]
    hash: String,
}

/// The `{volumeID}` of a volume's path (not a path inside the volume).
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct VolumeIdPath {
    /// The volume's ID
    #[param(rename = "volumeID")]
    volume_id: String,
}

/// The `{webhookID}` of a webhook's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct WebhookPath {
    /// The webhook's ID
    #[param(rename = "webhookID")]
    webhook_id: String,
}

/// The `{apiKeyID}` of an API key's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct ApiKeyPath {
    /// The key's ID
    #[param(rename = "apiKeyID")]
    api_key_id: String,
}

/// The `{teamID}` of a team's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct TeamPath {
    /// The team's ID; it must be the caller's
    #[param(rename = "teamID")]
    team_id: String,
}

/// The `{templateID}` and `{buildID}` of a build's path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct BuildPath {
    /// The template's ID or alias
    #[param(rename = "templateID")]
    template_id: String,
    /// The build's ID
    #[param(rename = "buildID")]
    build_id: String,
}

/// The generated document as JSON, built once.
fn document_json() -> &'static [u8] {
    static JSON: OnceLock<Vec<u8>> = OnceLock::new();
    JSON.get_or_init(|| {
        // Serializing a document of plain maps and strings cannot fail.
        serde_json::to_vec(&crate::openapi()).unwrap_or_default()
    })
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "service",
    operation_id = "getOpenApiDocument",
    security(()),
    responses((status = 200, description = "The OpenAPI document of this API", content_type = "application/json", body = Object))
)]
pub(crate) async fn serve() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
}
