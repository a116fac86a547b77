//! The `dispatch` hop: place a request (prefix index + policy + optimistic load), then open
//! its `Generate` stream on the chosen decode worker, naming the prefill worker when the policy
//! disaggregates. Tokens come back as [`BackendEvent`]s; dropping the stream cancels the
//! request on the workers.

use std::sync::Arc;

use cleave_kv_index::WorkerId;
use cleave_proto::convert::finish_from_wire;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use tokio_stream::StreamExt;

use crate::api::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use crate::api::metrics::{PlacementLabels, PlacementMode, RouterMetrics};
use crate::place::{PlaceError, Placement, Policy, Reservation};

pub use crate::place::state::BLOCK_SIZE;
pub use cluster::{BadEndpoint, Cluster, WorkerEntry};

/// Migrations per request by default: how many times a stream whose decode worker failed
/// mid-stream is moved to another one.
pub use cleave_config::router::DEFAULT_MIGRATION_LIMIT;

/// The dispatcher: a [`Backend`] over the cluster's workers.
pub struct Dispatcher {
    inner: Arc<Inner>,
}

/// What placing and opening a stream needs; shared with the streams, which place again when
/// they migrate.
pub(crate) struct Inner {
    cluster: Arc<Cluster>,
    policy: Box<dyn Policy>,
    model: String,
    metrics: Option<Arc<RouterMetrics>>,
    migration_limit: usize,
}

impl Dispatcher {
    /// A dispatcher placing with `policy` and serving `model`.
    pub fn new(cluster: Arc<Cluster>, policy: Box<dyn Policy>, model: String) -> Self {
        Dispatcher {
            inner: Arc::new(Inner {
                cluster,
                policy,
                model,
                metrics: None,
                migration_limit: DEFAULT_MIGRATION_LIMIT,
            }),
        }
    }

    fn inner_mut(&mut self) -> &mut Inner {
        Arc::get_mut(&mut self.inner).expect("configured before the first request")
    }

    /// Counts placements in `cleave_router_placements_total{policy,mode}` (and migrations).
    pub fn with_metrics(mut self, metrics: Arc<RouterMetrics>) -> Self {
        self.inner_mut().metrics = Some(metrics);
        self
    }

    /// How many times one request may move to another decode worker after its worker failed
    /// mid-stream (0: never; the stream then ends in an error).
    pub fn with_migration_limit(mut self, limit: usize) -> Self {
        self.inner_mut().migration_limit = limit;
        self
    }
}

/// A decode worker's event stream, first event included.
pub(crate) type WorkerStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<pb::GenerateEvent, tonic::Status>> + Send>,
>;

/// An opened stream: its events, what it holds against the worker's load, and the worker.
pub(crate) struct Opened {
    pub stream: WorkerStream,
    pub reservation: Reservation,
    pub decode: WorkerId,
}

impl Inner {
    /// Places `prompt` and counts it against its workers (load charge, in-flight blocks). A
    /// resumed request (`resume` not empty) is placed with its generated tokens as context and
    /// prefilled on its decode worker.
    fn place(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        resumed: bool,
    ) -> Result<(Placement, Reservation), PlaceError> {
        self.cluster
            .placement()
            .place_prompt(prompt, max_tokens, |req, view| {
                let mut placement = self.policy.place(req, view)?;
                if resumed {
                    placement.prefill = None;
                }
                Ok(placement)
            })
    }

    /// Marks a decode worker unhealthy: it is not placed on until discovery says otherwise.
    pub(crate) fn set_unhealthy(&self, id: WorkerId) {
        self.cluster.placement().set_healthy(id, false);
    }
}

fn event(ev: pb::GenerateEvent) -> Option<BackendEvent> {
    Some(match ev.event? {
        pb::generate_event::Event::Token(t) => BackendEvent::Token {
            id: t.id,
            text: t.text,
            logprob: t.logprob,
            top: t.top.into_iter().map(|x| (x.token, x.logprob)).collect(),
        },
        pb::generate_event::Event::Finished(f) => BackendEvent::Finished {
            reason: finish_from_wire(f.reason()),
            prompt_tokens: f.prompt_tokens as usize,
            completion_tokens: f.completion_tokens as usize,
            cached_tokens: f.cached_tokens as usize,
            text: f.text,
        },
    })
}

/// Why a first event shows the request never started (`Finished` as aborted with no token).
fn aborted_before_any_token(ev: &pb::GenerateEvent) -> bool {
    matches!(&ev.event, Some(pb::generate_event::Event::Finished(f))
        if f.completion_tokens == 0 && finish_from_wire(f.reason()) == FinishReason::Aborted)
}

impl Inner {
    /// Places the request (after `resume`, the tokens it already generated, if it migrates) and
    /// opens its stream on the decode worker. A worker that fails before its first event has
    /// streamed nothing: it is marked unhealthy and the request is placed again.
    pub(crate) async fn open(
        &self,
        req: &BackendRequest,
        resume: &[u32],
    ) -> Result<Opened, BackendError> {
        let context: Vec<u32>;
        let prompt = if resume.is_empty() {
            &req.prompt
        } else {
            context = [req.prompt.as_slice(), resume].concat();
            &context
        };
        let max_tokens = req.params.max_tokens.saturating_sub(resume.len());
        for _attempt in 0..4 {
            let (placement, mut reservation) =
                match self.place(prompt, max_tokens, !resume.is_empty()) {
                    Ok(p) => p,
                    Err(PlaceError::NoDecodeWorker) => return Err(BackendError::NoWorkers),
                };
            let decode = self
                .cluster
                .get(placement.decode)
                .ok_or(BackendError::NoWorkers)?;
            let prefill_endpoint = placement
                .prefill
                .and_then(|p| self.cluster.get(p))
                .map(|p| p.endpoint);
            if let Some(m) = &self.metrics {
                let mode = if prefill_endpoint.is_none() {
                    PlacementMode::Local
                } else {
                    PlacementMode::Disaggregated
                };
                m.placements
                    .get_or_create(&PlacementLabels {
                        policy: self.policy.name(),
                        mode,
                    })
                    .inc();
            }
            tracing::debug!(decode = %placement.decode, prefill = ?placement.prefill, "placed");
            let mut client = DecodeWorkerClient::new(decode.channel.clone());
            let mut call = tonic::Request::new(pb::GenerateRequest {
                request_id: req.request_id.clone(),
                prompt: req.prompt.clone(),
                params: Some(cleave_proto::convert::sampling_to_wire(&req.params)),
                prefill_endpoint,
                resume: resume.to_vec(),
            });
            if let Ok(v) = req.request_id.parse() {
                call.metadata_mut().insert("x-request-id", v);
            }
            if let Some(Ok(v)) = req.traceparent.as_deref().map(str::parse) {
                call.metadata_mut().insert("traceparent", v);
            }
            // The call, then its first event: a worker that fails before that (unreachable,
            // stopping, its group just failed) has streamed nothing, so the request is placed
            // again.
            let opened = match client.generate(call).await {
                Ok(r) => {
                    let mut stream = r.into_inner();
                    match stream.next().await {
                        Some(Ok(first)) => Ok(Some((first, stream))),
                        Some(Err(s)) => Err(s),
                        None => Ok(None),
                    }
                }
                Err(s) => Err(s),
            };
            let (first, stream) = match opened {
                Ok(Some((first, stream))) => {
                    if aborted_before_any_token(&first) {
                        tracing::warn!(worker = %placement.decode, "request aborted before its first token: placing it again");
                        continue;
                    }
                    (first, stream)
                }
                Ok(None) => {
                    tracing::warn!(worker = %placement.decode, "decode worker ended the stream without an event: placing the request again");
                    continue;
                }
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
                    return Err(BackendError::BadRequest(s.message().to_string()))
                }
                Err(s) => {
                    tracing::warn!(worker = %placement.decode, error = %s.message(), "decode worker failed before its first event: placing the request again");
                    self.set_unhealthy(placement.decode);
                    continue;
                }
            };
            // The first event is the first token: the prefill is done.
            reservation.prefill_done();
            return Ok(Opened {
                stream: Box::pin(tokio_stream::once(Ok(first)).chain(stream)),
                reservation,
                decode: placement.decode,
            });
        }
        Err(BackendError::Unavailable(
            "no decode worker answered".into(),
        ))
    }
}

#[async_trait::async_trait]
impl Backend for Dispatcher {
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError> {
        let opened = self.inner.open(&req, &[]).await?;
        Ok(Box::pin(migrate::Migrating::new(
            self.inner.clone(),
            req,
            opened,
        )))
    }

    fn model_name(&self) -> &str {
        &self.inner.model
    }

    fn healthy_decode_workers(&self) -> usize {
        self.inner.cluster.placement().healthy_decode_workers()
    }
}

mod cluster;
mod migrate;

#[cfg(test)]
mod tests;
