//! The `cleave` binary as a user runs it, on the default model.

use std::process::Command;

fn cleave() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cleave"))
}

fn model_path() -> String {
    let p = cleave_engine::gguf::default_model_path();
    assert!(
        p.exists(),
        "run `cleave model fetch` first (scripts/test does)"
    );
    p.display().to_string()
}

#[test]
fn generate_json_prints_ids_text_and_usage() {
    let out = cleave()
        .args([
            "generate",
            "--model",
            &model_path(),
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8);
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(
        v["usage"]["prompt_tokens"],
        v["prompt_tokens"].as_array().unwrap().len()
    );
}

#[test]
fn chat_generation_streams_an_answer_and_stops_at_end_of_turn() {
    let out = cleave()
        .args([
            "generate",
            "--model",
            &model_path(),
            "--chat",
            "--prompt",
            "Say hi.",
            "--max-tokens",
            "100",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.trim().is_empty());
    assert!(!text.contains("<|im_end|>"), "{text:?}");
}

#[test]
fn score_json_has_the_reference_fields() {
    let dir = std::env::temp_dir().join(format!("cleave-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("t.txt");
    std::fs::write(&file, "The quick brown fox jumps over the lazy dog.").unwrap();
    let out = cleave()
        .args(["score", "--model", &model_path(), "--json", "--file"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = v["tokens"].as_array().unwrap().len();
    assert_eq!(v["n_scored"], n - 1);
    assert_eq!(v["top1_next"].as_array().unwrap().len(), n - 1);
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 1000.0, "{ppl}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_file_that_is_not_gguf_gives_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("cleave-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("not-a-model.gguf");
    std::fs::write(&bad, b"definitely not a gguf file, just some text").unwrap();
    let out = cleave()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not-a-model.gguf") && err.to_lowercase().contains("magic"),
        "{err}"
    );
    // Truncated: the real file's first 64 KiB.
    let real = std::fs::read(model_path()).unwrap();
    std::fs::write(&bad, &real[..65_536]).unwrap();
    let out = cleave()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error:"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
