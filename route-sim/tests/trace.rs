//! The trace simulator on the first 300 requests of the shared Mooncake synthetic trace.

use std::collections::HashSet;
use std::path::PathBuf;

use cleave_place::PolicyKind;
use cleave_route_sim as sim;
use sim::{SimConfig, TenantTrace, TraceRequest};

fn slice() -> Vec<TraceRequest> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/mooncake_first_300.jsonl");
    sim::load_trace(&path).expect("the committed slice parses")
}

#[test]
fn parses_the_slice() {
    let t = slice();
    assert_eq!(t.len(), 300);
    assert_eq!(t[0].timestamp, 0);
    assert_eq!(t[0].input_length, 40160);
    assert_eq!(t[0].output_length, 6);
    assert_eq!(t[0].hash_ids, (0..79).collect::<Vec<u64>>());
    assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    let bad = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\nnot json\n";
    let err = sim::parse_trace(bad.as_bytes(), "inline").unwrap_err();
    assert!(
        matches!(err, sim::TraceError::Parse { line: 3, .. }),
        "{err:?}"
    );
}

/// Leading-prefix hits with an infinite cache, computed with a plain set.
fn reference_infinite_hit_rate(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        hits += r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        total += r.hash_ids.len();
        seen.extend(r.hash_ids.iter().copied());
    }
    hits as f64 / total as f64
}

#[test]
fn pooled_hit_rate_with_infinite_capacity_matches_reference() {
    let t = slice();
    let reference = reference_infinite_hit_rate(&t);
    assert!(reference > 0.02, "the slice shares prefixes: {reference}");
    let config = SimConfig {
        workers: 4,
        capacity_blocks: Some(1 << 30),
        policies: vec![PolicyKind::PrefixLoad],
        ..SimConfig::default()
    };
    let report = sim::run(&t, &config).unwrap();
    assert!(
        (report.pooled_hit_rate - reference).abs() < 1e-12,
        "{} vs {reference}",
        report.pooled_hit_rate
    );
    // No policy can beat a cache that never forgets.
    assert!(report.policies[0].hit_rate <= reference + 1e-12);
}

#[test]
fn prefix_load_beats_round_robin_and_the_index_mirrors_the_caches() {
    let t = slice();
    let config = SimConfig {
        workers: 4,
        ..SimConfig::default()
    };
    let report = sim::run(&t, &config).unwrap();
    let by = |name: &str| report.policy(name).unwrap().clone();
    let (pl, rr) = (by("prefix-load"), by("round-robin"));
    assert!(
        pl.hit_rate > 1.5 * rr.hit_rate,
        "prefix-load {} vs round-robin {}",
        pl.hit_rate,
        rr.hit_rate
    );
    let one_step = config.time.decode_step_s(1);
    for p in &report.policies {
        assert_eq!(
            p.completed,
            t.len(),
            "{}: every request prefilled",
            p.policy
        );
        // Every event reached the index once the run drained: it mirrors the caches exactly.
        assert_eq!(
            p.final_index_mismatches, 0,
            "{}: index and worker caches disagree",
            p.policy
        );
        assert!(
            p.hit_rate <= report.pooled_hit_rate * 1.5 + 1e-9,
            "{}",
            p.policy
        );
        assert!(
            p.load_imbalance >= 1.0 && p.ttft_p99_s >= p.ttft_p50_s,
            "{p:?}"
        );
        // No token comes faster than a batch-1 decode step.
        assert!(
            p.itl_p50_s >= one_step - 1e-12 && p.itl_p99_s >= p.itl_p50_s,
            "{p:?}"
        );
    }
}

#[test]
fn sglang_matches_what_it_routed_and_goes_stale_under_eviction() {
    // Small caches evict; SGLang's tree of routed requests never hears of it, the KV-event
    // index does once the events arrive.
    let t = slice();
    let config = SimConfig {
        workers: 4,
        capacity_blocks: Some(200),
        policies: vec![PolicyKind::SglangCacheAware, PolicyKind::DynamoCost],
        ..SimConfig::default()
    };
    let report = sim::run(&t, &config).unwrap();
    let sg = report.policy("sglang-cache-aware").unwrap();
    let dy = report.policy("dynamo-cost").unwrap();
    assert!(
        sg.stale_match_rate > dy.stale_match_rate,
        "sglang {} vs dynamo {}",
        sg.stale_match_rate,
        dy.stale_match_rate
    );
}

#[test]
fn a_faster_cluster_or_a_lighter_load_lowers_ttft() {
    let t = slice();
    let run = |load: f64, prefill: f64| {
        let mut config = SimConfig {
            workers: 4,
            offered_load: Some(load),
            policies: vec![PolicyKind::RoundRobin],
            ..SimConfig::default()
        };
        config.time.prefill_tokens_per_s = prefill;
        sim::run(&t, &config).unwrap().policies[0].clone()
    };
    let base = run(1.0, 830.2);
    let light = run(0.25, 830.2);
    assert!(light.ttft_p99_s < base.ttft_p99_s, "{light:?} vs {base:?}");
    // Same offered load on a 10x faster engine: arrivals are 10x denser, TTFT 10x shorter
    // for the prefill part (decode steps do not scale, so not exactly).
    let fast = run(1.0, 8302.0);
    assert!(
        fast.ttft_p50_s < base.ttft_p50_s / 3.0,
        "{fast:?} vs {base:?}"
    );
    assert!(
        (fast.hit_rate - base.hit_rate).abs() < 1e-12,
        "round-robin ignores time"
    );
}

#[test]
fn bad_time_models_are_errors() {
    let mut config = SimConfig::default();
    config.time.decode_tokens_per_s.clear();
    assert!(matches!(
        sim::run(&slice(), &config),
        Err(sim::SimError::Config(_))
    ));
    let config = SimConfig {
        offered_load: Some(0.0),
        ..SimConfig::default()
    };
    assert!(matches!(
        sim::run(&slice(), &config),
        Err(sim::SimError::Config(_))
    ));
}

#[test]
fn empty_trace_and_zero_workers_are_errors() {
    assert!(sim::run(&[], &SimConfig::default()).is_err());
    let config = SimConfig {
        workers: 0,
        ..SimConfig::default()
    };
    assert!(sim::run(&slice(), &config).is_err());
}

#[test]
fn json_has_exactly_the_documented_shape() {
    let t = slice();
    let report = sim::run(&t, &SimConfig::default()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    // Keys keep insertion order (serde_json `preserve_order`), so compare sorted.
    let mut top: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    top.sort();
    assert_eq!(top, ["policies", "pooled_hit_rate"]);
    assert!(v["pooled_hit_rate"].as_f64().unwrap() > 0.0);
    let policies = v["policies"].as_array().unwrap();
    let names: Vec<_> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    let all: Vec<_> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(names, all);
    let numbers = [
        "decisions_per_s",
        "hit_rate",
        "itl_p50_s",
        "itl_p99_s",
        "load_imbalance",
        "stale_match_rate",
        "ttft_p50_s",
        "ttft_p99_s",
    ];
    for p in policies {
        let mut keys: Vec<_> = p.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        let mut expected: Vec<_> = numbers.iter().chain(&["policy"]).copied().collect();
        expected.sort();
        assert_eq!(keys, expected);
        for k in numbers {
            let x = p[k].as_f64().unwrap();
            assert!(x.is_finite() && x >= 0.0, "{}: {k} = {x}", p["policy"]);
        }
    }
}

#[test]
fn pinned_reference_keeps_each_tenant_on_one_worker() {
    // 8 tenants on 8 workers whose caches hold one tenant's prompt (16 + 2 blocks): pinned,
    // every worker serves one tenant, so each prefix misses once and then always hits, while
    // its own question (2 blocks) always misses.
    let tenants = TenantTrace {
        tenants: 8,
        requests: 400,
        ..TenantTrace::default()
    };
    let t = tenants.generate();
    let seen: HashSet<u64> = t.iter().map(|r| r.hash_ids[0]).collect();
    let config = SimConfig {
        workers: 8,
        capacity_blocks: Some(18),
        policies: vec![PolicyKind::RoundRobin],
        pin_groups_of: Some(tenants.prefix_blocks),
        ..SimConfig::default()
    };
    let report = sim::run(&t, &config).unwrap();
    let pinned = report
        .policy(sim::PINNED)
        .expect("the pinned reference ran");
    let expected = (16 * (t.len() - seen.len())) as f64 / (18 * t.len()) as f64;
    assert!(
        (pinned.hit_rate - expected).abs() < 1e-12,
        "{} vs {expected}",
        pinned.hit_rate
    );
    assert_eq!(pinned.completed, t.len());
    assert_eq!(pinned.final_index_mismatches, 0);
    let rr = report.policy("round-robin").unwrap();
    assert!(rr.hit_rate < pinned.hit_rate / 2.0, "{rr:?}");
    // Not asked for: not run.
    let none = sim::run(
        &t,
        &SimConfig {
            pin_groups_of: None,
            ..config
        },
    )
    .unwrap();
    assert!(none.policy(sim::PINNED).is_none());
}
