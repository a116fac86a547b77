//! Prefill in one engine, decode in another: the export/import modes and the staged block
//! copy give exactly the tokens of one engine doing both, reuse the decode side's prefix cache,
//! fall back to local prefill when the KV does not come, and never leak a block.

use crate::common;

use cleave_engine::engine::{
    Engine, EngineConfig, FinishReason, GenerateRequest, PrefillMode, SeqEvent,
};
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::sample::SamplingParams;
use common::{disaggregated, settle, tokens_of};

fn engine(step_tokens: usize) -> Engine {
    engine_kv(step_tokens, KvDtype::F32)
}

fn engine_kv(step_tokens: usize, kv_dtype: KvDtype) -> Engine {
    let (m, t) = common::model_and_tokenizer();
    let config = EngineConfig {
        tiers: Default::default(),
        num_blocks: 128,
        kv_dtype,
        scheduler: SchedulerConfig {
            step_tokens,
            ..Default::default()
        },
        ..Default::default()
    };
    Engine::start(m, t, config)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_here_decode_there_equals_one_engine() {
    for dtype in KvDtype::ALL {
        disaggregate_with(dtype).await;
    }
}

/// The blocks travel as bytes in the pool's own element type (quantized ones unchanged), so
/// the tokens equal one engine's with the same type.
async fn disaggregate_with(dtype: KvDtype) {
    let tok = &common::loaded().tokenizer;
    let long = "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use this file except in compliance with the License. ".repeat(4);
    let prompts = [
        tok.encode("The capital of France is", false),
        // Longer than a prefill chunk (step budget 32 tokens below).
        tok.encode(&long, false),
    ];
    let single = engine_kv(32, dtype);
    let (p, d) = (engine_kv(32, dtype), engine_kv(32, dtype));
    for prompt in &prompts {
        let (want, _) = tokens_of(
            single
                .submit(GenerateRequest::new(prompt.clone(), greedy(20)))
                .unwrap()
                .1,
        )
        .await;
        let (got, copied) = disaggregated(&p, &d, prompt.clone(), greedy(20)).await;
        assert_eq!(
            got,
            want,
            "{dtype:?}: disaggregated output differs for a {}-token prompt",
            prompt.len()
        );
        assert_eq!(copied, prompt.len().div_ceil(16));
    }
    // The same long prompt again: the decode engine has its full blocks cached now, so only
    // the tail block travels, and the output is unchanged.
    let (want, _) = tokens_of(
        single
            .submit(GenerateRequest::new(prompts[1].clone(), greedy(20)))
            .unwrap()
            .1,
    )
    .await;
    let (got, copied) = disaggregated(&p, &d, prompts[1].clone(), greedy(20)).await;
    assert_eq!(got, want);
    assert_eq!(
        copied,
        prompts[1].len().div_ceil(16) - (prompts[1].len() - 1) / 16
    );
    for e in [&p, &d] {
        let s = settle(e).await;
        assert_eq!(s.pool.used, 0, "{:?}", s.pool);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_kv_falls_back_to_local_prefill_or_aborts_without_leaks() {
    let tok = &common::loaded().tokenizer;
    let prompt = tok.encode("Once upon a time, in a small village by the sea,", false);
    let single = engine(64);
    let (want, _) = tokens_of(
        single
            .submit(GenerateRequest::new(prompt.clone(), greedy(12)))
            .unwrap()
            .1,
    )
    .await;
    let d = engine(64);
    let import = GenerateRequest {
        prompt: prompt.clone(),
        params: greedy(12),
        mode: PrefillMode::Import,
        resume: Vec::new(),
    };
    // Fallback: the decode engine computes the prompt itself.
    let (id, mut rx) = d.submit(import.clone()).unwrap();
    assert!(matches!(rx.recv().await, Some(SeqEvent::KvNeeded { .. })));
    d.kv_import_failed(id, true);
    let (got, reason) = tokens_of(rx).await;
    assert_eq!(got, want);
    assert_eq!(reason, FinishReason::Length);
    // No fallback: the request ends with Aborted and its blocks come back.
    let (id, mut rx) = d.submit(import).unwrap();
    assert!(matches!(rx.recv().await, Some(SeqEvent::KvNeeded { .. })));
    let mut parked = d.stats();
    for _ in 0..400 {
        if parked.parked == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        parked = d.stats();
    }
    assert_eq!(parked.parked, 1);
    assert!(parked.pool.used > 0, "a parked sequence holds its blocks");
    d.kv_import_failed(id, false);
    let (got, reason) = tokens_of(rx).await;
    assert!(got.is_empty());
    assert_eq!(reason, FinishReason::Aborted);
    assert_eq!(settle(&d).await.pool.used, 0);
    // An exported sequence whose stream is dropped releases its held blocks.
    let p = engine(64);
    let (_, prx) = p
        .submit(GenerateRequest {
            prompt,
            params: greedy(1),
            mode: PrefillMode::Export,
            resume: Vec::new(),
        })
        .unwrap();
    drop(prx);
    assert_eq!(settle(&p).await.pool.used, 0);
}

/// A constrained request: the prefill engine samples the first token under the grammar, the
/// decode engine's grammar consumes it and constrains the rest; the output is the one engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_output_is_the_same_disaggregated() {
    use cleave_text::constrain::Constraint;
    let tok = &common::loaded().tokenizer;
    let prompt = tok.encode(
        "<|im_start|>user\nDescribe a city as JSON.<|im_end|>\n<|im_start|>assistant\n",
        true,
    );
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0},
            "coastal": {"type": "boolean"}
        },
        "required": ["city", "population", "coastal"],
        "additionalProperties": false
    });
    let params = SamplingParams {
        max_tokens: 80,
        constraint: Some(Constraint::JsonSchema { schema }),
        ..Default::default()
    };
    let single = engine(32);
    let (want, reason) = tokens_of(
        single
            .submit(GenerateRequest::new(prompt.clone(), params.clone()))
            .unwrap()
            .1,
    )
    .await;
    assert_eq!(reason, FinishReason::Stop);
    let text = tok.decode(&want);
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
    let (p, d) = (engine(32), engine(32));
    let (got, _) = disaggregated(&p, &d, prompt, params).await;
    assert_eq!(got, want, "{:?} vs {text:?}", tok.decode(&got));
}

/// A first token the decode side's grammar refuses (a prefill worker that ignored the
/// constraint) aborts that request alone; a request batched beside it is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_outside_the_grammar_aborts_only_its_request() {
    use cleave_text::constrain::Constraint;
    let tok = &common::loaded().tokenizer;
    let d = engine(32);
    let free_prompt = tok.encode("The capital of France is", false);
    let (want, _) = tokens_of(
        d.submit(GenerateRequest::new(free_prompt.clone(), greedy(16)))
            .unwrap()
            .1,
    )
    .await;
    let params = SamplingParams {
        max_tokens: 16,
        constraint: Some(Constraint::Regex {
            pattern: "[0-9]+".into(),
        }),
        ..Default::default()
    };
    let req = GenerateRequest {
        prompt: tok.encode("Pick a number:", false),
        params,
        mode: PrefillMode::Import,
        resume: Vec::new(),
    };
    let (id, mut rx) = d.submit(req).unwrap();
    assert!(matches!(rx.recv().await, Some(SeqEvent::KvNeeded { .. })));
    let (_, free_rx) = d
        .submit(GenerateRequest::new(free_prompt, greedy(16)))
        .unwrap();
    // "x" is no digit.
    let bad = tok.encode("x", false)[0];
    d.kv_imported(id, bad, None);
    let (ids, reason) = tokens_of(rx).await;
    assert_eq!((ids, reason), (vec![bad], FinishReason::Aborted));
    let (got, _) = tokens_of(free_rx).await;
    assert_eq!(got, want);
    let s = settle(&d).await;
    assert_eq!(s.pool.used, 0, "{:?}", s.pool);
}

/// More imports than the pool holds at once: the ones that do not fit wait until parked
/// sequences give their blocks back, instead of ending at once with no token (a decode worker
/// under a burst of disaggregated requests used to answer them `length` with empty text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imports_beyond_the_pool_wait_for_parked_blocks() {
    let tok = &common::loaded().tokenizer;
    let prompt = tok.encode(
        &"a few words to fill three blocks of sixteen tokens ".repeat(4),
        false,
    );
    let need = prompt.len().div_ceil(16);
    let (m, t) = common::model_and_tokenizer();
    // Room for two parked prompts, not three.
    let d = Engine::start(
        m,
        t,
        EngineConfig {
            tiers: Default::default(),
            num_blocks: 2 * need + need / 2,
            ..Default::default()
        },
    );
    let import = GenerateRequest {
        prompt,
        params: greedy(4),
        mode: PrefillMode::Import,
        resume: Vec::new(),
    };
    let (first, mut rx1) = d.submit(import.clone()).unwrap();
    let (second, mut rx2) = d.submit(import.clone()).unwrap();
    let (third, mut rx3) = d.submit(import).unwrap();
    for rx in [&mut rx1, &mut rx2] {
        assert!(matches!(rx.recv().await, Some(SeqEvent::KvNeeded { .. })));
    }
    // The first import fails without fallback: its blocks come back and the third gets them.
    d.kv_import_failed(first, false);
    assert!(
        matches!(rx3.recv().await, Some(SeqEvent::KvNeeded { .. })),
        "the request that did not fit must wait for blocks, not end"
    );
    d.kv_import_failed(second, true);
    d.kv_import_failed(third, true);
    for rx in [rx2, rx3] {
        let (got, reason) = tokens_of(rx).await;
        assert_eq!((got.len(), reason), (4, FinishReason::Length));
    }
    assert_eq!(settle(&d).await.pool.used, 0);
}
