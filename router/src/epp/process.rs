//! The `envoy.service.ext_proc.v3.ExternalProcessor` service: one bidirectional stream per HTTP
//! request, handled by an `Exchange`.
//!
//! In FULL_DUPLEX_STREAMED request body mode (what the endpoint picker protocol asks gateways
//! to configure, and what is assumed when Envoy sends no `protocol_config`), Envoy sends the
//! request headers and then the body chunks without waiting. The exchange buffers the chunks
//! until the body ends (`end_of_stream`, or trailers), picks, and only then answers: first the
//! request-headers response carrying the destination (header + `envoy.lb` metadata), then every
//! body chunk back, in order, unchanged, the last one with `end_of_stream` when the body had it.
//! No body response ever precedes the headers response.
//!
//! Other request body modes: BUFFERED (the headers wait for their answer, then one body
//! message comes): the headers are passed on, and the body's answer carries the destination.
//! NONE, STREAMED, BUFFERED_PARTIAL, or a request without a body: the pick is made at the
//! headers, by load alone (no prompt to score).
//!
//! Response phase: headers, body chunks (echoed in FULL_DUPLEX_STREAMED, else passed on) and
//! trailers are answered unchanged; the picked worker's optimistic charge is released when the
//! response ends or the stream closes. The response body's last bytes are kept: when they carry
//! the OpenAI usage with `cached_tokens`, the server's count corrects the router's guess of the
//! prefill work it did ([`Picked::response_ended`]).

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::pick::{self, PickError, Picked, Picker};
use super::protocol;

/// The ext_proc service.
pub struct EndpointPicker {
    picker: Arc<Picker>,
    max_body_bytes: usize,
}

impl EndpointPicker {
    /// Serves `picker`, refusing request bodies over `max_body_bytes` (413).
    pub fn new(picker: Arc<Picker>, max_body_bytes: usize) -> Self {
        EndpointPicker {
            picker,
            max_body_bytes,
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let exchange = Exchange {
            picker: self.picker.clone(),
            max_body_bytes: self.max_body_bytes,
            tx,
            modes: None,
            path: None,
            subset: None,
            chunks: Vec::new(),
            size: 0,
            picked: None,
            routed: false,
            response_tail: Vec::new(),
        };
        // One of the router's tasks: it ends with Envoy's stream or at the stop.
        self.picker.cluster().spawn(exchange.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The body modes of the stream: (request, response).
type Modes = (BodySendMode, BodySendMode);

fn mode(v: i32) -> BodySendMode {
    BodySendMode::try_from(v).unwrap_or(BodySendMode::FullDuplexStreamed)
}

/// Why the exchange stops.
enum Stop {
    /// Envoy went away (the response stream is closed).
    Gone,
    /// An immediate response was sent; nothing more is answered.
    Answered,
}

/// The state of one request's stream.
struct Exchange {
    picker: Arc<Picker>,
    max_body_bytes: usize,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    modes: Option<Modes>,
    path: Option<String>,
    subset: Option<Vec<String>>,
    chunks: Vec<Vec<u8>>,
    size: usize,
    picked: Option<Picked>,
    /// Whether the destination has been sent (a pick was made and answered).
    routed: bool,
    /// The last [`pick::RESPONSE_TAIL_BYTES`] of the response body.
    response_tail: Vec<u8>,
}

impl Exchange {
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "ext_proc stream ended");
                    return;
                }
            };
            if self.handle(msg).await.is_err() {
                return;
            }
        }
    }

    async fn send(&self, resp: ProcessingResponse) -> Result<(), Stop> {
        self.tx.send(Ok(resp)).await.map_err(|_| Stop::Gone)
    }

    async fn handle(&mut self, msg: ProcessingRequest) -> Result<(), Stop> {
        let modes = *self
            .modes
            .get_or_insert_with(|| match &msg.protocol_config {
                Some(c) => (mode(c.request_body_mode), mode(c.response_body_mode)),
                None => (
                    BodySendMode::FullDuplexStreamed,
                    BodySendMode::FullDuplexStreamed,
                ),
            });
        if self.subset.is_none() {
            self.subset = protocol::subset_hint(msg.metadata_context.as_ref());
        }
        use processing_request::Request as R;
        match msg.request {
            Some(R::RequestHeaders(h)) => self.request_headers(h, modes.0).await,
            Some(R::RequestBody(b)) => self.request_body(b, modes.0).await,
            Some(R::RequestTrailers(_)) => {
                if !self.routed {
                    self.route(modes.0).await?;
                }
                self.send(protocol::trailers_continue(true)).await
            }
            Some(R::ResponseHeaders(h)) => {
                if let Some(p) = &mut self.picked {
                    p.prefill_done();
                }
                if h.end_of_stream {
                    self.picked = None;
                }
                self.send(protocol::response_headers_continue()).await
            }
            Some(R::ResponseBody(b)) => {
                self.response_tail.extend_from_slice(&b.body);
                let excess = self
                    .response_tail
                    .len()
                    .saturating_sub(pick::RESPONSE_TAIL_BYTES);
                self.response_tail.drain(..excess);
                if b.end_of_stream {
                    self.response_ended();
                }
                match modes.1 {
                    BodySendMode::FullDuplexStreamed => {
                        self.send(protocol::response_body_chunk(b.body, b.end_of_stream))
                            .await
                    }
                    _ => self.send(protocol::body_continue(false)).await,
                }
            }
            Some(R::ResponseTrailers(_)) => {
                self.response_ended();
                self.send(protocol::trailers_continue(false)).await
            }
            None => Ok(()),
        }
    }

    /// The response is over: the server's usage (if its tail has it) corrects the charge, which
    /// is then released.
    fn response_ended(&mut self) {
        if let Some(mut p) = self.picked.take() {
            p.response_ended(&self.response_tail);
        }
    }

    async fn request_headers(&mut self, h: HttpHeaders, mode: BodySendMode) -> Result<(), Stop> {
        self.path = protocol::header(h.headers.as_ref(), ":path");
        match mode {
            BodySendMode::FullDuplexStreamed if !h.end_of_stream => Ok(()),
            BodySendMode::Buffered if !h.end_of_stream => {
                self.send(protocol::headers_continue()).await
            }
            // No body comes (or none is waited for): pick by load now.
            _ => self.route(BodySendMode::None).await,
        }
    }

    async fn request_body(&mut self, b: HttpBody, mode: BodySendMode) -> Result<(), Stop> {
        if self.routed {
            return match mode {
                BodySendMode::FullDuplexStreamed => {
                    self.send(protocol::request_body_chunk(b.body, b.end_of_stream))
                        .await
                }
                _ => self.send(protocol::body_continue(true)).await,
            };
        }
        self.size += b.body.len();
        if self.size > self.max_body_bytes {
            let body = serde_json::json!({"error": {
                "message": format!("the request body is larger than {} bytes", self.max_body_bytes),
                "type": "invalid_request_error",
                "param": null,
                "code": "request_too_large",
            }});
            self.send(protocol::immediate(413, body.to_string().into_bytes()))
                .await?;
            return Err(Stop::Answered);
        }
        self.chunks.push(b.body);
        // A buffered body comes in one message, which must be answered.
        if b.end_of_stream || mode == BodySendMode::Buffered {
            self.route_with_end(mode, true).await
        } else {
            Ok(())
        }
    }

    /// Picks and answers, the body (if buffered) having ended without `end_of_stream` (by
    /// trailers) or not mattering.
    async fn route(&mut self, mode: BodySendMode) -> Result<(), Stop> {
        self.route_with_end(mode, false).await
    }

    async fn route_with_end(&mut self, mode: BodySendMode, ended: bool) -> Result<(), Stop> {
        let body = self.chunks.concat();
        let subset = self.subset.clone();
        let req = pick::Request {
            path: self.path.as_deref(),
            body: &body,
            subset: subset.as_deref(),
        };
        let picked = match self.picker.pick(req).await {
            Ok(p) => p,
            Err(e) => return self.refuse(e).await,
        };
        let value = picked.value();
        tracing::debug!(destination = %value, "endpoint picked");
        self.picked = Some(picked);
        self.routed = true;
        match mode {
            BodySendMode::FullDuplexStreamed => {
                self.send(protocol::headers_routed(&value)).await?;
                let chunks = std::mem::take(&mut self.chunks);
                let n = chunks.len();
                for (i, chunk) in chunks.into_iter().enumerate() {
                    let last = i + 1 == n;
                    self.send(protocol::request_body_chunk(chunk, last && ended))
                        .await?;
                }
                Ok(())
            }
            BodySendMode::Buffered => {
                self.chunks.clear();
                self.send(protocol::body_routed(&value)).await
            }
            _ => self.send(protocol::headers_routed(&value)).await,
        }
    }

    async fn refuse(&mut self, e: PickError) -> Result<(), Stop> {
        let status = e.status();
        match &e {
            PickError::Request(_) => tracing::debug!(status, error = %e, "request refused"),
            _ => tracing::info!(status, error = %e, "no endpoint picked"),
        }
        self.send(protocol::immediate(status, e.body())).await?;
        Err(Stop::Answered)
    }
}
