//! One typed configuration for both worker roles: defined in [`cleave_config::worker`] (the
//! operator renders it without linking the worker).

pub use cleave_config::worker::*;

use cleave_config::kv_pool::{pool_blocks, KvPoolError, KvShape};
use cleave_engine::kv::memory::KvLayout;
use cleave_engine::model::Model;

/// The KV pool's block count for `model` (this rank's `layout`): `--kv-blocks`, else
/// `--kv-memory` over the whole model's block bytes, so every rank of a group agrees.
pub fn kv_pool_blocks(
    config: &WorkerConfig,
    model: &Model,
    layout: &KvLayout,
) -> Result<usize, KvPoolError> {
    let whole = KvLayout {
        n_kv_heads: model.config.n_kv_heads,
        ..*layout
    };
    let shape = KvShape {
        block_bytes: whole.block_bytes(),
        block_tokens: layout.block_size,
        context_tokens: model.config.context_length,
    };
    let blocks = pool_blocks(config.kv_blocks, config.kv_memory, shape)?;
    tracing::info!(
        blocks,
        tokens = blocks * layout.block_size,
        mib = (blocks * layout.block_bytes()) >> 20,
        kv_memory = %config.kv_memory,
        "KV pool of this process"
    );
    Ok(blocks)
}
