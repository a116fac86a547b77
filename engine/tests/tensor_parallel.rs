//! The weight loader and forward pass split across ranks (heads, FFN columns, vocabulary) give
//! the same logits as one rank, with the collectives of an in-process group.

use crate::common;
use crate::tiny;

use std::sync::Arc;

use cleave_engine::kernels::Threads;
use cleave_engine::model::Model;
use cleave_text::gguf::{default_model_path, GgufFile};

#[test]
fn three_way_tensor_parallel_matches_one_rank() {
    let l = common::loaded();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/apache2_excerpt.txt"
    ))
    .unwrap();
    let mut tokens = l.tokenizer.encode(&text, false);
    tokens.truncate(384);
    let want = tiny::all_logits(&l.model, &tokens);
    let vocab = l.model.config.vocab;
    let g = Arc::new(GgufFile::open(&default_model_path()).unwrap());
    let ranks = tiny::on_ranks(3, |c| {
        let m = Model::load(&g, c, Threads::single()).unwrap();
        assert_eq!((m.local_heads(), m.local_kv_heads()), (3, 1));
        tiny::all_logits(&m, &tokens)
    });
    // Row-parallel products sum in a different order; 8-bit activation quantization turns such
    // last-bit differences into occasional one-step rounding flips, which add up over 30
    // layers. So the check is statistical: perplexity within 2% and the same argmax almost
    // everywhere (a wrong head or column split gives garbage on both counts). Over 384 tokens:
    // on 128 a last-bit change of the kernels alone (exact whole-block integer dots) moved
    // TP=1's perplexity by 1.6% and TP=3's by 1.1% in opposite directions, and the agreement
    // from 96.1% to 94.5%; one rank's own noise floor, not a TP error.
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
            .filter(|(a, b)| cleave_text::sample::argmax(a) == cleave_text::sample::argmax(b))
            .count() as f64
            / tokens.len() as f64;
        eprintln!(
            "perplexity TP=3 {p:.4} vs TP=1 {base:.4}; argmax agreement {:.1}%",
            agree * 100.0
        );
        assert!((p - base).abs() / base < 0.02, "perplexity {p} vs {base}");
        assert!(agree >= 0.93, "argmax agreement {agree}");
    }
}

/// Greedy decoding through the paged KV cache (prefill, then one token per step) with three
/// ranks gives the tokens of one rank, and every step's logits stay within `TOL` of it.
#[test]
fn three_way_tensor_parallel_greedy_tokens_match_one_rank() {
    // Row-parallel sums in another order change the last bits of the residual stream, and the
    // 8-bit activation quantization turns some of those into one-step rounding flips that add
    // up over 30 layers. This is the model's own sensitivity, not a TP effect: perturbing only
    // the last bits of TP=1's layer outputs (no TP at all) moved its logits by up to 0.72
    // (mean 0.10) and changed its greedy path after 3 tokens. TP=3 measured 0.96 / 0.165 here.
    // So the stated tolerance is on max and mean |dlogit|, and the prompt is one whose 32-token
    // greedy path TP=3 reproduces (the computation is deterministic, so this is stable); with
    // most prompts this 135M model meets a near-tie (top-2 gap of a few hundredths) within 32
    // tokens, where TP=3 and a perturbed TP=1 alike may take the other branch.
    const TOL: f32 = 1.5;
    const MEAN_TOL: f64 = 0.25;
    let l = common::loaded();
    let prompt = l.encode_text("List three fruits:");
    let (want, want_rows) = tiny::greedy(&l.model, &prompt, 32);
    // The smallest gap between the best and second-best logit along the way: the greedy
    // tokens can only differ where this is below the TP logit error.
    let margin = want_rows
        .iter()
        .map(|r| {
            let mut v = r.clone();
            v.sort_by(|a, b| b.total_cmp(a));
            v[0] - v[1]
        })
        .fold(f32::MAX, f32::min);
    eprintln!("TP=1 smallest top-2 logit margin over 32 steps: {margin:.4}");
    let g = Arc::new(GgufFile::open(&default_model_path()).unwrap());
    let got = tiny::on_ranks(3, |c| {
        let m = Model::load(&g, c, Threads::single()).unwrap();
        tiny::greedy(&m, &prompt, 32)
    });
    eprintln!("TP=1: {}", l.tokenizer.decode(&want));
    for (tokens, rows) in &got {
        assert_eq!(tokens, &got[0].0, "ranks disagree");
        // Logits are comparable while both runs have seen the same tokens.
        let same = tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let worst = rows[..=same.min(31)]
            .iter()
            .zip(&want_rows)
            .map(|(a, b)| tiny::max_diff(a, b).0)
            .fold(0.0, f32::max);
        let (sum, count) = rows[..=same.min(31)]
            .iter()
            .zip(&want_rows)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64))
            .fold((0.0, 0usize), |(s, n), d| (s + d, n + 1));
        let mean = sum / count as f64;
        eprintln!("TP=3 vs TP=1: {same} equal tokens, max |dlogit| {worst:.4}, mean {mean:.5}");
        assert!(worst <= TOL, "TP=3 logits differ by {worst}");
        assert!(mean <= MEAN_TOL, "TP=3 logits differ by {mean} on average");
        assert_eq!(
            tokens,
            &want,
            "TP=3 greedy tokens: {:?}",
            l.tokenizer.decode(tokens)
        );
    }
}
