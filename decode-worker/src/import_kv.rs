//! Getting a parked sequence's prompt KV from a prefill worker: it writes straight into this
//! worker's blocks through the transport and answers with the first token. On error or timeout
//! the blocks are freed or reused for a local prefill — never decoded from half-written KV
//! (the sequence only joins the batch after the prefill worker confirmed every write).

use std::sync::Arc;
use std::time::Instant;

use cleave_engine::schedule::SeqId;
use cleave_proto::v1 as pb;
use cleave_proto::v1::prefill_worker_client::PrefillWorkerClient;

use cleave_worker::WorkerState;

use crate::channels::{BadEndpoint, Channels};
use cleave_worker::convert::kv;

/// What to ask the prefill worker for.
pub struct Job {
    pub id: SeqId,
    pub request_id: String,
    pub prompt: Vec<u32>,
    /// The sampling parameters as the router sent them.
    pub params: pb::SamplingParams,
    pub endpoint: String,
    pub traceparent: Option<String>,
    pub blocks: Vec<cleave_engine::kv::BlockId>,
    pub cached_tokens: usize,
}

/// Why a remote prefill failed (the sequence then falls back to a local prefill, or aborts).
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// The router named an endpoint that is not a URI.
    #[error("prefill {0}")]
    Endpoint(#[from] BadEndpoint),
    /// The prefill worker answered with an error (or could not be reached).
    #[error("prefill worker: {}", .0.message())]
    Call(#[from] tonic::Status),
    /// No answer in time (`--prefill-timeout`).
    #[error("prefill worker did not answer within {0:?}")]
    Timeout(std::time::Duration),
}

/// How a successful remote prefill went: compute and transfer-tail seconds as the prefill
/// worker measured them, and when the decode worker had the KV.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub compute_seconds: f64,
    pub transfer_seconds: f64,
    pub imported_at: Instant,
}

/// Runs the remote prefill and tells the engine how it went.
pub async fn run(
    state: Arc<WorkerState>,
    channels: Arc<Channels>,
    job: Job,
    timing: tokio::sync::oneshot::Sender<Timing>,
) {
    let started = Instant::now();
    let timeout = state.config.prefill_timeout;
    let result = tokio::time::timeout(timeout, call(&state, &channels, &job)).await;
    let outcome = result.unwrap_or(Err(PrefillError::Timeout(timeout)));
    match outcome {
        Ok(resp) => {
            state.metrics.disaggregated.inc();
            state.metrics.transfer_bytes.inc_by(resp.bytes_transferred);
            state
                .metrics
                .transfer_seconds
                .observe(resp.transfer_seconds);
            tracing::debug!(elapsed = ?started.elapsed(), bytes = resp.bytes_transferred, "kv imported");
            let logprob = resp
                .logprob
                .map(|logprob| cleave_text::sample::TokenLogprob {
                    token: resp.first_token,
                    logprob,
                    top: resp.top.iter().map(|t| (t.token, t.logprob)).collect(),
                });
            state.engine.kv_imported(job.id, resp.first_token, logprob);
            let _ = timing.send(Timing {
                compute_seconds: resp.compute_seconds,
                transfer_seconds: resp.transfer_seconds,
                imported_at: Instant::now(),
            });
        }
        Err(why) => {
            let fallback = state.config.local_fallback;
            tracing::warn!(request_id = ?job.request_id, %why, fallback, "remote prefill failed");
            if fallback {
                state.metrics.prefill_fallbacks.inc();
            }
            state.engine.kv_import_failed(job.id, fallback);
        }
    }
}

async fn call(
    state: &WorkerState,
    channels: &Channels,
    job: &Job,
) -> Result<pb::PrefillResponse, PrefillError> {
    let mut client = PrefillWorkerClient::new(channels.get(&job.endpoint)?);
    let bs = state.layout.block_size;
    let ranks = state
        .ranks
        .iter()
        .map(|r| pb::KvRankRegion {
            worker_address: Some(kv::address_to_wire(&r.address)),
            region: Some(kv::region_to_wire(&r.region)),
        })
        .collect();
    let req = pb::PrefillRequest {
        request_id: job.request_id.clone(),
        prompt: job.prompt.clone(),
        params: Some(job.params.clone()),
        destination: Some(pb::KvDestination {
            worker_address: Some(kv::address_to_wire(&state.transport.local_address())),
            region: Some(kv::region_to_wire(&state.region.descriptor())),
            blocks: job.blocks.iter().map(|b| b.0).collect(),
            block_bytes: state.layout.block_bytes() as u64,
            skip_blocks: (job.cached_tokens / bs) as u32,
            ranks,
        }),
    };
    let mut request = tonic::Request::new(req);
    if let Ok(v) = job.request_id.parse() {
        request.metadata_mut().insert("x-request-id", v);
    }
    if let Some(Ok(v)) = job.traceparent.as_deref().map(str::parse) {
        request.metadata_mut().insert("traceparent", v);
    }
    Ok(client.prefill(request).await?.into_inner())
}
