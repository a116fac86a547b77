//! KV tiers on the default model: a prefix evicted from a small pool comes back from the host
//! tier, and from the disk tier after a restart on the same directory, with the same tokens
//! and logprobs (bit for bit) as computing it; blocks are all accounted for afterwards.

use std::path::PathBuf;

use crate::common;

use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::kv::tiers::{DiskConfig, TierConfig};
use cleave_engine::kv::KvEvent;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::sample::SamplingParams;

const POOL: usize = 12;

fn engine(tiers: TierConfig) -> Engine {
    let (m, t) = common::model_and_tokenizer();
    let config = EngineConfig {
        num_blocks: POOL,
        kv_dtype: KvDtype::F16,
        max_model_len: None,
        scheduler: SchedulerConfig {
            step_tokens: 256,
            ..Default::default()
        },
        tiers,
    };
    Engine::start(m, t, config)
}

/// Greedy tokens with their logprobs as bits.
async fn run(e: &Engine, prompt: Vec<u32>) -> Vec<(u32, u32)> {
    let params = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        logprobs: Some(2),
        ..Default::default()
    };
    let (_, mut rx) = e.submit(GenerateRequest::new(prompt, params)).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { id, logprob, .. } => {
                out.push((id, logprob.expect("logprobs asked for").logprob.to_bits()))
            }
            SeqEvent::Done { .. } => return out,
            other => panic!("unexpected event {other:?}"),
        }
    }
    panic!("stream ended without Done");
}

/// A prompt of 70 tokens (four full blocks), distinct per `i`.
fn long_prompt(i: usize) -> Vec<u32> {
    let text = format!(
        "Document {i}. The committee met on a grey morning to review the harbour accounts, the \
         repairs to the north pier, the lighthouse keeper's report and the fishing quotas for \
         the coming season, item by item, in the order of the agenda. Each member spoke in \
         turn about the costs, the weather, the boats laid up for the winter and the nets."
    );
    let mut p = common::prompt(&text);
    p.truncate(70);
    assert_eq!(p.len(), 70, "prompt {i} is too short");
    p
}

/// Fills the pool with other prompts so that everything `long_prompt(0)` cached is evicted.
async fn evict(e: &Engine) {
    for i in 1..=3 {
        run(e, long_prompt(i)).await;
    }
    common::wait_idle(e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_prefix_evicted_to_the_host_tier_comes_back_bit_identical() {
    let p = long_prompt(0);
    let plain = engine(TierConfig::default());
    let computed = run(&plain, p.clone()).await;
    let e = engine(TierConfig {
        host_bytes: 64 << 20,
        ..Default::default()
    });
    assert_eq!(run(&e, p.clone()).await, computed);
    evict(&e).await;
    let before = e.stats();
    assert!(before.tiers.host_entries >= 4, "{:?}", before.tiers);
    let restored = run(&e, p.clone()).await;
    common::wait_idle(&e).await;
    let after = e.stats();
    assert_eq!(
        restored, computed,
        "restored KV gives other tokens or logprobs"
    );
    assert_eq!(after.tiers.host_hits - before.tiers.host_hits, 4);
    assert_eq!(
        after.counters.prefix_hit_tokens - before.counters.prefix_hit_tokens,
        64
    );
    // Nothing leaked: every block is free or cached, none referenced.
    assert_eq!(after.pool.used, 0, "{:?}", after.pool);
    assert_eq!(after.pool.free + after.pool.cached_idle, POOL);
    // Demoted blocks were never announced as removed: the worker still held them.
    let removed: Vec<_> = e
        .take_kv_events()
        .into_iter()
        .filter(|r| matches!(r.event, KvEvent::Removed { .. }))
        .collect();
    assert!(removed.is_empty(), "{removed:?}");
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_restarted_worker_serves_a_prefix_hit_from_its_disk_tier() {
    let dir =
        TempDir(std::env::temp_dir().join(format!("cleave-disk-tier-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    let tiers = TierConfig {
        host_bytes: 0,
        disk: Some(DiskConfig {
            dir: dir.0.clone(),
            max_bytes: 256 << 20,
            min_uses: 1,
        }),
        model_id: 42,
    };
    let p = long_prompt(0);
    let first = engine(tiers.clone());
    let computed = run(&first, p.clone()).await;
    evict(&first).await;
    assert!(first.stats().tiers.disk_written >= 4);
    drop(first); // stops the engine; the disk writer finishes its queue
    let second = engine(tiers);
    // It announces what it found before serving anything.
    let stored = second
        .take_kv_events()
        .into_iter()
        .filter(|r| matches!(r.event, KvEvent::Stored { .. }))
        .count();
    assert!(stored >= 4, "{stored} blocks announced after the restart");
    let restored = run(&second, p).await;
    common::wait_idle(&second).await;
    let s = second.stats();
    assert_eq!(restored, computed);
    assert_eq!(s.tiers.disk_hits, 4, "{:?}", s.tiers);
    assert_eq!(s.counters.prefix_hit_tokens, 64);
    assert_eq!(s.pool.used, 0);
}
