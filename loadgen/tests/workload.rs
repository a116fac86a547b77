//! Trace scaling, prompt mapping, synthetic prefixes, percentiles, Poisson arrivals, SSE and
//! Prometheus parsing.

use std::path::PathBuf;

use cleave_loadgen::arrival::poisson;
use cleave_loadgen::report::measured_prefix_overlap;
use cleave_loadgen::scrape::{delta, sum_metric, Counters};
use cleave_loadgen::sse::{classify, SseEvent, SseParser};
use cleave_loadgen::stats::{percentile, Summary};
use cleave_loadgen::tokens::{Prompt, PromptFormat, TokenMap};
use cleave_loadgen::trace::{self, TraceSample, TraceScale};
use cleave_loadgen::workload::{LengthDist, RequestSpec, Synthetic};
use cleave_loadgen::LoadgenError;
use cleave_types::trace::TraceRequest;

fn trace_file() -> Vec<TraceRequest> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../route-sim/tests/data/mooncake_first_300.jsonl");
    cleave_types::trace::load_trace(&p).unwrap()
}

fn scale(s: f64) -> TraceScale {
    TraceScale {
        input_scale: s,
        output_scale: 0.5,
        max_input: None,
        max_output: Some(16),
        source_block_tokens: 512,
    }
}

/// `t` mapped with its lengths scaled by `input_scale` (see [`scale`]), the default token
/// map, token prompts and the trace's own timing.
fn token_requests(t: &[TraceRequest], input_scale: f64) -> Result<Vec<RequestSpec>, LoadgenError> {
    trace::to_requests(
        t,
        &scale(input_scale),
        &TokenMap::default(),
        PromptFormat::Tokens,
        1.0,
    )
}

fn tokens(p: &Prompt) -> &[u32] {
    match p {
        Prompt::Tokens(t) => t,
        Prompt::Text(_) => panic!("expected tokens"),
    }
}

fn req(ts: u64, input: u64, ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp: ts,
        input_length: input,
        output_length: 40,
        hash_ids: ids.to_vec(),
    }
}

#[test]
fn scaled_trace_lengths_blocks_and_offsets() {
    let t = vec![req(1000, 1536, &[1, 2, 3]), req(3000, 1200, &[1, 2, 9])];
    let r = trace::to_requests(
        &t,
        &scale(1.0 / 32.0),
        &TokenMap::default(),
        PromptFormat::Tokens,
        0.5,
    )
    .unwrap();
    assert_eq!(r[0].prompt_tokens, 48);
    assert_eq!(tokens(&r[0].prompt).len(), 48);
    // 1200/32 = 37.5 → 38 tokens: two full 16-token blocks and 6 of the third.
    assert_eq!(tokens(&r[1].prompt).len(), 38);
    assert_eq!(r[0].max_tokens, 16, "40 × 0.5 = 20, capped at 16");
    assert_eq!(r[0].at.unwrap().as_millis(), 0);
    assert_eq!(
        r[1].at.unwrap().as_millis(),
        1000,
        "2000 ms apart × time scale 0.5"
    );
    // Shared ids 1, 2 → the first 32 tokens are identical; block 3 vs 9 differ.
    assert_eq!(tokens(&r[0].prompt)[..32], tokens(&r[1].prompt)[..32]);
    assert_ne!(tokens(&r[0].prompt)[32..38], tokens(&r[1].prompt)[32..38]);
}

#[test]
fn mapping_is_deterministic_and_seeded() {
    let t = trace_file();
    let a = token_requests(&t[..50], 1.0 / 64.0).unwrap();
    let b = token_requests(&t[..50], 1.0 / 64.0).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.prompt, y.prompt);
    }
    let other = TokenMap {
        seed: 99,
        ..TokenMap::default()
    };
    let c = trace::to_requests(
        &t[..50],
        &scale(1.0 / 64.0),
        &other,
        PromptFormat::Tokens,
        1.0,
    )
    .unwrap();
    assert_ne!(a[0].prompt, c[0].prompt);
    // Every token stays inside the map's range.
    let m = TokenMap::default();
    assert!(a
        .iter()
        .flat_map(|r| tokens(&r.prompt).iter())
        .all(|&t| t >= m.lo && t < m.hi));
}

#[test]
fn shared_hash_ids_give_identical_prefixes_in_the_real_trace() {
    let t = trace_file();
    let r = token_requests(&t, 1.0 / 64.0).unwrap();
    let bt = 8;
    let mut checked = 0;
    for i in 0..t.len() {
        for j in 0..i {
            let shared = t[i]
                .hash_ids
                .iter()
                .zip(&t[j].hash_ids)
                .take_while(|(a, b)| a == b)
                .count();
            let (a, b) = (tokens(&r[i].prompt), tokens(&r[j].prompt));
            let n = (shared * bt).min(a.len()).min(b.len());
            assert_eq!(a[..n], b[..n], "requests {j} and {i} share {shared} ids");
            if shared > 0 && n < a.len() && n < b.len() {
                // The first differing id starts a different run of tokens.
                assert_ne!(
                    a[n..(n + bt).min(a.len()).min(b.len())],
                    b[n..(n + bt).min(a.len()).min(b.len())]
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "the first 300 requests share some prefixes");
    // Text prompts share the same prefixes (as words).
    let text = trace::to_requests(
        &t[..2],
        &scale(1.0 / 64.0),
        &TokenMap::default(),
        PromptFormat::Text,
        1.0,
    )
    .unwrap();
    match &text[0].prompt {
        Prompt::Text(s) => assert_eq!(s.split(' ').count(), text[0].prompt_tokens),
        _ => panic!("expected text"),
    }
}

#[test]
fn session_sampling_keeps_whole_sessions() {
    let t = vec![
        req(0, 512, &[1, 2]),
        req(1, 512, &[5]),
        req(2, 512, &[1, 2, 3]),
        req(3, 512, &[7]),
        req(4, 512, &[5, 6]),
    ];
    let s = trace::sample(
        &t,
        &TraceSample {
            sessions: Some(2),
            limit: None,
        },
    );
    let roots: Vec<u64> = s.iter().map(|r| r.hash_ids[0]).collect();
    assert_eq!(roots, vec![1, 5, 1, 5]);
    assert!(trace::prefix_overlap(&s) > 0.3);
    let s = trace::sample(
        &t,
        &TraceSample {
            sessions: None,
            limit: Some(3),
        },
    );
    assert_eq!(s.len(), 3);
}

#[test]
fn bad_scales_are_refused_with_a_message() {
    let t = vec![req(0, 512, &[1])];
    let err = token_requests(&t, 0.0).unwrap_err();
    assert!(err.to_string().contains("input scale"), "{err}");
    let err = token_requests(&[], 0.5).unwrap_err();
    assert!(err.to_string().contains("no requests"), "{err}");
}

#[test]
fn synthetic_prefix_fraction_is_what_was_asked() {
    let s = Synthetic {
        input: LengthDist {
            mean: 100,
            spread: 0.0,
        },
        output: LengthDist {
            mean: 10,
            spread: 0.5,
        },
        prefix_fraction: 0.5,
        prefix_groups: 1,
        requests: 20,
        seed: 1,
    };
    let r = s
        .generate(&TokenMap::default(), PromptFormat::Tokens)
        .unwrap();
    assert!(r
        .iter()
        .all(|x| x.prompt_tokens == 100 && (5..=15).contains(&x.max_tokens)));
    // One group: every prompt after the first repeats exactly 50 tokens.
    let overlap = measured_prefix_overlap(&r);
    assert!((overlap - 0.5 * 19.0 / 20.0).abs() < 0.02, "{overlap}");
    let none = Synthetic {
        prefix_fraction: 0.0,
        ..s.clone()
    }
    .generate(&TokenMap::default(), PromptFormat::Tokens)
    .unwrap();
    assert!(measured_prefix_overlap(&none) < 0.01);
    assert!(Synthetic {
        prefix_fraction: 1.5,
        ..s
    }
    .generate(&TokenMap::default(), PromptFormat::Tokens)
    .is_err());
}

#[test]
fn percentiles_match_known_values() {
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    // NumPy: np.percentile(range(1, 101), [50, 90, 99]) = 50.5, 90.1, 99.01.
    assert!((percentile(&v, 50.0).unwrap() - 50.5).abs() < 1e-9);
    assert!((percentile(&v, 90.0).unwrap() - 90.1).abs() < 1e-9);
    assert!((percentile(&v, 99.0).unwrap() - 99.01).abs() < 1e-9);
    assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.0), Some(1.0));
    assert_eq!(percentile(&[3.0, 1.0, 2.0], 100.0), Some(3.0));
    assert_eq!(percentile(&[], 50.0), None);
    let s = Summary::of_seconds(&[0.010, 0.020, 0.030, 0.040]);
    assert!(
        (s.p50 - 25.0).abs() < 1e-9 && (s.mean - 25.0).abs() < 1e-9,
        "{s:?}"
    );
    assert!((s.p99 - 39.7).abs() < 1e-9, "{s:?}");
}

#[test]
fn poisson_arrivals_have_the_stated_rate() {
    for rate in [0.5, 4.0, 50.0] {
        let t = poisson(rate, 20_001, 42);
        assert_eq!(t[0].as_secs_f64(), 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let measured = 20_000.0 / t.last().unwrap().as_secs_f64();
        // The mean of 20,000 exponential gaps is within ±3% of 1/rate with overwhelming odds.
        assert!(
            (measured / rate - 1.0).abs() < 0.03,
            "rate {rate}: measured {measured}"
        );
        // Exponential gaps: the coefficient of variation is 1.
        let gaps: Vec<f64> = t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((var.sqrt() / mean - 1.0).abs() < 0.05);
    }
    assert_eq!(poisson(2.0, 10, 1), poisson(2.0, 10, 1));
    assert_ne!(poisson(2.0, 10, 1), poisson(2.0, 10, 2));
}

#[test]
fn sse_events_split_across_reads() {
    let stream = "data: {\"choices\":[{\"text\":\"Hel\",\"index\":0}]}\n\ndata: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\r\n\r\n: comment\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\ndata: [DONE]\n\n";
    let mut p = SseParser::default();
    let mut events = Vec::new();
    for piece in stream.as_bytes().chunks(7) {
        events.extend(p.feed(piece).iter().map(|d| classify(d)));
    }
    assert_eq!(
        events,
        vec![
            SseEvent::Token,
            SseEvent::Other,
            SseEvent::Other,
            SseEvent::Token,
            SseEvent::Usage {
                prompt: 5,
                completion: 2,
                cached: Some(3)
            },
            SseEvent::Done
        ]
    );
    assert!(
        matches!(classify("{\"error\":{\"message\":\"boom\"}}"), SseEvent::Error(m) if m == "boom")
    );
    assert!(matches!(classify("not json"), SseEvent::Error(_)));
}

#[test]
fn prometheus_counters_and_their_deltas() {
    let text = "# HELP x\ncleave_router_placements_total{policy=\"prefix-load\",mode=\"local\"} 3\ncleave_router_placements_total{policy=\"prefix-load\",mode=\"disaggregated\"} 1\ncleave_prefix_cache_hit_tokens_total 40\ncleave_prefix_cache_hit_tokens_total_extra 99\n";
    assert_eq!(
        sum_metric(text, "cleave_router_placements_total", None),
        Some(4.0)
    );
    assert_eq!(
        sum_metric(
            text,
            "cleave_router_placements_total",
            Some("mode=\"local\"")
        ),
        Some(3.0)
    );
    assert_eq!(
        sum_metric(text, "cleave_prefix_cache_hit_tokens_total", None),
        Some(40.0)
    );
    assert_eq!(sum_metric(text, "absent", None), None);
    let before = Counters {
        disaggregated: 1.0,
        local: 3.0,
        hit_tokens: 40.0,
        query_tokens: 100.0,
        router_seen: true,
        workers_seen: true,
    };
    let after = Counters {
        disaggregated: 4.0,
        local: 4.0,
        hit_tokens: 70.0,
        query_tokens: 200.0,
        ..before
    };
    let d = delta(&before, &after);
    assert_eq!(d.prefix_hit_rate, Some(0.3));
    assert_eq!(d.disaggregated_fraction, Some(0.75));
    assert_eq!(
        delta(&Counters::default(), &Counters::default()).prefix_hit_rate,
        None
    );
}
