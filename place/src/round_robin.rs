//! `round-robin`: healthy decode workers in turn (and prefill workers in turn when
//! disaggregating), ignoring cache and load (a baseline).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{
    decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest, Policy,
    WorkerView,
};

/// The `round-robin` policy.
#[derive(Debug)]
pub struct RoundRobin {
    config: PlaceConfig,
    next_decode: AtomicUsize,
    next_prefill: AtomicUsize,
}

impl RoundRobin {
    /// The policy with `config`.
    pub fn new(config: PlaceConfig) -> Self {
        Self {
            config,
            next_decode: AtomicUsize::new(0),
            next_prefill: AtomicUsize::new(0),
        }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let n = decode_candidates(workers).count();
        if n == 0 {
            return Err(PlaceError::NoDecodeWorker);
        }
        let i = self.next_decode.fetch_add(1, Ordering::Relaxed) % n;
        let decode = decode_candidates(workers).nth(i).expect("i < n").id;
        Ok(finish(decode, req, &self.config, workers, |candidates| {
            let all: Vec<_> = candidates.map(|w| w.id).collect();
            (!all.is_empty())
                .then(|| all[self.next_prefill.fetch_add(1, Ordering::Relaxed) % all.len()])
        }))
    }
}
