//! Per-key limits through the whole router (`serve::run`, real HTTP, a fake gRPC decode
//! worker): a key over its requests per minute gets 429 with `Retry-After` and OpenAI's
//! `x-ratelimit-*` headers while another key goes on; a concurrency cap refuses a second
//! request while the first streams; tokens are reserved (prompt + max_tokens) and settled to
//! usage; a changed keys file takes effect without restart; the old one-key-per-line file
//! keeps working; per-key metrics appear only with `--key-metrics`.
//!
//! Buckets refill at `limit / 60` per second, so within a test (seconds) a limit of a few
//! requests per minute cannot refill; the assertions never depend on elapsed time.

use crate::support;

use std::path::{Path, PathBuf};

use reqwest::StatusCode;
use serde_json::Value;
use support::{chat, next_generation, replace, scratch, worker, Router};

struct Reply {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// The router over `decode` with the API keys `keys` (written to a keys file in a fresh scratch
/// folder `name`, whose path it returns too) and the `extra` flags.
async fn keyed_router(
    model: &Path,
    decode: &str,
    name: &str,
    keys: &str,
    extra: &[&str],
) -> (Router, PathBuf) {
    let file = scratch(name).join("keys");
    std::fs::write(&file, keys).unwrap();
    let file_flag = file.display().to_string();
    let mut flags = vec!["--api-keys-file", &file_flag];
    flags.extend_from_slice(extra);
    (Router::start(model, decode, &flags).await, file)
}

async fn post(router: &Router, key: Option<&str>, body: String) -> Reply {
    let mut req = client()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .header("content-type", "application/json")
        .body(body);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = req.send().await.expect("the router answers");
    Reply {
        status: resp.status(),
        headers: resp.headers().clone(),
        body: resp.text().await.unwrap(),
    }
}

/// A client whose requests fail instead of hanging when a request is wrongly held.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(support::PATIENCE)
        .build()
        .unwrap()
}

async fn metrics(router: &Router) -> String {
    reqwest::get(format!("http://{}/metrics", router.addr()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn assert_rate_limited(r: &Reply) {
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["type"], "rate_limit_error", "{e}");
    assert_eq!(e["code"], "rate_limit_exceeded", "{e}");
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1, "Retry-After {retry}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_rpm_gets_429_and_other_keys_are_unaffected() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    let keys = "# team A is limited, B has its own budget, the third key is old-style\n\
                sk-a rpm=2 name=team-a\n\
                sk-b rpm=2 name=team-b\n\
                sk-plain\n";
    let (router, _) = keyed_router(&model, &decode, "limits-rpm", keys, &["--key-metrics"]).await;

    for remaining in ["1", "0"] {
        let ok = post(&router, Some("sk-a"), chat(false, 4)).await;
        assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
        assert_eq!(ok.header("x-ratelimit-limit-requests"), Some("2"));
        assert_eq!(ok.header("x-ratelimit-remaining-requests"), Some(remaining));
        assert!(ok.header("x-ratelimit-reset-requests").is_some());
        assert!(
            ok.header("x-ratelimit-limit-tokens").is_none(),
            "no tpm set"
        );
    }
    let refused = post(&router, Some("sk-a"), chat(false, 4)).await;
    assert_rate_limited(&refused);
    // Two per minute: the next request is at most 30 s away.
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "Retry-After {retry}");
    assert_eq!(refused.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    let reset = refused.header("x-ratelimit-reset-requests").unwrap();
    assert!(reset.ends_with('s'), "{reset}");

    // The other keys have their own budgets.
    for key in ["sk-b", "sk-b", "sk-plain", "sk-plain", "sk-plain"] {
        let ok = post(&router, Some(key), chat(false, 4)).await;
        assert_eq!(ok.status, StatusCode::OK, "{key}: {}", ok.body);
    }
    assert!(post(&router, Some("sk-b"), chat(false, 4)).await.status == 429);
    // Wrong and missing keys are still 401, not 429.
    assert_eq!(
        post(&router, Some("sk-c"), chat(false, 4)).await.status,
        401
    );
    assert_eq!(post(&router, None, chat(false, 4)).await.status, 401);

    let m = metrics(&router).await;
    assert!(
        m.contains(r#"cleave_router_key_requests_total{key="team-a"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"cleave_router_key_rate_limited_total{key="team-a",limit="requests"} 1"#),
        "{m}"
    );
    assert!(
        !m.contains("sk-a") && !m.contains("sk-plain"),
        "keys never in metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_key_per_line_file_still_works_and_adds_no_headers_or_metrics() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    let keys = "sk-one\n\n  sk-two  \n";
    let (router, _) = keyed_router(&model, &decode, "limits-old", keys, &[]).await;
    for _ in 0..3 {
        for key in ["sk-one", "sk-two"] {
            let ok = post(&router, Some(key), chat(false, 4)).await;
            assert_eq!(ok.status, StatusCode::OK, "{key}: {}", ok.body);
            assert!(ok.header("x-ratelimit-limit-requests").is_none());
        }
    }
    assert_eq!(
        post(&router, Some("sk-on"), chat(false, 4)).await.status,
        401
    );
    assert!(!metrics(&router).await.contains("cleave_router_key_"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_cap_refuses_a_second_request_while_the_first_streams() {
    let Some(model) = support::model() else {
        return;
    };
    // The worker holds every stream after its first token until the gate opens.
    let (decode, gate) = worker(false).await;
    let keys = "sk-c concurrency=1\nsk-d concurrency=1\n";
    let (router, _) = keyed_router(&model, &decode, "limits-conc", keys, &[]).await;
    let url = format!("http://{}/v1/chat/completions", router.addr());
    let client = client();
    let stream = |key: &'static str| {
        client
            .post(&url)
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(chat(true, 4))
            .send()
    };
    let mut first = stream("sk-c").await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // The first chunk arrived: the request is admitted and in flight.
    assert!(first.chunk().await.unwrap().is_some());

    let second = post(&router, Some("sk-c"), chat(false, 4)).await;
    assert_rate_limited(&second);
    assert!(second.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("concurrency"));

    // Another key is not held back by sk-c's cap.
    let mut other = stream("sk-d").await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    assert!(other.chunk().await.unwrap().is_some());

    gate.send(true).unwrap();
    let mut rest = Vec::new();
    while let Some(c) = first.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    assert!(String::from_utf8_lossy(&rest).contains("data: [DONE]"));
    while other.chunk().await.unwrap().is_some() {}
    // The finished stream gave its slot back.
    let third = post(&router, Some("sk-c"), chat(false, 4)).await;
    assert_eq!(third.status, StatusCode::OK, "{}", third.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_reserved_as_prompt_plus_max_tokens_and_settled_to_usage() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    let (router, _) = keyed_router(&model, &decode, "limits-tpm", "sk-t tpm=600\n", &[]).await;

    let too_big = post(&router, Some("sk-t"), chat(false, 700)).await;
    assert_rate_limited(&too_big);
    let msg = too_big.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("too large"), "{msg}");
    assert_eq!(too_big.header("x-ratelimit-limit-tokens"), Some("600"));

    let first = post(&router, Some("sk-t"), chat(false, 100)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let usage = &first.json()["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let total = usage["total_tokens"].as_u64().unwrap();
    assert_eq!(total, prompt + 2, "the fake worker generates two tokens");
    let remaining = |r: &Reply| -> u64 {
        r.header("x-ratelimit-remaining-tokens")
            .expect("tokens header")
            .parse()
            .unwrap()
    };
    // At most what is left after reserving prompt + max_tokens (plus what refilled since).
    assert!(remaining(&first) >= 600 - (prompt + 100));
    let second = post(&router, Some("sk-t"), chat(false, 100)).await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.body);
    // The first request gave back the 98 tokens it reserved and did not use: without
    // settling, only 600 - 2·(prompt + 100) (plus refill) would be left.
    assert!(
        remaining(&second) >= 600 - total - (prompt + 100),
        "remaining {} after usage {total} and a reservation of {}",
        remaining(&second),
        prompt + 100
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_keys_file_takes_effect_without_restart() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    let reload = ["--reload-interval", "0.05"];
    let (router, keys) = keyed_router(
        &model,
        &decode,
        "limits-reload",
        "sk-r rpm=1\nsk-gone\n",
        &reload,
    )
    .await;
    let mut generation = router.running.keys.as_ref().unwrap().generation();
    assert_eq!(
        post(&router, Some("sk-r"), chat(false, 4)).await.status,
        200
    );
    assert_rate_limited(&post(&router, Some("sk-r"), chat(false, 4)).await);

    replace(&keys, "sk-r rpm=5\nsk-new\n");
    next_generation(&mut generation).await;
    let ok = post(&router, Some("sk-r"), chat(false, 4)).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert_eq!(ok.header("x-ratelimit-limit-requests"), Some("5"));
    let remaining: u64 = ok
        .header("x-ratelimit-remaining-requests")
        .unwrap()
        .parse()
        .unwrap();
    assert!(remaining <= 4, "{remaining}");
    assert_eq!(
        post(&router, Some("sk-new"), chat(false, 4)).await.status,
        200
    );
    assert_eq!(
        post(&router, Some("sk-gone"), chat(false, 4)).await.status,
        401
    );
}
