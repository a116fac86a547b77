//! The engine end to end on the default model: batching, prefix cache, cancellation,
//! preemption, and block accounting after each.

use crate::common;

use common::{collect, engine, greedy, prompt, run_all, wait_idle};

use cleave_engine::engine::{Engine, FinishReason, GenerateRequest, SeqEvent};
use cleave_text::sample::SamplingParams;

async fn assert_no_leak(e: &Engine, total: usize) {
    wait_idle(e).await;
    let s = e.stats();
    assert_eq!(s.pool.used, 0, "blocks still referenced: {:?}", s.pool);
    assert_eq!(s.pool.total, total);
    assert_eq!(s.pool.free + s.pool.cached_idle, total);
}

const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three primary colors:",
    "Water boils at a temperature of",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn batched_greedy_equals_each_alone() {
    let e = engine(512, 64, false);
    let mut alone = Vec::new();
    for p in PROMPTS {
        alone.push(run_all(&e, vec![(prompt(p), greedy(24))]).await.remove(0));
    }
    let together = run_all(
        &e,
        PROMPTS.iter().map(|p| (prompt(p), greedy(24))).collect(),
    )
    .await;
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a.ids, b.ids,
            "prompt {i} differs when batched: {:?} vs {:?}",
            a.text, b.text
        );
        assert_eq!(a.ids.len(), 24);
        assert_eq!(b.reason, FinishReason::Length);
    }
    // The model really answers: greedy continuation of the first prompt mentions Paris.
    assert!(alone[0].text.contains("Paris"), "{:?}", alone[0].text);
    assert_no_leak(&e, 512).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn prefix_cache_hit_gives_same_tokens_and_skips_compute() {
    let e = engine(256, 256, true);
    let long = "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use this file except in compliance with the License. You may obtain a copy of the License at";
    let p = prompt(long);
    assert!(p.len() >= 32, "prompt has {} tokens", p.len());
    let first = run_all(&e, vec![(p.clone(), greedy(12))]).await.remove(0);
    wait_idle(&e).await;
    let before = e.stats().counters;
    let second = run_all(&e, vec![(p.clone(), greedy(12))]).await.remove(0);
    wait_idle(&e).await;
    let after = e.stats().counters;
    assert_eq!(first.ids, second.ids);
    assert_eq!(first.usage.cached_tokens, 0);
    let full_blocks = (p.len() - 1) / 16 * 16;
    assert_eq!(second.usage.cached_tokens, full_blocks);
    assert_eq!(
        after.prefix_hit_tokens - before.prefix_hit_tokens,
        full_blocks as u64
    );
    // Only the uncached prompt tail and the decoded tokens were computed the second time.
    let computed = after.computed_tokens - before.computed_tokens;
    assert_eq!(computed as usize, p.len() - full_blocks + 11);
    // The stored events name the cached blocks.
    let events = e.take_kv_events();
    assert!(!events.is_empty());
    assert_no_leak(&e, 256).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn preemption_under_block_pressure_keeps_results_and_frees_everything() {
    // 12 blocks of 16 tokens for 4 sequences that each need ~3 blocks at the end: someone must
    // be preempted and recomputed.
    let reqs: Vec<_> = PROMPTS[..4]
        .iter()
        .map(|p| (prompt(p), greedy(30)))
        .collect();
    let roomy = engine(512, 256, false);
    let want = run_all(&roomy, reqs.clone()).await;
    let tight = engine(10, 256, false);
    let got = run_all(&tight, reqs).await;
    for (a, b) in want.iter().zip(&got) {
        assert_eq!(a.ids, b.ids);
    }
    assert!(
        tight.stats().counters.preemptions > 0,
        "no preemption happened: {:?}",
        tight.stats()
    );
    assert_no_leak(&tight, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn cancellation_and_dropped_streams_free_blocks() {
    let e = engine(128, 64, true);
    let (id, mut rx) = e
        .submit(GenerateRequest::new(prompt(PROMPTS[1]), greedy(500)))
        .unwrap();
    // Wait for a couple of tokens, then cancel.
    for _ in 0..2 {
        assert!(matches!(rx.recv().await, Some(SeqEvent::Token { .. })));
    }
    e.cancel(id);
    let out = collect(rx).await;
    assert_eq!(out.reason, FinishReason::Cancelled);
    // A client that goes away is cancelled too.
    let (_, rx) = e
        .submit(GenerateRequest::new(prompt(PROMPTS[2]), greedy(500)))
        .unwrap();
    drop(rx);
    assert_no_leak(&e, 128).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn stop_strings_eos_and_bad_requests() {
    let e = engine(128, 64, true);
    let l = common::loaded();
    // Greedy output of this prompt (checked above) contains "Paris": stop right before it.
    let params = SamplingParams {
        stop: vec!["Paris".into()],
        ..greedy(24)
    };
    let out = run_all(&e, vec![(prompt(PROMPTS[0]), params)])
        .await
        .remove(0);
    assert_eq!(out.reason, FinishReason::Stop);
    assert!(
        !out.text.contains("Paris") && !out.text.contains("Par"),
        "{:?}",
        out.text
    );
    // A chat prompt ends with <|im_end|> (an end-of-generation token) well before 200 tokens.
    let msg = cleave_text::chat::ChatMessage::new("user", "Say hello.");
    let text = l.template.as_ref().unwrap().render(&[msg], true).unwrap();
    let params = SamplingParams {
        max_tokens: 200,
        ..Default::default()
    };
    let out = run_all(&e, vec![(l.tokenizer.encode(&text, true), params)])
        .await
        .remove(0);
    assert_eq!(out.reason, FinishReason::Stop, "{:?}", out.text);
    assert!(!out.text.contains("<|im_end|>"));
    assert!(out.usage.completion_tokens < 200);
    // Bad input is refused with a precise error.
    let err = e
        .submit(GenerateRequest::new(vec![], greedy(1)))
        .unwrap_err();
    assert!(err.to_string().contains("empty"));
    let err = e
        .submit(GenerateRequest::new(vec![1, 999_999], greedy(1)))
        .unwrap_err();
    assert!(err.to_string().contains("999999"));
    let err = e
        .submit(GenerateRequest::new(vec![1; 100], greedy(1_000_000)))
        .unwrap_err();
    assert!(err.to_string().contains("exceeds"));
    assert_no_leak(&e, 128).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn seeded_sampling_is_reproducible_with_logprobs() {
    let e = engine(128, 64, true);
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 40,
        seed: Some(7),
        logprobs: Some(3),
        ..greedy(16)
    };
    let a = run_all(&e, vec![(prompt(PROMPTS[1]), params.clone())])
        .await
        .remove(0);
    let b = run_all(&e, vec![(prompt(PROMPTS[1]), params.clone())])
        .await
        .remove(0);
    assert_eq!(a.ids, b.ids);
    let c = run_all(
        &e,
        vec![(
            prompt(PROMPTS[1]),
            SamplingParams {
                seed: Some(8),
                ..params
            },
        )],
    )
    .await
    .remove(0);
    assert_ne!(a.ids, c.ids, "different seeds gave the same 16 tokens");
    assert_no_leak(&e, 128).await;
}
