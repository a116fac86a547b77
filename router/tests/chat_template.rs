//! `--chat-template` through the whole router (`serve::run`, real HTTP, a fake gRPC decode
//! worker that reports the prompt length it was sent): a model that ships without a chat
//! template answers `/v1/chat/completions` with a 400 naming the flag; with the flag the router
//! renders chat requests with the template it names; a flag that names nothing stops the start
//! with an error naming it.

use crate::support;

use std::path::Path;

use cleave_text::safetensors::Dtype;
use cleave_text::tiny::{write_model, Kind};
use serde_json::Value;
use support::{chat, config, scratch, worker, Router};

/// A tiny Hugging Face model directory (byte-level tokenizer without merges: one token per
/// byte) whose `tokenizer_config.json` has no chat template.
fn model_without_template(dir: &Path) {
    write_model(dir, Kind::Llama, Dtype::F32, 1).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"add_bos_token": false}"#,
    )
    .unwrap();
}

async fn post_chat(router: &Router) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .header("content-type", "application/json")
        .body(chat(false, 2))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (
        status,
        serde_json::from_str(&r.text().await.unwrap()).unwrap(),
    )
}

#[tokio::test]
async fn a_model_without_a_template_chats_once_the_flag_names_one() {
    let dir = scratch("chat-template");
    model_without_template(&dir);
    let (decode, _gate) = worker(true).await;

    let router = Router::start(&dir, &decode, &[]).await;
    let (status, body) = post_chat(&router).await;
    assert_eq!(status, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("no chat template") && msg.contains("--chat-template"),
        "{msg}"
    );
    drop(router);

    let router = Router::start(&dir, &decode, &["--chat-template", "chatml"]).await;
    let (status, body) = post_chat(&router).await;
    assert_eq!(status, 200, "{body}");
    let rendered = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(body["usage"]["prompt_tokens"], rendered.len(), "{body}");

    let template = dir.join("t.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}<{{ m.content }}>{% endfor %}",
    )
    .unwrap();
    let router = Router::start(
        &dir,
        &decode,
        &["--chat-template", template.to_str().unwrap()],
    )
    .await;
    let (status, body) = post_chat(&router).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], "<Hi!>".len(), "{body}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_chat_template_flag_that_names_nothing_stops_the_start() {
    let dir = scratch("chat-template-bad");
    model_without_template(&dir);
    let (decode, _gate) = worker(true).await;
    for (flag, says) in [
        ("/no/such/file.jinja", "/no/such/file.jinja"),
        ("{% for m in messages %}", "syntax"),
    ] {
        let cfg = config(&dir, &decode, &["--chat-template", flag]);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let err = match cleave_router::serve::run(cfg, shutdown).await {
            Ok(_) => panic!("{flag:?} started"),
            Err(e) => cleave_telemetry::error_chain(&e),
        };
        assert!(err.contains(says), "{flag:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
