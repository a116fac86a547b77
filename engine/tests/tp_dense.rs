//! A tiny random Llama checkpoint (HF safetensors, BF16) split across 2 and 4 ranks gives the
//! logits and greedy tokens of one rank.

use crate::tiny;

use cleave_engine::kernels::Threads;
use cleave_engine::model::Model;
use cleave_text::safetensors::Dtype;
use tiny::{greedy, max_diff, on_ranks, write_model, Kind};

/// Weights and activations are f32 on this path, so TP only reorders sums (row-parallel
/// all-reduce, attention per head): differences stay at float rounding level.
const TOL: f32 = 1e-4;

#[test]
fn tiny_dense_tp2_and_tp4_match_tp1() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tiny-llama");
    write_model(&dir, Kind::Llama, Dtype::BF16, 7);
    let prompt: Vec<u32> = (0..20)
        .map(|i| (i * 37 + 11) % tiny::VOCAB as u32)
        .collect();
    let one = Model::load_hf(
        &dir,
        std::sync::Arc::new(cleave_types::collective::SingleRank),
        Threads::single(),
    )
    .unwrap();
    let (want_tokens, want_rows) = greedy(&one, &prompt, 16);
    let want_all = tiny::all_logits(&one, &prompt);
    for world in [2, 4] {
        let got = on_ranks(world, |c| {
            let m = Model::load_hf(&dir, c, Threads::single()).unwrap();
            assert_eq!(m.local_heads(), 8 / world);
            (greedy(&m, &prompt, 16), tiny::all_logits(&m, &prompt))
        });
        for ((tokens, rows), all) in &got {
            assert_eq!(tokens, &got[0].0 .0, "ranks disagree");
            assert_eq!(tokens, &want_tokens, "TP={world} greedy tokens");
            let (d, scale) = max_diff(all, &want_all);
            eprintln!("TP={world}: prefill max |dlogit| {d:e} (logits up to {scale:.2})");
            assert!(
                d <= TOL * scale.max(1.0),
                "TP={world} prefill logits differ by {d}"
            );
            for (g, w) in rows.iter().zip(&want_rows) {
                let (d, scale) = max_diff(g, w);
                assert!(
                    d <= TOL * scale.max(1.0),
                    "TP={world} decode logits differ by {d}"
                );
            }
        }
    }
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tiny-llama-bad");
    write_model(&dir, Kind::Llama, Dtype::F32, 3);
    // A group size that does not divide the KV heads (4).
    let errs = on_ranks(3, |c| {
        Model::load_hf(&dir, c, Threads::single())
            .err()
            .map(|e| e.to_string())
    });
    assert!(
        errs[0].as_deref().unwrap_or("").contains("kv heads"),
        "{errs:?}"
    );
    // A config that names a missing tensor's shape wrongly.
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let one_rank_error = || {
        Model::load_hf(
            &dir,
            std::sync::Arc::new(cleave_types::collective::SingleRank),
            Threads::single(),
        )
        .err()
        .expect("the load fails")
        .to_string()
    };
    let e = one_rank_error();
    assert!(e.contains("gate_proj") && e.contains("96"), "{e}");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = one_rank_error();
    assert!(e.contains("model.safetensors"), "{e}");
}
