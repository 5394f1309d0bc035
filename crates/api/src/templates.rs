//! Template endpoints.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::AppState;
use crate::dto::TemplateItem;
use crate::error::ApiError;
use crate::extract::{ApiKeyTeam, PathParam};

pub(crate) async fn list(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
) -> Result<Json<Vec<TemplateItem>>, ApiError> {
    let templates = state.templates.list(&team).await?;
    Ok(Json(templates.iter().map(TemplateItem::from).collect()))
}

pub(crate) async fn alias(
    State(state): State<AppState>,
    ApiKeyTeam(team): ApiKeyTeam,
    PathParam(alias): PathParam<String>,
) -> Result<Json<Value>, ApiError> {
    let template = state.templates.resolve(&team, &alias).await?;
    Ok(Json(
        json!({"templateID": template.id, "public": template.public}),
    ))
}
