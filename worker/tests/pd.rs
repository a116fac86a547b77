//! Disaggregated prefill and decode through real gRPC and the real KV transport (UCX when this
//! build has it, and TCP), against the single-process engine's output.

use crate::common;

use std::time::Duration;

use cleave_decode_worker::SERVICE as DECODE;
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_kv_transfer::BackendChoice;
use cleave_prefill_worker::SERVICE as PREFILL;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_text::gguf::default_model_path;
use cleave_worker::convert::kv;
use cleave_worker::{run, Running, WorkerConfig};
use common::{config, generate, greedy, http_get, prompts, reference, settle};
use tokio_util::sync::CancellationToken;

/// Waits until `w`'s engine is computing a sequence (the prefill has started).
async fn wait_until_computing(w: &Running) {
    for _ in 0..500 {
        if w.state.engine.stats().running > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the prefill never started: {:?}", w.state.engine.stats());
}

async fn disaggregated_equals_single_process(transport: BackendChoice) {
    let stop = CancellationToken::new();
    let prefill = run(PREFILL, config(transport), stop.clone()).await.unwrap();
    let decode = run(DECODE, config(transport), stop.clone()).await.unwrap();
    for prompt in prompts() {
        let want = reference(&prompt, 16).await;
        let (got, fin) = generate(&decode, &prompt, Some(&prefill), 16).await;
        assert_eq!(got, want, "{transport:?}: {}-token prompt", prompt.len());
        assert!(fin.disaggregated);
        assert_eq!(fin.reason(), pb::FinishReason::Length);
        let t = fin
            .ttft
            .expect("a disaggregated request reports its TTFT breakdown");
        assert!(
            t.total_seconds >= t.prefill_seconds && t.prefill_seconds > 0.0,
            "{t:?}"
        );
    }
    // The long prompt again: the decode worker's own prefix cache serves its full blocks.
    let long = prompts().remove(1);
    let (got, fin) = generate(&decode, &long, Some(&prefill), 16).await;
    assert_eq!(got, reference(&long, 16).await);
    assert_eq!(fin.cached_tokens as usize, (long.len() - 1) / 16 * 16);
    for w in [&prefill, &decode] {
        assert_eq!(settle(w).await.pool.used, 0);
    }
    let metrics = http_get(decode.http_addr, "/metrics").await;
    for name in [
        "cleave_kv_blocks_used",
        "cleave_kv_blocks_total",
        "cleave_kv_transfer_bytes_total",
        "cleave_kv_transfer_seconds",
        "cleave_worker_queue_depth",
        "cleave_prefix_cache_hit_tokens_total",
        "cleave_prefix_cache_query_tokens_total",
    ] {
        assert!(
            metrics.contains(name),
            "{name} missing from /metrics:\n{metrics}"
        );
    }
    assert!(
        metrics.contains("cleave_worker_disaggregated_requests_total 3"),
        "{metrics}"
    );
    assert!(http_get(prefill.http_addr, "/ready")
        .await
        .contains("200 OK"));
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp() {
    disaggregated_equals_single_process(BackendChoice::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_ucx() {
    if !cleave_kv_transfer::ucx_or_skip("pd::over_ucx") {
        return;
    }
    disaggregated_equals_single_process(BackendChoice::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_prefill_worker_falls_back_to_local_prefill() {
    let stop = CancellationToken::new();
    let decode = run(DECODE, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    // A prefill worker that is gone: bind a port, then close it.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let prompt = prompts().remove(0);
    let mut client = DecodeWorkerClient::connect(format!("http://{}", decode.grpc_addr))
        .await
        .unwrap();
    let req = pb::GenerateRequest {
        request_id: "fallback".into(),
        prompt: prompt.clone(),
        params: Some(greedy(8)),
        prefill_endpoint: Some(format!("http://{dead}")),
        resume: Vec::new(),
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::generate_event::Event::Token(t)) = ev.event {
            ids.push(t.id);
        }
    }
    assert_eq!(ids, reference(&prompt, 8).await);
    assert_eq!(settle(&decode).await.pool.used, 0);
    let metrics = http_get(decode.http_addr, "/metrics").await;
    assert!(
        metrics.contains("cleave_worker_prefill_fallbacks_total 1"),
        "{metrics}"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_prefill_call_aborts_the_prefill_and_its_transfers() {
    use cleave_proto::v1::prefill_worker_client::PrefillWorkerClient;
    let stop = CancellationToken::new();
    let prefill = run(PREFILL, config(BackendChoice::Auto), stop.clone())
        .await
        .unwrap();
    // The destination: a decode worker's real region (no sequence of its own is running).
    let decode = run(DECODE, config(BackendChoice::Auto), stop.clone())
        .await
        .unwrap();
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let long = "Licensed under the Apache License, Version 2.0; you may not use this file except in compliance with the License. ".repeat(25);
    let prompt = l.tokenizer.encode(&long, false);
    let blocks = prompt.len().div_ceil(16);
    assert!(blocks < 128);
    let dest = pb::KvDestination {
        worker_address: Some(kv::address_to_wire(&decode.state.transport.local_address())),
        region: Some(kv::region_to_wire(&decode.state.region.descriptor())),
        blocks: (0..blocks as u32).collect(),
        block_bytes: decode.state.layout.block_bytes() as u64,
        skip_blocks: 0,
        ranks: Vec::new(),
    };
    let req = pb::PrefillRequest {
        request_id: "dropped".into(),
        prompt,
        params: Some(greedy(1)),
        destination: Some(dest),
    };
    let mut client = PrefillWorkerClient::connect(format!("http://{}", prefill.grpc_addr))
        .await
        .unwrap();
    let call = tokio::spawn(async move { client.prefill(req).await });
    // Wait until the prefill is running, then drop the call.
    wait_until_computing(&prefill).await;
    call.abort();
    let s = settle(&prefill).await;
    assert_eq!(s.pool.used, 0, "{:?}", s.pool);
    assert_eq!(s.finished, 1);
    assert!(
        s.generated_tokens == 0,
        "the aborted prefill still produced its first token"
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_uncached_remainders_are_prefilled_locally() {
    let stop = CancellationToken::new();
    let prefill = run(PREFILL, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    let decode = run(
        DECODE,
        WorkerConfig {
            local_prefill_below_tokens: 64,
            ..config(BackendChoice::Tcp)
        },
        stop.clone(),
    )
    .await
    .unwrap();
    let short = prompts().remove(0);
    let (got, fin) = generate(&decode, &short, Some(&prefill), 8).await;
    assert_eq!(got, reference(&short, 8).await);
    assert!(
        !fin.disaggregated,
        "a {}-token prompt was sent to the prefill worker",
        short.len()
    );
    let long = prompts().remove(1);
    assert!(long.len() > 64);
    let (_, fin) = generate(&decode, &long, Some(&prefill), 4).await;
    assert!(fin.disaggregated);
    assert_eq!(settle(&decode).await.pool.used, 0);
    stop.cancel();
}

/// A client that drops its `Generate` stream while the decode worker waits for the prefill
/// worker (nothing has been streamed yet) cancels the whole request: the decode worker notices
/// the closed stream at once, aborts the import, and the dropped `Prefill` call stops the
/// prefill worker before it samples the first token; nothing leaks on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_the_remote_prefill_cancels_the_prefill() {
    let stop = CancellationToken::new();
    let prefill = run(PREFILL, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    let decode = run(DECODE, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let long = "Licensed under the Apache License, Version 2.0; you may not use this file except in compliance with the License. ".repeat(25);
    let prompt = l.tokenizer.encode(&long, false);
    let mut client = DecodeWorkerClient::connect(format!("http://{}", decode.grpc_addr))
        .await
        .unwrap();
    let req = pb::GenerateRequest {
        request_id: "gone".into(),
        prompt,
        params: Some(greedy(8)),
        prefill_endpoint: Some(format!("http://{}", prefill.grpc_addr)),
        resume: Vec::new(),
    };
    let call = tokio::spawn(async move {
        let mut stream = client.generate(req).await.unwrap().into_inner();
        stream.message().await
    });
    wait_until_computing(&prefill).await;
    call.abort();
    let p = settle(&prefill).await;
    assert_eq!(p.pool.used, 0, "{:?}", p.pool);
    assert_eq!(
        p.generated_tokens, 0,
        "the prefill worker finished a prefill whose client was gone"
    );
    let d = settle(&decode).await;
    assert_eq!(d.pool.used, 0, "{:?}", d.pool);
    assert_eq!(d.generated_tokens, 0);
    stop.cancel();
}
