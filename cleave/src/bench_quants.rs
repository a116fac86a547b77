//! `cleave bench quants`: quantizations of one model side by side, in the same run and on one
//! thread (e.g. the default SmolLM2 Q4_1 next to llama.cpp requantizations of it with
//! K-quants) — prefill and batch-1 decode tok/s, perplexity on a reference text, and argmax
//! agreement with the first model.
//!
//! ```text
//! cleave bench quants --model a.Q4_1.gguf --model b.Q4_K_M.gguf \
//!   --reference engine/tests/data/apache2_llamacpp_ref.json
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Args;
use cleave_engine::model::reference::greedy;

use cleave_engine::kernels::{simd_path, Threads};
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score;
use cleave_engine::model::Model;
use cleave_text::gguf::GgufFile;

#[derive(serde::Deserialize)]
struct Reference {
    tokens: Vec<u32>,
}

/// Flags of `cleave bench quants`.
#[derive(Debug, Args)]
pub struct QuantsArgs {
    /// The models to compare (two or more; the first is the baseline).
    #[arg(long = "model", required = true, num_args = 1)]
    pub models: Vec<PathBuf>,
    /// llama.cpp's record of a reference text (`{"tokens": [...]}`, as
    /// `engine/tests/data/apache2_llamacpp_ref.json`): its first 128 tokens are the prompt,
    /// all of them are scored.
    #[arg(long)]
    pub reference: PathBuf,
}

fn histogram(path: &std::path::Path) -> anyhow::Result<String> {
    let g = GgufFile::open(path)?;
    let mut h = std::collections::BTreeMap::new();
    for t in &g.tensors {
        *h.entry(t.ty.to_string()).or_insert(0) += 1;
    }
    Ok(h.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(" "))
}

pub fn bench_quants(args: QuantsArgs) -> anyhow::Result<()> {
    let r: Reference = serde_json::from_str(
        &std::fs::read_to_string(&args.reference)
            .with_context(|| format!("reading {}", args.reference.display()))?,
    )
    .with_context(|| format!("{} is not a token record", args.reference.display()))?;
    ensure!(
        r.tokens.len() >= 256,
        "{} has {} tokens; the benchmark needs at least 256",
        args.reference.display(),
        r.tokens.len()
    );
    let prompt = &r.tokens[..128];
    println!("simd path: {}, 1 thread", simd_path());
    println!("| model | prefill 128 tok/s | decode 64 tok/s | ppl | argmax = first | types |");
    println!("|---|---|---|---|---|---|");
    let (mut base, mut base_top1) = (None, None);
    for path in &args.models {
        let model = Model::open(path, Threads::single())
            .with_context(|| format!("loading {}", path.display()))?;
        // Warm up, then best of three.
        greedy(&model, prompt, 2);
        let (mut pre, mut dec) = (f64::MAX, f64::MAX);
        for _ in 0..3 {
            let t = Instant::now();
            greedy(&model, prompt, 1);
            let p = t.elapsed().as_secs_f64();
            let t = Instant::now();
            greedy(&model, prompt, 65);
            let d = t.elapsed().as_secs_f64() - p;
            pre = pre.min(p);
            dec = dec.min(d);
        }
        let (pre, dec) = (128.0 / pre, 64.0 / dec);
        let s = score(&model, r.tokens.clone(), 256, KvDtype::F32)?;
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
            histogram(path)?
        );
    }
    Ok(())
}
