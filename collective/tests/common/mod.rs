//! Groups of ranks as threads over loopback TCP, with a watchdog so a hang fails the test.
#![allow(dead_code)]

pub mod quarantine;

use std::sync::mpsc;
use std::time::Duration;

use cleave_collective::{GroupConfig, NetGroup, Pending, Transport};

/// How long any multi-rank test may run before it counts as hung.
pub const WATCHDOG: Duration = Duration::from_secs(60);

/// Rank 0's listener on an ephemeral loopback port, and the leader address for the others.
pub fn leader(world: usize, tweak: &impl Fn(&mut GroupConfig)) -> (Pending, String) {
    let mut cfg = GroupConfig::new(0, world, "127.0.0.1:0");
    cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
    tweak(&mut cfg);
    let pending = Pending::bind(cfg).expect("bind rank 0");
    let addr = pending.local_addr().unwrap().to_string();
    (pending, addr)
}

/// Config of rank `rank` joining at `addr`, with `tweak` applied.
pub fn config(
    rank: usize,
    world: usize,
    addr: &str,
    tweak: &impl Fn(&mut GroupConfig),
) -> GroupConfig {
    let mut cfg = GroupConfig::new(rank, world, addr);
    cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
    tweak(&mut cfg);
    cfg
}

/// Receives `n` results from `rx`, panicking if they do not all arrive within [`WATCHDOG`].
pub fn collect<T>(rx: mpsc::Receiver<(usize, T)>, n: usize) -> Vec<T> {
    let deadline = std::time::Instant::now() + WATCHDOG;
    let mut got: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (rank, v) = rx
            .recv_timeout(left)
            .expect("ranks hung (watchdog) or a rank panicked");
        got[rank] = Some(v);
    }
    got.into_iter().map(|v| v.unwrap()).collect()
}

/// Forms a group of `world` threads and runs `f(group)` on each; results in rank order.
/// Panics if the ranks do not all finish within [`WATCHDOG`].
pub fn on_ranks_with<T: Send + 'static>(
    world: usize,
    tweak: impl Fn(&mut GroupConfig) + Send + Sync + Copy + 'static,
    f: impl Fn(NetGroup) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let (pending, addr) = leader(world, &tweak);
    let (tx, rx) = mpsc::channel();
    let mut pending = Some(pending);
    for rank in 0..world {
        let tx = tx.clone();
        let cfg = config(rank, world, &addr, &tweak);
        let mine = if rank == 0 { pending.take() } else { None };
        std::thread::spawn(move || {
            let group = match mine {
                Some(p) => p.join(),
                None => NetGroup::connect(cfg),
            };
            let group = group.unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
            let _ = tx.send((rank, f(group)));
        });
    }
    let got = collect(rx, world);
    let bad = quarantine::writes_after_free();
    assert_eq!(
        bad, 0,
        "{bad} freed buffer(s) were written after they were freed (a transport request outlived its buffer)"
    );
    got
}

/// [`on_ranks_with`] with the default configuration.
pub fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(NetGroup) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    on_ranks_with(world, |_| {}, f)
}

/// Deterministic pseudo-random floats (a different stream per seed).
pub fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The transports this build can test: TCP, and UCX where it was found at build time (a
/// visible skip of the UCX half otherwise, or a failure under `CLEAVE_REQUIRE_UCX=1`).
pub fn transports() -> Vec<Transport> {
    [Transport::Tcp, Transport::Ucx]
        .into_iter()
        .filter(|t| *t == Transport::Tcp || cleave_ucx_sys::ucx_or_skip("collectives over UCX"))
        .collect()
}
