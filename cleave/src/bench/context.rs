//! The long-context and memory-bound parts of `cleave bench engine`: prefill speed and decode
//! inter-token latency after prompts of given lengths, this machine's read bandwidth, and the
//! decode speed it allows (weight bytes read per token ÷ bandwidth).

use std::time::Instant;

use anyhow::Context;
use cleave_engine::engine::Engine;
use cleave_engine::load::Loaded;
use cleave_text::gguf::GgufFile;
use serde::{Deserialize, Serialize};

use super::{prompt, run_batch};

/// One context length's measurements.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ContextRow {
    /// Prompt tokens.
    pub context: usize,
    /// Prompt tokens per second of time to first token.
    pub prefill_tok_s: f64,
    /// Mean time per generated token after the first, batch 1 (ms).
    pub itl_ms: f64,
}

/// Prefill and decode of one sequence at each of `contexts` prompt tokens (best of `repeat`).
pub(super) fn measure(
    engine: &Engine,
    loaded: &Loaded,
    contexts: &[usize],
    gen: usize,
    repeat: usize,
) -> anyhow::Result<Vec<ContextRow>> {
    let mut rows = Vec::new();
    for &len in contexts {
        let p = prompt(loaded, 7, len);
        anyhow::ensure!(p.len() == len, "could only make a {}-token prompt", p.len());
        let mut row = ContextRow {
            context: len,
            prefill_tok_s: 0.0,
            itl_ms: f64::INFINITY,
        };
        for _ in 0..repeat {
            let (ttft, rest, n) = run_batch(engine, vec![p.clone()], gen.max(2))?;
            row.prefill_tok_s = row.prefill_tok_s.max(len as f64 / ttft.as_secs_f64());
            row.itl_ms = row.itl_ms.min(rest.as_secs_f64() * 1e3 / n.max(1) as f64);
        }
        rows.push(row);
    }
    Ok(rows)
}

/// What a token costs in weights, from the file's tensor table (read once).
pub(super) struct WeightCost {
    /// Bytes a decode step reads per token: every tensor but the token embeddings, of which one
    /// row is read (unless the output layer is tied to them, when all of it is).
    pub bytes_per_token: u64,
    /// Multiply-adds of a prefill token's matrix work: the elements of every layer's weight
    /// matrices (not the embeddings, whose rows are copied, nor the output layer, which prefill
    /// runs for the last token only). `None` for an MoE file, whose tokens use only some experts.
    pub matmul_macs_per_token: Option<u64>,
}

/// The [`WeightCost`] of the GGUF file at `path`.
pub(super) fn weight_cost(path: &std::path::Path) -> anyhow::Result<WeightCost> {
    let file = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let tied = file.tensor("output.weight").is_err();
    let (mut bytes, mut macs, mut moe) = (0u64, 0u64, false);
    for t in &file.tensors {
        moe |= t.name.contains("_exps");
        if t.name.starts_with("blk.") && t.name.ends_with(".weight") && t.dims.len() >= 2 {
            macs += t.n_elements();
        }
        if t.name == "token_embd.weight" && !tied {
            continue;
        }
        bytes += t
            .n_bytes()
            .with_context(|| format!("tensor {} has no known size", t.name))?;
    }
    Ok(WeightCost {
        bytes_per_token: bytes,
        matmul_macs_per_token: (!moe).then_some(macs),
    })
}

/// This machine's read bandwidth over a 1 GiB buffer with `threads` threads (GB/s, best of
/// three passes after one that pages the buffer in).
pub(super) fn read_bandwidth(threads: usize) -> f64 {
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads.max(1));
    let mut best = 0.0f64;
    for pass in 0..4 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(part)
                .map(|c| s.spawn(move || sum_words(c)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        std::hint::black_box(sum);
        if pass > 0 {
            best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    best
}

/// Sums `c` with eight independent accumulators (the loads, not the adds, are the limit).
fn sum_words(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = c.chunks_exact(8);
    let rest: u64 = chunks.remainder().iter().fold(0, |a, &x| a.wrapping_add(x));
    for w in chunks {
        for (a, &x) in acc.iter_mut().zip(w) {
            *a = a.wrapping_add(x);
        }
    }
    acc.iter().fold(rest, |a, &x| a.wrapping_add(x))
}
