//! Keeping the prefix index and the load view current: one task per worker follows its
//! `Watch` stream (a snapshot of its cached blocks, then KV events and load). A sequence gap or
//! a broken stream marks the worker unhealthy and reconnects, which resyncs from a new snapshot.

use std::sync::Arc;
use std::time::Duration;

use cleave_kv_index::WorkerId;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_proto::v1::prefill_worker_client::PrefillWorkerClient;
use cleave_types::kv::{BlockHash, KvEvent, KvEventRecord};
use tokio_util::sync::CancellationToken;

use crate::dispatch::Cluster;
use crate::place::{Load, Role};

fn record(e: pb::KvEvent) -> Option<KvEventRecord> {
    use pb::kv_event::Kind;
    let event = match e.kind? {
        Kind::Stored(s) => KvEvent::Stored {
            parent: s.parent.map(BlockHash),
            blocks: s.blocks.into_iter().map(BlockHash).collect(),
        },
        Kind::Removed(r) => KvEvent::Removed {
            hashes: r.hashes.into_iter().map(BlockHash).collect(),
        },
        Kind::Cleared(_) => KvEvent::Cleared,
    };
    Some(KvEventRecord { id: e.id, event })
}

fn load(role: Role, l: &pb::Load) -> Load {
    let used = l.kv_blocks_used as u64;
    Load {
        prefill_blocks: if role == Role::Prefill { used } else { 0 },
        decode_blocks: if role == Role::Prefill { 0 } else { used },
        queue_depth: (l.queue_depth + l.running) as u64,
        kv_capacity_blocks: l.kv_blocks_total as u64,
    }
}

/// Follows one worker until `shutdown`.
pub async fn follow(cluster: Arc<Cluster>, id: WorkerId, shutdown: CancellationToken) {
    let placement = cluster.placement();
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(entry) = cluster.get(id) else { return };
        let stream = match entry.role {
            // The worker's channel (plain or mutual TLS), shared with the requests.
            Role::Prefill => PrefillWorkerClient::new(entry.channel.clone())
                .watch(pb::WatchRequest {})
                .await
                .map(|r| r.into_inner()),
            _ => DecodeWorkerClient::new(entry.channel.clone())
                .watch(pb::WatchRequest {})
                .await
                .map(|r| r.into_inner()),
        };
        if let Ok(mut stream) = stream {
            let mut first = true;
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = stream.message() => m,
                };
                let Ok(Some(update)) = msg else { break };
                if first {
                    placement.with_index(|index| {
                        index.apply_snapshot(
                            id,
                            update.snapshot.iter().copied().map(BlockHash),
                            Some(update.next_event_id),
                        )
                    });
                    placement.set_healthy(id, true);
                    tracing::info!(worker = %id, endpoint = %entry.endpoint, "worker healthy");
                    backoff = Duration::from_millis(100);
                    first = false;
                }
                // The first event that does not follow its predecessor is a gap.
                let gap = placement.with_index(|index| {
                    update
                        .events
                        .into_iter()
                        .filter_map(record)
                        .any(|r| index.apply(id, &r).is_err())
                });
                if let Some(l) = &update.load {
                    placement.with_view(|view| view.report(id, load(entry.role, l)));
                }
                if gap {
                    tracing::warn!(worker = %id, "KV event gap: resyncing");
                    break;
                }
            }
        }
        placement.set_healthy(id, false);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
