//! The router's OpenAI-compatible HTTP front, the first hop of `api → admit → place →
//! dispatch → stream`.
//!
//! [`router`] builds the axum routes over an [`ApiState`]:
//! - `POST /v1/chat/completions`, `POST /v1/completions`: validate ([`prepare`]), admit
//!   ([`crate::admit`]), tokenize, start one [`backend::Backend`] generation per choice, and
//!   answer with one JSON body ([`generate`]) or server-sent events ([`sse`]);
//! - `GET /v1/models`: the served model;
//! - `GET /health` (always 200), `GET /ready` (200 when a decode worker is ready, else 503),
//!   `GET /metrics` (Prometheus text of the injected registry). These three need no API key.
//!
//! Every failure is an [`error::ApiError`], turned into OpenAI's error JSON in one place.
//! Request bodies are limited by axum's default body limit (2 MiB, [`error::BODY_LIMIT`]);
//! a larger one gets a 413.

pub mod backend;
pub mod error;
pub mod generate;
mod ids;
pub mod metrics;
pub mod openai;
pub mod prepare;
pub mod sse;
pub mod structured;
pub mod toolparse;
pub mod tools;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use cleave_text::chat::ChatTemplate;
use cleave_text::constrain::LazyGrammars;
use cleave_text::tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::Instrument;

use crate::admit::{Admission, Permit};
use backend::Backend;
use error::ApiError;
use generate::Meta;
use metrics::{RouterMetrics, StatusClass};
use openai::{Model, ModelList};
use prepare::{Endpoint, Tokenize};

/// Everything the HTTP layer needs; built once by the binary and shared by all requests.
pub struct ApiState {
    /// Places and runs generations.
    pub backend: Arc<dyn Backend>,
    /// The served model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template; without one, chat requests get a 400.
    pub template: Option<Arc<ChatTemplate>>,
    /// The model's context length in tokens (prompt + completion).
    pub max_context: usize,
    /// Compiles output constraints (JSON schemas, grammars) to check them before placing.
    pub grammars: Arc<LazyGrammars>,
    /// Accepted bearer tokens and their limits; `None` disables authentication.
    pub api_keys: Option<Arc<crate::keys::Keys>>,
    /// In-flight and queue limits, and each request's deadline.
    pub admission: Admission,
    /// The router's metrics (registered in `registry`).
    pub metrics: Arc<RouterMetrics>,
    /// The registry `/metrics` encodes (the router's and any other component's metrics).
    pub registry: Arc<Registry>,
}

/// The axum router serving the OpenAI API, health, readiness and metrics over `state`.
pub fn router(state: Arc<ApiState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(unknown_route)
        .with_state(state)
}

async fn chat_completions(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&s, Endpoint::Chat, &headers, body).await
}

async fn completions(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&s, Endpoint::Completion, &headers, body).await
}

/// Serves one completion request and counts its response class.
async fn serve(
    s: &Arc<ApiState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let span = tracing::debug_span!("api", ?endpoint);
    // Continue the client's trace in the exported spans (a no-op without export).
    cleave_telemetry::set_parent(&span, client_traceparent(headers).as_deref());
    match run(s, endpoint, headers, body, arrived)
        .instrument(span)
        .await
    {
        Ok(resp) => {
            s.metrics.count_request(StatusClass::Ok);
            resp
        }
        Err(e) => {
            s.metrics.count_request(e.class());
            e.into_response()
        }
    }
}

/// The client's W3C `traceparent` header, if it sent one.
fn client_traceparent(headers: &HeaderMap) -> Option<String> {
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn run(
    s: &Arc<ApiState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let key = authorize(s, headers)?;
    let traceparent = client_traceparent(headers);
    // When spans are exported the workers continue the `api` span itself.
    let exported = cleave_telemetry::traceparent_of(&tracing::Span::current());
    let body = body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge,
        _ => ApiError::bad_request(r.body_text()),
    })?;
    let req = prepare::parse_body(&body)?;
    let (mut job, input, max_tokens) = prepare::validate(endpoint, req, s.backend.model_name())?;
    // The key's own concurrency and request limits come before the shared queue.
    let lease = match &key {
        Some(k) => Some(k.admit().map_err(ApiError::key_limited)?),
        None => None,
    };
    let mut permit = s
        .admission
        .admit()
        .instrument(tracing::debug_span!("admit"))
        .await
        .map_err(|rejected| {
            tracing::debug!(%rejected, "request refused by admission");
            ApiError::RateLimited
        })?;
    if let Some(lease) = lease {
        permit.attach_key(lease);
    }
    let deadline = permit.deadline();
    let work = async move {
        let t = Tokenize {
            tokenizer: s.tokenizer.clone(),
            template: s.template.clone(),
            max_context: s.max_context,
        };
        let grammars = s.grammars.clone();
        let (constraint, field, tools) = (
            job.params.constraint.clone(),
            job.constraint_field.clone(),
            job.tools.clone(),
        );
        job.prompts = tokio::task::spawn_blocking(move || {
            prepare::check_constraint(&grammars, constraint.as_ref(), &field, tools.as_ref())?;
            prepare::tokenize(&t, input, max_tokens)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))??;
        let limits = match permit.key_mut() {
            Some(lease) => {
                lease
                    .reserve_tokens(reserved_tokens(&job))
                    .map_err(ApiError::key_limited)?;
                Some(lease.status())
            }
            None => None,
        };
        let meta = Meta::new(
            endpoint,
            s.backend.model_name(),
            job.params.logprobs.is_some(),
        )
        .with_trace(traceparent.as_deref());
        let meta = match exported {
            Some(tp) => meta.with_traceparent(tp),
            None => meta,
        };
        let streams = generate::start(&*s.backend, &job, &meta).await?;
        let mut resp = if job.stream {
            stream_response(s, meta, &job, streams, permit, arrived)
        } else {
            let value =
                generate::collect(streams, &job, &meta, &s.tokenizer, &s.metrics, arrived).await?;
            if let Some(used) = value["usage"]["total_tokens"].as_u64() {
                permit.settle(used);
            }
            drop(permit);
            s.metrics
                .e2e_request_latency
                .observe(arrived.elapsed().as_secs_f64());
            Json(value).into_response()
        };
        if let Some(limits) = limits {
            limits.apply(resp.headers_mut());
        }
        Ok(resp)
    };
    match deadline {
        Some(d) => tokio::time::timeout_at(d, work)
            .await
            .map_err(|_| ApiError::Timeout)?,
        None => work.await,
    }
}

fn stream_response(
    s: &Arc<ApiState>,
    meta: Meta,
    job: &prepare::Job,
    streams: tokio_stream::StreamMap<usize, backend::BackendStream>,
    permit: Permit,
    arrived: Instant,
) -> Response {
    let body = sse::SseBody::new(
        meta,
        job,
        streams,
        s.tokenizer.clone(),
        s.metrics.clone(),
        permit,
        arrived,
    );
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// What a request reserves from its key's tokens per minute: every prompt once, and
/// `max_tokens` for each of its choices (settled to the usage when it ends).
fn reserved_tokens(job: &prepare::Job) -> u64 {
    job.prompts
        .iter()
        .map(|p| (p.tokens.len() + job.n * p.max_tokens) as u64)
        .sum()
}

/// Checks `Authorization: Bearer <key>` when keys are configured; the key's entry (its
/// limits) when it is one.
fn authorize(
    s: &ApiState,
    headers: &HeaderMap,
) -> Result<Option<Arc<crate::keys::KeyEntry>>, ApiError> {
    let Some(keys) = &s.api_keys else {
        return Ok(None);
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, key) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        });
    match presented.and_then(|k| keys.find(k)) {
        Some(entry) => Ok(Some(entry)),
        None => Err(ApiError::Unauthorized),
    }
}

async fn models(State(s): State<Arc<ApiState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Json(ModelList {
        object: "list",
        data: vec![Model {
            id: s.backend.model_name(),
            object: "model",
            created,
            owned_by: "cleave",
        }],
    })
    .into_response()
}

async fn health() -> &'static str {
    "ok"
}

async fn ready(State(s): State<Arc<ApiState>>) -> Response {
    if s.backend.ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no decode worker is ready").into_response()
    }
}

async fn metrics_text(State(s): State<Arc<ApiState>>) -> Response {
    s.metrics
        .healthy_decode_workers
        .set(s.backend.healthy_decode_workers() as i64);
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &s.registry) {
        return ApiError::Internal(format!("encoding metrics: {e}")).into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn unknown_route() -> Response {
    ApiError::UnknownRoute.into_response()
}

#[cfg(test)]
mod tests;
