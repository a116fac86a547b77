//! The live placement path (`Dispatcher::place` → `PlacementState::place`) with and without the
//! in-flight overlay, no worker process needed (placement opens no connection).

use cleave_kv_index::{KvEvent, KvEventRecord};
use cleave_types::kv::block_hashes;

use super::*;
use crate::place::{BuildPolicy, PlaceConfig, PolicyKind, Role};

/// A cluster of `n` healthy `both` workers placing with `policy` (never disaggregating, so the
/// decode worker is the one that prefills).
fn dispatcher(policy: PolicyKind, n: u64) -> (Arc<Cluster>, Dispatcher) {
    let cluster = Arc::new(Cluster::for_policy(policy));
    for i in 0..n {
        cluster
            .add(
                WorkerId(i),
                Role::Both,
                &format!("http://127.0.0.1:{}", 9 + i),
            )
            .unwrap();
        cluster.placement().set_healthy(WorkerId(i), true);
    }
    let config = PlaceConfig {
        disagg_min_uncached_blocks: usize::MAX,
        ..PlaceConfig::default()
    };
    let d = Dispatcher::new(cluster.clone(), policy.build(&config), "m".into());
    (cluster, d)
}

/// A prompt of `blocks` full blocks, distinct per `seed`.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_SIZE) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

/// Two requests with the same 64-block prompt, the second placed before any KV event: where
/// each went.
async fn back_to_back(policy: PolicyKind) -> (WorkerId, WorkerId) {
    let (_cluster, d) = dispatcher(policy, 4);
    let p = prompt(1, 64);
    let (a, _ra) = d.inner.place(&p, 16, false).unwrap();
    let (b, _rb) = d.inner.place(&p, 16, false).unwrap();
    (a.decode, b.decode)
}

#[tokio::test]
async fn same_prefix_back_to_back_lands_on_one_worker_with_the_overlay() {
    let (a, b) = back_to_back(PolicyKind::PrefixOptimistic).await;
    assert_eq!(
        a, b,
        "the second request should follow the first's in-flight prefix"
    );
}

#[tokio::test]
async fn without_the_overlay_the_second_request_goes_elsewhere() {
    // The control: the index alone has no match yet and the first worker carries the prefill
    // charge, so prefix-load spreads them (what the overlay exists to fix).
    let (a, b) = back_to_back(PolicyKind::PrefixLoad).await;
    assert_ne!(a, b);
}

#[tokio::test]
async fn the_overlay_counts_the_placed_prefix_on_the_decode_worker_only() {
    let (cluster, d) = dispatcher(PolicyKind::PrefixOptimistic, 4);
    let p = prompt(2, 40);
    let (a, _r) = d.inner.place(&p, 16, false).unwrap();
    // A longer prompt with the same first 40 blocks.
    let mut longer = p.clone();
    longer.extend(prompt(3, 8));
    let m = cluster.placement().matches(&longer);
    for e in m.entries() {
        let want = if e.worker == a.decode { 40 } else { 0 };
        assert_eq!(e.matched_blocks, want, "{}", e.worker);
    }
}

#[tokio::test]
async fn a_request_dropped_before_its_first_token_stops_counting() {
    let (cluster, d) = dispatcher(PolicyKind::PrefixOptimistic, 4);
    let p = prompt(4, 32);
    let (_a, r) = d.inner.place(&p, 16, false).unwrap();
    assert_eq!(cluster.placement().in_flight_len(), 1);
    drop(r);
    assert_eq!(cluster.placement().in_flight_len(), 0);
    assert_eq!(cluster.placement().matches(&p).longest(), 0);
    // Its load charge went too.
    assert!(cluster.placement().no_load_charged());
}

#[tokio::test]
async fn after_the_first_token_the_workers_events_take_over() {
    let (cluster, d) = dispatcher(PolicyKind::PrefixOptimistic, 4);
    let p = prompt(5, 32);
    let (a, mut r) = d.inner.place(&p, 16, false).unwrap();
    r.prefill_done();
    drop(r);
    // Stream over, events not in yet: the blocks still count.
    assert_eq!(cluster.placement().matches(&p).matched(a.decode), 32);
    assert_eq!(cluster.placement().in_flight_len(), 1);
    // The worker's `Stored` arrives: the next lookup drops the overlay entry, the index answers.
    let hashes = block_hashes(&p, BLOCK_SIZE, 0);
    cluster
        .placement()
        .with_index(|index| {
            index.apply(
                a.decode,
                &KvEventRecord {
                    id: 0,
                    event: KvEvent::Stored {
                        parent: None,
                        blocks: hashes,
                    },
                },
            )
        })
        .unwrap();
    assert_eq!(cluster.placement().matches(&p).matched(a.decode), 32);
    assert_eq!(cluster.placement().in_flight_len(), 0);
}

#[tokio::test]
async fn reused_match_buffers_carry_nothing_over() {
    let (cluster, d) = dispatcher(PolicyKind::PrefixOptimistic, 2);
    let p = prompt(6, 16);
    let (_a, r) = d.inner.place(&p, 16, false).unwrap();
    drop(r);
    // The buffer of that lookup is reused here: a different prompt matches nothing.
    let q = prompt(7, 16);
    let m = cluster.placement().matches(&q);
    assert_eq!(m.entries().len(), 2);
    assert_eq!(m.longest(), 0);
}

#[tokio::test]
async fn a_removed_worker_leaves_the_overlay() {
    let (cluster, d) = dispatcher(PolicyKind::PrefixOptimistic, 2);
    let p = prompt(8, 16);
    let (a, _r) = d.inner.place(&p, 16, false).unwrap();
    cluster.remove(a.decode);
    assert_eq!(cluster.placement().in_flight_len(), 0);
    assert_eq!(cluster.placement().matches(&p).longest(), 0);
}
