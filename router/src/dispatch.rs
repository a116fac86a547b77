//! The `dispatch` hop: place a request (prefix index + policy + optimistic load), then open
//! its `Generate` stream on the chosen decode worker, naming the prefill worker when the policy
//! disaggregates. Tokens come back as [`BackendEvent`]s; dropping the stream cancels the
//! request on the workers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_kv_index::{BlockHash, Matches, PrefixIndex, WorkerId};
use cleave_proto::convert::finish_from_wire;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_types::kv::block_hashes;
use tokio_stream::StreamExt;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;

use crate::api::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use crate::api::metrics::{PlacementLabels, PlacementMode, RouterMetrics};
use crate::place::{
    Charge, InFlight, PlaceError, Placement, PlacementRequest, Policy, PolicyKind, Role, Ticket,
    WorkerView,
};

/// Token slots per KV block on the workers (the engine's default).
pub const BLOCK_SIZE: usize = cleave_types::kv::DEFAULT_BLOCK_SIZE;

/// Matches buffers kept for reuse ([`Cluster::prepare`]); more requests placed at once allocate.
const SPARE_MATCHES: usize = 16;

/// One known worker.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    /// Its id in the index and the load view.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC endpoint (`http://host:port`).
    pub endpoint: String,
    pub(crate) channel: Channel,
}

/// The placement state the dispatcher and the watchers share.
///
/// Lock order: `index` before the in-flight overlay; `view` is never held with either.
pub struct Cluster {
    /// Which worker caches which prefix blocks.
    pub index: Mutex<PrefixIndex>,
    /// Load, health and optimistic charges.
    pub view: Mutex<WorkerView>,
    workers: Mutex<BTreeMap<WorkerId, WorkerEntry>>,
    /// Blocks of placed prompts whose KV events have not arrived (`None`: the policy reads the
    /// index alone).
    in_flight: Option<Mutex<InFlight>>,
    /// Matches buffers of finished placements, reused by the next lookups.
    spare: Mutex<Vec<Matches>>,
    /// The overlay's clock starts here.
    epoch: Instant,
    /// Mutual TLS on the channels to the workers (`--internal-tls-*`).
    tls: Option<cleave_tls::Mutual>,
    /// The router's background tasks (worker watches, discovery, KV-event feeds, reloads):
    /// owned here, so shutdown can wait for them ([`Cluster::finish_tasks`]).
    tasks: TaskTracker,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            index: Mutex::new(PrefixIndex::default()),
            view: Mutex::new(WorkerView::new()),
            workers: Mutex::new(BTreeMap::new()),
            in_flight: None,
            spare: Mutex::new(Vec::new()),
            epoch: Instant::now(),
            tls: None,
            tasks: TaskTracker::new(),
        }
    }
}

/// A request ready for a policy: its [`PlacementRequest`], and the block hashes the in-flight
/// overlay records once it is placed ([`Cluster::reserve`]).
#[derive(Debug)]
pub struct Prepared {
    /// What the policy reads.
    pub req: PlacementRequest,
    hashes: Vec<BlockHash>,
}

impl Cluster {
    /// The state a router placing with `policy` needs: with the in-flight overlay when the
    /// policy reads it ([`PolicyKind::matches_in_flight`]).
    pub fn for_policy(policy: PolicyKind) -> Self {
        let c = Cluster::default();
        if policy.matches_in_flight() {
            c.with_in_flight(InFlight::default())
        } else {
            c
        }
    }

    /// Extends every lookup over `overlay` (the blocks of placements whose KV events have not
    /// arrived yet; [`crate::place::in_flight`]).
    pub fn with_in_flight(mut self, overlay: InFlight) -> Self {
        self.in_flight = Some(Mutex::new(overlay));
        self
    }

    /// Opens the channels to workers added from now on over mutual TLS with `tls`.
    pub fn with_internal_tls(mut self, tls: Option<cleave_tls::Mutual>) -> Self {
        self.tls = tls;
        self
    }

    /// Runs `task` as one of the router's own tasks (a background task, or a request's relay);
    /// it must end when the router's shutdown token is cancelled or its request ends.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// The router's tasks still running (background ones and requests' relays).
    pub fn background_tasks(&self) -> usize {
        self.tasks.len()
    }

    /// After shutdown was signalled: waits up to `patience` for the router's tasks to end
    /// ([`cleave_telemetry::finish_tasks`]).
    pub async fn finish_tasks(&self, patience: Duration) {
        cleave_telemetry::finish_tasks(&self.tasks, patience).await;
    }

    /// Whether every placement's load charge has been given back (no worker carries any).
    pub fn no_load_charged(&self) -> bool {
        let view = self.view.lock().expect("view");
        let settled = view.iter().all(|w| w.inflight == Default::default());
        settled
    }

    /// In-flight placements whose blocks count in lookups (0 without the overlay).
    pub fn in_flight_len(&self) -> usize {
        self.in_flight
            .as_ref()
            .map_or(0, |o| o.lock().expect("in-flight").len())
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// How many leading blocks of `prompt` each worker caches (the router's block hashes
    /// looked up in the index, with the in-flight overlay when there is one).
    pub fn matches(&self, prompt: &[u32]) -> Matches {
        self.prepare(prompt, 0).req.matches
    }

    /// What a policy needs to place `prompt` with room for `max_tokens` of output.
    pub fn placement_request(&self, prompt: &[u32], max_tokens: usize) -> PlacementRequest {
        self.prepare(prompt, max_tokens).req
    }

    /// [`Self::placement_request`], keeping what [`Self::reserve`] needs.
    pub fn prepare(&self, prompt: &[u32], max_tokens: usize) -> Prepared {
        self.prepare_blocks(
            prompt,
            prompt.len().div_ceil(BLOCK_SIZE),
            max_tokens.div_ceil(BLOCK_SIZE),
        )
    }

    /// A request whose prefix is `prompt` and that occupies `prompt_blocks` and
    /// `decode_blocks` (callers that count several prompts of one request). An empty `prompt`
    /// has no matches at all.
    pub fn prepare_blocks(
        &self,
        prompt: &[u32],
        prompt_blocks: usize,
        decode_blocks: usize,
    ) -> Prepared {
        let mut matches = self
            .spare
            .lock()
            .expect("spare matches")
            .pop()
            .unwrap_or_default();
        let hashes = if prompt.is_empty() {
            matches = Matches::default();
            Vec::new()
        } else {
            let hashes = block_hashes(prompt, BLOCK_SIZE, 0);
            let index = self.index.lock().expect("index");
            index.find_matches_into(&hashes, &mut matches);
            if let Some(o) = &self.in_flight {
                let mut o = o.lock().expect("in-flight");
                o.expire(self.now(), &index);
                o.extend(&index, &hashes, &mut matches);
            }
            hashes
        };
        Prepared {
            req: PlacementRequest {
                prompt_blocks,
                decode_blocks,
                matches,
            },
            hashes,
        }
    }

    /// Gives a lookup's buffer back for reuse.
    pub fn recycle(&self, matches: Matches) {
        let mut spare = self.spare.lock().expect("spare matches");
        if spare.len() < SPARE_MATCHES {
            spare.push(matches);
        }
    }

    /// Counts `placement` of `prepared` now: the optimistic load charge, and the prompt's blocks
    /// as in flight on the decode worker (where its KV will live). Dropping the reservation
    /// gives both back ([`Reservation`]).
    pub fn reserve(self: &Arc<Self>, prepared: Prepared, placement: &Placement) -> Reservation {
        let charge = self
            .view
            .lock()
            .expect("view")
            .charge(&prepared.req, placement);
        let ticket = self.in_flight.as_ref().and_then(|o| {
            (!prepared.hashes.is_empty()).then(|| {
                o.lock()
                    .expect("in-flight")
                    .add(placement.decode, prepared.hashes, self.now())
            })
        });
        self.recycle(prepared.req.matches);
        Reservation {
            cluster: self.clone(),
            charge: Some(charge),
            ticket,
        }
    }

    /// Adds (or replaces) a worker; it takes part in placement once it is healthy.
    pub fn add(&self, id: WorkerId, role: Role, endpoint: &str) -> Result<(), BadEndpoint> {
        let channel = cleave_tls::grpc_endpoint(endpoint, self.tls.as_ref())
            .map_err(|source| BadEndpoint {
                endpoint: endpoint.to_string(),
                source,
            })?
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
        if let Some(o) = &self.in_flight {
            o.lock().expect("in-flight").remove_worker(id);
        }
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

    /// How many decode-capable workers are healthy.
    pub fn healthy_decode_workers(&self) -> usize {
        self.view
            .lock()
            .expect("view")
            .iter()
            .filter(|w| w.healthy && w.role.can_decode())
            .count()
    }
}

/// What [`Cluster::reserve`] counted for one placed request: the optimistic load charge and the
/// in-flight overlay ticket. [`Reservation::prefill_done`] at the first token; dropping it (the
/// stream ended or was dropped) releases the charge and, before the first token, the ticket
/// (after it, the ticket waits for the worker's KV events).
pub struct Reservation {
    cluster: Arc<Cluster>,
    charge: Option<Charge>,
    ticket: Option<Ticket>,
}

impl Reservation {
    /// The request's prefill is done (its first token came).
    pub fn prefill_done(&mut self) {
        if let Some(c) = &mut self.charge {
            self.cluster.view.lock().expect("view").prefill_done(c);
        }
        if let (Some(o), Some(t)) = (&self.cluster.in_flight, &self.ticket) {
            o.lock()
                .expect("in-flight")
                .prefill_done(t, self.cluster.now());
        }
    }

    /// The worker said it had `cached_tokens` of the prompt cached (its usage, reported when the
    /// request finished): corrects the recent prefill work the charge added, from what the
    /// index expected to what the worker computed ([`crate::place::WorkerView::prefill_measured`]).
    /// Call it only for a request whose prefill ran (a token came).
    pub fn prefill_measured(&mut self, cached_tokens: usize) {
        if let Some(c) = &mut self.charge {
            self.cluster
                .view
                .lock()
                .expect("view")
                .prefill_measured(c, (cached_tokens / BLOCK_SIZE) as u64);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(c) = self.charge.take() {
            self.cluster.view.lock().expect("view").release(c);
        }
        if let (Some(o), Some(t)) = (&self.cluster.in_flight, self.ticket.take()) {
            o.lock().expect("in-flight").release(t);
        }
    }
}

/// Migrations per request by default: how many times a stream whose decode worker failed
/// mid-stream is moved to another one.
pub use cleave_config::router::DEFAULT_MIGRATION_LIMIT;

/// A worker endpoint the router cannot make a channel to (not a URI, or TLS settings it
/// cannot take).
#[derive(Debug, thiserror::Error)]
#[error("worker endpoint {endpoint:?}: {source}")]
pub struct BadEndpoint {
    /// The endpoint as configured or discovered.
    pub endpoint: String,
    /// Why no channel could be made.
    #[source]
    pub source: tonic::transport::Error,
}

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
        let prepared = self.cluster.prepare(prompt, max_tokens);
        let mut placement = self
            .policy
            .place(&prepared.req, &self.cluster.view.lock().expect("view"))?;
        if resumed {
            placement.prefill = None;
        }
        Ok((placement, self.cluster.reserve(prepared, &placement)))
    }

    /// Marks a decode worker unhealthy: it is not placed on until discovery says otherwise.
    pub(crate) fn set_unhealthy(&self, id: WorkerId) {
        self.cluster
            .view
            .lock()
            .expect("view")
            .set_healthy(id, false);
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
        self.inner.cluster.healthy_decode_workers()
    }
}

mod migrate;

#[cfg(test)]
mod tests;
