//! Server-sent events: chunk shapes and order, usage chunk, errors mid-stream, and that a
//! client disconnect drops (cancels) the backend streams.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokio_stream::StreamExt;

use super::{harness, harness_in, hello, model, Mode, Opts, MODEL, REPLY};

pub(super) fn parse(events: &[String]) -> (Vec<Value>, bool) {
    let done = events.last().map(String::as_str) == Some("[DONE]");
    let chunks = events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    (chunks, done)
}

#[tokio::test]
async fn chat_stream_has_role_deltas_finish_usage_and_done() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "text/event-stream");
    let (chunks, done) = parse(&r.events());
    assert!(done, "stream must end with [DONE]");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], MODEL);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, REPLY);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    let finish = rest.last().unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert!(rest.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(usage_chunk["choices"], json!([]));
    let (tok, _) = model().unwrap();
    let n = tok.encode(REPLY, false).len();
    assert_eq!(usage_chunk["usage"]["completion_tokens"], n);
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens"],
        h.requests()[0].prompt.len()
    );
}

#[tokio::test]
async fn stream_without_include_usage_has_no_usage_chunk() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": hello(), "stream": true, "n": 2, "max_tokens": 3}),
        )
        .await;
    let (chunks, done) = parse(&r.events());
    assert!(done);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    for index in 0..2 {
        let mine: Vec<_> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            mine.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
        let content: Vec<_> = mine
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .filter(|s| !s.is_empty())
            .collect();
        assert_eq!(content.len(), 3);
    }
}

#[tokio::test]
async fn completion_stream_and_logprobs() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "Hi", "stream": true, "logprobs": 2, "max_tokens": 2,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    let (chunks, done) = parse(&r.events());
    assert!(done);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert!(chunks[0]["id"].as_str().unwrap().starts_with("cmpl-"));
    let tokens: Vec<_> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(tokens.len(), 2);
    let lp0 = &tokens[0]["choices"][0]["logprobs"];
    let lp1 = &tokens[1]["choices"][0]["logprobs"];
    assert_eq!(lp0["text_offset"], json!([0]));
    let first_len = lp0["tokens"][0].as_str().unwrap().chars().count();
    assert_eq!(lp1["text_offset"], json!([first_len]));
    assert_eq!(lp0["top_logprobs"][0].as_object().unwrap().len(), 2);
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn error_mid_stream_is_an_error_event_and_the_end() {
    let Some(h) = harness_in(Mode::FailMidStream) else {
        return;
    };
    let events = h.stream_hello().await;
    assert_ne!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error");
    assert!(last["error"].get("param").is_some());
    assert!(!last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("exploded"));
    // Role chunk and the two tokens came before it.
    assert_eq!(events.len(), 4);
}

#[tokio::test]
async fn client_disconnect_drops_the_backend_streams() {
    let Some(h) = harness_in(Mode::Hang) else {
        return;
    };
    let req = axum::http::Request::post("/v1/chat/completions")
        .body(axum::body::Body::from(
            json!({"messages": hello(), "stream": true, "n": 3}).to_string(),
        ))
        .unwrap();
    let resp = tower::ServiceExt::oneshot(h.app.clone(), req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(h.fake.live.load(Ordering::SeqCst), 3);
    let mut body = resp.into_body().into_data_stream();
    // Three role chunks and one token per choice, then the backend hangs.
    for _ in 0..6 {
        let frame = body.next().await.unwrap().unwrap();
        assert!(frame.starts_with(b"data: {"));
    }
    drop(body);
    assert_eq!(
        h.fake.live.load(Ordering::SeqCst),
        0,
        "streams must be dropped"
    );
    let m = h.metrics().await;
    assert!(
        m.contains("cleave_router_requests_total{status=\"ok\"} 1"),
        "{m}"
    );
}
