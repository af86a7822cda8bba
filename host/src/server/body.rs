//! Reading request bodies within a size limit.

use crate::server::connections::{self, Refusal, BODY_TIMEOUT};
use crate::server::errors::ApiError;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::Request;

/// The whole body of `req`, at most `limit` bytes, within [`BODY_TIMEOUT`].
/// A `Content-Length` beyond the limit is refused before a byte of the body
/// is read, so a client cannot make the server wait for (or buffer) what it
/// will refuse. While the body is read, its progress is reported to the
/// connection's eviction policy: a body that stalls makes its connection
/// evictable when every slot is taken (see
/// [`watch_body`](connections::watch_body)).
pub async fn read_limited(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let body = Limited::new(connections::watch_body(req), limit);
    tokio::time::timeout(BODY_TIMEOUT, body.collect())
        .await
        .map_err(|_| {
            connections::refused(Refusal::BodyTimeout);
            ApiError::timed_out(format!(
                "The request body did not arrive within {} s.",
                BODY_TIMEOUT.as_secs()
            ))
        })?
        .map(|c| c.to_bytes())
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                ApiError::too_large(limit)
            } else {
                ApiError::invalid(None, format!("cannot read the request body: {e}"))
            }
        })
}
