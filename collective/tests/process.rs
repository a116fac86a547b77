//! Ranks in separate processes: a rank that is killed makes the others fail fast.
//! The child ranks are this test binary re-executed with `CLEAVE_COLL_CHILD` set.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use crate::common;

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use cleave_collective::{NetGroup, Transport};
use cleave_types::collective::{Collective, CollectiveError};

const CHILD_ENV: &str = "CLEAVE_COLL_CHILD";

/// The child rank: joins the group and all-reduces until the group fails. A no-op when run as
/// an ordinary test.
#[test]
fn child_rank() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (rank, world, addr) = (
        parts[0].parse().unwrap(),
        parts[1].parse().unwrap(),
        parts[2],
    );
    let transport: Transport = parts[3].parse().unwrap();
    let group = NetGroup::connect(common::config(rank, world, addr, &|c| {
        c.transport = transport
    }))
    .unwrap();
    loop {
        let mut buf = vec![rank as f32; 1000];
        if group.all_reduce_sum(&mut buf).is_err() {
            return;
        }
    }
}

#[test]
fn a_killed_rank_process_fails_the_others_promptly() {
    for t in common::transports() {
        killed_rank(t);
    }
}

fn killed_rank(t: Transport) {
    let world = 3;
    let tweak = move |c: &mut cleave_collective::GroupConfig| {
        c.timeout = Duration::from_secs(600);
        c.transport = t;
    };
    let (pending, addr) = common::leader(world, &tweak);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "process::child_rank",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            format!(
                "2,{world},{addr},{}",
                if t == Transport::Ucx { "ucx" } else { "tcp" }
            ),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (warm_tx, warm_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel();
    let mut pending = Some(pending);
    for rank in 0..2 {
        let cfg = common::config(rank, world, &addr, &tweak);
        let mine = if rank == 0 { pending.take() } else { None };
        let (tx, warm_tx) = (tx.clone(), warm_tx.clone());
        std::thread::spawn(move || {
            let g = match mine {
                Some(p) => p.join(),
                None => NetGroup::connect(cfg),
            }
            .unwrap();
            // Across processes the sums are right: 0 + 1 + 2.
            for _ in 0..20 {
                let mut buf = vec![rank as f32; 1000];
                g.all_reduce_sum(&mut buf).unwrap();
                assert!(buf.iter().all(|&x| x == 3.0));
            }
            warm_tx.send(()).unwrap();
            let err = loop {
                if let Err(e) = g.all_reduce_sum(&mut vec![rank as f32; 1000]) {
                    break e;
                }
            };
            let _ = tx.send((rank, err));
        });
    }
    for _ in 0..2 {
        warm_rx
            .recv_timeout(common::WATCHDOG)
            .expect("ranks did not start");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let errs = common::collect(rx, 2);
    assert_eq!(
        common::quarantine::writes_after_free(),
        0,
        "a transport request outlived its buffer"
    );
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            matches!(
                e,
                CollectiveError::PeerFailed { .. } | CollectiveError::Aborted(_)
            ),
            "rank {rank}: {e}"
        );
    }
    assert!(
        errs.iter()
            .any(|e| matches!(e, CollectiveError::PeerFailed { rank: 2, .. })),
        "{errs:?}"
    );
}
