//! Computing a prompt in export mode and writing each finished block into the decode worker's
//! region through the transport while later chunks still compute.

use std::sync::Arc;
use std::time::Instant;

use cleave_engine::engine::{GenerateRequest, PrefillMode, SeqEvent};
use cleave_engine::schedule::SeqId;
use cleave_kv_transfer::{RegionDescriptor, WorkerAddress, WriteOp};
use cleave_proto::v1 as pb;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use cleave_worker::convert::kv;
use cleave_worker::rank_kv::{RankRegion, Relay};
use cleave_worker::WorkerState;

/// Cancels the sequence and its transfers unless disarmed (the request finished normally).
struct Guard<'a> {
    state: &'a WorkerState,
    id: SeqId,
    cancel: CancellationToken,
    armed: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.cancel.cancel();
            self.state.engine.cancel(self.id);
            if self.state.group_size > 1 {
                // The followers' writes for this request stop too.
                let engine = self.state.engine.clone();
                let msg = Relay::Cancel { key: self.id.0 }.encode();
                self.state
                    .tasks
                    .spawn(async move { engine.group_relay(msg, false).await });
            }
        }
    }
}

/// Every decode rank's region, indexed by rank; the decode group must be as large as ours.
#[allow(clippy::result_large_err)] // tonic's Status is the handler's error type
fn targets(
    dest: &pb::KvDestination,
    rank0: &RankRegion,
    group_size: usize,
) -> Result<Vec<RankRegion>, Status> {
    let decode_size = dest.ranks.len() + 1;
    if decode_size != group_size {
        return Err(bad(&format!(
            "the decode worker is a group of {decode_size} rank(s) and this prefill worker of \
             {group_size}: rank-to-rank KV transfer needs both groups to have the same \
             tensor-parallel size (--tp)"
        )));
    }
    let mut all = vec![rank0.clone()];
    for (i, r) in dest.ranks.iter().enumerate() {
        all.push(RankRegion {
            address: kv::address_from_wire(
                r.worker_address.as_ref(),
                &format!("destination.ranks[{i}].worker_address"),
            )
            .map_err(|e| bad(&e.to_string()))?,
            region: kv::region_from_wire(
                r.region.as_ref(),
                &format!("destination.ranks[{i}].region"),
            )
            .map_err(|e| bad(&e.to_string()))?,
        });
    }
    Ok(all)
}

fn bad(what: &str) -> Status {
    cleave_worker::convert::invalid_argument(what)
}

/// The request's destination, checked against this worker: the decode worker's blocks must be
/// the size of ours and enough for the prompt, its address and region well formed.
#[allow(clippy::result_large_err)] // tonic's Status is the handler's error type
fn destination(
    state: &WorkerState,
    req: &pb::PrefillRequest,
) -> Result<(pb::KvDestination, WorkerAddress, RegionDescriptor), Status> {
    let dest = req
        .destination
        .clone()
        .ok_or_else(|| bad("destination is required"))?;
    let bb = state.layout.block_bytes();
    if dest.block_bytes != bb as u64 {
        return Err(bad(&format!(
            "destination blocks are {} bytes but this worker's are {bb}: the workers must load the same model with the same KV dtype",
            dest.block_bytes
        )));
    }
    if dest.blocks.len() < req.prompt.len().div_ceil(state.layout.block_size) {
        return Err(bad("destination has fewer blocks than the prompt needs"));
    }
    let peer = kv::address_from_wire(dest.worker_address.as_ref(), "destination.worker_address")
        .map_err(|e| bad(&e.to_string()))?;
    let remote = kv::region_from_wire(dest.region.as_ref(), "destination.region")
        .map_err(|e| bad(&e.to_string()))?;
    Ok((dest, peer, remote))
}

/// Waits for every write of this request (and, in a group, every follower's) to be confirmed
/// by the decode side: the bytes sent, or why the KV is not there.
async fn confirm_writes(
    state: &WorkerState,
    id: SeqId,
    mut writes: JoinSet<Result<u64, cleave_kv_transfer::Error>>,
) -> Result<u64, Status> {
    let mut bytes = 0;
    while let Some(r) = writes.join_next().await {
        match r {
            Ok(Ok(n)) => bytes += n,
            Ok(Err(e)) => {
                return Err(Status::unavailable(format!(
                    "writing KV to the decode worker: {e}"
                )))
            }
            Err(e) => return Err(Status::internal(format!("transfer task: {e}"))),
        }
    }
    if state.group_size > 1 {
        // Every follower's writes must be confirmed too before the decode side may read.
        let failed = state
            .engine
            .group_relay(Relay::Finish { key: id.0 }.encode(), true)
            .await
            .map_err(|e| Status::unavailable(format!("worker group: {e}")))?;
        if failed != 0.0 {
            return Err(Status::unavailable(format!(
                "writing KV to the decode worker: {failed} rank(s) of this prefill group failed"
            )));
        }
    }
    Ok(bytes)
}

/// Runs one prefill request to completion.
pub async fn run(
    state: Arc<WorkerState>,
    req: pb::PrefillRequest,
) -> Result<pb::PrefillResponse, Status> {
    let (dest, peer, remote) = destination(&state, &req)?;
    let bb = state.layout.block_bytes();
    let targets = Arc::new(targets(
        &dest,
        &RankRegion {
            address: peer.clone(),
            region: remote.clone(),
        },
        state.group_size,
    )?);
    let mut params = cleave_worker::convert::sampling(req.params)?;
    params.max_tokens = 1;
    let started = Instant::now();
    let (id, mut rx) = state
        .engine
        .submit(GenerateRequest {
            prompt: req.prompt,
            params,
            mode: PrefillMode::Export,
            resume: Vec::new(),
        })
        .map_err(cleave_worker::convert::submit_error)?;
    let cancel = CancellationToken::new();
    let mut guard = Guard {
        state: &state,
        id,
        cancel: cancel.clone(),
        armed: true,
    };
    let skip = dest.skip_blocks as usize;
    let peer = Arc::new(peer);
    let remote = Arc::new(remote);
    let mut writes: JoinSet<Result<u64, cleave_kv_transfer::Error>> = JoinSet::new();
    let (mut first, mut lease, mut compute_done) = (None, None, None);
    let mut cached_tokens = 0;
    let mut sent_blocks = 0u64;
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::KvReady { blocks } => {
                let ops: Vec<WriteOp> = blocks
                    .iter()
                    .filter(|(i, _)| *i >= skip)
                    .map(|&(i, b)| WriteOp {
                        local_offset: b.0 as usize * bb,
                        remote_offset: dest.blocks[i] as usize * bb,
                        len: bb,
                    })
                    .collect();
                if ops.is_empty() {
                    continue;
                }
                sent_blocks += ops.len() as u64;
                if state.group_size > 1 {
                    // Each follower writes its own heads of the same blocks to its decode rank.
                    let msg = Relay::Write {
                        key: id.0,
                        targets: targets.to_vec(),
                        blocks: blocks
                            .iter()
                            .filter(|(i, _)| *i >= skip)
                            .map(|&(i, b)| (b.0, dest.blocks[i]))
                            .collect(),
                    };
                    state
                        .engine
                        .group_relay(msg.encode(), false)
                        .await
                        .map_err(|e| Status::unavailable(format!("worker group: {e}")))?;
                }
                let (t, peer, remote, local, c) = (
                    state.transport.clone(),
                    peer.clone(),
                    remote.clone(),
                    state.region.clone(),
                    cancel.child_token(),
                );
                writes.spawn(async move {
                    t.write(&peer, &remote, &ops, &local, c)
                        .await
                        .map(|s| s.bytes)
                });
                cleave_worker::fault::point("prefill.kv_blocks_sent", sent_blocks);
            }
            SeqEvent::Token { id, logprob, .. } => first = Some((id, logprob)),
            SeqEvent::Held(l) => lease = Some(l),
            SeqEvent::Done { usage, .. } => {
                cached_tokens = usage.cached_tokens;
                compute_done = Some(started.elapsed());
                break;
            }
            SeqEvent::KvNeeded { .. } => {}
        }
    }
    let compute = compute_done.ok_or_else(|| Status::unavailable("the engine stopped"))?;
    let transfer_start = Instant::now();
    let bytes = confirm_writes(&state, id, writes).await?;
    // Every block is at the decode worker: ours can go back to the pool (cached).
    drop(lease);
    guard.armed = false;
    let (token, lp) = first.ok_or_else(|| Status::unavailable("the prefill produced no token"))?;
    let (logprob, top) = cleave_worker::convert::logprob(lp);
    state.metrics.transfer_bytes.inc_by(bytes);
    // Transfers overlap the compute; this is what remained after the last chunk.
    let transfer = transfer_start.elapsed().as_secs_f64();
    state.metrics.transfer_seconds.observe(transfer);
    Ok(pb::PrefillResponse {
        first_token: token,
        logprob,
        top,
        bytes_transferred: bytes,
        compute_seconds: compute.as_secs_f64(),
        transfer_seconds: transfer,
        cached_tokens: cached_tokens as u32,
    })
}
