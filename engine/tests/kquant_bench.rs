//! A measurement, ignored by default: the default SmolLM2 Q4_1 model next to a llama.cpp
//! requantization of it with K-quants (`Q4_K_M`: Q4_K/Q6_K where rows are whole super-blocks,
//! Q5_0/Q8_0 elsewhere), in the same run and on one thread — prefill and batch-1 decode tok/s,
//! perplexity on the reference text and argmax agreement with the first (Q4_1) model.
//!
//! ```text
//! CLEAVE_KQUANT_MODELS=/path/a.Q4_K_M.gguf,/path/b.Q6_K.gguf \
//!   cargo test --release -p cleave-engine --test integration kquant_bench -- --ignored --nocapture
//! ```
//! (default: `SmolLM2-135M-Instruct.Q4_K_M.gguf` next to the default model).

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use crate::tiny;

use std::path::PathBuf;
use std::time::Instant;

use cleave_engine::kernels::{simd_path, Threads};
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score;
use cleave_engine::model::Model;
use cleave_text::gguf::{default_model_path, GgufFile};

#[derive(serde::Deserialize)]
struct Reference {
    tokens: Vec<u32>,
}

fn histogram(path: &std::path::Path) -> String {
    let g = GgufFile::open(path).unwrap();
    let mut h = std::collections::BTreeMap::new();
    for t in &g.tensors {
        *h.entry(t.ty.to_string()).or_insert(0) += 1;
    }
    h.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn k_quant_models_next_to_the_default() {
    let default = default_model_path();
    let others = std::env::var("CLEAVE_KQUANT_MODELS").unwrap_or_else(|_| {
        default
            .with_file_name("SmolLM2-135M-Instruct.Q4_K_M.gguf")
            .display()
            .to_string()
    });
    let mut models = vec![default];
    models.extend(others.split(',').map(PathBuf::from));
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
    let r: Reference = serde_json::from_str(
        &std::fs::read_to_string(format!("{dir}/apache2_llamacpp_ref.json")).unwrap(),
    )
    .unwrap();
    let prompt = &r.tokens[..128];
    println!("simd path: {}, 1 thread", simd_path());
    println!("| model | prefill 128 tok/s | decode 64 tok/s | ppl | argmax = first | types |");
    println!("|---|---|---|---|---|---|");
    let (mut base, mut base_top1) = (None, None);
    for path in &models {
        let model = Model::open(path, Threads::single()).unwrap();
        // Warm up, then best of three.
        tiny::greedy(&model, prompt, 2);
        let (mut pre, mut dec) = (f64::MAX, f64::MAX);
        for _ in 0..3 {
            let t = Instant::now();
            tiny::greedy(&model, prompt, 1);
            let p = t.elapsed().as_secs_f64();
            let t = Instant::now();
            tiny::greedy(&model, prompt, 65);
            let d = t.elapsed().as_secs_f64() - p;
            pre = pre.min(p);
            dec = dec.min(d);
        }
        let (pre, dec) = (128.0 / pre, 64.0 / dec);
        let s = score(&model, r.tokens.clone(), 256, KvDtype::F32).unwrap();
        let top1 = base_top1.get_or_insert_with(|| s.top1_next.clone());
        let agree = top1
            .iter()
            .zip(&s.top1_next)
            .filter(|(a, b)| a == b)
            .count() as f64
            / top1.len() as f64;
        let (bp, bd) = *base.get_or_insert((pre, dec));
        println!(
            "| {} | {pre:.0} ({:.2}×) | {dec:.0} ({:.2}×) | {:.3} | {:.1}% | {} |",
            path.file_name().unwrap().to_string_lossy(),
            pre / bp,
            dec / bd,
            s.ppl,
            100.0 * agree,
            histogram(path)
        );
    }
}
