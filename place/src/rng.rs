//! A seeded, lock-free RNG shared by a policy's calls (SplitMix64 over an atomic counter), for
//! tie-breaking and the `random` policy. Deterministic for a given seed and call order.

use std::sync::atomic::{AtomicU64, Ordering};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 whose state advances with one atomic add, so `&self` suffices.
#[derive(Debug)]
pub struct SharedRng {
    state: AtomicU64,
}

impl SharedRng {
    /// An RNG seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(GOLDEN, Ordering::Relaxed)
            .wrapping_add(GOLDEN);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` (`n > 0`; Lemire's multiply-shift, bias < n/2^64).
    pub fn below(&self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}
