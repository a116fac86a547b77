//! Every error case: status, OpenAI error shape, `param` and `code`; auth; admission.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::{harness, harness_in, hello, Mode, Opts, MODEL};
use crate::admit::AdmitConfig;

/// Posts a chat request with `extra` merged into a valid body and returns the error object.
async fn chat_error(extra: Value, status: StatusCode) -> Option<Value> {
    let h = harness(Opts::default())?;
    let mut body = json!({"model": MODEL, "messages": hello()});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = h.post("/v1/chat/completions", body).await;
    let e = r.error(status);
    assert!(h.requests().is_empty(), "nothing may reach the backend");
    Some(e)
}

#[tokio::test]
async fn parameter_ranges_name_the_field() {
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (json!({"logprobs": 3}), "logprobs"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
        (json!({"max_tokens": -5}), "max_tokens"),
        (json!({"stop": ""}), "stop"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"stop": 3}), "stop"),
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0].type",
        ),
    ];
    for (extra, param) in cases {
        let Some(e) = chat_error(extra.clone(), StatusCode::BAD_REQUEST).await else {
            return;
        };
        assert_eq!(e["type"], "invalid_request_error", "{extra}");
        assert_eq!(e["param"], param, "{extra}: {e}");
        if !param.contains('[') {
            assert!(
                e["message"].as_str().unwrap().contains(param),
                "{extra}: {e}"
            );
        }
    }
}

#[tokio::test]
async fn accepted_but_ignored_fields_pass() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let body = json!({
        "messages": hello(), "user": "u-1", "presence_penalty": 0.5, "frequency_penalty": 0,
        "response_format": {"type": "text"}, "some_future_field": [1, 2], "top_k": 40,
        "ignore_eos": true, "max_tokens": 2
    });
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json());
    let p = &h.requests()[0].params;
    assert_eq!((p.top_k, p.ignore_eos), (40, true));
}

#[tokio::test]
async fn malformed_json_and_missing_inputs() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    for body in ["{\"messages\": [", "not json", ""] {
        let r = h
            .call("POST", "/v1/chat/completions", Some(body), None)
            .await;
        let e = r.error(StatusCode::BAD_REQUEST);
        assert_eq!(e["type"], "invalid_request_error");
        assert!(e["message"].as_str().unwrap().contains("JSON"), "{e}");
    }
    let r = h
        .call("POST", "/v1/completions", Some("[1, 2]"), None)
        .await;
    r.error(StatusCode::BAD_REQUEST);

    let e = h
        .post("/v1/chat/completions", json!({"model": MODEL}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "messages");
    let e = h
        .post("/v1/completions", json!({"messages": hello()}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "prompt");
    let e = h
        .post("/v1/completions", json!({"prompt": []}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "prompt");
    let e = h
        .post("/v1/completions", json!({"prompt": [999999]}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert!(e["message"].as_str().unwrap().contains("vocabulary"), "{e}");
    let e = h
        .post("/v1/completions", json!({"prompt": "x", "echo": true}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "echo");
    assert!(h.requests().is_empty());
}

#[tokio::test]
async fn unknown_model_is_404_model_not_found() {
    let Some(e) = chat_error(json!({"model": "gpt-4o"}), StatusCode::NOT_FOUND).await else {
        return;
    };
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-4o"));
}

/// A template failure caused by the conversation's shape is the client's: a 400 naming
/// `messages`, both when the template raises and when it fails to render them.
#[tokio::test]
async fn chat_template_failures_on_these_messages_are_400() {
    for (template, says) in [
        (
            "{% if messages[0].role != 'user' %}{{ raise_exception('a user turn must come first') }}{% endif %}ok",
            "a user turn must come first",
        ),
        (
            "{{ messages[0].content.nosuchmethod() }}",
            "cannot render these messages",
        ),
    ] {
        let Some(h) = harness(Opts {
            template: Some(template),
            ..Opts::default()
        }) else {
            return;
        };
        let r = h
            .post("/v1/chat/completions", json!({"model": MODEL, "messages": hello()}))
            .await;
        let e = r.error(StatusCode::BAD_REQUEST);
        assert_eq!(e["type"], "invalid_request_error", "{e}");
        assert_eq!(e["param"], "messages", "{e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{e}");
        assert!(h.requests().is_empty(), "nothing may reach the backend");
    }
}

#[tokio::test]
async fn context_length_exceeded() {
    let Some(h) = harness(Opts {
        max_context: 64,
        ..Opts::default()
    }) else {
        return;
    };
    let e = h
        .post(
            "/v1/chat/completions",
            json!({"messages": hello(), "max_tokens": 60}),
        )
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "messages");
    let m = e["message"].as_str().unwrap();
    assert!(
        m.starts_with("This model's maximum context length is 64 tokens. However, you requested"),
        "{m}"
    );
    assert!(m.contains("60 in the completion"), "{m}");

    let long = "word ".repeat(100);
    let e = h
        .post("/v1/completions", json!({"prompt": long}))
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "prompt");
    // Without max_tokens, a prompt that fits gets the rest of the context.
    let r = h.post("/v1/completions", json!({"prompt": "Hi"})).await;
    assert_eq!(r.status, StatusCode::OK);
    let req = &h.requests()[0];
    assert_eq!(req.params.max_tokens, 64 - req.prompt.len());
}

#[tokio::test]
async fn api_keys_guard_the_api_but_not_health() {
    let Some(h) = harness(Opts {
        keys: Some(&["sk-good", "sk-other"]),
        ..Opts::default()
    }) else {
        return;
    };
    let body = json!({"messages": hello(), "max_tokens": 1}).to_string();
    for key in [None, Some("sk-bad")] {
        let r = h
            .call("POST", "/v1/chat/completions", Some(&body), key)
            .await;
        let e = r.error(StatusCode::UNAUTHORIZED);
        assert_eq!(e["code"], "invalid_api_key");
        assert!(!e["message"].as_str().unwrap().contains("sk-bad"));
    }
    h.call("GET", "/v1/models", None, None)
        .await
        .error(StatusCode::UNAUTHORIZED);
    let r = h
        .call(
            "POST",
            "/v1/chat/completions",
            Some(&body),
            Some("sk-other"),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    for path in ["/health", "/ready", "/metrics"] {
        assert_eq!(
            h.call("GET", path, None, None).await.status,
            StatusCode::OK,
            "{path}"
        );
    }
    let m = h.metrics().await;
    assert!(
        m.contains("cleave_router_requests_total{status=\"unauthorized\"} 2"),
        "{m}"
    );
}

#[tokio::test]
async fn no_workers_is_503() {
    let Some(h) = harness_in(Mode::NoWorkers) else {
        return;
    };
    let e = h
        .post("/v1/chat/completions", json!({"messages": hello()}))
        .await
        .error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(e["code"], "no_workers");
}

#[tokio::test]
async fn worker_failure_is_a_500_with_a_fixed_message() {
    let Some(h) = harness_in(Mode::FailMidStream) else {
        return;
    };
    let e = h
        .post("/v1/chat/completions", json!({"messages": hello()}))
        .await
        .error(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(e["type"], "server_error");
    assert!(!e["message"].as_str().unwrap().contains("exploded"), "{e}");
    let aborted = harness_in(Mode::Abort).unwrap();
    aborted
        .post("/v1/completions", json!({"prompt": "Hi"}))
        .await
        .error(StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn full_admission_is_429_with_retry_after() {
    let Some(h) = harness(Opts {
        mode: Mode::Hang,
        admit: AdmitConfig {
            max_in_flight: 1,
            max_queue: 0,
            queue_timeout: Duration::from_secs(1),
            request_timeout: None,
        },
        ..Opts::default()
    }) else {
        return;
    };
    // A streamed request holds its in-flight slot as long as its body is alive.
    let req = axum::http::Request::post("/v1/chat/completions")
        .body(axum::body::Body::from(
            json!({"messages": hello(), "stream": true}).to_string(),
        ))
        .unwrap();
    let held = tower::ServiceExt::oneshot(h.app.clone(), req)
        .await
        .unwrap();
    assert_eq!(held.status(), StatusCode::OK);

    let r = h
        .post("/v1/chat/completions", json!({"messages": hello()}))
        .await;
    let e = r.error(StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(e["type"], "rate_limit_error");
    assert_eq!(r.headers["retry-after"], "1");

    drop(held);
    assert_eq!(h.fake.live.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The slot is free again.
    let req = axum::http::Request::post("/v1/completions")
        .body(axum::body::Body::from(
            json!({"prompt": "Hi", "stream": true}).to_string(),
        ))
        .unwrap();
    let again = tower::ServiceExt::oneshot(h.app.clone(), req)
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::OK);
}

// The clock is paused: the 300 ms deadline passes as soon as the hung request is idle, without
// waiting for it in real time.
#[tokio::test(start_paused = true)]
async fn request_deadline_is_504() {
    let Some(h) = harness(Opts {
        mode: Mode::Hang,
        admit: AdmitConfig {
            request_timeout: Some(Duration::from_millis(300)),
            ..AdmitConfig::default()
        },
        ..Opts::default()
    }) else {
        return;
    };
    let e = h
        .post("/v1/chat/completions", json!({"messages": hello()}))
        .await
        .error(StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(e["code"], "timeout");
    assert_eq!(h.fake.live.load(std::sync::atomic::Ordering::SeqCst), 0);

    // Streaming: the deadline ends the event stream with an error event.
    let events = h.stream_hello().await;
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "timeout");
    assert_eq!(h.fake.live.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_in_openai_shape() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let big = "a".repeat(crate::api::error::BODY_LIMIT + 1);
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": big}]}),
        )
        .await;
    let e = r.error(StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(e["code"], "request_too_large");
    assert!(e["message"].as_str().unwrap().contains("2 MiB"), "{e}");
    assert!(h.requests().is_empty());
}
