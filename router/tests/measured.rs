//! On the decode-worker path, the cached tokens a worker reports when a request finishes
//! correct the router's recent prefill work (what the index expected it to compute) to what it
//! computed (docs/routing.md, "Measured prefill work").

use crate::support;

use cleave_router::dispatch::BLOCK_SIZE;
use support::{chat, worker_with_all_cached, Router};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_workers_cached_tokens_correct_the_recent_prefill_work() {
    let Some(model) = support::model() else {
        return;
    };
    // The index knows of nothing cached, so the router charges the whole prompt; the worker
    // says it had all of it.
    let (decode, _gate) = worker_with_all_cached(true).await;
    let router = Router::start(&model, &decode, &[]).await;
    let recent = || {
        let view = router.running.cluster.placement().view();
        let w = view.iter().next().expect("the worker");
        w.recent_prefill_blocks
    };
    assert_eq!(recent(), 0.0);
    let long = "Tell me about the history of the city and its rivers. ".repeat(8);
    let body = chat(false, 2).replace("Hi!", &long);
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", router.addr()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer");
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 32, "a prompt of several blocks: {v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], prompt_tokens,
        "{v}"
    );
    // The response is complete, so the stream has ended and the correction is in: the router
    // charged every block of the prompt and now counts only the partial last one, which no
    // engine caches (whole blocks of the reported tokens are taken as cached).
    let p = prompt_tokens as usize;
    let charged = p.div_ceil(BLOCK_SIZE);
    let computed = charged - p / BLOCK_SIZE;
    assert!(charged >= 2);
    assert_eq!(
        recent(),
        computed as f64,
        "corrected from {charged} blocks to {computed}"
    );
}
