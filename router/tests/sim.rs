//! The trace simulator on the first 300 requests of the shared Mooncake synthetic trace.

use std::collections::HashSet;
use std::path::PathBuf;

use cleave_router::place::PolicyKind;
use cleave_router::sim::{self, SimConfig, TraceRequest};

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
        matches!(err, sim::SimError::Parse { line: 3, .. }),
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
    let by = |name: &str| {
        report
            .policies
            .iter()
            .find(|p| p.policy == name)
            .unwrap()
            .clone()
    };
    let (pl, rr) = (by("prefix-load"), by("round-robin"));
    assert!(
        pl.hit_rate > 1.5 * rr.hit_rate,
        "prefix-load {} vs round-robin {}",
        pl.hit_rate,
        rr.hit_rate
    );
    for p in &report.policies {
        assert_eq!(
            p.index_mismatches, 0,
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
    }
}

#[test]
fn json_has_exactly_the_documented_shape() {
    let t = slice();
    let report = sim::run(&t, &SimConfig::default()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let mut top: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    top.sort();
    assert_eq!(top, ["policies", "pooled_hit_rate"]);
    assert!(v["pooled_hit_rate"].is_f64());
    let policies = v["policies"].as_array().unwrap();
    let names: Vec<_> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["prefix-load", "round-robin", "least-load", "random"]
    );
    for p in policies {
        let mut keys: Vec<_> = p.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "decisions_per_s",
                "hit_rate",
                "load_imbalance",
                "policy",
                "ttft_p50_s",
                "ttft_p99_s"
            ]
        );
        for k in [
            "decisions_per_s",
            "hit_rate",
            "load_imbalance",
            "ttft_p50_s",
            "ttft_p99_s",
        ] {
            assert!(p[k].as_f64().unwrap() >= 0.0, "{k}");
        }
    }
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
