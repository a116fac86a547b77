//! Disaggregated prefill/decode between two tensor-parallel groups of real processes: a TP=3
//! `cleave worker --role prefill` group writes each rank's KV heads straight into the matching rank of a TP=3
//! `cleave worker --role decode` group (rank to rank, over TCP), and the decode group then generates the
//! greedy tokens of the same three-way split computed in one process — also with all six ranks on separate "hosts" (network
//! namespaces). A prefill group asked to write into a group of another size
//! refuses with a clear error.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use crate::support;
use crate::support::SERIAL;

use std::time::{Duration, Instant};

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvDtype, KvLayout};
use cleave_engine::load::Loaded;
use cleave_proto::v1 as pb;
use cleave_proto::v1::prefill_worker_client::PrefillWorkerClient;
use cleave_text::gguf::default_model_path;
use support::{generate_via, metric, Group, Netns};

/// Tokens compared (see worker/tests/group.rs on why not many more).
const N: usize = 12;

fn prompts(l: &Loaded) -> Vec<Vec<u32>> {
    let long = "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use \
                this file except in compliance with the License. "
        .repeat(3);
    vec![
        l.encode_text(&long),
        l.encode_text("The capital of France is"),
    ]
}

/// Greedy tokens of the model split three ways in one process (`support::split_tokens`).
async fn reference() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    support::split_tokens(prompts, N, 3)
}

/// Waits until the metric reads `want` (gauges are published asynchronously).
fn wait_metric(addr: &str, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = metric(addr, name);
        if got == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr}: {name} is {got:?}, not {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_prefill_group_feeds_a_tp3_decode_group_rank_to_rank_over_tcp() {
    rank_to_rank("tcp", None).await;
}

/// Six "hosts": each rank of both groups in its own network namespace (veth + bridge), so the
/// KV transport must listen on and advertise each rank's own address, not loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp3_groups_on_separate_hosts_do_pd_rank_to_rank() {
    let ns = Netns::create(6);
    rank_to_rank("tcp", Some(&ns)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_prefill_group_feeds_a_tp3_decode_group_rank_to_rank_over_ucx() {
    if !cleave_kv_transfer::ucx_or_skip("group_pd::rank_to_rank over UCX") {
        return;
    }
    rank_to_rank("ucx", None).await;
}

async fn rank_to_rank(transport: &str, ns: Option<&Netns>) {
    let _one = SERIAL.lock().await;
    let (prompts, want) = reference().await;
    // Prefill ranks in namespaces 0-2 and decode ranks in 3-5, or all on loopback.
    let (wraps, hosts): (Vec<Vec<String>>, Vec<String>) = match ns {
        Some(ns) => ((0..6).map(|i| ns.wrap(i)).collect(), ns.hosts.clone()),
        None => (vec![Vec::new(); 6], vec!["127.0.0.1".to_string(); 6]),
    };
    let prefill = Group::start_role(
        "prefill",
        &wraps[..3],
        &hosts[..3],
        &["--transport", transport],
    );
    let extra = ["--local-fallback", "false", "--transport", transport];
    let decode = Group::start(&wraps[3..], &hosts[3..], &extra);
    let (d, p) = (decode.grpc(), prefill.grpc());
    // The long prompt (several blocks), a short one, then the long one again: its full blocks
    // are then in the decode group's prefix cache and only the rest is transferred.
    for (i, prompt) in [0, 1, 0].into_iter().map(|i| (i, &prompts[i])) {
        let got = generate_via(&d, &p, prompt, N as u32).await.unwrap();
        assert_eq!(
            got, want[i],
            "{transport}: P/D TP=3 vs the same split in one process, prompt {i}"
        );
    }
    let http = decode.http();
    // Every request's KV came from the prefill group (no local fallback: it is off, and a
    // failed import would have aborted the request).
    wait_metric(&http, "cleave_worker_disaggregated_requests_total", 3.0);
    wait_metric(&http, "cleave_kv_blocks_used", 0.0);
    wait_metric(&prefill.http(), "cleave_kv_blocks_used", 0.0);
    assert!(
        metric(&prefill.http(), "cleave_kv_transfer_bytes_total").unwrap_or(0.0) > 0.0,
        "the prefill leader wrote nothing"
    );

    // A destination naming one rank (a single-process decode worker) is refused by name.
    let mut client = PrefillWorkerClient::connect(p.clone()).await.unwrap();
    let req = pb::PrefillRequest {
        request_id: "mismatch".into(),
        prompt: prompts[0].clone(),
        params: Some(pb::SamplingParams {
            max_tokens: 1,
            top_p: 1.0,
            ..Default::default()
        }),
        destination: Some(pb::KvDestination {
            worker_address: Some(pb::KvWorkerAddress {
                tcp: "127.0.0.1:9".into(),
                ucx: None,
            }),
            region: Some(pb::KvRegion {
                owner: "127.0.0.1:9".into(),
                id: 1,
                len: 1 << 20,
                ucx: None,
            }),
            blocks: (0..prompts[0].len().div_ceil(16) as u32).collect(),
            block_bytes: 0,
            skip_blocks: 0,
            ranks: Vec::new(),
        }),
    };
    let err = client.prefill(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // block_bytes 0 is refused first; with the right size the group size is what is wrong.
    let mut req = req;
    req.destination.as_mut().unwrap().block_bytes = block_bytes_of_rank();
    let err = client.prefill(req).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("same tensor-parallel size"),
        "{}",
        err.message()
    );
}

/// Bytes of one KV block of one rank of a TP=3 group of the default model (the workers' default
/// KV dtype).
fn block_bytes_of_rank() -> u64 {
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let c = &l.model.config;
    KvLayout {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads / 3,
        head_dim: c.head_dim,
        block_size: cleave_engine::kv::DEFAULT_BLOCK_SIZE,
        dtype: KvDtype::default(),
    }
    .block_bytes() as u64
}
