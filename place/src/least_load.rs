//! `least-load`: the least loaded worker, ignoring the prefix cache (a baseline).
//!
//! Decode worker: lowest `prefill_weight · active_prefill_blocks + active_decode_blocks`;
//! prefill worker (when disaggregating): lowest `active_prefill_blocks`. Ties at random (seeded).

use super::rng::SharedRng;
use super::{
    argmin_random, decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest,
    Policy, WorkerView,
};

/// The `least-load` policy.
#[derive(Debug)]
pub struct LeastLoad {
    config: PlaceConfig,
    rng: SharedRng,
}

impl LeastLoad {
    /// The policy with `config`.
    pub fn new(config: PlaceConfig) -> Self {
        let rng = SharedRng::new(config.seed);
        Self { config, rng }
    }
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least-load"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let pw = self.config.prefill_weight;
        let decode = argmin_random(
            decode_candidates(workers).map(|w| {
                let l = w.load();
                (
                    w.id,
                    pw * l.prefill_blocks as f64 + l.decode_blocks as f64,
                    0,
                )
            }),
            &self.rng,
        )
        .ok_or(PlaceError::NoDecodeWorker)?;
        Ok(finish(decode, req, &self.config, workers, |candidates| {
            argmin_random(
                candidates.map(|w| (w.id, w.load().prefill_blocks as f64, 0)),
                &self.rng,
            )
        }))
    }
}
