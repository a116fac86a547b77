//! A rank that dies, stalls or calls wrongly makes every other rank fail promptly, and the group
//! stays failed.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use crate::common;

use std::time::{Duration, Instant};

use cleave_collective::{GroupConfig, GroupError, NetGroup, Pending, Transport};
use cleave_types::collective::{Collective, CollectiveError};
use common::on_ranks_with;

fn is_peer_or_abort(e: &CollectiveError) -> bool {
    matches!(
        e,
        CollectiveError::PeerFailed { .. } | CollectiveError::Aborted(_)
    )
}

#[test]
fn a_rank_that_drops_its_group_fails_the_others_without_a_timeout() {
    for t in common::transports() {
        // Call timeout far above the watchdog: only the closed connection can end the calls.
        let got = on_ranks_with(
            4,
            move |c| {
                c.timeout = Duration::from_secs(600);
                c.transport = t;
            },
            |g| {
                let mut buf = vec![1.0f32; 100_000];
                g.all_reduce_sum(&mut buf).unwrap();
                if g.rank() == 2 {
                    drop(g);
                    return None;
                }
                let first = loop {
                    if let Err(e) = g.all_reduce_sum(&mut buf) {
                        break e;
                    }
                };
                let later = g.barrier().unwrap_err();
                Some((first, later))
            },
        );
        for (rank, r) in got.into_iter().enumerate() {
            let Some((first, later)) = r else { continue };
            assert!(is_peer_or_abort(&first), "rank {rank}: {first}");
            assert!(
                matches!(later, CollectiveError::Aborted(_)),
                "rank {rank}: {later}"
            );
        }
    }
}

#[test]
fn a_stalled_rank_times_out_the_call_everywhere() {
    for t in common::transports() {
        let got = on_ranks_with(
            3,
            move |c| {
                c.timeout = Duration::from_millis(300);
                c.transport = t;
            },
            |g| {
                if g.rank() == 1 {
                    // Never calls; waits until the others have given up, then finds the group dead.
                    std::thread::sleep(Duration::from_secs(2));
                    return g.barrier().unwrap_err();
                }
                let start = Instant::now();
                let e = g.all_reduce_sum(&mut [1.0; 10]).unwrap_err();
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "took {:?}",
                    start.elapsed()
                );
                e
            },
        );
        assert!(
            got.iter()
                .any(|e| matches!(e, CollectiveError::Timeout(..))),
            "{got:?}"
        );
        // The waiting ranks time out (or see the other waiting rank give up); the stalled rank's
        // late call fails too (what it reads first depends on what was in flight).
        for e in [&got[0], &got[2]] {
            assert!(
                matches!(e, CollectiveError::Timeout(..)) || is_peer_or_abort(e),
                "{got:?}"
            );
        }
    }
}

#[test]
fn a_wrong_send_count_is_invalid_and_stops_the_group() {
    for t in common::transports() {
        let got = on_ranks_with(
            3,
            move |c| c.transport = t,
            |g| {
                let send = if g.rank() == 0 {
                    vec![vec![1.0]; 2]
                } else {
                    vec![vec![1.0]; 3]
                };
                let e = g.all_to_all_v(&send, &mut Vec::new()).unwrap_err();
                (e, g.barrier().unwrap_err())
            },
        );
        assert!(
            matches!(got[0].0, CollectiveError::Invalid(_)),
            "{:?}",
            got[0]
        );
        for (e, later) in &got[1..] {
            assert!(is_peer_or_abort(e), "{e}");
            assert!(matches!(later, CollectiveError::Aborted(_)), "{later}");
        }
    }
}

#[test]
fn mismatched_lengths_and_mismatched_calls_are_invalid() {
    for t in common::transports() {
        let got = on_ranks_with(
            2,
            move |c| c.transport = t,
            |g| {
                g.all_gather(&vec![0.0; 3 + g.rank()], &mut Vec::new())
                    .unwrap_err()
            },
        );
        assert!(
            got.iter()
                .any(|e| matches!(e, CollectiveError::Invalid(m) if m.contains("expected"))),
            "{got:?}"
        );
        let got = on_ranks_with(
            2,
            move |c| c.transport = t,
            |g| {
                if g.rank() == 0 {
                    g.barrier().unwrap_err()
                } else {
                    g.all_reduce_sum(&mut [1.0]).unwrap_err()
                }
            },
        );
        assert!(
            got.iter().any(
                |e| matches!(e, CollectiveError::Invalid(m) if m.contains("while this rank is in"))
            ),
            "{got:?}"
        );
    }
}

#[test]
fn bad_roots_are_invalid() {
    for t in common::transports() {
        let got = on_ranks_with(
            2,
            move |c| c.transport = t,
            |g| g.broadcast(5, &mut Vec::new()).unwrap_err(),
        );
        assert!(got.iter().all(|e| matches!(
            e,
            CollectiveError::Invalid(_)
                | CollectiveError::PeerFailed { .. }
                | CollectiveError::Aborted(_)
        )));
        assert!(got.iter().any(|e| matches!(e, CollectiveError::Invalid(_))));
    }
}

#[test]
fn abort_from_another_thread_ends_a_blocked_call() {
    for t in common::transports() {
        let got = on_ranks_with(
            2,
            move |c| c.transport = t,
            |g| {
                if g.rank() == 1 {
                    std::thread::sleep(Duration::from_secs(1));
                    return None;
                }
                let g = std::sync::Arc::new(g);
                let h = {
                    let g = g.clone();
                    std::thread::spawn(move || g.barrier())
                };
                std::thread::sleep(Duration::from_millis(100));
                g.abort("shutting down");
                Some(h.join().unwrap())
            },
        );
        assert_eq!(
            got[0],
            Some(Err(CollectiveError::Aborted("shutting down".into())))
        );
    }
}

#[test]
fn forming_a_group_fails_cleanly() {
    // A rank that never shows up.
    let mut cfg = GroupConfig::new(0, 2, "127.0.0.1:0");
    cfg.connect_timeout = Duration::from_millis(200);
    assert!(matches!(
        NetGroup::connect(cfg),
        Err(GroupError::Timeout(..))
    ));
    // Nobody listening at the leader address.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = GroupConfig::new(1, 2, free.to_string());
    cfg.connect_timeout = Duration::from_millis(200);
    assert!(matches!(
        NetGroup::connect(cfg),
        Err(GroupError::Timeout(..))
    ));
    // Bad rank, unsupported transport.
    assert!(matches!(
        NetGroup::connect(GroupConfig::new(2, 2, "127.0.0.1:1")),
        Err(GroupError::Config(_))
    ));
    if !cleave_collective::transport_available(Transport::Ucx) {
        let mut cfg = GroupConfig::new(0, 2, "127.0.0.1:0");
        cfg.transport = Transport::Ucx;
        assert!(matches!(
            NetGroup::connect(cfg),
            Err(GroupError::Unsupported(_))
        ));
    }
    // A peer that disagrees on the group size.
    let mut cfg0 = GroupConfig::new(0, 2, "127.0.0.1:0");
    cfg0.bind_addr = Some("127.0.0.1:0".parse().unwrap());
    cfg0.connect_timeout = Duration::from_secs(5);
    let p = Pending::bind(cfg0).unwrap();
    let addr = p.local_addr().unwrap().to_string();
    let other = std::thread::spawn(move || {
        let mut cfg = GroupConfig::new(1, 3, addr);
        cfg.connect_timeout = Duration::from_secs(5);
        NetGroup::connect(cfg)
    });
    assert!(matches!(p.join(), Err(GroupError::Protocol(_))));
    assert!(other.join().unwrap().is_err());
}
