//! The weight loader and forward pass split across ranks (heads, FFN columns, vocabulary) give
//! the same logits as one rank, with the collectives of an in-process group.

mod common;

use std::sync::Arc;

use cleave_engine::collective::LocalGroup;
use cleave_engine::gguf::{default_model_path, GgufFile};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype, KvLayout};
use cleave_engine::kv::BlockId;
use cleave_engine::model::{Logits, Model, SeqChunk, Workspace};

fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let layout = KvLayout {
        n_layers: model.config.n_layers,
        n_kv_heads: model.local_kv_heads(),
        head_dim: model.config.head_dim,
        block_size: 16,
        dtype: KvDtype::F32,
    };
    let mut cache = KvCache::on_heap(layout, 8);
    let blocks: Vec<BlockId> = (0..8).map(BlockId).collect();
    let mut ws = Workspace::new();
    let chunk = SeqChunk {
        tokens,
        start_pos: 0,
        blocks: &blocks,
        logits: Logits::All,
    };
    model
        .forward(&[chunk], &mut cache, &mut ws)
        .expect("local group collectives do not fail");
    ws.logits.clone()
}

#[test]
fn three_way_tensor_parallel_matches_one_rank() {
    let l = common::loaded();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/apache2_excerpt.txt"
    ))
    .unwrap();
    let mut tokens = l.tokenizer.encode(&text, false);
    tokens.truncate(128);
    let want = logits(&l.model, &tokens);
    let vocab = l.model.config.vocab;
    let g = Arc::new(GgufFile::open(&default_model_path()).unwrap());
    let ranks: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|c| {
                let g = g.clone();
                let tokens = tokens.clone();
                s.spawn(move || {
                    let m = Model::load(&g, Arc::new(c), Threads::single()).unwrap();
                    assert_eq!((m.local_heads(), m.local_kv_heads()), (3, 1));
                    logits(&m, &tokens)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Row-parallel products sum in a different order; 8-bit activation quantization turns such
    // last-bit differences into occasional one-step rounding flips, which add up over 30
    // layers. So the check is statistical: perplexity within 2% and the same argmax almost
    // everywhere (a wrong head or column split gives garbage on both counts).
    let ppl = |logits: &[f32]| {
        let nll: f64 = logits
            .chunks(vocab)
            .zip(&tokens[1..])
            .map(|(row, &next)| {
                let m = row.iter().copied().fold(f32::MIN, f32::max);
                let lse = m as f64
                    + row
                        .iter()
                        .map(|&v| ((v - m) as f64).exp())
                        .sum::<f64>()
                        .ln();
                lse - row[next as usize] as f64
            })
            .sum();
        (nll / (tokens.len() - 1) as f64).exp()
    };
    let base = ppl(&want);
    for got in &ranks {
        assert_eq!(got.len(), want.len());
        assert_eq!(got, &ranks[0], "ranks disagree");
        let p = ppl(got);
        let agree = got
            .chunks(vocab)
            .zip(want.chunks(vocab))
            .filter(|(a, b)| cleave_engine::sample::argmax(a) == cleave_engine::sample::argmax(b))
            .count() as f64
            / tokens.len() as f64;
        eprintln!(
            "perplexity TP=3 {p:.4} vs TP=1 {base:.4}; argmax agreement {:.1}%",
            agree * 100.0
        );
        assert!((p - base).abs() / base < 0.02, "perplexity {p} vs {base}");
        assert!(agree >= 0.95, "argmax agreement {agree}");
    }
}
