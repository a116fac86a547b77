//! Byte-level BPE tokenizers from a Hugging Face model directory: `tokenizer.json` (vocabulary,
//! merges, added tokens, pre-tokenizer) and, when present, `tokenizer_config.json` (BOS/EOS,
//! `add_bos_token`). The pre-tokenizer is mapped to the llama.cpp pre-tokenizer with the same
//! split rules; unknown ones are an error.

use std::path::Path;

use serde_json::Value;

use super::{TokenizerError, TokenizerSpec, TYPE_CONTROL, TYPE_UNUSED, TYPE_USER_DEFINED};

fn read_json(path: &Path) -> Result<Value, TokenizerError> {
    let bad = |why: String| TokenizerError::HfJson {
        path: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))
}

/// The llama.cpp pre-tokenizer name equivalent to a `pre_tokenizer` object.
fn pre_name(pre: &Value) -> Option<&'static str> {
    let parts: Vec<&Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"].as_array()?.iter().collect(),
        Some(_) => vec![pre],
        None => return None,
    };
    let kinds: Vec<&str> = parts.iter().filter_map(|p| p["type"].as_str()).collect();
    let regex = parts
        .iter()
        .find_map(|p| p["pattern"]["Regex"].as_str())
        .unwrap_or("");
    let byte_level_regex = parts
        .iter()
        .any(|p| p["type"] == "ByteLevel" && p["use_regex"].as_bool().unwrap_or(true));
    let digits = parts
        .iter()
        .any(|p| p["type"] == "Digits" && p["individual_digits"] == true);
    match kinds.as_slice() {
        ["Split", "ByteLevel"] if regex.contains(r"\p{N}{1,3}") => Some("llama3"),
        ["Split", "ByteLevel"] if regex.contains(r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|") => {
            Some("qwen2")
        }
        ["Digits", "ByteLevel"] if digits && byte_level_regex => Some("smollm"),
        ["ByteLevel"] if byte_level_regex => Some("gpt2"),
        _ => None,
    }
}

/// A special token given as a string or as `{"content": ...}`.
fn token_text(v: &Value) -> Option<&str> {
    v.as_str().or_else(|| v["content"].as_str())
}

impl TokenizerSpec {
    /// Reads `dir/tokenizer.json` (and `dir/tokenizer_config.json` when present).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bad = |why: String| TokenizerError::HfJson {
            path: path.clone(),
            why,
        };
        let j = read_json(&path)?;
        let model = &j["model"];
        if model["type"] != "BPE" {
            return Err(TokenizerError::UnsupportedModel(
                model["type"].as_str().unwrap_or("none").to_string(),
            ));
        }
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| bad("model.vocab is not an object".into()))?;
        let mut entries: Vec<(u64, &str, i32)> = Vec::with_capacity(vocab.len());
        for (text, id) in vocab {
            let id = id.as_u64().ok_or_else(|| bad(format!("id of {text:?}")))?;
            entries.push((id, text, 1));
        }
        for t in j["added_tokens"].as_array().into_iter().flatten() {
            let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
                return Err(bad(format!("added token {t}")));
            };
            let ty = if t["special"] == true {
                TYPE_CONTROL
            } else {
                TYPE_USER_DEFINED
            };
            entries.retain(|e| e.0 != id);
            entries.push((id, text, ty));
        }
        let n = entries.iter().map(|e| e.0 + 1).max().unwrap_or(0) as usize;
        if n > u32::MAX as usize || n > 4 * entries.len() + 1024 {
            return Err(TokenizerError::BadVocabSize(n));
        }
        // Ids without a token (gaps) become unused padding, as llama.cpp's converter does.
        let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
        let mut types = vec![TYPE_UNUSED; n];
        for (id, text, ty) in entries {
            tokens[id as usize] = text.to_string();
            types[id as usize] = ty;
        }
        let merges = model["merges"]
            .as_array()
            .ok_or_else(|| bad("model.merges is not a list".into()))?
            .iter()
            .map(|m| match m {
                Value::String(s) => Some(s.clone()),
                Value::Array(p) if p.len() == 2 => {
                    Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?))
                }
                _ => None,
            })
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| bad("a merge is neither \"a b\" nor [\"a\", \"b\"]".into()))?;
        let pre = pre_name(&j["pre_tokenizer"]).ok_or_else(|| {
            TokenizerError::UnknownPreTokenizer(format!("tokenizer.json {}", j["pre_tokenizer"]))
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() {
            read_json(&cfg_path)?
        } else {
            Value::Null
        };
        let id_of = |v: &Value| token_text(v).and_then(|t| tokens.iter().position(|x| x == t));
        let (bos, eos) = (id_of(&cfg["bos_token"]), id_of(&cfg["eos_token"]));
        Ok(TokenizerSpec {
            merges,
            pre: pre.to_string(),
            bos: bos.map(|i| i as u32),
            eos: eos.map(|i| i as u32),
            add_bos: cfg["add_bos_token"].as_bool().unwrap_or(false),
            tokens,
            token_types: types,
            ..TokenizerSpec::default()
        })
    }
}
