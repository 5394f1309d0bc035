//! Webhooks of lifecycle events: parse and validate, then call
//! [`sandbar_core::webhooks::Webhooks`].

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use sandbar_core::SandboxEventType;
use sandbar_core::webhooks::{Webhook, WebhookChange, WebhookDelivery, Webhooks};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::dto::rfc3339;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{JsonBody, PathParam, QueryPairs, TeamAuth};
use crate::openapi::{CommonErrors, WebhookPath};

/// A registered webhook; its secret is never shown.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct WebhookView {
    id: String,
    #[serde(rename = "teamID")]
    team_id: String,
    name: String,
    #[serde(rename = "createdAt")]
    #[schema(format = DateTime)]
    created_at: String,
    enabled: bool,
    url: String,
    events: Vec<String>,
}

impl From<&Webhook> for WebhookView {
    fn from(w: &Webhook) -> Self {
        Self {
            id: w.id.clone(),
            team_id: w.team_id.clone(),
            name: w.name.clone(),
            created_at: rfc3339(w.created_at),
            enabled: w.enabled,
            url: w.url.clone(),
            events: w.events.iter().map(|e| e.as_str().to_owned()).collect(),
        }
    }
}

/// What a registration or an update sets; an update keeps what it leaves out.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct WebhookBody {
    name: Option<String>,
    /// An `http` or `https` URL.
    url: Option<String>,
    enabled: Option<bool>,
    /// Event types, each `sandbox.lifecycle.` and one of `created`, `updated`, `paused`,
    /// `resumed`, `checkpointed`, `killed`.
    events: Option<Vec<String>>,
    /// What the `e2b-signature` of each delivery is made with, 8 to 256 bytes.
    #[serde(rename = "signatureSecret")]
    signature_secret: Option<String>,
}

impl WebhookBody {
    fn change(self) -> Result<WebhookChange, ApiError> {
        let events = self
            .events
            .map(|names| {
                names
                    .iter()
                    .map(|n| {
                        SandboxEventType::parse(n).ok_or_else(|| {
                            ApiError::bad_request(format!("unknown event type '{n}'"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        Ok(WebhookChange {
            name: self.name,
            url: self.url,
            enabled: self.enabled,
            events,
            secret: self.signature_secret,
        })
    }
}

/// One attempt to deliver an event.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WebhookDeliveryView {
    /// The `e2b-delivery-id` sent: the same for each attempt of one event.
    id: String,
    event_id: String,
    event_type: String,
    attempt: u32,
    /// The receiver's HTTP status, when it answered.
    status_code: Option<u16>,
    error: Option<String>,
    delivered: bool,
    #[schema(format = DateTime)]
    timestamp: String,
}

impl From<&WebhookDelivery> for WebhookDeliveryView {
    fn from(d: &WebhookDelivery) -> Self {
        Self {
            id: d.id.clone(),
            event_id: d.event_id.clone(),
            event_type: d.event_type.as_str().to_owned(),
            attempt: d.attempt,
            status_code: d.status_code,
            error: d.error.clone(),
            delivered: d.delivered(),
            timestamp: rfc3339(d.at),
        }
    }
}

fn webhooks(state: &AppState) -> Result<&Webhooks, ApiError> {
    state.sandboxes.webhooks().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "webhooks are not set up on this server",
        )
    })
}

/// `POST /events/webhooks`: registers a webhook for the team's sandbox events.
#[utoipa::path(
    post,
    path = "/events/webhooks",
    tag = "events",
    operation_id = "postWebhook",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    request_body = WebhookBody,
    responses(
        (status = 201, description = "The webhook was registered", body = WebhookView),
        (status = 400, description = "Invalid body", body = ErrorBody),
        (status = 429, description = "The team has as many webhooks as it may", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn create(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    JsonBody(body): JsonBody<WebhookBody>,
) -> Result<(StatusCode, Json<WebhookView>), ApiError> {
    let webhook = webhooks(&state)?.create(&team, body.change()?).await?;
    Ok((StatusCode::CREATED, Json(WebhookView::from(&webhook))))
}

/// `GET /events/webhooks`: the team's webhooks, oldest first.
#[utoipa::path(
    get,
    path = "/events/webhooks",
    tag = "events",
    operation_id = "getWebhooks",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    responses(
        (status = 200, description = "The team's webhooks", body = Vec<WebhookView>),
        CommonErrors,
    )
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
) -> Result<Json<Vec<WebhookView>>, ApiError> {
    let list = webhooks(&state)?.list(&team).await?;
    Ok(Json(list.iter().map(WebhookView::from).collect()))
}

/// `GET /events/webhooks/{webhookID}`.
#[utoipa::path(
    get,
    path = "/events/webhooks/{webhookID}",
    tag = "events",
    operation_id = "getWebhook",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(WebhookPath),
    responses(
        (status = 200, description = "The webhook", body = WebhookView),
        (status = 404, description = "No such webhook", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn detail(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(id): PathParam<String>,
) -> Result<Json<WebhookView>, ApiError> {
    let webhook = webhooks(&state)?.get(&team, &id).await?;
    Ok(Json(WebhookView::from(&webhook)))
}

/// `PATCH /events/webhooks/{webhookID}`: changes the fields given.
#[utoipa::path(
    patch,
    path = "/events/webhooks/{webhookID}",
    tag = "events",
    operation_id = "patchWebhook",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(WebhookPath),
    request_body = WebhookBody,
    responses(
        (status = 200, description = "The webhook as it is now", body = WebhookView),
        (status = 400, description = "Invalid body", body = ErrorBody),
        (status = 404, description = "No such webhook", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn update(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(id): PathParam<String>,
    JsonBody(body): JsonBody<WebhookBody>,
) -> Result<Json<WebhookView>, ApiError> {
    let webhook = webhooks(&state)?.update(&team, &id, body.change()?).await?;
    Ok(Json(WebhookView::from(&webhook)))
}

/// `DELETE /events/webhooks/{webhookID}`: no more deliveries; its log goes with it.
#[utoipa::path(
    delete,
    path = "/events/webhooks/{webhookID}",
    tag = "events",
    operation_id = "deleteWebhook",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(WebhookPath),
    responses(
        (status = 200, description = "The webhook was removed"),
        (status = 404, description = "No such webhook", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn delete(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(id): PathParam<String>,
) -> Result<StatusCode, ApiError> {
    webhooks(&state)?.delete(&team, &id).await?;
    Ok(StatusCode::OK)
}

/// Attempts listed when `limit` is not given, and the most.
const DEFAULT_DELIVERY_LIMIT: i64 = 100;
const MAX_DELIVERY_LIMIT: i64 = 1000;

/// `GET /events/webhooks/{webhookID}/deliveries`: the latest attempts, newest first.
#[utoipa::path(
    get,
    path = "/events/webhooks/{webhookID}/deliveries",
    tag = "events",
    operation_id = "getWebhookDeliveries",
    security(("ApiKeyAuth" = []), ("AccessTokenAuth" = [])),
    params(
        WebhookPath,
        ("limit" = Option<i32>, Query, minimum = 1, maximum = 1000, description = "Most attempts returned (default 100)"),
    ),
    responses(
        (status = 200, description = "The webhook's delivery log", body = Vec<WebhookDeliveryView>),
        (status = 400, description = "Invalid query parameter", body = ErrorBody),
        (status = 404, description = "No such webhook", body = ErrorBody),
        CommonErrors,
    )
)]
pub(crate) async fn deliveries(
    State(state): State<AppState>,
    TeamAuth(team): TeamAuth,
    PathParam(id): PathParam<String>,
    query: QueryPairs,
) -> Result<Json<Vec<WebhookDeliveryView>>, ApiError> {
    let limit = query
        .int_in("limit", 1..=MAX_DELIVERY_LIMIT)?
        .unwrap_or(DEFAULT_DELIVERY_LIMIT);
    let log = webhooks(&state)?
        .deliveries(&team, &id, u32::try_from(limit).unwrap_or(1))
        .await?;
    Ok(Json(log.iter().map(WebhookDeliveryView::from).collect()))
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(detail, update, delete))
        .routes(routes!(deliveries))
}
