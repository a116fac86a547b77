//! Tiny random MoE checkpoints (Mixtral-style; Qwen2-MoE-style with a gated shared expert and a
//! dense layer; Qwen3-MoE-style with head norms): expert parallelism over 1, 2 and 4 ranks gives
//! the same logits, and one rank matches an independent numpy forward pass.

use crate::tiny;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cleave_engine::kernels::Threads;
use cleave_engine::model::Model;
use cleave_text::safetensors::Dtype;
use cleave_types::collective::SingleRank;
use tiny::{all_logits, max_diff, on_ranks, write_model, Kind};

/// Across EP sizes only the order of float sums changes (attention's all-reduce, the shared
/// expert's row-parallel sum); the routed experts' outputs are combined in the same order.
const EP_TOL: f32 = 1e-4;
/// numpy runs in float64 from the same stored weights; cleave computes in f32.
const REF_TOL: f32 = 2e-3;

fn prompt() -> Vec<u32> {
    (0..24).map(|i| (i * 53 + 7) % tiny::VOCAB as u32).collect()
}

fn numpy_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf_reference.py");
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(dir)
        .arg(list.join(","))
        .output()
        .expect("running python3 (scripts/test installs it with numpy)");
    assert!(
        out.status.success(),
        "numpy reference failed (is numpy installed? scripts/test installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect()
}

fn check(kind: Kind, dtype: Dtype, name: &str) {
    let dir: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    write_model(&dir, kind, dtype, 11);
    let tokens = prompt();
    let one = Model::load_hf(&dir, Arc::new(SingleRank), Threads::single()).unwrap();
    let want = all_logits(&one, &tokens);

    let reference = numpy_logits(&dir, &tokens);
    let (d, scale) = max_diff(&want, &reference);
    eprintln!("{name}: EP=1 vs numpy max |dlogit| {d:e} (logits up to {scale:.2})");
    assert!(
        d <= REF_TOL * scale.max(1.0),
        "{name}: EP=1 differs from numpy by {d}"
    );

    // Every token picked top_k experts in every sparse layer.
    let counts = one.expert_counts();
    let sparse: Vec<&Vec<u64>> = counts.iter().filter(|c| !c.is_empty()).collect();
    assert!(!sparse.is_empty());
    for c in &sparse {
        assert_eq!(c.iter().sum::<u64>(), 2 * tokens.len() as u64, "{counts:?}");
    }

    for world in [2, 4] {
        let got = on_ranks(world, |c| {
            let m = Model::load_hf(&dir, c, Threads::single()).unwrap();
            (all_logits(&m, &tokens), m.expert_counts())
        });
        for (logits, c) in &got {
            assert_eq!(logits, &got[0].0, "{name}: EP={world} ranks disagree");
            assert_eq!(c, &counts, "{name}: EP={world} routed differently");
            let (d, scale) = max_diff(logits, &want);
            eprintln!("{name}: EP={world} vs EP=1 max |dlogit| {d:e}");
            assert!(
                d <= EP_TOL * scale.max(1.0),
                "{name}: EP={world} differs by {d}"
            );
        }
    }
}

#[test]
fn mixtral_expert_parallel_matches_one_rank_and_numpy() {
    check(Kind::Mixtral, Dtype::F16, "tiny-mixtral");
}

#[test]
fn qwen2_moe_shared_expert_matches_one_rank_and_numpy() {
    check(Kind::Qwen2Moe, Dtype::F32, "tiny-qwen2-moe");
}

#[test]
fn qwen3_moe_expert_parallel_matches_one_rank_and_numpy() {
    check(Kind::Qwen3Moe, Dtype::BF16, "tiny-qwen3-moe");
}
