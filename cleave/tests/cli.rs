//! The `cleave` binary as a user runs it, on the default model.

use crate::support;

use std::process::Command;

use support::{cleave, model_path, stderr_of_failure, stdout_of};

/// `cleave SUBCOMMAND --model <the default model>`.
fn on_model(subcommand: &str) -> Command {
    let mut cmd = cleave();
    cmd.args([subcommand, "--model"]).arg(model_path());
    cmd
}

#[test]
fn generate_json_prints_ids_text_and_usage() {
    let out = stdout_of(on_model("generate").args([
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
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
    let out = stdout_of(on_model("generate").args([
        "--chat",
        "--prompt",
        "Say hi.",
        "--max-tokens",
        "100",
    ]));
    let text = String::from_utf8(out).unwrap();
    assert!(!text.trim().is_empty());
    assert!(!text.contains("<|im_end|>"), "{text:?}");
}

#[test]
fn score_json_has_the_reference_fields() {
    let dir = std::env::temp_dir().join(format!("cleave-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("t.txt");
    std::fs::write(&file, "The quick brown fox jumps over the lazy dog.").unwrap();
    let out = stdout_of(on_model("score").args(["--json", "--file"]).arg(&file));
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
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
    let generate = || {
        stderr_of_failure(
            cleave()
                .args(["generate", "--prompt", "hi", "--model"])
                .arg(&bad),
        )
    };
    std::fs::write(&bad, b"definitely not a gguf file, just some text").unwrap();
    let err = generate();
    assert!(
        err.contains("not-a-model.gguf") && err.to_lowercase().contains("magic"),
        "{err}"
    );
    // Truncated: the real file's first 64 KiB.
    let real = std::fs::read(model_path()).unwrap();
    std::fs::write(&bad, &real[..65_536]).unwrap();
    let err = generate();
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error:"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A model that ships without a chat template (a tiny Hugging Face directory whose
/// `tokenizer_config.json` has none) chats once `--chat-template` supplies one.
#[test]
fn chat_template_flag_serves_a_model_without_one() {
    let dir = std::env::temp_dir().join(format!("cleave-no-template-{}", std::process::id()));
    let model = dir.join("model");
    stdout_of(
        cleave()
            .args(["model", "tiny", "--kind", "llama"])
            .arg(&model),
    );
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"add_bos_token": false}"#,
    )
    .unwrap();
    let generate = |extra: &[&str]| {
        let mut c = cleave();
        c.args([
            "generate",
            "--chat",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--json",
        ])
        .arg("--model")
        .arg(&model)
        .args(extra);
        c
    };
    let err = stderr_of_failure(&mut generate(&[]));
    assert!(
        err.contains("no chat template") && err.contains("--chat-template"),
        "{err}"
    );
    let out = stdout_of(&mut generate(&["--chat-template", "chatml"]));
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    // The tiny model's tokenizer is byte-level without merges: one token per byte of the
    // rendered prompt.
    let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        v["prompt_tokens"].as_array().unwrap().len(),
        rendered.len(),
        "{v}"
    );
    let err = stderr_of_failure(&mut generate(&[
        "--chat-template",
        "/no/such/template.jinja",
    ]));
    assert!(
        err.contains("/no/such/template.jinja") && err.contains("chatml, llama3, gemma"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn model_inspect_says_whether_the_file_has_a_chat_template() {
    let out = stdout_of(cleave().args(["model", "inspect"]).arg(model_path()));
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("chat template:  yes ("), "{text}");
}
