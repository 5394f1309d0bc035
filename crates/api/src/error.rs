//! The API's error body `{"code": int, "message": str}` and the mapping from domain errors.

use axum::Json;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use sandbar_core::{
    AuthError, CreateSandboxError, ListSandboxesError, RateLimited, RuntimeError, SandboxError,
    TakeOverError, TemplateError, UpdateNetworkError, sandboxes::SnapshotError,
};
use serde::Serialize;
use utoipa::ToSchema;

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Error)]
pub(crate) struct ErrorBody {
    /// The HTTP status code again.
    #[schema(minimum = 100, maximum = 599)]
    code: u16,
    message: String,
}

impl From<ApiError> for ErrorBody {
    fn from(e: ApiError) -> Self {
        Self {
            code: e.status.as_u16(),
            message: e.message,
        }
    }
}

#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Seconds a client should wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A refusal that a client may send again after `retry_after_secs`.
    pub fn retry_later(
        status: StatusCode,
        message: impl Into<String>,
        retry_after_secs: u64,
    ) -> Self {
        Self {
            retry_after: Some(retry_after_secs),
            ..Self::new(status, message)
        }
    }

    /// 503 for want of capacity: the request was fine and may be sent again after
    /// `retry_after_secs`.
    fn unavailable(message: String, retry_after_secs: u64) -> Self {
        Self::retry_later(StatusCode::SERVICE_UNAVAILABLE, message, retry_after_secs)
    }

    /// 429 for a rate that is spent; Retry-After has whole seconds, rounded up so a client
    /// never retries too early.
    fn rate_limited(message: String, retry_after: std::time::Duration) -> Self {
        let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        Self::retry_later(StatusCode::TOO_MANY_REQUESTS, message, secs)
    }

    /// 507: the request was fine, the data disk has no room for what it would write.
    pub fn insufficient_storage(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INSUFFICIENT_STORAGE, message)
    }

    fn internal(err: &dyn std::fmt::Display) -> Self {
        let message = err.to_string();
        // A disk that filled between the up-front check and the write (the host wrote the
        // last of it) surfaces as SQLite's or the kernel's own words.
        if message.contains("database or disk is full")
            || message.contains("No space left on device")
        {
            tracing::warn!(error = %message, "request failed: the data disk is full");
            return Self::insufficient_storage(format!("the data disk is full: {message}"));
        }
        tracing::error!(error = %message, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(ErrorBody {
                code: self.status.as_u16(),
                message: self.message,
            }),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        if self.status.is_server_error() && self.retry_after.is_none() {
            // Retrying a failed sandbox operation blindly would not help; the SDKs honour this.
            // A refusal for want of capacity says when a retry may succeed instead.
            response.headers_mut().insert(
                "Should-Retry",
                axum::http::HeaderValue::from_static("false"),
            );
        }
        response
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Store(ref s) => Self::internal(s),
            AuthError::MalformedRequestedKey => Self::bad_request(e.to_string()),
            _ => Self::new(StatusCode::UNAUTHORIZED, e.to_string()),
        }
    }
}

/// A count cap is the team's own rate of keeping things (429); a bytes cap is storage the
/// team has no more of (507).
impl From<sandbar_core::CapError> for ApiError {
    fn from(e: sandbar_core::CapError) -> Self {
        match e {
            sandbar_core::CapError::Count { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            sandbar_core::CapError::Bytes { .. } => Self::insufficient_storage(e.to_string()),
        }
    }
}

impl From<RateLimited> for ApiError {
    fn from(e: RateLimited) -> Self {
        Self::rate_limited(e.to_string(), e.retry_after)
    }
}

impl From<TemplateError> for ApiError {
    fn from(e: TemplateError) -> Self {
        let status = match &e {
            TemplateError::BadReference(_) => StatusCode::BAD_REQUEST,
            TemplateError::NotFound(_) => StatusCode::NOT_FOUND,
            TemplateError::BuildFailed { .. } => StatusCode::BAD_REQUEST,
            TemplateError::StillBuilding(_) => StatusCode::CONFLICT,
            TemplateError::NeverBuilt(_) => StatusCode::BAD_REQUEST,
            TemplateError::Store(s) => return Self::internal(s),
        };
        Self::new(status, e.to_string())
    }
}

impl From<CreateSandboxError> for ApiError {
    fn from(e: CreateSandboxError) -> Self {
        match e {
            CreateSandboxError::Template(t) => t.into(),
            CreateSandboxError::Volumes(v) => v.into(),
            CreateSandboxError::TimeoutTooLong { .. }
            | CreateSandboxError::Network(_)
            | CreateSandboxError::ResourceLimit { .. } => Self::bad_request(e.to_string()),
            CreateSandboxError::ConcurrencyLimit {
                retry_after_secs, ..
            } => Self::retry_later(
                StatusCode::TOO_MANY_REQUESTS,
                e.to_string(),
                retry_after_secs,
            ),
            CreateSandboxError::NoCapacity {
                retry_after_secs, ..
            } => Self::unavailable(e.to_string(), retry_after_secs),
            CreateSandboxError::Runtime(ref r) => Self::internal(r),
            CreateSandboxError::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> Self {
        match e {
            SandboxError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            SandboxError::TimeoutTooLong { .. } => Self::bad_request(e.to_string()),
            SandboxError::Conflict { .. } => Self::new(StatusCode::CONFLICT, e.to_string()),
            SandboxError::ConcurrencyLimit {
                retry_after_secs, ..
            } => Self::retry_later(
                StatusCode::TOO_MANY_REQUESTS,
                e.to_string(),
                retry_after_secs,
            ),
            SandboxError::NoCapacity {
                retry_after_secs, ..
            } => Self::unavailable(e.to_string(), retry_after_secs),
            SandboxError::Runtime(RuntimeError::StillRunning { .. }) => {
                Self::new(StatusCode::CONFLICT, e.to_string())
            }
            SandboxError::Runtime(ref r) => Self::internal(r),
            SandboxError::Store(ref s) => Self::internal(s),
            SandboxError::TakeOver(ref t) => match t {
                TakeOverError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, t.to_string()),
                TakeOverError::NodeAlive { .. } | TakeOverError::Moved { .. } => {
                    Self::new(StatusCode::CONFLICT, t.to_string())
                }
                // As for any request to a lost node's sandbox: what the SDKs read as a sandbox
                // that no longer runs.
                TakeOverError::NotPaused { .. } | TakeOverError::NoCopy { .. } => Self::new(
                    StatusCode::BAD_GATEWAY,
                    format!("The sandbox was not found: {t}"),
                ),
                TakeOverError::Runtime(r) => Self::internal(r),
                TakeOverError::Store(s) => Self::internal(s),
                TakeOverError::NotInCluster(_) => Self::internal(t),
            },
        }
    }
}

impl From<SnapshotError> for ApiError {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            SnapshotError::BadName(_) | SnapshotError::BadCount(_) | SnapshotError::Network(_) => {
                Self::bad_request(e.to_string())
            }
            SnapshotError::NotRunning { .. }
            | SnapshotError::NameTaken(_)
            | SnapshotError::HasVolumes(_)
            | SnapshotError::NoImage(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            SnapshotError::NoCheckpoints(_) => {
                Self::new(StatusCode::NOT_IMPLEMENTED, e.to_string())
            }
            SnapshotError::Sandbox(s) => s.into(),
            // What the sandbox holds is the tenant's to change; the reason names only the
            // kind of object.
            SnapshotError::Runtime {
                source: RuntimeError::Uncheckpointable { .. },
                ..
            } => Self::new(StatusCode::CONFLICT, e.to_string()),
            SnapshotError::Cap(c) => c.into(),
            SnapshotError::Runtime { .. } => Self::internal(&e),
            SnapshotError::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<UpdateNetworkError> for ApiError {
    fn from(e: UpdateNetworkError) -> Self {
        match e {
            UpdateNetworkError::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            UpdateNetworkError::Invalid(_) => Self::bad_request(e.to_string()),
            UpdateNetworkError::Runtime { .. } => Self::internal(&e),
            UpdateNetworkError::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<ListSandboxesError> for ApiError {
    fn from(e: ListSandboxesError) -> Self {
        match e {
            ListSandboxesError::BadToken(_) => Self::bad_request(e.to_string()),
            ListSandboxesError::Store(ref s) => Self::internal(s),
        }
    }
}

pub(crate) async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {method} {}", uri.path()),
    )
}

pub(crate) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

impl From<sandbar_core::builds::RequestBuildError> for ApiError {
    fn from(e: sandbar_core::builds::RequestBuildError) -> Self {
        use sandbar_core::builds::RequestBuildError as E;
        match e {
            E::NameTaken(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::TemplateNotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::Cap(c) => c.into(),
            E::Store(ref s) => Self::internal(s),
            _ => Self::bad_request(e.to_string()),
        }
    }
}

impl From<sandbar_core::builds::StartBuildError> for ApiError {
    fn from(e: sandbar_core::builds::StartBuildError) -> Self {
        use sandbar_core::builds::StartBuildError as E;
        match e {
            E::TemplateNotFound(_) | E::BuildNotFound { .. } => {
                Self::new(StatusCode::NOT_FOUND, e.to_string())
            }
            E::AlreadyStarted(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Invalid(_) | E::RegistryRefused { .. } => Self::bad_request(e.to_string()),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::builds::CancelBuildError> for ApiError {
    fn from(e: sandbar_core::builds::CancelBuildError) -> Self {
        use sandbar_core::builds::CancelBuildError as E;
        match e {
            E::TemplateNotFound(_) | E::BuildNotFound { .. } => {
                Self::new(StatusCode::NOT_FOUND, e.to_string())
            }
            E::AlreadyEnded { .. } | E::OnAnotherNode { .. } => {
                Self::new(StatusCode::CONFLICT, e.to_string())
            }
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::builds::BuildLookupError> for ApiError {
    fn from(e: sandbar_core::builds::BuildLookupError) -> Self {
        use sandbar_core::builds::BuildLookupError as E;
        match e {
            E::Store(ref s) => Self::internal(s),
            _ => Self::new(StatusCode::NOT_FOUND, e.to_string()),
        }
    }
}

impl From<sandbar_core::builds::UploadLinkError> for ApiError {
    fn from(e: sandbar_core::builds::UploadLinkError) -> Self {
        use sandbar_core::builds::{UploadError, UploadLinkError as E};
        match e {
            E::TemplateNotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::BadHash(_) => Self::bad_request(e.to_string()),
            E::BadToken => Self::new(StatusCode::FORBIDDEN, e.to_string()),
            E::Upload(UploadError::TooLarge { .. } | UploadError::TeamBytes { .. }) => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string())
            }
            E::Upload(UploadError::TeamCount { .. }) => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            }
            E::Upload(UploadError::Corrupt { .. }) => Self::bad_request(e.to_string()),
            E::Upload(ref u) => Self::internal(u),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::builds::TemplateAdminError> for ApiError {
    fn from(e: sandbar_core::builds::TemplateAdminError) -> Self {
        use sandbar_core::builds::TemplateAdminError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::BuiltIn(_) => Self::new(StatusCode::FORBIDDEN, e.to_string()),
            E::Invalid(_) => Self::bad_request(e.to_string()),
            E::Cap(c) => c.into(),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::StoreError> for ApiError {
    fn from(e: sandbar_core::StoreError) -> Self {
        Self::internal(&e)
    }
}

impl From<sandbar_core::TeamAccessError> for ApiError {
    fn from(e: sandbar_core::TeamAccessError) -> Self {
        use sandbar_core::TeamAccessError as E;
        match e {
            E::NoAccess(_) => Self::new(StatusCode::FORBIDDEN, e.to_string()),
            E::Auth(a) => a.into(),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::CreateCredentialError> for ApiError {
    fn from(e: sandbar_core::CreateCredentialError) -> Self {
        use sandbar_core::CreateCredentialError as E;
        match e {
            E::BadName(_) => Self::bad_request(e.to_string()),
            E::Cap(c) => c.into(),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::RenameApiKeyError> for ApiError {
    fn from(e: sandbar_core::RenameApiKeyError) -> Self {
        use sandbar_core::RenameApiKeyError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::BadName(_) => Self::bad_request(e.to_string()),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

/// Errors of a lookup by id whose only failures are an unknown id and the store's.
macro_rules! not_found_or_store {
    ($($error:path),+ $(,)?) => {$(
        impl From<$error> for ApiError {
            fn from(e: $error) -> Self {
                use $error as E;
                match e {
                    E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
                    E::Store(ref s) => Self::internal(s),
                }
            }
        }
    )+};
}

not_found_or_store!(
    sandbar_core::DeleteApiKeyError,
    sandbar_core::DeleteAccessTokenError,
    sandbar_core::GetVolumeError,
);

impl From<sandbar_core::CreateVolumeError> for ApiError {
    fn from(e: sandbar_core::CreateVolumeError) -> Self {
        use sandbar_core::CreateVolumeError as E;
        match e {
            E::BadName(_) => Self::bad_request(e.to_string()),
            E::NameTaken(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Cap(c) => c.into(),
            E::Host { .. } => Self::internal(&e),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::DeleteVolumeError> for ApiError {
    fn from(e: sandbar_core::DeleteVolumeError) -> Self {
        use sandbar_core::DeleteVolumeError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::InUse { .. } => Self::new(StatusCode::CONFLICT, e.to_string()),
            E::Store(ref s) => Self::internal(s),
        }
    }
}

impl From<sandbar_core::VolumeMountError> for ApiError {
    fn from(e: sandbar_core::VolumeMountError) -> Self {
        use sandbar_core::VolumeMountError as E;
        match e {
            E::Store(ref s) => Self::internal(s),
            E::Disabled => Self::new(StatusCode::NOT_IMPLEMENTED, e.to_string()),
            _ => Self::bad_request(e.to_string()),
        }
    }
}

impl From<sandbar_core::VolumeContentError> for ApiError {
    fn from(e: sandbar_core::VolumeContentError) -> Self {
        use sandbar_core::VolumeContentError as E;
        use sandbar_core::VolumeIoError as Io;
        let status = match &e {
            E::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            E::BadPath { .. } | E::BadRequest { .. } | E::Upload { .. } => StatusCode::BAD_REQUEST,
            E::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            E::RateLimited { retry_after, .. } => {
                return Self::rate_limited(e.to_string(), *retry_after);
            }
            E::Io { source, .. } => match source {
                Io::NotFound(_) => StatusCode::NOT_FOUND,
                Io::AlreadyExists(_) => StatusCode::CONFLICT,
                Io::Escapes(_)
                | Io::NotADirectory(_)
                | Io::IsADirectory(_)
                | Io::Symlink(_)
                | Io::NotAFile { .. }
                | Io::Root => StatusCode::BAD_REQUEST,
                Io::Io { .. } => return Self::internal(&e),
            },
            E::Cap(c) => return c.clone().into(),
            E::Store(s) => return Self::internal(s),
        };
        Self::new(status, e.to_string())
    }
}

impl From<sandbar_core::webhooks::WebhookError> for ApiError {
    fn from(e: sandbar_core::webhooks::WebhookError) -> Self {
        use sandbar_core::webhooks::WebhookError as E;
        match e {
            E::NotFound(_) => Self::new(StatusCode::NOT_FOUND, e.to_string()),
            E::Invalid(_) => Self::bad_request(e.to_string()),
            E::TooMany { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()),
            E::Store(s) => s.into(),
        }
    }
}
