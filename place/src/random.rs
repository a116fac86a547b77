//! `random`: a uniformly random healthy worker from a seeded RNG (a baseline).

use super::rng::SharedRng;
use super::{
    decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest, Policy,
    WorkerView,
};

/// The `random` policy.
#[derive(Debug)]
pub struct Random {
    config: PlaceConfig,
    rng: SharedRng,
}

impl Random {
    /// The policy with `config` (its seed drives the picks).
    pub fn new(config: PlaceConfig) -> Self {
        let rng = SharedRng::new(config.seed);
        Self { config, rng }
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let n = decode_candidates(workers).count();
        if n == 0 {
            return Err(PlaceError::NoDecodeWorker);
        }
        let decode = decode_candidates(workers)
            .nth(self.rng.below(n))
            .expect("below n")
            .id;
        Ok(finish(decode, req, &self.config, workers, |candidates| {
            let all: Vec<_> = candidates.map(|w| w.id).collect();
            (!all.is_empty()).then(|| all[self.rng.below(all.len())])
        }))
    }
}
