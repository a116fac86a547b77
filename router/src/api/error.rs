//! The API layer's errors and their one mapping to HTTP statuses and OpenAI's error JSON:
//! `{"error":{"message","type","param","code"}}`.
//!
//! Client errors carry a message the user can act on, naming the offending field in `param`;
//! internal errors are logged here with their detail and answered with a fixed public message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::backend::BackendError;
use super::metrics::StatusClass;

/// Everything that can go wrong serving one OpenAI request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a parameter is out of range (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the user.
        message: String,
        /// The offending field, e.g. `temperature` or `messages[0].content`.
        param: Option<String>,
        /// A machine-readable code, e.g. `context_length_exceeded`.
        code: Option<&'static str>,
    },
    /// The request body is larger than the router accepts (413).
    #[error("the request body is larger than the {} MiB limit", BODY_LIMIT >> 20)]
    TooLarge,
    /// The API key is missing or not one of the configured keys (401).
    #[error("incorrect or missing API key; pass it as `Authorization: Bearer <key>`")]
    Unauthorized,
    /// The requested model is not the one served (404).
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// No such route (404).
    #[error("unknown URL; the API is served under /v1")]
    UnknownRoute,
    /// Admission refused the request: queue full or queue wait too long (429).
    #[error("the server is at capacity; retry the request shortly")]
    RateLimited,
    /// One of the API key's own limits refused the request (429 with `Retry-After` and the
    /// `x-ratelimit-*` headers).
    #[error("{0}")]
    KeyLimited(Box<crate::keys::Limited>),
    /// The request ran past its deadline (504).
    #[error("the request timed out")]
    Timeout,
    /// No worker is available (503).
    #[error("no workers are available to serve the request; retry later")]
    NoWorkers,
    /// Workers could not take the request; the detail is logged (503).
    #[error("workers are unavailable: {0}")]
    Unavailable(String),
    /// The decode worker serving a stream failed mid-stream and the request could not be
    /// migrated (the limit was reached, or no worker could take it); the reason is for the
    /// client (503).
    #[error("the decode worker serving this request failed mid-stream and the request could not be moved to another one: {0}")]
    WorkerLost(String),
    /// Something failed inside the router or a worker; the detail is logged (500).
    #[error("internal error: {0}")]
    Internal(String),
}

/// The largest request body accepted: axum's default body limit.
pub const BODY_LIMIT: usize = 2 << 20;

/// Public message of every 500.
const INTERNAL_MESSAGE: &str =
    "the server had an error while processing your request; retry the request";
/// Public message of workers being unavailable.
const UNAVAILABLE_MESSAGE: &str = "the model workers are unavailable; retry later";

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 not tied to one field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A refusal by the key's own limits.
    pub fn key_limited(limited: crate::keys::Limited) -> Self {
        ApiError::KeyLimited(Box::new(limited))
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::UnknownRoute => StatusCode::NOT_FOUND,
            ApiError::RateLimited | ApiError::KeyLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ApiError::NoWorkers | ApiError::Unavailable(_) | ApiError::WorkerLost(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The metrics class of the response.
    pub fn class(&self) -> StatusClass {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::TooLarge => StatusClass::BadRequest,
            ApiError::Unauthorized => StatusClass::Unauthorized,
            ApiError::ModelNotFound(_) | ApiError::UnknownRoute => StatusClass::NotFound,
            ApiError::RateLimited | ApiError::KeyLimited(_) => StatusClass::RateLimited,
            ApiError::Timeout => StatusClass::Timeout,
            ApiError::NoWorkers | ApiError::Unavailable(_) | ApiError::WorkerLost(_) => {
                StatusClass::Unavailable
            }
            ApiError::Internal(_) => StatusClass::Error,
        }
    }

    /// The body in OpenAI's shape; logs internal details (never shown to the client).
    pub fn body(&self) -> ErrorBody {
        let (kind, code, param, message) = match self {
            ApiError::InvalidRequest {
                message,
                param,
                code,
            } => (
                "invalid_request_error",
                *code,
                param.clone(),
                message.clone(),
            ),
            ApiError::TooLarge => (
                "invalid_request_error",
                Some("request_too_large"),
                None,
                self.to_string(),
            ),
            ApiError::Unauthorized => (
                "invalid_request_error",
                Some("invalid_api_key"),
                None,
                self.to_string(),
            ),
            ApiError::ModelNotFound(_) => (
                "invalid_request_error",
                Some("model_not_found"),
                Some("model".to_string()),
                self.to_string(),
            ),
            ApiError::UnknownRoute => (
                "invalid_request_error",
                Some("unknown_url"),
                None,
                self.to_string(),
            ),
            ApiError::RateLimited | ApiError::KeyLimited(_) => (
                "rate_limit_error",
                Some("rate_limit_exceeded"),
                None,
                self.to_string(),
            ),
            ApiError::Timeout => ("timeout_error", Some("timeout"), None, self.to_string()),
            ApiError::NoWorkers => (
                "service_unavailable_error",
                Some("no_workers"),
                None,
                self.to_string(),
            ),
            ApiError::WorkerLost(_) => (
                "service_unavailable_error",
                Some("worker_lost"),
                None,
                self.to_string(),
            ),
            ApiError::Unavailable(detail) => {
                tracing::warn!(%detail, "workers unavailable");
                (
                    "service_unavailable_error",
                    Some("service_unavailable"),
                    None,
                    UNAVAILABLE_MESSAGE.to_string(),
                )
            }
            ApiError::Internal(detail) => {
                tracing::error!(%detail, "internal error serving a request");
                (
                    "server_error",
                    Some("internal_error"),
                    None,
                    INTERNAL_MESSAGE.to_string(),
                )
            }
        };
        ErrorBody {
            error: ErrorDetail {
                message,
                kind,
                param,
                code,
            },
        }
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::NoWorkers => ApiError::NoWorkers,
            BackendError::Unavailable(d) => ApiError::Unavailable(d),
            BackendError::BadRequest(m) => ApiError::bad_request(m),
        }
    }
}

/// OpenAI's error envelope.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// OpenAI's error object.
#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    /// Human-readable description.
    pub message: String,
    /// `invalid_request_error`, `rate_limit_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The offending request field, if any.
    pub param: Option<String>,
    /// A machine-readable code, if any.
    pub code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        match &self {
            ApiError::RateLimited => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ApiError::KeyLimited(limited) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, limited.retry_after_secs().into());
                limited.status.apply(resp.headers_mut());
            }
            _ => {}
        }
        resp
    }
}
