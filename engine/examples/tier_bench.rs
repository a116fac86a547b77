//! What a KV tier saves: the time to first token of a long prompt computed, then of the same
//! prompt after its blocks were evicted from the pool to the disk tier (or the host tier) and
//! are copied back. The disk here is whatever holds the system's temporary directory, and the
//! entries were just written, so they are usually read from the page cache: a warm disk.
//!
//! `cargo run --release -p cleave-engine --example tier_bench MODEL [PROMPT_TOKENS] [THREADS]`

use std::path::PathBuf;
use std::time::Instant;

use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::kv::tiers::{DiskConfig, TierConfig};
use cleave_engine::load::Loaded;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::sample::SamplingParams;

/// Seconds from submitting `prompt` (one output token) to its end.
fn ttft(rt: &tokio::runtime::Runtime, e: &Engine, prompt: Vec<u32>) -> f64 {
    let params = SamplingParams {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    let start = Instant::now();
    let (_, mut rx) = e
        .submit(GenerateRequest::new(prompt, params))
        .expect("submit");
    rt.block_on(async {
        while let Some(ev) = rx.recv().await {
            if let SeqEvent::Done { .. } = ev {
                break;
            }
        }
    });
    start.elapsed().as_secs_f64()
}

/// `n` token ids from the vocabulary, a different sequence per `seed`.
fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (vocab as u64 - 1000) + 500) as u32
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(
        args.get(1)
            .expect("usage: tier_bench MODEL [TOKENS] [THREADS]"),
    );
    let tokens: usize = args.get(2).map_or(2048, |s| s.parse().expect("tokens"));
    let threads: usize = args.get(3).map_or(1, |s| s.parse().expect("threads"));
    let l = Loaded::open(&model, Threads::new(threads)).expect("load");
    let vocab = l.model.config.vocab;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = std::env::temp_dir().join(format!("cleave-tier-bench-{}", std::process::id()));
    // A pool that holds one prompt: the second evicts the first.
    let blocks = tokens.div_ceil(16) + 8;
    for (name, tiers) in [
        (
            "disk",
            TierConfig {
                host_bytes: 0,
                disk: Some(DiskConfig {
                    dir: dir.clone(),
                    max_bytes: 64 << 30,
                    min_uses: 1,
                }),
                model_id: 1,
            },
        ),
        (
            "host",
            TierConfig {
                host_bytes: 64 << 30,
                disk: None,
                model_id: 1,
            },
        ),
    ] {
        let config = EngineConfig {
            num_blocks: blocks,
            kv_dtype: KvDtype::F16,
            max_model_len: None,
            scheduler: SchedulerConfig {
                step_tokens: 512,
                ..Default::default()
            },
            tiers,
        };
        let e = Engine::start(l.model.clone(), l.tokenizer.clone(), config);
        let (a, b) = (prompt(tokens, vocab, 1), prompt(tokens, vocab, 2));
        let computed = ttft(&rt, &e, a.clone());
        ttft(&rt, &e, b);
        let restored = ttft(&rt, &e, a);
        let s = e.stats().tiers;
        println!(
            "{name}: {tokens}-token prompt computed in {computed:.3} s, restored from the {name} \
             tier in {restored:.3} s ({:.1}x faster; {} host and {} disk block hits)",
            computed / restored,
            s.host_hits,
            s.disk_hits
        );
        drop(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
