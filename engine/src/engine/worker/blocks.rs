//! The staged block copies (`Engine::read_blocks` / `write_blocks`), on the engine thread.

use crate::kv::memory::KvCache;
use crate::kv::BlockId;

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
