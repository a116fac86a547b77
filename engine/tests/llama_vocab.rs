//! Token ids equal llama.cpp's on its own vocab-only test GGUFs (`scripts/llama-vocab` fetches
//! them): for every text of `ggml-vocab-NAME.gguf.inp`, `encode(text, parse_special = false)`
//! without BOS must equal the line of `.gguf.out` (llama.cpp's `test-tokenizer-0` uses
//! `add_special = false, parse_special = false`). Also `decode(encode(text)) == text` and the
//! streaming decoder never emitting a split UTF-8 character.

use crate::llama_ref;

use std::path::PathBuf;

use cleave_text::gguf::GgufFile;
use cleave_text::tokenizer::{StreamDecoder, Tokenizer};

/// Vocabularies expected to match exactly.
const SUPPORTED: &[&str] = &[
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "deepseek-llm",
    "deepseek-coder",
    "starcoder",
    "falcon",
    "mpt",
    "refact",
    "command-r",
];

fn vocab_dir() -> PathBuf {
    llama_ref::dir()
}

fn cases(dir: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let base = dir.join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read_to_string(base.with_extension("gguf.inp")).expect("read .inp");
    let out = std::fs::read_to_string(base.with_extension("gguf.out")).expect("read .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(sep) {
            Some(i) => {
                texts.push(rest[..i].to_string());
                rest = &rest[i + sep.len()..];
            }
            None => {
                texts.push(rest.to_string());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{name}: .inp and .out differ in length"
    );
    texts.into_iter().zip(ids).collect()
}

#[test]
fn token_ids_equal_llama_cpp() {
    let dir = vocab_dir();
    if !llama_ref::available(&dir.join("ggml-vocab-llama-spm.gguf")) {
        return;
    }
    let mut failures = Vec::new();
    for name in SUPPORTED {
        let g = GgufFile::open(&dir.join(format!("ggml-vocab-{name}.gguf"))).expect("open");
        let tok = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut bad = 0;
        for (text, want) in cases(&dir, name) {
            let got = tok.encode(&text, false);
            if got != want {
                bad += 1;
                if bad <= 3 {
                    failures.push(format!("{name}: {text:?}: got {got:?} want {want:?}"));
                }
                continue;
            }
            assert_eq!(tok.decode(&got), text, "{name}: round trip of {text:?}");
            let mut dec = StreamDecoder::text_start();
            let mut streamed = String::new();
            for &id in &got {
                let piece = dec.push(&tok, id);
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "{name}: split char in {text:?}"
                );
                streamed.push_str(&piece);
            }
            streamed.push_str(&dec.finish());
            assert_eq!(streamed, text, "{name}: streamed {text:?}");
        }
        if bad > 0 {
            failures.push(format!("{name}: {bad} texts differ"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Vocabularies in llama.cpp's set that cleave does not support, with the reason; they must be
/// refused with an error naming the tokenizer model, never tokenized wrongly.
const KNOWN_UNSUPPORTED: &[(&str, &str, &str)] = &[
    (
        "gemma-4",
        "gemma4",
        "BPE over ▁-escaped text with byte fallback: not implemented",
    ),
    ("bert-bge", "bert", "WordPiece (WPM): not implemented"),
];

#[test]
fn known_unsupported_vocabs_are_refused() {
    let dir = vocab_dir();
    if !llama_ref::available(&dir.join("ggml-vocab-llama-spm.gguf")) {
        return;
    }
    for (name, model, why) in KNOWN_UNSUPPORTED {
        let g = GgufFile::open(&dir.join(format!("ggml-vocab-{name}.gguf"))).expect("open");
        let e = Tokenizer::from_gguf(&g).expect_err(why).to_string();
        assert!(e.contains(model), "{name}: {e}");
    }
}
