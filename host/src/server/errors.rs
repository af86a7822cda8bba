//! Errors in OpenAI's exact shape:
//! `{"error": {"message", "type", "param", "code"}}` with string codes.

use bytes::Bytes;
use hyper::{Response, StatusCode};

/// An error the API returns to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: &'static str,
    /// Seconds for a `Retry-After` header (429s of rate limits).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: the request is malformed or a field is out of range.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: "invalid_request_error",
            retry_after: None,
        }
    }

    /// 400 with `context_length_exceeded`.
    pub fn context_length(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: "context_length_exceeded",
            ..ApiError::invalid(Some(param.to_string()), message)
        }
    }

    /// 401: a missing or wrong API key.
    pub fn invalid_api_key() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.".into(),
            kind: "invalid_request_error",
            param: None,
            code: "invalid_api_key",
            retry_after: None,
        }
    }

    /// 404: the model named in the request is not served here.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: "model_not_found",
            retry_after: None,
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("No route for {path}."),
            kind: "invalid_request_error",
            param: None,
            code: "not_found",
            retry_after: None,
        }
    }

    /// 405: the route exists with another method.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("{method} is not allowed on {path}."),
            kind: "invalid_request_error",
            param: None,
            code: "method_not_allowed",
            retry_after: None,
        }
    }

    /// 413: the body is larger than the server accepts.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("The request body exceeds the limit of {limit} bytes."),
            kind: "invalid_request_error",
            param: None,
            code: "request_too_large",
            retry_after: None,
        }
    }

    /// 429: too many requests queued. It carries `Retry-After: 1`, so
    /// clients back off instead of retrying at once (a tokens-per-minute
    /// limit sets the time it knows instead).
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: "rate_limit_exceeded",
            retry_after: Some(1),
        }
    }

    /// 409: the request conflicts with the server's current state; the
    /// message says when to retry.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::CONFLICT,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: "conflict",
            retry_after: None,
        }
    }

    /// 503: the server is starting, shutting down, or its engine stopped.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: "service_unavailable",
            retry_after: None,
        }
    }

    /// 408: the client did not send its request in time.
    pub fn timed_out(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: "request_timeout",
            retry_after: None,
        }
    }

    /// 501: an OpenAI or vLLM route that Pagoda does not serve.
    pub fn not_implemented(path: &str, what: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_IMPLEMENTED,
            message: format!("{path} ({what}) is not implemented by this server; it serves text generation: /v1/completions and /v1/chat/completions."),
            kind: "invalid_request_error",
            param: None,
            code: "not_implemented",
            retry_after: None,
        }
    }

    /// 500: a bug or an unexpected failure on our side.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: "internal_error",
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The full HTTP response.
    pub fn response(&self) -> Response<super::Body> {
        let mut r = Response::new(super::full(Bytes::from(self.body().to_string())));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from(s),
            );
        }
        r
    }

    /// An error of a plugin: `status` with `code` (e.g. `plugin_error`,
    /// `plugin_rejected`); `type` follows the status class.
    pub fn plugin(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        let status = StatusCode::from_u16(status)
            .ok()
            .filter(|s| s.is_client_error() || s.is_server_error())
            .unwrap_or(StatusCode::BAD_REQUEST);
        ApiError {
            status,
            message: message.into(),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code,
            retry_after: None,
        }
    }

    /// 403: authenticated, but not allowed here.
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: "forbidden",
            retry_after: None,
        }
    }
}

/// A JSON response with status 200.
pub fn json_response(v: &serde_json::Value) -> Response<super::Body> {
    let mut r = Response::new(super::full(Bytes::from(v.to_string())));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}
