//! The staged block copies (`Engine::read_blocks` / `write_blocks`) and the copies between the
//! pool and the KV tiers, on the engine thread.

use crate::kv::memory::KvCache;
use crate::kv::tiers::Move;
use crate::kv::BlockId;
use crate::schedule::Scheduler;

/// Runs the block copies the last `schedule` recorded (evicted blocks into the tiers, restored
/// ones back into the pool), in order, before the forward pass writes any block; then
/// announces the hashes that left every tier.
pub(super) fn run_moves(sched: &mut Scheduler, cache: &mut KvCache) {
    let moves = sched.pool.drain_moves();
    let Some(tiers) = sched.tiers.as_mut() else {
        return;
    };
    let bb = cache.layout().block_bytes();
    for m in moves {
        match m {
            Move::Out {
                block,
                hash,
                parent,
            } => {
                let b = block.0 as usize;
                let data = cache.region()[b * bb..(b + 1) * bb].to_vec();
                tiers.put(hash, parent, data);
            }
            Move::In { block, data } => {
                let b = block.0 as usize;
                cache.region_mut()[b * bb..(b + 1) * bb].copy_from_slice(&data);
            }
        }
    }
    let mut dropped = tiers.drain_dropped();
    dropped.retain(|h| !tiers.contains(*h));
    sched.pool.forget(dropped);
}

/// The bytes of `blocks` in order (blocks out of range are skipped).
pub(super) fn read(cache: &KvCache, blocks: &[BlockId]) -> Vec<u8> {
    let bb = cache.layout().block_bytes();
    let region = cache.region();
    let mut out = Vec::with_capacity(blocks.len() * bb);
    for b in blocks {
        let b = b.0 as usize;
        if b < cache.num_blocks() {
            out.extend_from_slice(&region[b * bb..(b + 1) * bb]);
        }
    }
    out
}

/// Writes one block's bytes per block; false (nothing written) if sizes or ids do not fit.
pub(super) fn write(cache: &mut KvCache, blocks: &[BlockId], data: &[u8]) -> bool {
    let bb = cache.layout().block_bytes();
    let n = cache.num_blocks();
    let ok = data.len() == blocks.len() * bb && blocks.iter().all(|b| (b.0 as usize) < n);
    if ok {
        let region = cache.region_mut();
        for (b, chunk) in blocks.iter().zip(data.chunks_exact(bb)) {
            let b = b.0 as usize;
            region[b * bb..(b + 1) * bb].copy_from_slice(chunk);
        }
    }
    ok
}
