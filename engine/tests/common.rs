//! Shared by the integration tests: the default model, loaded once per test binary.

use std::sync::{Arc, OnceLock};

use cleave_engine::engine::{
    Engine, EngineConfig, FinishReason, GenerateRequest, PrefillMode, SeqEvent, Usage,
};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::kv::BlockId;
use cleave_engine::load::Loaded;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::gguf::default_model_path;
use cleave_text::sample::SamplingParams;

#[allow(dead_code)]
pub fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let path = default_model_path();
        assert!(
            path.exists(),
            "the default model is not at {}: run `cargo run -p cleave -- model fetch` (the test script does)",
            path.display()
        );
        Loaded::open(&path, Threads::single()).expect("loading the default model")
    })
}

#[allow(dead_code)]
pub fn model_and_tokenizer() -> (
    Arc<cleave_engine::model::Model>,
    Arc<cleave_text::tokenizer::Tokenizer>,
) {
    let l = loaded();
    (l.model.clone(), l.tokenizer.clone())
}

#[allow(dead_code)]
pub fn engine(num_blocks: usize, step_tokens: usize, prefix_caching: bool) -> Engine {
    let (m, t) = model_and_tokenizer();
    let config = EngineConfig {
        tiers: Default::default(),
        num_blocks,
        kv_dtype: KvDtype::F32,
        max_model_len: None,
        scheduler: SchedulerConfig {
            step_tokens,
            prefix_caching,
            ..Default::default()
        },
    };
    Engine::start(m, t, config)
}

#[allow(dead_code)]
pub fn prompt(text: &str) -> Vec<u32> {
    loaded().tokenizer.encode(text, false)
}

#[allow(dead_code)]
pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

#[allow(dead_code)]
pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub usage: Usage,
}

#[allow(dead_code)]
pub async fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<SeqEvent>) -> Outcome {
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { id, text: t, .. } => {
                ids.push(id);
                text.push_str(&t);
            }
            SeqEvent::Done {
                reason,
                usage,
                text: t,
            } => {
                text.push_str(&t);
                return Outcome {
                    ids,
                    text,
                    reason,
                    usage,
                };
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    panic!("stream ended without Done");
}

#[allow(dead_code)]
pub async fn run_all(e: &Engine, reqs: Vec<(Vec<u32>, SamplingParams)>) -> Vec<Outcome> {
    // All queued before the next step, whatever the timing: batching and preemption in the
    // tests do not depend on how fast the engine thread wakes up.
    e.hold();
    let rxs: Vec<_> = reqs
        .into_iter()
        .map(|(prompt, params)| e.submit(GenerateRequest::new(prompt, params)).unwrap().1)
        .collect();
    e.resume();
    let mut out = Vec::new();
    for rx in rxs {
        out.push(collect(rx).await);
    }
    out
}

#[allow(dead_code)]
pub async fn tokens_of(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<SeqEvent>,
) -> (Vec<u32>, FinishReason) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { id, .. } => ids.push(id),
            SeqEvent::Done { reason, .. } => return (ids, reason),
            other => panic!("unexpected {other:?}"),
        }
    }
    panic!("no Done");
}

/// Runs one request disaggregated (prefill in `prefill`, its KV blocks copied into
/// `decode`, which decodes); returns (tokens, blocks copied).
#[allow(dead_code)]
pub async fn disaggregated(
    prefill: &Engine,
    decode: &Engine,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> (Vec<u32>, usize) {
    let req = |mode| GenerateRequest {
        prompt: prompt.clone(),
        params: params.clone(),
        mode,
        resume: Vec::new(),
    };
    let (did, mut drx) = decode.submit(req(PrefillMode::Import)).unwrap();
    let (dst, cached) = match drx.recv().await {
        Some(SeqEvent::KvNeeded {
            blocks,
            cached_tokens,
        }) => (blocks, cached_tokens),
        other => panic!("expected KvNeeded, got {other:?}"),
    };
    let skip = cached / 16;
    let (_, mut prx) = prefill.submit(req(PrefillMode::Export)).unwrap();
    let (mut first, mut copied, mut lease) = (None, 0, None);
    while let Some(ev) = prx.recv().await {
        match ev {
            // Copy each block as soon as it is ready (overlapping the rest of the prefill).
            SeqEvent::KvReady { blocks } => {
                let wanted: Vec<(usize, BlockId)> =
                    blocks.into_iter().filter(|(i, _)| *i >= skip).collect();
                if wanted.is_empty() {
                    continue;
                }
                let src: Vec<BlockId> = wanted.iter().map(|w| w.1).collect();
                let to: Vec<BlockId> = wanted.iter().map(|w| dst[w.0]).collect();
                let bytes = prefill.read_blocks(src).await.unwrap();
                assert!(decode.write_blocks(to, bytes).await.unwrap());
                copied += wanted.len();
            }
            SeqEvent::Token { id, .. } => first = Some(id),
            SeqEvent::Held(l) => lease = Some(l),
            SeqEvent::Done { reason, .. } => {
                assert_eq!(reason, FinishReason::Length);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        lease.as_ref().map(|l| l.blocks().len()),
        Some(prompt.len().div_ceil(16))
    );
    drop(lease);
    decode.kv_imported(did, first.expect("prefill produced a first token"), None);
    let (ids, _) = tokens_of(drx).await;
    (ids, copied)
}

/// Waits until `e` runs, queues, parks and holds nothing; returns its stats then.
#[allow(dead_code)]
pub async fn settle(e: &Engine) -> cleave_engine::engine::EngineStats {
    for _ in 0..400 {
        let s = e.stats();
        if s.running == 0 && s.waiting == 0 && s.parked == 0 && s.held == 0 {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("engine did not settle: {:?}", e.stats());
}

/// The share of positions where the engine's next-token argmax (`got`) is llama.cpp's (`want`).
#[allow(dead_code)]
pub fn argmax_agreement(got: &[u32], want: &[u32]) -> f64 {
    let same = got.iter().zip(want).filter(|(a, b)| a == b).count();
    same as f64 / want.len() as f64
}

/// Waits until nothing runs or waits in `e` (polling its published stats).
#[allow(dead_code)]
pub async fn wait_idle(e: &Engine) {
    for _ in 0..2000 {
        let s = e.stats();
        if s.running == 0 && s.waiting == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("engine did not go idle: {:?}", e.stats());
}
