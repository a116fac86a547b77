//! Worker groups of real processes: a TP=3 decode group of the default model (9 heads, 3 KV
//! heads; each rank its own `cleave worker --role decode` process holding a third of the heads) generates
//! exactly the tokens of the same three-way split computed in one process, also with every rank in its own network namespace; a rank dying
//! inside a collective (the `group.all_reduces` fault point) fails the group fast (aborted
//! requests, not ready, no blocks held, exit status 1) and a restarted group serves again.

use crate::support;
use crate::support::SERIAL;

use std::time::{Duration, Instant};

use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_text::gguf::default_model_path;
use support::{generate, http_get, metric, Group, Netns};

/// Tokens compared. Splitting heads and the FFN across ranks changes the order of sums, so a
/// near tie between two tokens can flip after many steps (see engine/tests/tensor_parallel.rs
/// for the statistical check); these prompts have no such tie within `N` tokens, and the
/// result is deterministic run to run.
const N: usize = 12;

fn prompts(l: &Loaded) -> Vec<Vec<u32>> {
    [
        "The capital of France is",
        "Licensed under the Apache License, Version 2.0; you may not use this file except in \
         compliance with the License. You may obtain a copy of the License at",
    ]
    .iter()
    .map(|t| l.encode_text(t))
    .collect()
}

/// Greedy tokens of the model split three ways in one process (`support::split_tokens`).
async fn reference() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    support::split_tokens(prompts, N, 3)
}

async fn check_tokens(group: &Group, prompts: &[Vec<u32>], want: &[Vec<u32>]) {
    // Concurrently, so the leader batches both into its steps.
    let endpoint = group.grpc();
    let (a, b) = tokio::join!(
        generate(&endpoint, &prompts[0], N as u32),
        generate(&endpoint, &prompts[1], N as u32)
    );
    assert_eq!(
        a.unwrap(),
        want[0],
        "TP=3 group vs the same split in one process, prompt 0"
    );
    assert_eq!(
        b.unwrap(),
        want[1],
        "TP=3 group vs the same split in one process, prompt 1"
    );
}

fn loopback(n: usize) -> (Vec<Vec<String>>, Vec<String>) {
    (vec![Vec::new(); n], vec!["127.0.0.1".to_string(); n])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_group_of_processes_generates_the_single_process_tokens() {
    let _one = SERIAL.lock().await;
    let (prompts, want) = reference().await;
    let (wraps, hosts) = loopback(3);
    let mut group = Group::start(&wraps, &hosts, &[]);
    check_tokens(&group, &prompts, &want).await;
    // Followers answer their pods' probes (they serve no requests).
    for f in &group.ranks[1..] {
        for path in ["/health", "/ready"] {
            assert_eq!(http_get(&f.addr("http"), path).map(|r| r.0), Some(200));
        }
    }
    // A leader that stops cleanly stops its followers cleanly (exit 0).
    group.ranks[0].signal("-TERM");
    for (r, p) in group.ranks.iter_mut().enumerate() {
        let s = p.wait_exit(Duration::from_secs(30)).expect("rank exits");
        assert!(s.success(), "rank {r} exited with {s}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_group_with_ucx_collectives_generates_the_single_process_tokens() {
    if !cleave_kv_transfer::ucx_or_skip("group::tp3 with UCX collectives") {
        return;
    }
    let _one = SERIAL.lock().await;
    let (prompts, want) = reference().await;
    let (wraps, hosts) = loopback(3);
    let group = Group::start(&wraps, &hosts, &["--group-transport", "ucx"]);
    check_tokens(&group, &prompts, &want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_group_across_network_namespaces_serves_requests() {
    let _one = SERIAL.lock().await;
    let (prompts, want) = reference().await;
    let ns = Netns::create(3);
    let wraps: Vec<Vec<String>> = (0..3).map(|i| ns.wrap(i)).collect();
    let group = Group::start(&wraps, &ns.hosts, &[]);
    assert!(group.grpc().contains(&ns.hosts[0]), "{}", group.grpc());
    check_tokens(&group, &prompts, &want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_dying_mid_collective_fails_the_group_fast_and_a_restarted_group_serves() {
    let _one = SERIAL.lock().await;
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let prompt = l.encode_text("Once upon a time");
    drop(l);
    let (clean, hosts) = loopback(3);
    // Rank 2 exits (status 86) as it enters its 8th forward pass's first all-reduce (SmolLM2
    // does 2 per layer, 30 layers): the prompt's forward and 7 decode steps ran, and the other
    // ranks are inside that all-reduce, waiting for rank 2's part.
    let mut wraps = clean.clone();
    wraps[2] = ["env", "CLEAVE_FAULT=group.all_reduces=421"]
        .map(String::from)
        .to_vec();
    // Stay up (not ready) for a while after the failure so the test can look at it.
    let extra = ["--group-failed-exit-after", "20s"];
    let mut group = Group::start(&wraps, &hosts, &extra);
    let http = group.http();
    assert_eq!(http_get(&http, "/ready").unwrap().0, 200);
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        generate(&group.grpc(), &prompt, 2000),
    )
    .await
    .expect("the request ends (no hang)");
    assert!(res.is_err(), "the request must end with an error: {res:?}");
    let s = group.ranks[2]
        .wait_exit(Duration::from_secs(10))
        .expect("rank 2 stopped at the fault point");
    assert_eq!(
        s.code(),
        Some(86),
        "rank 2 must stop at the fault point: {s}"
    );
    let failed = Instant::now();
    // Not ready promptly (the leader polls its engine every 50 ms).
    let mut ready = http_get(&http, "/ready").expect("leader still answers HTTP");
    while ready.0 == 200 && failed.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ready = http_get(&http, "/ready").expect("leader still answers HTTP");
    }
    assert_eq!((ready.0, ready.1.as_str()), (503, "worker group failed"));
    assert_eq!(metric(&http, "cleave_kv_blocks_used"), Some(0.0));
    // New requests are refused rather than queued.
    assert!(generate(&group.grpc(), &prompt, 4).await.is_err());
    // The leader and the surviving follower exit with an error (the supervisor restarts the
    // group).
    for r in [0, 1] {
        let s = group.ranks[r]
            .wait_exit(Duration::from_secs(40))
            .unwrap_or_else(|| panic!("rank {r} did not exit"));
        assert!(!s.success(), "rank {r} exited with {s}");
    }
    drop(group);
    let group = Group::start(&clean, &hosts, &[]);
    assert_eq!(http_get(&group.http(), "/ready").unwrap().0, 200);
    assert_eq!(generate(&group.grpc(), &prompt, 4).await.unwrap().len(), 4);
}
