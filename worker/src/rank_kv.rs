//! Rank-to-rank KV transfer between tensor-parallel groups (disaggregated P/D with `--tp > 1`).
//!
//! Every rank allocates its KV pool from the transport, and at startup the ranks of a group
//! exchange their transport addresses and region descriptors ([`exchange`]), so the decode
//! leader can name every rank's region in `PrefillRequest`. On the prefill side the leader
//! relays ([`cleave_engine::engine::Engine::group_relay`]) each batch of finished blocks to its
//! followers ([`Relay::Write`]); each follower writes its own heads' blocks into the matching
//! decode rank's region, and before the prefill answers, [`Relay::Finish`] waits for every
//! follower's writes (an all-reduce of their statuses).

use std::collections::HashMap;
use std::sync::Arc;

use cleave_kv_transfer::{RegionDescriptor, RegionHandle, Transport, WorkerAddress, WriteOp};
use cleave_types::collective::Collective;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// How peers reach one rank's KV region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRegion {
    /// The rank's transport.
    pub address: WorkerAddress,
    /// The rank's KV region.
    pub region: RegionDescriptor,
}

/// Every rank's [`RankRegion`], indexed by rank: rank r broadcasts its own in turn. All ranks
/// of a group call this once, after allocating their region and before the engine starts.
pub fn exchange(
    group: &dyn Collective,
    mine: &RankRegion,
) -> Result<Vec<RankRegion>, crate::WorkerError> {
    use crate::WorkerError;
    let mut all = Vec::with_capacity(group.world());
    for root in 0..group.world() {
        let mut buf = if root == group.rank() {
            serde_json::to_vec(mine).map_err(|source| WorkerError::Descriptor { root, source })?
        } else {
            Vec::new()
        };
        group
            .broadcast(root, &mut buf)
            .map_err(|source| WorkerError::Exchange { root, source })?;
        let r: RankRegion = serde_json::from_slice(&buf)
            .map_err(|source| WorkerError::Descriptor { root, source })?;
        all.push(r);
    }
    Ok(all)
}

/// What the prefill leader relays to its followers (JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Relay {
    /// Write these `(local block, remote block)` pairs of request `key` into `targets[rank]`.
    Write {
        key: u64,
        targets: Vec<RankRegion>,
        blocks: Vec<(u32, u32)>,
    },
    /// Wait for request `key`'s writes; the status is 0 when all succeeded.
    Finish { key: u64 },
    /// Request `key` was abandoned: cancel its writes.
    Cancel { key: u64 },
}

impl Relay {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("relay messages serialize")
    }
}

/// Why a follower's write of its heads failed.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    /// The leader's message names fewer decode ranks than this follower's rank.
    #[error("no KV target for rank {rank} of {ranks}")]
    NoTarget { rank: usize, ranks: usize },
    /// The transfer failed.
    #[error(transparent)]
    Transfer(#[from] cleave_kv_transfer::Error),
    /// The write's task panicked or was cancelled.
    #[error("write task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// One request's writes on a follower: their cancellation and their tasks.
type Pending = (
    CancellationToken,
    Vec<tokio::task::JoinHandle<Result<(), WriteError>>>,
);

/// A follower's handler of [`Relay`] messages.
pub struct FollowerRelay {
    rank: usize,
    transport: Arc<dyn Transport>,
    local: RegionHandle,
    block_bytes: usize,
    rt: tokio::runtime::Handle,
    pending: HashMap<u64, Pending>,
}

impl FollowerRelay {
    /// The handler of rank `rank`, writing from `local` (its KV region).
    pub fn new(
        rank: usize,
        transport: Arc<dyn Transport>,
        local: RegionHandle,
        block_bytes: usize,
        rt: tokio::runtime::Handle,
    ) -> Self {
        FollowerRelay {
            rank,
            transport,
            local,
            block_bytes,
            rt,
            pending: HashMap::new(),
        }
    }

    /// Handles one message; returns this rank's status (0 = ok). Runs on the follower's
    /// (blocking) thread.
    pub fn handle(&mut self, payload: &[u8]) -> f32 {
        let msg: Relay = match serde_json::from_slice(payload) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "bad relay message from the leader");
                return 1.0;
            }
        };
        match msg {
            Relay::Write {
                key,
                targets,
                blocks,
            } => {
                let entry = self.pending.entry(key).or_default();
                let Some(target) = targets.get(self.rank).cloned() else {
                    // Reported by `Finish`.
                    let why = WriteError::NoTarget {
                        rank: self.rank,
                        ranks: targets.len(),
                    };
                    entry.1.push(self.rt.spawn(async move { Err(why) }));
                    return 1.0;
                };
                let bb = self.block_bytes;
                let ops: Vec<WriteOp> = blocks
                    .iter()
                    .map(|&(l, r)| WriteOp {
                        local_offset: l as usize * bb,
                        remote_offset: r as usize * bb,
                        len: bb,
                    })
                    .collect();
                let (t, local, cancel) = (
                    self.transport.clone(),
                    self.local.clone(),
                    entry.0.child_token(),
                );
                entry.1.push(self.rt.spawn(async move {
                    t.write(&target.address, &target.region, &ops, &local, cancel)
                        .await?;
                    Ok(())
                }));
                0.0
            }
            Relay::Finish { key } => {
                let Some((_, writes)) = self.pending.remove(&key) else {
                    return 0.0;
                };
                let rank = self.rank;
                self.rt.block_on(async move {
                    let mut status = 0.0;
                    for w in writes {
                        let r = w.await.map_err(WriteError::from).and_then(|r| r);
                        if let Err(e) = r {
                            tracing::warn!(rank, key, error = %e, "writing KV to the decode rank failed");
                            status = 1.0;
                        }
                    }
                    status
                })
            }
            Relay::Cancel { key } => {
                self.fail(key);
                0.0
            }
        }
    }

    fn fail(&mut self, key: u64) {
        if let Some((cancel, _)) = self.pending.remove(&key) {
            cancel.cancel();
        }
    }
}
