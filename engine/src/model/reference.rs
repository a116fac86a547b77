//! Unbatched greedy decoding straight through [`Model::forward`]: the reference that the
//! engine (batching, chunked prefill, prefix cache) and worker groups are checked against.

use std::sync::Arc;

use crate::kernels::Threads;
use crate::kv::memory::{KvCache, KvDtype};
use crate::kv::BlockId;
use cleave_text::gguf::GgufFile;
use cleave_text::sample::argmax;
use cleave_types::collective::{Collective, LocalGroup};

use super::{Logits, Model, SeqChunk, Workspace};

/// Greedy decoding: prefill `prompt`, then `n` one-token steps through an f32 KV cache. Returns
/// the generated tokens and the logits each was picked from.
pub fn greedy(model: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    greedy_kv(model, prompt, n, KvDtype::F32)
}

/// [`greedy`] through a KV cache of `dtype`.
pub fn greedy_kv(
    model: &Model,
    prompt: &[u32],
    n: usize,
    dtype: KvDtype,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let nb = (prompt.len() + n).div_ceil(16);
    let mut cache = KvCache::on_heap(model.kv_layout(16, dtype), nb);
    let blocks: Vec<BlockId> = (0..nb as u32).map(BlockId).collect();
    let mut ws = Workspace::new();
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    let mut seq = prompt.to_vec();
    let mut start = 0;
    while out.len() < n {
        let chunk = SeqChunk {
            tokens: &seq[start..],
            start_pos: start,
            blocks: &blocks,
            logits: Logits::Last,
        };
        model
            .forward(&[chunk], &mut cache, &mut ws)
            .expect("a forward pass of the reference");
        let next = argmax(&ws.logits);
        rows.push(ws.logits.clone());
        start = seq.len();
        seq.push(next);
        out.push(next);
    }
    (out, rows)
}

/// [`greedy`] with the model of `g` split over `world` ranks of an in-process group (threads
/// over [`LocalGroup`]) and its KV cache in `dtype`: what a tensor-parallel worker group of that
/// size and KV type must generate exactly. Panics if the file does not load or the ranks
/// disagree.
pub fn greedy_split(
    g: &GgufFile,
    world: usize,
    prompt: &[u32],
    n: usize,
    dtype: KvDtype,
) -> Vec<u32> {
    let outs: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let m = Model::load(g, c, Threads::single()).expect("loading a rank");
                    greedy_kv(&m, prompt, n, dtype).0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outs.iter().all(|o| *o == outs[0]), "ranks disagree");
    outs[0].clone()
}
