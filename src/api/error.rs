//! `ApiError`: each domain error mapped to a status once. 4xx name the
//! field and are not logged as errors; 5xx are opaque and logged in full.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::runs::files::FileError;
use crate::runs::model::FieldError;
use crate::runs::RunError;

#[derive(Debug)]
pub enum ApiError {
    BadRequest {
        field: String,
        message: String,
    },
    Unauthorized,
    NotFound(String),
    Conflict {
        error: &'static str,
        message: String,
    },
    /// A lease conflict: `busy`, `held` (who, until when) or `superseded`.
    Lease(crate::leases::LeaseError, Option<String>),
    TooLarge(String),
    Unprocessable(String),
    ShuttingDown,
    Internal(String),
}

impl ApiError {
    pub fn bad(field: &str, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::BadRequest {
            field: e.field,
            message: e.message,
        }
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::NotFound(_) => ApiError::NotFound(e.to_string()),
            RunError::NotRunning { .. } => ApiError::Conflict {
                error: "not_running",
                message: e.to_string(),
            },
            RunError::Lease { err, expires_at } => ApiError::Lease(err, expires_at),
            RunError::Unprocessable(m) => ApiError::Unprocessable(m),
            RunError::ShuttingDown => ApiError::ShuttingDown,
            RunError::Internal(m) => ApiError::Internal(m),
        }
    }
}

impl From<FileError> for ApiError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::BadPath(m) => ApiError::bad("path", m),
            FileError::NotFound => ApiError::NotFound("no such file or directory".into()),
            FileError::TooLarge(_) => ApiError::TooLarge(e.to_string()),
            FileError::NotRegular => ApiError::bad("path", e.to_string()),
            FileError::Io(io) => ApiError::Internal(format!("file io: {io}")),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use crate::leases::LeaseError;
        let server = crate::SERVER_NAME.get().cloned().unwrap_or_default();
        let (status, error, message) = match self {
            ApiError::BadRequest { field, message } => (
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("{field}: {message}"),
            ),
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token".into(),
            ),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, "not_found", m),
            ApiError::Conflict { error, message } => (StatusCode::CONFLICT, error, message),
            ApiError::Lease(err, expires_at) => {
                let mut body = json!({"message": err.to_string(), "server": server});
                match err {
                    LeaseError::Busy => body["error"] = json!("busy"),
                    LeaseError::Held {
                        holder, generation, ..
                    } => {
                        body["error"] = json!("held");
                        body["holder"] = json!(holder);
                        body["generation"] = json!(generation);
                        body["expiresAt"] = json!(expires_at);
                    }
                    LeaseError::Superseded { given, current } => {
                        body["error"] = json!("superseded");
                        body["given"] = json!(given);
                        body["generation"] = json!(current);
                    }
                }
                return (StatusCode::CONFLICT, axum::Json(body)).into_response();
            }
            ApiError::TooLarge(m) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large", m),
            ApiError::Unprocessable(m) => (StatusCode::UNPROCESSABLE_ENTITY, "unprocessable", m),
            ApiError::ShuttingDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "daemon is shutting down".into(),
            ),
            ApiError::Internal(m) => {
                tracing::error!(error = %m, "internal error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; see the daemon log".into(),
                )
            }
        };
        (
            status,
            axum::Json(json!({"error": error, "message": message, "server": server})),
        )
            .into_response()
    }
}
