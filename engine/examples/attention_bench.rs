//! Times one layer's paged attention at the Llama-3.2-1B / 3.1-8B head shape (32 query heads,
//! 8 kv heads of 64 or 128), for a decode step (one token) and a prefill chunk (64 tokens) at
//! the end of a long context, per KV type: the part of a long-context step that grows with the
//! context.
//!
//! `cargo run --release -p cleave-engine --example attention_bench [CONTEXT] [HEAD_DIM] [THREADS]
//! [KV_DTYPE]` (every KV type when none is named)

use std::time::Instant;

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype, KvLayout};
use cleave_engine::kv::BlockId;
use cleave_engine::model::attention::{attend, write_kv, AttnParams, AttnScratch, TokenSlot};

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |s| s.parse().unwrap());
    let (ctx, hd, threads) = (arg(1, 4096), arg(2, 64), arg(3, 1));
    let threads = Threads::new(threads);
    let (n_heads, n_kv) = (32, 8);
    let only = std::env::args().nth(4);
    for dtype in KvDtype::ALL {
        if only.as_deref().is_some_and(|o| o != dtype.as_str()) {
            continue;
        }
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: n_kv,
            head_dim: hd,
            block_size: 16,
            dtype,
        };
        let nb = ctx.div_ceil(16);
        let mut cache = KvCache::on_heap(layout, nb);
        let blocks: Vec<BlockId> = (0..nb as u32)
            .map(|b| BlockId((b * 7919) % nb as u32))
            .collect();
        let row = |p: usize, s: usize| -> Vec<f32> {
            (0..n_kv * hd)
                .map(|i| (((p * 131 + i * 71 + s) % 97) as f32 - 48.0) * 0.02)
                .collect()
        };
        for p in 0..ctx {
            let slot = [TokenSlot {
                pos: p,
                blocks: &blocks,
            }];
            write_kv(&mut cache, 0, &slot, &row(p, 0), &row(p, 5));
        }
        for (what, tokens) in [("decode, 1 token", 1), ("prefill, 64 tokens", 64)] {
            let slots: Vec<TokenSlot> = (ctx - tokens..ctx)
                .map(|pos| TokenSlot {
                    pos,
                    blocks: &blocks,
                })
                .collect();
            let q: Vec<f32> = (0..tokens * n_heads * hd)
                .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.05)
                .collect();
            let mut out = vec![0.0; q.len()];
            let mut scratch = AttnScratch::default();
            let params = AttnParams::plain(hd);
            let mut run = || {
                attend(
                    &cache,
                    0,
                    &slots,
                    &q,
                    n_heads,
                    &params,
                    &mut out,
                    &mut scratch,
                    &threads,
                )
            };
            run();
            let reps = (2_000_000 / (ctx * tokens)).max(3);
            let t = Instant::now();
            for _ in 0..reps {
                run();
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            println!(
                "{:5} context {ctx} head {hd}: {what}: {ms:.3} ms per layer",
                dtype.as_str()
            );
        }
    }
}
