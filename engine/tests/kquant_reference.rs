//! The default model requantized to Q4_K_M, Q5_K_M, Q6_K and Q8_0 — tensor for tensor what
//! llama.cpp's quantizer writes (`scripts/kquant-models` makes the files with ggml's own
//! quantization functions and llama.cpp's type choices; `tests/data/kquant/make.py` checked the
//! bytes against llama.cpp's and measured llama.cpp on them) — against llama.cpp: perplexity on
//! the reference text within 3% and next-token argmax agreement of at least 90%, on each file.

use crate::common;
use crate::llama_ref;

use std::collections::BTreeMap;
use std::path::PathBuf;

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score;
use cleave_engine::model::Model;
use cleave_text::gguf::default_model_path;
use sha2::{Digest, Sha256};

#[derive(serde::Deserialize)]
struct Measured {
    n_scored: usize,
    ppl: f64,
    top1_next: Vec<u32>,
    sha256: String,
}

#[derive(serde::Deserialize)]
struct References {
    models: BTreeMap<String, Measured>,
}

#[derive(serde::Deserialize)]
struct Text {
    tokens: Vec<u32>,
}

fn data(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file)
}

fn sha256(path: &std::path::Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn agrees(ty: &str) {
    let refs: References =
        serde_json::from_slice(&std::fs::read(data("kquant/ref.json")).unwrap()).unwrap();
    let r = &refs.models[ty];
    let path = default_model_path().with_file_name(format!("SmolLM2-135M-Instruct.{ty}.gguf"));
    if !llama_ref::made_by(&path, "scripts/kquant-models") {
        return;
    }
    assert_eq!(
        sha256(&path),
        r.sha256,
        "{} is not the file llama.cpp was measured on (remove it and run scripts/kquant-models)",
        path.display()
    );
    let text: Text =
        serde_json::from_slice(&std::fs::read(data("apache2_llamacpp_ref.json")).unwrap()).unwrap();
    let model = Model::open(&path, Threads::single()).unwrap();
    let s = score(&model, text.tokens, 256, KvDtype::F32).unwrap();
    assert_eq!(s.n_scored, r.n_scored);
    let rel = (s.ppl - r.ppl).abs() / r.ppl;
    let agree = common::argmax_agreement(&s.top1_next, &r.top1_next);
    println!(
        "{ty}: ppl {:.4} vs llama.cpp {:.4} ({:+.2}%), argmax agreement {:.1}%",
        s.ppl,
        r.ppl,
        (s.ppl / r.ppl - 1.0) * 100.0,
        agree * 100.0
    );
    assert!(
        rel <= 0.03,
        "{ty}: perplexity {} vs llama.cpp's {}",
        s.ppl,
        r.ppl
    );
    assert!(agree >= 0.90, "{ty}: argmax agreement {agree}");
}

#[test]
fn q4_k_m_agrees_with_llama_cpp() {
    agrees("Q4_K_M");
}

#[test]
fn q5_k_m_agrees_with_llama_cpp() {
    agrees("Q5_K_M");
}

#[test]
fn q6_k_agrees_with_llama_cpp() {
    agrees("Q6_K");
}

#[test]
fn q8_0_agrees_with_llama_cpp() {
    agrees("Q8_0");
}
