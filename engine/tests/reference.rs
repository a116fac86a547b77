//! The engine against llama.cpp's reference outputs on the default model.

use crate::common;

use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score;

#[derive(serde::Deserialize)]
struct Reference {
    /// Only in the default reference (the KV references score the same tokens).
    #[serde(default)]
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

/// llama.cpp's measurements with its KV cache in f16 and in q8_0 (`tests/data/kv/make.py`).
#[derive(serde::Deserialize)]
struct KvReferences {
    kv: std::collections::HashMap<String, Reference>,
}

#[test]
fn perplexity_and_argmax_agree_with_llama_cpp() {
    let (_, r) = reference();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/kv");
    let kv: KvReferences =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/ref.json")).unwrap()).unwrap();
    let l = common::loaded();
    // Each KV type against llama.cpp with the same type (f32 against its default run); the
    // chunk sizes vary so that prefills cross blocks differently.
    let q8 = &kv.kv["q8_0"];
    let mut ppl = std::collections::HashMap::new();
    for (dtype, chunk, want) in [
        (KvDtype::F32, 256, &r),
        (KvDtype::F16, 100, &kv.kv["f16"]),
        (KvDtype::Q8_0, 77, q8),
    ] {
        let s = score(&l.model, r.tokens.clone(), chunk, dtype).expect("single rank");
        assert_eq!(s.n_scored, want.n_scored);
        let rel = (s.ppl - want.ppl).abs() / want.ppl;
        let frac = common::argmax_agreement(&s.top1_next, &want.top1_next);
        eprintln!(
            "{dtype:?}: ppl {:.4} vs llama.cpp {:.4} ({:.2}%), argmax agreement {:.1}%",
            s.ppl,
            want.ppl,
            rel * 100.0,
            frac * 100.0
        );
        assert!(
            rel < 0.03,
            "{dtype:?}: perplexity {} is more than 3% from {}",
            s.ppl,
            want.ppl
        );
        assert!(frac >= 0.90, "{dtype:?}: argmax agreement {frac}");
        ppl.insert(dtype.as_str(), s.ppl);
    }
    // What storing KV as q8_0 costs, against what it costs llama.cpp (from its f16 cache): no
    // more than llama.cpp's own cost plus 0.5% of perplexity.
    let ours = ppl["q8_0"] / ppl["f16"] - 1.0;
    let theirs = q8.ppl / kv.kv["f16"].ppl - 1.0;
    eprintln!(
        "q8_0 KV costs {:+.3}% of perplexity here, {:+.3}% in llama.cpp",
        ours * 100.0,
        theirs * 100.0
    );
    assert!(
        ours <= theirs.max(0.0) + 0.005,
        "q8_0 KV costs {ours}, llama.cpp's {theirs}"
    );
}
