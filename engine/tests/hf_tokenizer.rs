//! A `tokenizer.json` in the Hugging Face layout builds the same byte-level BPE as the GGUF
//! metadata: the default model's vocabulary, merges and special tokens written as SmolLM2's
//! `tokenizer.json` (Digits + ByteLevel pre-tokenizer) encode the reference text identically.

use crate::tiny;

use std::sync::Arc;

use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_text::gguf::{default_model_path, GgufFile};
use cleave_text::safetensors::Dtype;
use cleave_text::tokenizer::{Tokenizer, TokenizerSpec};
use cleave_types::collective::SingleRank;
use serde_json::json;

#[test]
fn tokenizer_json_matches_the_gguf_tokenizer() {
    let g =
        GgufFile::open(&default_model_path()).expect("the default model (scripts/test fetches it)");
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    let merges = g.get_str_array("tokenizer.ggml.merges").unwrap();
    let (bos, eos) = (
        g.get_u32("tokenizer.ggml.bos_token_id").unwrap() as usize,
        g.get_u32("tokenizer.ggml.eos_token_id").unwrap() as usize,
    );
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        if *ty == 3 || *ty == 4 {
            added.push(json!({"id": i, "content": t, "special": *ty == 3}));
        }
        vocab.insert(t.clone(), json!(i));
    }
    // Newer tokenizers store merges as pairs; use that form for half of them.
    let merges: Vec<serde_json::Value> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if i % 2 == 0 {
                json!(m)
            } else {
                let (a, b) = m.split_once(' ').unwrap();
                json!([a, b])
            }
        })
        .collect();
    let tj = json!({
        "added_tokens": added,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges},
    });
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hf-tokenizer");
    tiny::write_model(&dir, tiny::Kind::Llama, Dtype::F32, 1);
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    let template = g.get_str("tokenizer.chat_template").unwrap();
    let tc = json!({
        "bos_token": tokens[bos], "eos_token": {"content": tokens[eos]},
        "add_bos_token": false, "chat_template": template,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&tc).unwrap(),
    )
    .unwrap();

    let want = Tokenizer::from_gguf(&g).unwrap();
    let got = Tokenizer::new(TokenizerSpec::from_hf_dir(&dir).unwrap()).unwrap();
    assert_eq!((got.bos(), got.eos()), (want.bos(), want.eos()));
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/apache2_excerpt.txt"
    ))
    .unwrap();
    let chat = "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n";
    for (t, special) in [(text.as_str(), false), (chat, true), (chat, false)] {
        assert_eq!(got.encode(t, special), want.encode(t, special));
    }

    // The whole directory loads: model, tokenizer and chat template.
    let l = Loaded::open_hf(&dir, Arc::new(SingleRank), Threads::single()).unwrap();
    assert!(l.template.is_some());
    assert_eq!(
        l.encode_text("Hello world"),
        want.encode("Hello world", false)
    );

    // An unknown pre-tokenizer is a clear error.
    let mut odd = tj.clone();
    odd["pre_tokenizer"] = json!({"type": "Whitespace"});
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&odd).unwrap(),
    )
    .unwrap();
    let e = TokenizerSpec::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("Whitespace"), "{e}");
}
