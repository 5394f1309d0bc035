//! How a failed action is answered: an error box with the API's own message, swapped by
//! htmx into the page's `#errors` area (see `assets/app.js`, which lets htmx swap 4xx and 5xx
//! answers).

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::html;
use sandbar_core::builds::TemplateAdminError;
use sandbar_core::runtime::RuntimeError;
use sandbar_core::sandboxes::SnapshotError;
use sandbar_core::{CapError, CreateSandboxError, SandboxError};

#[derive(Debug)]
pub(crate) struct PageError {
    pub status: StatusCode,
    pub message: String,
}

impl PageError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A failure of the server itself; what went wrong is in the server's log, not shown to
    /// the tenant.
    pub(crate) fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; the server's log has the cause",
        )
    }

    pub(crate) fn logged(context: &str, error: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %error, "dashboard: {context}");
        Self::internal()
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = html! { div.error role="alert" { (self.message) } };
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert("hx-retarget", HeaderValue::from_static("#errors"));
        headers.insert("hx-reswap", HeaderValue::from_static("innerHTML"));
        response
    }
}

impl From<SandboxError> for PageError {
    fn from(e: SandboxError) -> Self {
        match e {
            SandboxError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            SandboxError::TimeoutTooLong { .. } => Self::bad_request(e.to_string()),
            SandboxError::Conflict { .. } => Self::new(StatusCode::CONFLICT, e.to_string()),
            SandboxError::ConcurrencyLimit { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            SandboxError::NoCapacity { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            SandboxError::Store(ref s) => Self::logged("sandbox operation", s),
            other => Self::logged("sandbox operation", &other),
        }
    }
}

impl From<sandbar_core::SandboxLogsError> for PageError {
    fn from(e: sandbar_core::SandboxLogsError) -> Self {
        match e {
            sandbar_core::SandboxLogsError::NotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, e.to_string())
            }
            sandbar_core::SandboxLogsError::Store(ref s) => Self::logged("sandbox log", s),
        }
    }
}

impl From<CreateSandboxError> for PageError {
    fn from(e: CreateSandboxError) -> Self {
        match e {
            CreateSandboxError::Runtime(ref r) => Self::logged("sandbox create", r),
            CreateSandboxError::Store(ref s) => Self::logged("sandbox create", s),
            CreateSandboxError::ConcurrencyLimit { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            CreateSandboxError::NoCapacity { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            other => Self::bad_request(other.to_string()),
        }
    }
}

impl From<CapError> for PageError {
    fn from(e: CapError) -> Self {
        match e {
            CapError::Count { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            CapError::Bytes { .. } => Self::new(StatusCode::INSUFFICIENT_STORAGE, e.to_string()),
        }
    }
}

impl From<SnapshotError> for PageError {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            SnapshotError::BadName(_) | SnapshotError::BadCount(_) | SnapshotError::Network(_) => {
                Self::bad_request(e.to_string())
            }
            SnapshotError::NotRunning { .. }
            | SnapshotError::NameTaken(_)
            | SnapshotError::HasVolumes(_)
            | SnapshotError::NoImage(_)
            | SnapshotError::Runtime {
                source: RuntimeError::Uncheckpointable { .. },
                ..
            } => Self::new(StatusCode::CONFLICT, e.to_string()),
            SnapshotError::NoCheckpoints(_) => {
                Self::new(StatusCode::NOT_IMPLEMENTED, e.to_string())
            }
            SnapshotError::Sandbox(s) => s.into(),
            SnapshotError::Cap(c) => c.into(),
            other => Self::logged("snapshot", &other),
        }
    }
}

impl From<TemplateAdminError> for PageError {
    fn from(e: TemplateAdminError) -> Self {
        match e {
            TemplateAdminError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            TemplateAdminError::BuiltIn(_) => Self::new(StatusCode::FORBIDDEN, e.to_string()),
            TemplateAdminError::Invalid(_) => Self::bad_request(e.to_string()),
            TemplateAdminError::Cap(c) => c.into(),
            TemplateAdminError::Store(ref s) => Self::logged("template", s),
        }
    }
}

impl From<sandbar_core::builds::RequestBuildError> for PageError {
    fn from(e: sandbar_core::builds::RequestBuildError) -> Self {
        use sandbar_core::builds::RequestBuildError as E;
        match e {
            E::NameTaken(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::TemplateNotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::Cap(c) => c.into(),
            E::Store(ref s) => Self::logged("template build", s),
            _ => Self::bad_request(e.to_string()),
        }
    }
}

impl From<sandbar_core::builds::StartBuildError> for PageError {
    fn from(e: sandbar_core::builds::StartBuildError) -> Self {
        use sandbar_core::builds::StartBuildError as E;
        match e {
            E::TemplateNotFound(_) | E::BuildNotFound { .. } => {
                Self::new(StatusCode::NOT_FOUND, e.to_string())
            }
            E::AlreadyStarted(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Invalid(_) | E::RegistryRefused { .. } => Self::bad_request(e.to_string()),
            E::Store(ref s) => Self::logged("template build", s),
        }
    }
}

impl From<sandbar_core::CreateVolumeError> for PageError {
    fn from(e: sandbar_core::CreateVolumeError) -> Self {
        use sandbar_core::CreateVolumeError as E;
        match e {
            E::BadName(_) => Self::bad_request(e.to_string()),
            E::NameTaken(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Cap(c) => c.into(),
            other => Self::logged("volume create", &other),
        }
    }
}

impl From<sandbar_core::GetVolumeError> for PageError {
    fn from(e: sandbar_core::GetVolumeError) -> Self {
        use sandbar_core::GetVolumeError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::Store(ref s) => Self::logged("volume", s),
        }
    }
}

impl From<sandbar_core::DeleteVolumeError> for PageError {
    fn from(e: sandbar_core::DeleteVolumeError) -> Self {
        use sandbar_core::DeleteVolumeError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::InUse { .. } => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Store(ref s) => Self::logged("volume delete", s),
        }
    }
}

impl From<sandbar_core::VolumeContentError> for PageError {
    fn from(e: sandbar_core::VolumeContentError) -> Self {
        use sandbar_core::VolumeContentError as E;
        use sandbar_core::VolumeIoError as Io;
        let status = match &e {
            E::Io {
                source: Io::NotFound(_),
                ..
            } => StatusCode::NOT_FOUND,
            E::Io {
                source: Io::Io { .. },
                ..
            }
            | E::Store(_) => return Self::logged("volume content", &e),
            E::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::Cap(c) => return c.clone().into(),
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, e.to_string())
    }
}

impl From<sandbar_core::webhooks::WebhookError> for PageError {
    fn from(e: sandbar_core::webhooks::WebhookError) -> Self {
        use sandbar_core::webhooks::WebhookError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::Invalid(_) => Self::bad_request(e.to_string()),
            E::TooMany { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            E::Store(ref s) => Self::logged("webhooks", s),
        }
    }
}

/// An answer in the dashboard's error form (shown in the page's error box), for a request the
/// dashboard's handlers never saw: one an API host could not forward to a node.
pub fn error_answer(status: StatusCode, message: impl Into<String>) -> Response {
    PageError::new(status, message).into_response()
}
