//! Shared by the integration tests: the default model, loaded once per test binary.

use std::sync::{Arc, OnceLock};

use cleave_engine::engine::{Engine, EngineConfig, FinishReason, GenerateRequest, SeqEvent, Usage};
use cleave_engine::gguf::default_model_path;
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::load::Loaded;
use cleave_engine::sample::SamplingParams;
use cleave_engine::schedule::SchedulerConfig;

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
    Arc<cleave_engine::tokenizer::Tokenizer>,
) {
    let l = loaded();
    (l.model.clone(), l.tokenizer.clone())
}

#[allow(dead_code)]
pub fn engine(num_blocks: usize, step_tokens: usize, prefix_caching: bool) -> Engine {
    let (m, t) = model_and_tokenizer();
    let config = EngineConfig {
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
    let rxs: Vec<_> = reqs
        .into_iter()
        .map(|(prompt, params)| e.submit(GenerateRequest::new(prompt, params)).unwrap().1)
        .collect();
    let mut out = Vec::new();
    for rx in rxs {
        out.push(collect(rx).await);
    }
    out
}
