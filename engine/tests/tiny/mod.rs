//! Tiny random-weight checkpoints (written by `cleave_text::tiny`) and helpers to run a
//! model on the ranks of an in-process group.
#![allow(dead_code, unused_imports)]

use std::sync::Arc;

use cleave_engine::kv::memory::{KvCache, KvDtype};
use cleave_engine::kv::BlockId;
use cleave_engine::model::{Logits, Model, SeqChunk, Workspace};
pub use cleave_text::tiny::{Kind, VOCAB};
use cleave_types::collective::{Collective, LocalGroup};

/// Runs `f` on every rank of an in-process group of `world`; results in rank order.
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(Arc<dyn Collective>) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(Arc::new(c)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn cache_for(model: &Model, blocks: usize) -> KvCache {
    let layout = model.kv_layout(16, KvDtype::F32);
    KvCache::on_heap(layout, blocks)
}

/// Every position's logits for `tokens` in one prefill.
pub fn all_logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = cache_for(model, tokens.len().div_ceil(16));
    let blocks: Vec<BlockId> = (0..tokens.len().div_ceil(16) as u32).map(BlockId).collect();
    let mut ws = Workspace::new();
    let chunk = SeqChunk {
        tokens,
        start_pos: 0,
        blocks: &blocks,
        logits: Logits::All,
    };
    model.forward(&[chunk], &mut cache, &mut ws).unwrap();
    ws.logits.clone()
}

pub use cleave_engine::model::reference::greedy;

/// Largest absolute difference, and the largest absolute value of `want`.
pub fn max_diff(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "logit counts differ");
    let d = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    (d, want.iter().map(|v| v.abs()).fold(0.0, f32::max))
}

/// Writes a tiny checkpoint of `kind` into `dir`, weights stored as `dtype`.
pub fn write_model(
    dir: &std::path::Path,
    kind: Kind,
    dtype: cleave_text::safetensors::Dtype,
    seed: u64,
) {
    cleave_text::tiny::write_model(dir, kind, dtype, seed).expect("writing a tiny checkpoint");
}
