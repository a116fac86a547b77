//! A migrated request (`GenerateRequest::resume`): continuing after the first k tokens of a run
//! gives exactly the rest of that run — the same token ids, the text not yet streamed (including
//! what the decoder or a stop string held back), the seeded RNG's next draws — and usage that
//! counts every token once.

use crate::common;

use cleave_engine::engine::{Engine, EngineConfig, FinishReason, GenerateRequest, SeqEvent, Usage};
use cleave_text::constrain::Constraint;
use cleave_text::sample::SamplingParams;

fn engine() -> Engine {
    let (m, t) = common::model_and_tokenizer();
    Engine::start(
        m,
        t,
        EngineConfig {
            tiers: Default::default(),
            num_blocks: 128,
            ..Default::default()
        },
    )
}

/// (ids, streamed text per token, held-back tail, reason, usage)
async fn run(
    e: &Engine,
    req: GenerateRequest,
) -> (Vec<u32>, Vec<String>, String, FinishReason, Usage) {
    let (_, mut rx) = e.submit(req).expect("submit");
    let (mut ids, mut texts) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { id, text, .. } => {
                ids.push(id);
                texts.push(text);
            }
            SeqEvent::Done {
                reason,
                usage,
                text,
            } => return (ids, texts, text, reason, usage),
            other => panic!("unexpected {other:?}"),
        }
    }
    panic!("no Done");
}

async fn check_resume(params: SamplingParams, prompt: &str, k: usize) {
    let e = engine();
    let tok = &common::loaded().tokenizer;
    let prompt = tok.encode(prompt, false);
    let whole = run(&e, GenerateRequest::new(prompt.clone(), params.clone())).await;
    assert!(whole.0.len() > k, "the run is too short: {:?}", whole.0);
    let mut req = GenerateRequest::new(prompt.clone(), params.clone());
    req.resume = whole.0[..k].to_vec();
    let rest = run(&e, req).await;
    assert_eq!(rest.0, whole.0[k..], "token ids after the resume point");
    assert_eq!(rest.1, whole.1[k..], "text streamed after the resume point");
    assert_eq!((rest.2, rest.3), (whole.2, whole.3));
    assert_eq!(rest.4.prompt_tokens, prompt.len());
    assert_eq!(rest.4.completion_tokens, whole.4.completion_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_resume_continues_the_run() {
    let params = SamplingParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    check_resume(params, "The capital of France is", 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_resumes_at_the_same_rng_position() {
    let params = SamplingParams {
        max_tokens: 24,
        ignore_eos: true,
        temperature: 0.9,
        seed: Some(1234),
        ..Default::default()
    };
    check_resume(params, "Write a poem about the sea:", 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_held_back_for_a_stop_string_is_streamed_after_the_resume() {
    // Find a run, then stop at a string that spans the resume point: the text held back at the
    // cut must come out of the resumed request, and the stop must still apply.
    let e = engine();
    let tok = &common::loaded().tokenizer;
    let prompt = "Count: one, two, three, four, five,";
    let free = SamplingParams {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let ids = tok.encode(prompt, false);
    let whole = run(&e, GenerateRequest::new(ids, free.clone())).await;
    let text: String = whole.1.concat() + &whole.2;
    // A stop string made of the end of token 4's text and the start of token 6's.
    let upto4: usize = whole.1[..4].iter().map(String::len).sum();
    let upto6: usize = whole.1[..6].iter().map(String::len).sum();
    let cut = |i: usize| {
        (i..=text.len())
            .find(|&j| text.is_char_boundary(j))
            .unwrap()
    };
    let (a, b) = (
        cut(upto4.saturating_sub(2)),
        cut((upto6 + 1).min(text.len())),
    );
    let stop = text[a..b].to_string();
    assert!(!stop.is_empty(), "{text:?}");
    let params = SamplingParams {
        stop: vec![stop],
        ..free
    };
    check_resume(params, prompt, 5).await;
}

/// The grammar takes the resumed tokens: without them it would start again at `{` and mask the
/// continuation differently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_request_resumes_inside_its_grammar() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let params = SamplingParams {
        max_tokens: 40,
        constraint: Some(Constraint::JsonSchema { schema }),
        ..Default::default()
    };
    check_resume(params, "Describe a person as JSON:", 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_left_to_generate_is_refused() {
    let e = engine();
    let mut req = GenerateRequest::new(
        vec![1, 2, 3],
        SamplingParams {
            max_tokens: 2,
            ..Default::default()
        },
    );
    req.resume = vec![4, 5];
    let err = e.submit(req).expect_err("resume as long as max_tokens");
    assert!(err.to_string().contains("nothing is left"), "{err}");
}
