//! Draining before a stop: between the stop signal and the end of `--drain-period` the router
//! keeps accepting and serving, answers `/ready` with 503, and marks every response
//! `Connection: close`. A client on a kept-alive HTTP/1.1 connection then opens a new one for
//! its next request, which the Service sends to a router that is not stopping; without this,
//! the stop closes idle kept-alive connections at once, and a client that has just sent its
//! next request on one gets no answer.
//!
//! HTTP/2 needs nothing here: hyper strips the header and its graceful stop sends GOAWAY.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;

/// The two phases of a stop: `draining` is cancelled at the stop signal, `stop` once the
/// drain period after it has passed (the server and the background tasks end on `stop`).
#[derive(Clone, Debug)]
pub struct Drain {
    /// Cancelled when the stop signal arrives.
    pub draining: CancellationToken,
    /// Cancelled `period` after that.
    pub stop: CancellationToken,
}

impl Drain {
    /// Follows `signal`: drains for `period`, then stops. With a zero period both tokens are
    /// cancelled together.
    pub fn after(signal: CancellationToken, period: Duration) -> Drain {
        let drain = Drain {
            draining: CancellationToken::new(),
            stop: CancellationToken::new(),
        };
        let d = drain.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = signal.cancelled() => {}
                // Stopped by other means (the server failed): nothing left to drain.
                _ = d.stop.cancelled() => return,
            }
            d.draining.cancel();
            if !period.is_zero() {
                tracing::info!(
                    ?period,
                    "stop signal: draining (Connection: close, /ready 503)"
                );
                tokio::time::sleep(period).await;
            }
            d.stop.cancel();
        });
        drain
    }
}

/// Middleware over the API: while draining, `/ready` is 503 and every response says
/// `Connection: close`.
pub async fn layer(
    State(draining): State<CancellationToken>,
    req: Request,
    next: Next,
) -> Response {
    if draining.is_cancelled() && req.uri().path() == "/ready" {
        return close((StatusCode::SERVICE_UNAVAILABLE, "draining").into_response());
    }
    let response = next.run(req).await;
    if draining.is_cancelled() {
        close(response)
    } else {
        response
    }
}

fn close(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
