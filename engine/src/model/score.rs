//! Teacher-forced scoring: the negative log-likelihood of each next token and the argmax
//! prediction at every position, computed chunk by chunk over a paged KV cache.

use serde::Serialize;

use crate::kv::memory::{KvCache, KvDtype};
use crate::kv::BlockId;
use cleave_text::sample::argmax;
use cleave_types::collective::CollectiveError;

use super::{Logits, Model, SeqChunk, Workspace};

/// The result of scoring a token sequence (same fields as the llama.cpp reference file).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Score {
    /// The scored tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose probability was scored (`tokens.len() - 1`).
    pub n_scored: usize,
    /// Σ −log p(tokens[p+1] | tokens[..=p]).
    pub nll_sum: f64,
    /// exp(nll_sum / n_scored).
    pub ppl: f64,
    /// Argmax next-token id after each prefix `tokens[..=p]`, for p < len − 1.
    pub top1_next: Vec<u32>,
}

/// Scores `tokens`, computing `chunk` tokens per forward pass.
/// Fails only when the model's rank group fails.
pub fn score(
    model: &Model,
    tokens: Vec<u32>,
    chunk: usize,
    dtype: KvDtype,
) -> Result<Score, CollectiveError> {
    let bs = crate::kv::DEFAULT_BLOCK_SIZE;
    let n = tokens.len();
    let layout = model.kv_layout(bs, dtype);
    let nblocks = n.div_ceil(bs).max(1);
    let mut cache = KvCache::on_heap(layout, nblocks);
    let blocks: Vec<BlockId> = (0..nblocks as u32).map(BlockId).collect();
    let mut ws = Workspace::new();
    let vocab = model.config.vocab;
    let (mut nll_sum, mut top1_next) = (0.0f64, Vec::with_capacity(n.saturating_sub(1)));
    let mut start = 0;
    while start < n {
        let end = (start + chunk.max(1)).min(n);
        let c = SeqChunk {
            tokens: &tokens[start..end],
            start_pos: start,
            blocks: &blocks,
            logits: Logits::All,
        };
        model.forward(&[c], &mut cache, &mut ws)?;
        for (i, row) in ws.logits.chunks_exact(vocab).enumerate() {
            let p = start + i;
            if p + 1 >= n {
                break;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max as f64
                + row
                    .iter()
                    .map(|&l| ((l - max) as f64).exp())
                    .sum::<f64>()
                    .ln();
            nll_sum += lse - row[tokens[p + 1] as usize] as f64;
            top1_next.push(argmax(row));
        }
        start = end;
    }
    let n_scored = n.saturating_sub(1);
    Ok(Score {
        ppl: (nll_sum / n_scored.max(1) as f64).exp(),
        tokens,
        n_scored,
        nll_sum,
        top1_next,
    })
}
