//! The `dispatch` hop: place a request (prefix index + policy + optimistic load), then open
//! its `Generate` stream on the chosen decode worker, naming the prefill worker when the policy
//! disaggregates. Tokens come back as [`BackendEvent`]s; dropping the stream cancels the
//! request on the workers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cleave_engine::kv::block_hashes;
use cleave_kv_index::{Matches, PrefixIndex, WorkerId};
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::api::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use crate::api::metrics::{PlacementLabels, PlacementMode, RouterMetrics};
use crate::place::{Charge, PlaceError, Placement, PlacementRequest, Policy, Role, WorkerView};

/// Token slots per KV block on the workers (the engine's default).
pub const BLOCK_SIZE: usize = cleave_engine::kv::DEFAULT_BLOCK_SIZE;

/// One known worker.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    /// Its id in the index and the load view.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC endpoint (`http://host:port`).
    pub endpoint: String,
    channel: Channel,
}

/// The placement state the dispatcher and the watchers share.
pub struct Cluster {
    /// Which worker caches which prefix blocks.
    pub index: Mutex<PrefixIndex>,
    /// Load, health and optimistic charges.
    pub view: Mutex<WorkerView>,
    workers: Mutex<BTreeMap<WorkerId, WorkerEntry>>,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            index: Mutex::new(PrefixIndex::default()),
            view: Mutex::new(WorkerView::new()),
            workers: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Cluster {
    /// How many leading blocks of `prompt` each worker caches (the router's block hashes
    /// looked up in the index).
    pub fn matches(&self, prompt: &[u32]) -> Matches {
        let hashes = block_hashes(prompt, BLOCK_SIZE, 0);
        self.index.lock().expect("index").find_matches(&hashes)
    }

    /// What a policy needs to place `prompt` with room for `max_tokens` of output.
    pub fn placement_request(&self, prompt: &[u32], max_tokens: usize) -> PlacementRequest {
        PlacementRequest {
            prompt_blocks: prompt.len().div_ceil(BLOCK_SIZE),
            decode_blocks: max_tokens.div_ceil(BLOCK_SIZE),
            matches: self.matches(prompt),
        }
    }

    /// Adds (or replaces) a worker; it takes part in placement once it is healthy.
    pub fn add(
        &self,
        id: WorkerId,
        role: Role,
        endpoint: &str,
    ) -> Result<(), tonic::transport::Error> {
        let channel = Endpoint::from_shared(endpoint.to_string())?
            .connect_timeout(std::time::Duration::from_secs(2))
            .connect_lazy();
        self.workers.lock().expect("workers").insert(
            id,
            WorkerEntry {
                id,
                role,
                endpoint: endpoint.to_string(),
                channel,
            },
        );
        self.index.lock().expect("index").add_worker(id);
        let mut view = self.view.lock().expect("view");
        view.upsert(id, role);
        view.set_healthy(id, false);
        Ok(())
    }

    /// Removes a worker and everything known about it.
    pub fn remove(&self, id: WorkerId) {
        self.workers.lock().expect("workers").remove(&id);
        self.index.lock().expect("index").remove_worker(id);
        self.view.lock().expect("view").remove(id);
    }

    /// A worker's entry.
    pub fn get(&self, id: WorkerId) -> Option<WorkerEntry> {
        self.workers.lock().expect("workers").get(&id).cloned()
    }

    /// Every worker.
    pub fn all(&self) -> Vec<WorkerEntry> {
        self.workers
            .lock()
            .expect("workers")
            .values()
            .cloned()
            .collect()
    }

    /// Whether any decode-capable worker is healthy.
    pub fn any_decode_ready(&self) -> bool {
        self.view
            .lock()
            .expect("view")
            .iter()
            .any(|w| w.healthy && w.role.can_decode())
    }
}

/// The dispatcher: a [`Backend`] over the cluster's workers.
pub struct Dispatcher {
    cluster: Arc<Cluster>,
    policy: Box<dyn Policy>,
    model: String,
    metrics: Option<Arc<RouterMetrics>>,
}

impl Dispatcher {
    /// A dispatcher placing with `policy` and serving `model`.
    pub fn new(cluster: Arc<Cluster>, policy: Box<dyn Policy>, model: String) -> Self {
        Dispatcher {
            cluster,
            policy,
            model,
            metrics: None,
        }
    }

    /// Counts placements in `cleave_router_placements_total{policy,mode}`.
    pub fn with_metrics(mut self, metrics: Arc<RouterMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn place(
        &self,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Result<(PlacementRequest, Placement), PlaceError> {
        let req = self.cluster.placement_request(prompt, max_tokens);
        let placement = self
            .policy
            .place(&req, &self.cluster.view.lock().expect("view"))?;
        Ok((req, placement))
    }
}

/// Releases the router's optimistic charge when the request's stream ends or is dropped.
struct ChargeGuard {
    cluster: Arc<Cluster>,
    charge: Option<Charge>,
}

impl Drop for ChargeGuard {
    fn drop(&mut self) {
        if let Some(c) = self.charge.take() {
            self.cluster.view.lock().expect("view").release(c);
        }
    }
}

fn finish_reason(s: &str) -> FinishReason {
    match s {
        "stop" => FinishReason::Stop,
        "length" => FinishReason::Length,
        "cancelled" => FinishReason::Cancelled,
        _ => FinishReason::Aborted,
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
            reason: finish_reason(&f.reason),
            prompt_tokens: f.prompt_tokens as usize,
            completion_tokens: f.completion_tokens as usize,
            cached_tokens: f.cached_tokens as usize,
            text: f.text,
        },
    })
}

/// Why a first event shows the request never started (`Finished` as aborted with no token).
fn aborted_before_any_token(ev: &pb::GenerateEvent) -> Option<&str> {
    match &ev.event {
        Some(pb::generate_event::Event::Finished(f))
            if f.completion_tokens == 0 && finish_reason(&f.reason) == FinishReason::Aborted =>
        {
            Some(&f.reason)
        }
        _ => None,
    }
}

#[async_trait::async_trait]
impl Backend for Dispatcher {
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError> {
        // Try the placement; a decode worker that cannot be reached is marked unhealthy and the
        // request is placed again (nothing has been streamed yet).
        for _attempt in 0..4 {
            let (preq, placement) = match self.place(&req.prompt, req.params.max_tokens) {
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
                .map(|p| p.endpoint)
                .unwrap_or_default();
            if let Some(m) = &self.metrics {
                let mode = if prefill_endpoint.is_empty() {
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
            let charge = self
                .cluster
                .view
                .lock()
                .expect("view")
                .charge(&preq, &placement);
            let guard = ChargeGuard {
                cluster: self.cluster.clone(),
                charge: Some(charge),
            };
            let mut client = DecodeWorkerClient::new(decode.channel.clone());
            let mut call = tonic::Request::new(pb::GenerateRequest {
                request_id: req.request_id.clone(),
                prompt: req.prompt.clone(),
                params: Some(cleave_proto::convert::sampling_to_wire(&req.params)),
                prefill_endpoint,
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
                    if let Some(reason) = aborted_before_any_token(&first) {
                        tracing::warn!(worker = %placement.decode, %reason, "request aborted before its first token: placing it again");
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
                    self.cluster
                        .view
                        .lock()
                        .expect("view")
                        .set_healthy(placement.decode, false);
                    continue;
                }
            };
            let stream = tokio_stream::once(Ok(first)).chain(stream);
            let out = stream.map(move |item| {
                let _keep = &guard;
                match item {
                    Ok(ev) => event(ev)
                        .unwrap_or(BackendEvent::Error("empty event from the worker".into())),
                    Err(s) => BackendEvent::Error(format!("decode worker failed: {}", s.message())),
                }
            });
            return Ok(Box::pin(out));
        }
        Err(BackendError::Unavailable(
            "no decode worker answered".into(),
        ))
    }

    fn model_name(&self) -> &str {
        &self.model
    }

    fn ready(&self) -> bool {
        self.cluster.any_decode_ready()
    }
}
