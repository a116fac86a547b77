//! Gemma, Gemma 2, Gemma 3, Phi-3, Llama 3.1's RoPE frequency factors and the MoE layouts
//! (Mixtral, Qwen2-MoE, Qwen3-MoE; alone and as EP=2 groups) against llama.cpp, on small
//! random-weight files that llama.cpp's own quantizer made (`tests/data/archs/make.py`: Q4_K_M,
//! Q5_K_M, Q8_0 and Q2_K mixes, SentencePiece-style vocabularies): the same token ids for
//! a multilingual text with emoji and code, perplexity within 3% of llama.cpp's, next-token
//! argmax agreement of at least 90%, and close logits. Then the windowed models (Gemma 2 and 3)
//! give the same greedy tokens however they are computed: prefill or decode, in chunks,
//! batched, with a prefix-cache hit, and disaggregated.

use crate::common;
use crate::tiny;

use std::collections::BTreeMap;
use std::path::PathBuf;

use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest};
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_engine::model::{Arch, Model};
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::gguf::GgufFile;
use cleave_text::sample::SamplingParams;
use common::{disaggregated, settle, tokens_of};

#[derive(serde::Deserialize)]
struct Reference {
    text: String,
    text_tokens: Vec<u32>,
    tokens: Vec<u32>,
    vocab: usize,
    nll: Vec<f64>,
    ppl: f64,
    top1: Vec<u32>,
    logits_at: BTreeMap<String, Vec<f32>>,
}

fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/archs/{name}.gguf"))
}

fn reference(name: &str) -> Reference {
    let p = path(name).with_extension("json");
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

fn load(name: &str) -> Loaded {
    Loaded::open(&path(name), Threads::single()).unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// `-log softmax(row)[next]`, in f64.
fn nll(row: &[f32], next: u32) -> f64 {
    let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
    let z: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    z.ln() + max - row[next as usize] as f64
}

/// Tokens, perplexity, argmax agreement and logits of `name` against llama.cpp's.
fn agrees_with_llama_cpp(name: &str, arch: Arch) {
    let r = reference(name);
    let l = load(name);
    assert_eq!(l.model.config.arch, arch);
    assert_eq!(l.model.config.vocab, r.vocab);
    assert_eq!(
        l.tokenizer.encode(&r.text, false),
        r.text_tokens,
        "{name}: token ids differ from llama.cpp's"
    );
    assert_eq!(l.tokenizer.encode_special(&r.text, true, false), r.tokens);
    assert_eq!(l.tokenizer.decode(&r.text_tokens), r.text);
    logits_agree(name, &r, &tiny::all_logits(&l.model, &r.tokens));
}

/// Perplexity within 3%, argmax agreement ≥ 90% and logits within 8% of their range at the
/// recorded positions, against llama.cpp's; prints the numbers.
fn logits_agree(name: &str, r: &Reference, logits: &[f32]) {
    let rows: Vec<&[f32]> = logits.chunks_exact(r.vocab).collect();
    let ours: Vec<f64> = (0..r.tokens.len() - 1)
        .map(|p| nll(rows[p], r.tokens[p + 1]))
        .collect();
    let ppl = (ours.iter().sum::<f64>() / ours.len() as f64).exp();
    let agree = rows
        .iter()
        .zip(&r.top1)
        .filter(|(row, &t)| argmax(row) == t)
        .count() as f64
        / rows.len() as f64;
    let mut worst = (0.0f32, 0.0f32);
    for (p, want) in &r.logits_at {
        let got = rows[p.parse::<usize>().unwrap()];
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        if diff / scale > worst.0 / worst.1.max(f32::MIN_POSITIVE) {
            worst = (diff, scale);
        }
    }
    let nll_diff = ours
        .iter()
        .zip(&r.nll)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "{name}: {} tokens, ppl {ppl:.4} vs llama.cpp {:.4} ({:+.2}%), argmax agreement {:.1}%, \
         max |Δ nll| {nll_diff:.4}, max |Δ logit| {:.4} of {:.2}",
        r.tokens.len(),
        r.ppl,
        (ppl / r.ppl - 1.0) * 100.0,
        agree * 100.0,
        worst.0,
        worst.1
    );
    assert!(
        (ppl / r.ppl - 1.0).abs() <= 0.03,
        "{name}: perplexity {ppl} vs llama.cpp's {}",
        r.ppl
    );
    assert!(agree >= 0.90, "{name}: argmax agreement {agree}");
    assert!(
        worst.0 <= 0.08 * worst.1,
        "{name}: logits differ by {} (max |logit| {})",
        worst.0,
        worst.1
    );
}

#[test]
fn gemma_matches_llama_cpp() {
    agrees_with_llama_cpp("gemma", Arch::Gemma);
}

#[test]
fn gemma2_matches_llama_cpp() {
    agrees_with_llama_cpp("gemma2", Arch::Gemma2);
}

#[test]
fn gemma3_matches_llama_cpp() {
    agrees_with_llama_cpp("gemma3", Arch::Gemma3);
}

#[test]
fn phi3_matches_llama_cpp() {
    agrees_with_llama_cpp("phi3", Arch::Phi3);
}

#[test]
fn llama31_rope_factors_match_llama_cpp() {
    agrees_with_llama_cpp("llama31", Arch::Llama);
}

#[test]
fn mixtral_matches_llama_cpp() {
    agrees_with_llama_cpp("mixtral", Arch::Mixtral);
}

#[test]
fn qwen2moe_matches_llama_cpp() {
    agrees_with_llama_cpp("qwen2moe", Arch::Qwen2Moe);
}

#[test]
fn qwen3moe_matches_llama_cpp() {
    agrees_with_llama_cpp("qwen3moe", Arch::Qwen3Moe);
}

/// The MoE files as expert-parallel groups of two (each rank holds two experts and half the
/// heads and vocabulary) against the same llama.cpp logits.
#[test]
fn moe_files_as_ep2_groups_match_llama_cpp() {
    for name in ["mixtral", "qwen2moe", "qwen3moe"] {
        let r = reference(name);
        let g = GgufFile::open(&path(name)).unwrap();
        let per_rank = tiny::on_ranks(2, |c| {
            let m = Model::load(&g, c, Threads::single()).unwrap();
            tiny::all_logits(&m, &r.tokens)
        });
        assert_eq!(per_rank[0], per_rank[1], "{name}: ranks disagree");
        logits_agree(&format!("{name} EP=2"), &r, &per_rank[0]);
    }
}

#[test]
fn the_files_carry_what_the_tests_claim() {
    let g2 = load("gemma2").model.config.clone();
    let w = g2.options.sliding_window.as_ref().unwrap();
    assert_eq!((w.size, w.layers.clone()), (24, vec![true, false]));
    assert_eq!(
        (g2.options.attn_softcap, g2.options.final_softcap),
        (Some(3.0), Some(8.0))
    );
    let g3 = load("gemma3").model.config.clone();
    let w = g3.options.sliding_window.as_ref().unwrap();
    assert_eq!((w.size, w.layers.clone()), (20, vec![true, true, false]));
    assert_eq!((w.rope_theta, g3.rope_theta), (10_000.0, 1_000_000.0));
    assert_eq!(g3.rope_scaling.freq_scale, 0.125);
    let phi = load("phi3").model.config.clone();
    // The long factors: the context (4096) exceeds the original 256.
    let f = phi.rope_scaling.factors.as_ref().unwrap();
    assert_eq!((f[0], *f.last().unwrap()), (1.0, 12.0));
    assert!((phi.rope_scaling.attn_factor - 1.19).abs() < 1e-6);
    assert!(load("llama31")
        .model
        .config
        .rope_scaling
        .factors
        .as_ref()
        .is_some_and(|f| f.contains(&8.0) && f.contains(&1.0)));
}

/// Decoding token by token through the KV cache (the window moving with each token) gives the
/// logits of one prefill over the same tokens, bit for bit, on the windowed models.
#[test]
fn teacher_forced_and_decoded_logits_agree_bit_for_bit_on_windowed_models() {
    for name in ["gemma2", "gemma3"] {
        let r = reference(name);
        let l = load(name);
        let prompt = &r.tokens[..40];
        let (tokens, rows) = tiny::greedy(&l.model, prompt, 24);
        let mut seq = prompt.to_vec();
        seq.extend(&tokens[..23]);
        let all = tiny::all_logits(&l.model, &seq);
        for (i, row) in rows.iter().enumerate() {
            let p = prompt.len() - 1 + i;
            assert_eq!(
                &all[p * r.vocab..(p + 1) * r.vocab],
                &row[..],
                "{name} token {i}: decode and prefill logits differ"
            );
        }
    }
}

fn engine(l: &Loaded, step_tokens: usize, prefix_caching: bool) -> Engine {
    let config = EngineConfig {
        tiers: Default::default(),
        num_blocks: 96,
        scheduler: SchedulerConfig {
            step_tokens,
            prefix_caching,
            ..Default::default()
        },
        ..Default::default()
    };
    Engine::start(l.model.clone(), l.tokenizer.clone(), config)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

async fn alone(e: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let rx = e
        .submit(GenerateRequest::new(prompt.to_vec(), greedy(n)))
        .unwrap()
        .1;
    tokens_of(rx).await.0
}

/// Gemma 2 and 3 (window layers beside global ones) give one engine's greedy tokens in one
/// chunk, in 7-token chunks, batched with two other requests, after a prefix-cache hit on a
/// prompt sharing 4 blocks, and prefilled in one engine and decoded in another; every block is
/// returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windowed_models_give_the_same_tokens_however_computed() {
    for name in ["gemma2", "gemma3"] {
        let r = reference(name);
        let l = load(name);
        // 100+ tokens: several windows and blocks.
        let long = r.tokens.clone();
        let other: Vec<u32> = long.iter().rev().copied().collect();
        let mut shared = long[..64].to_vec();
        shared.extend(&other[..30]);
        let single = engine(&l, 4096, false);
        let want = alone(&single, &long, 32).await;
        let want_other = alone(&single, &other, 32).await;
        let want_shared = alone(&single, &shared, 32).await;

        let chunked = engine(&l, 7, false);
        assert_eq!(alone(&chunked, &long, 32).await, want, "{name}: chunked");

        let batched = engine(&l, 64, false);
        let rxs: Vec<_> = [&long, &other, &shared]
            .iter()
            .map(|p| {
                batched
                    .submit(GenerateRequest::new(p.to_vec(), greedy(32)))
                    .unwrap()
                    .1
            })
            .collect();
        let mut got = Vec::new();
        for rx in rxs {
            got.push(tokens_of(rx).await.0);
        }
        assert_eq!(
            got,
            [want.clone(), want_other, want_shared.clone()],
            "{name}: batched"
        );

        let cached = engine(&l, 4096, true);
        assert_eq!(alone(&cached, &long, 32).await, want);
        let before = cached.stats().counters.prefix_hit_tokens;
        assert_eq!(
            alone(&cached, &shared, 32).await,
            want_shared,
            "{name}: prefix hit"
        );
        assert_eq!(
            cached.stats().counters.prefix_hit_tokens - before,
            64,
            "{name}"
        );

        let (p, d) = (engine(&l, 32, true), engine(&l, 32, true));
        let (got, copied) = disaggregated(&p, &d, long.clone(), greedy(32)).await;
        assert_eq!(got, want, "{name}: disaggregated");
        assert_eq!(copied, long.len().div_ceil(16));
        for e in [&single, &chunked, &batched, &cached, &p, &d] {
            assert_eq!(settle(e).await.pool.used, 0, "{name}: blocks leaked");
        }
    }
}
