//! Tests of the tokenizer against llama.cpp's reference ids and round trips.

use super::*;
use crate::gguf::{default_model_path, GgufFile};

fn real_tokenizer() -> Option<Tokenizer> {
    let path = default_model_path();
    if !path.exists() {
        eprintln!("skipping: model not found at {}", path.display());
        return None;
    }
    let g = GgufFile::open(&path).expect("open model");
    Some(Tokenizer::from_gguf(&g).expect("build tokenizer"))
}

/// The engine's test data: the reference text and llama.cpp's record of it, which the engine's
/// accuracy tests read too.
fn data(name: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/data")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

#[test]
fn matches_llama_cpp_reference_ids() {
    let Some(tok) = real_tokenizer() else { return };
    let text = data("apache2_excerpt.txt");
    let reference: serde_json::Value =
        serde_json::from_str(&data("apache2_llamacpp_ref.json")).expect("reference json");
    let want: Vec<u32> = reference["tokens"]
        .as_array()
        .expect("tokens array")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let got = tok.encode(&text, false);
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        let at = first.unwrap_or(got.len().min(want.len()));
        let lo = at.saturating_sub(3);
        panic!(
            "mismatch at {at} (got {} ids, want {}): got {:?} want {:?}; context {:?}",
            got.len(),
            want.len(),
            &got[lo..(at + 5).min(got.len())],
            &want[lo..(at + 5).min(want.len())],
            tok.decode(&want[lo..(at + 5).min(want.len())]),
        );
    }
    // Parsing specials changes nothing when the text contains none.
    assert_eq!(tok.encode(&text, true), want);
}

#[test]
fn round_trips() {
    let Some(tok) = real_tokenizer() else { return };
    let samples = [
        data("apache2_excerpt.txt"),
        "Hello, world! 12345 and 3.14159".to_string(),
        "emoji 🦀🎉👩‍👩‍👧 done".to_string(),
        "中文文本，日本語のテキスト、한국어".to_string(),
        "accents: café naïve façade Ångström".to_string(),
        "spaces   and\n\n\nnewlines \t tabs  \n ".to_string(),
        " leading space, trailing space ".to_string(),
        "it's they're we've I'm you'll he'd".to_string(),
        String::new(),
        "\u{0}\u{1}\u{7f} control bytes".to_string(),
    ];
    for s in &samples {
        let ids = tok.encode(s, false);
        assert_eq!(&tok.decode(&ids), s, "ids {ids:?}");
    }
    // Digits are split one per token by the smollm pre-tokenizer.
    let ids = tok.encode("12345", false);
    assert_eq!(ids.len(), 5);
    assert_eq!(tok.decode(&ids), "12345");
}

#[test]
fn parse_special_control_tokens() {
    let Some(tok) = real_tokenizer() else { return };
    let text = "<|im_start|>user\nhi<|im_end|>";
    let start = tok.token_id("<|im_start|>").unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!((start, end), (1, 2));
    assert!(tok.is_control(start) && tok.is_control(end));
    assert!(!tok.is_control(tok.token_id("user").unwrap()));

    let parsed = tok.encode(text, true);
    assert_eq!(parsed.first(), Some(&start));
    assert_eq!(parsed.last(), Some(&end));
    assert_eq!(
        &parsed[1..parsed.len() - 1],
        &tok.encode("user\nhi", false)[..]
    );
    assert_eq!(tok.decode(&parsed), text);

    let plain = tok.encode(text, false);
    assert!(!plain.contains(&start) && !plain.contains(&end));
    assert_eq!(tok.decode(&plain), text);

    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.eos(), Some(2));
    assert!(!tok.add_bos());
    assert_eq!(tok.vocab_size(), 49152);
    let eog = tok.eog_ids();
    assert!(eog.contains(&2) && eog.contains(&0), "{eog:?}");
    assert_eq!(tok.token_str(2), Some("<|im_end|>"));
    assert_eq!(tok.token_bytes(2), b"<|im_end|>");
    assert_eq!(tok.token_bytes(u32::MAX), b"");
    assert_eq!(tok.token_str(u32::MAX), None);
}

#[test]
fn stream_decoder_never_splits_chars() {
    let Some(tok) = real_tokenizer() else { return };
    let text = "naïve 🦀 crabs — 中文 and 👩‍👩‍👧 families, ∑ ≠ ∞.";
    let ids = tok.encode(text, false);
    // Multi-byte characters must actually be split across tokens for this test to bite.
    assert!(ids
        .iter()
        .any(|&id| std::str::from_utf8(tok.token_bytes(id)).is_err()));
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(&tok, id);
        assert!(
            !piece.contains('\u{FFFD}'),
            "partial char emitted: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);

    // A dangling partial character is flushed lossily.
    let crab = tok.encode("🦀", false);
    let mut dec = StreamDecoder::new();
    if crab.len() > 1 {
        assert_eq!(dec.push(&tok, crab[0]), "");
        assert_eq!(dec.finish(), "\u{FFFD}");
    }
}

fn toy_spec(pre: &str) -> TokenizerSpec {
    let table = bpe::byte_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.extend(["ĠĠ", "ab", "Ġab", "<|sp|>", "<u>"].map(String::from));
    let mut token_types = vec![1; tokens.len()];
    let n = token_types.len();
    token_types[n - 2] = 3;
    token_types[n - 1] = 4;
    TokenizerSpec {
        tokens,
        token_types,
        merges: ["Ġ Ġ", "a b", "Ġ ab"].map(String::from).to_vec(),
        pre: pre.to_string(),
        bos: None,
        eos: None,
        add_bos: false,
        ..TokenizerSpec::default()
    }
}

#[test]
fn toy_vocab_and_errors() {
    let tok = Tokenizer::new(toy_spec("gpt2")).unwrap();
    let ab = tok.token_id("ab").unwrap();
    let sab = tok.token_id("Ġab").unwrap();
    let sp = tok.token_id("<|sp|>").unwrap();
    let user = tok.token_id("<u>").unwrap();
    assert_eq!(tok.encode("ab ab", false), vec![ab, sab]);
    // User-defined tokens are always matched; control ones only when parsing specials.
    assert_eq!(tok.encode("<u>ab", false), vec![user, ab]);
    assert!(!tok.encode("<|sp|>", false).contains(&sp));
    assert_eq!(tok.encode("<|sp|>ab", true), vec![sp, ab]);
    assert_eq!(tok.n_merges(), 3);

    for pre in ["smollm", "llama-bpe", "qwen2", "default"] {
        let t = Tokenizer::new(toy_spec(pre)).unwrap();
        let s = "ab  ab 123 x's\n\n";
        assert_eq!(t.decode(&t.encode(s, false)), s, "pre {pre}");
    }
    match Tokenizer::new(toy_spec("nonesuch")) {
        Err(TokenizerError::UnknownPreTokenizer(name)) => assert_eq!(name, "nonesuch"),
        other => panic!("expected UnknownPreTokenizer, got {other:?}"),
    }
    let mut bad = toy_spec("gpt2");
    bad.merges.push("nospace".into());
    assert!(matches!(
        Tokenizer::new(bad),
        Err(TokenizerError::BadMerge { .. })
    ));
    let mut bad = toy_spec("gpt2");
    bad.eos = Some(1_000_000);
    assert!(matches!(
        Tokenizer::new(bad),
        Err(TokenizerError::BadSpecialId { which: "eos", .. })
    ));
    let mut bad = toy_spec("gpt2");
    bad.token_types.pop();
    assert!(matches!(
        Tokenizer::new(bad),
        Err(TokenizerError::TokenTypesMismatch { .. })
    ));
}

#[test]
fn unknown_model_is_rejected() {
    // Build a minimal GGUF whose tokenizer model is "llama".
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let key = "tokenizer.ggml.model";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    b.extend(b"t5");
    let g = GgufFile::from_bytes(b).unwrap();
    match Tokenizer::from_gguf(&g) {
        Err(TokenizerError::UnsupportedModel(m)) => assert_eq!(m, "t5"),
        other => panic!("expected UnsupportedModel, got {other:?}"),
    }
}

#[test]
fn tokenizer_is_send_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<Tokenizer>();
}

/// Inputs that make a naive BPE quadratic (long runs of one character, of spaces, of digits, of
/// special-token look-alikes) round-trip. Their speed is not asserted here (a test must not
/// depend on the machine's load); the time each took is printed, and a quadratic regression at
/// these sizes shows as a test that runs for minutes.
#[test]
fn pathological_inputs_round_trip() {
    let Some(tok) = real_tokenizer() else { return };
    let inputs = [
        "a".repeat(100_000),
        " ".repeat(100_000) + "x",
        "\n".repeat(50_000) + &" \t".repeat(25_000),
        "9".repeat(100_000),
        "🦀".repeat(20_000),
        "<|im_start|>".repeat(5_000) + &"<|im_end".repeat(5_000),
    ];
    for s in &inputs {
        let t = std::time::Instant::now();
        let ids = tok.encode(s, true);
        let took = t.elapsed();
        assert_eq!(&tok.decode(&ids), s);
        eprintln!("{} bytes encoded in {took:?}", s.len());
    }
}
