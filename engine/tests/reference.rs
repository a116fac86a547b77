//! The engine against llama.cpp's reference outputs on the default model.

use crate::common;

use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score;

#[derive(serde::Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    n_scored: usize,
    ppl: f64,
    top1_next: Vec<u32>,
}

fn reference() -> (String, Reference) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
    let text = std::fs::read_to_string(format!("{dir}/apache2_excerpt.txt")).unwrap();
    let r = serde_json::from_str(
        &std::fs::read_to_string(format!("{dir}/apache2_llamacpp_ref.json")).unwrap(),
    )
    .unwrap();
    (text, r)
}

#[test]
fn tokenization_equals_llama_cpp() {
    let (text, r) = reference();
    let ids = common::loaded().tokenizer.encode(&text, false);
    assert_eq!(ids.len(), r.tokens.len());
    assert_eq!(ids, r.tokens);
}

#[test]
fn perplexity_and_argmax_agree_with_llama_cpp() {
    let (_, r) = reference();
    let l = common::loaded();
    for (dtype, chunk) in [(KvDtype::F32, 256), (KvDtype::F16, 100)] {
        let s = score(&l.model, r.tokens.clone(), chunk, dtype).expect("single rank");
        assert_eq!(s.n_scored, r.n_scored);
        let rel = (s.ppl - r.ppl).abs() / r.ppl;
        let frac = common::argmax_agreement(&s.top1_next, &r.top1_next);
        eprintln!(
            "{dtype:?}: ppl {:.4} vs llama.cpp {:.4} ({:.2}%), argmax agreement {:.1}%",
            s.ppl,
            r.ppl,
            rel * 100.0,
            frac * 100.0
        );
        assert!(
            rel < 0.03,
            "{dtype:?}: perplexity {} is more than 3% from {}",
            s.ppl,
            r.ppl
        );
        assert!(frac >= 0.90, "{dtype:?}: argmax agreement {frac}");
    }
}
