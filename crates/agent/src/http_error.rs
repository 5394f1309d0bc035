//! The envd error body for plain HTTP endpoints: `{"code": <status>, "message": "..."}`.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

/// Builds an error response the SDKs parse (they read the integer `code` and `message`).
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    (status, Json(body)).into_response()
}

/// An error destined to become a [`json_error`] response; small enough to return by value.
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    message: String,
}

impl HttpError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        json_error(self.status, self.message)
    }
}
