//! The decode role: `Generate` admits a request, gets its prompt KV (from a prefill worker or
//! computed here) and streams tokens from the continuous batch.

#![forbid(unsafe_code)]

mod channels;
mod import_kv;
mod session;

use std::pin::Pin;
use std::sync::Arc;

use cleave_engine::engine::{GenerateRequest, PrefillMode};
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use cleave_worker::{Role, RoleService, WorkerState};

use session::{DecodeSession, Step};

/// The gRPC service.
pub fn service(state: Arc<WorkerState>) -> DecodeWorkerServer<Decode> {
    DecodeWorkerServer::new(Decode {
        state: state.clone(),
        prefill: Arc::new(channels::Channels::new(state.internal_tls.clone())),
        calls: Default::default(),
    })
}

/// The decode role for the worker runtime ([`cleave_worker::run`], [`cleave_worker::main_for`]).
pub const SERVICE: RoleService = RoleService {
    role: Role::Decode,
    routes: |state| tonic::service::Routes::new(service(state)),
};

/// The decode worker's gRPC handler.
pub struct Decode {
    state: Arc<WorkerState>,
    /// Channels to prefill workers, shared by every request.
    prefill: Arc<channels::Channels>,
    /// `Generate` calls received (the `decode.generate_calls` fault point).
    calls: std::sync::atomic::AtomicU64,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for Decode {
    type GenerateStream = EventStream;
    type WatchStream = cleave_worker::watch::Stream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let arrival = std::time::Instant::now();
        let call = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        cleave_worker::fault::point("decode.generate_calls", call);
        let traceparent = cleave_worker::convert::traceparent(request.metadata());
        let req = request.into_inner();
        let params = cleave_worker::convert::sampling(req.params.clone())?;
        // A tensor-parallel group names every rank's region (cleave_worker::rank_kv).
        // A migrated request (resume tokens) is prefilled here: the prefill worker would sample
        // its next token without the output state the resumed tokens built.
        let remote = req
            .prefill_endpoint
            .as_deref()
            .is_some_and(|e| !e.is_empty())
            && req.resume.is_empty();
        let mode = if remote {
            PrefillMode::Import
        } else {
            PrefillMode::Local
        };
        let engine = self.state.engine.clone();
        let (id, mut rx) = engine
            .submit(GenerateRequest {
                prompt: req.prompt.clone(),
                params: params.clone(),
                mode,
                resume: req.resume.clone(),
            })
            .map_err(cleave_worker::convert::submit_error)?;
        let (tx, out) = tokio::sync::mpsc::channel(64);
        let state = self.state.clone();
        let prefill = self.prefill.clone();
        let span = tracing::info_span!(
            "decode",
            request_id = ?req.request_id,
            trace_id = %cleave_worker::convert::trace_id(traceparent.as_deref()),
            seq = id.0,
            remote
        );
        // Continue the router's trace; the prefill worker then continues this span.
        cleave_telemetry::set_parent(&span, traceparent.as_deref());
        let traceparent = cleave_telemetry::traceparent_of(&span).or(traceparent);
        // The worker owns the request's task (WorkerState::tasks); it ends with the stream.
        let mut session = DecodeSession::new(
            arrival,
            req.prompt.len(),
            self.state.config.local_prefill_below_tokens,
        );
        // The worker owns the request's task (WorkerState::tasks); it ends with the stream.
        self.state.tasks.spawn(tracing::Instrument::instrument(
            async move {
                let mut import: Option<tokio::task::JoinHandle<()>> = None;
                let mut streamed = 0u64;
                loop {
                    // A caller that goes away is noticed at once, also while nothing is sent
                    // (waiting for the prefill worker): the engine drops the sequence and the
                    // import below is aborted, which cancels the remote prefill.
                    let ev = tokio::select! {
                        ev = rx.recv() => match ev {
                            Some(ev) => ev,
                            None => break,
                        },
                        _ = tx.closed() => {
                            engine.cancel(id);
                            break;
                        }
                    };
                    match session.on_event(ev, std::time::Instant::now()) {
                        Step::PrefillHere => engine.kv_import_failed(id, true),
                        Step::Import {
                            blocks,
                            cached_tokens,
                        } => {
                            let job = import_kv::Job {
                                id,
                                request_id: req.request_id.clone(),
                                prompt: req.prompt.clone(),
                                // Forwarded as received (checked above), not re-encoded.
                                params: req.params.clone().unwrap_or_default(),
                                endpoint: req.prefill_endpoint.clone().unwrap_or_default(),
                                traceparent: traceparent.clone(),
                                blocks,
                                cached_tokens,
                            };
                            let (timing, timing_rx) = tokio::sync::oneshot::channel();
                            session.importing(timing_rx);
                            import = Some(state.tasks.spawn(import_kv::run(
                                state.clone(),
                                prefill.clone(),
                                job,
                                timing,
                            )));
                        }
                        Step::Send { event, token, done } => {
                            if let Some(e) = event {
                                if tx.send(Ok(e)).await.is_err() {
                                    // The caller went away: stop decoding (and the prefill,
                                    // below).
                                    engine.cancel(id);
                                    break;
                                }
                            }
                            if token {
                                streamed += 1;
                                cleave_worker::fault::point("decode.tokens_streamed", streamed);
                            }
                            if done {
                                break;
                            }
                        }
                    }
                }
                if let Some(j) = import {
                    j.abort();
                }
            },
            span,
        ));
        let stream: EventStream = Box::pin(tokio_stream::wrappers::ReceiverStream::new(out));
        Ok(Response::new(stream))
    }

    async fn watch(
        &self,
        _: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(cleave_worker::watch::response(&self.state))
    }
}
