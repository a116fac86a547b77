//! `dynamo-cost`: NVIDIA Dynamo KV router's worker selection, re-implemented from its documented
//! cost model (Dynamo docs, "Routing Concepts" / "Router Design": potential prefill blocks and
//! potential decode blocks per worker, `--router-kv-overlap-score-weight`, `--router-temperature`).
//!
//! For each healthy decode-capable worker `w`:
//!
//! ```text
//! prefill_blocks(w) = active_prefill_blocks(w) + uncached_prompt_blocks(w)
//! decode_blocks(w)  = active_decode_blocks(w)  + new_decode_blocks
//! cost(w)           = overlap_score_weight · prefill_blocks(w) + decode_blocks(w)
//! ```
//!
//! With temperature 0 (Dynamo's default) the lowest cost wins; ties at random (seeded), as
//! Dynamo's docs say. `new_decode_blocks` is the request's prompt and decode blocks, the same
//! for every worker. When disaggregating, the prefill worker is the prefill-capable worker with
//! the lowest `overlap_score_weight · prefill_blocks(w)`.
//!
//! The only difference to ARCHITECTURE.md's starting cost is the weight (1 here, 16 there) —
//! one weight for queued and new prefill work, which `prefix-load` splits (docs/routing.md).

use super::rng::SharedRng;
use super::{
    argmin_random, decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest,
    Policy, WorkerState, WorkerView,
};

/// Parameters of `dynamo-cost`, named as in Dynamo's router flags.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamoConfig {
    /// `--router-kv-overlap-score-weight`: weight of the prefill blocks against decode blocks
    /// (Dynamo's default 1.0).
    pub overlap_score_weight: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_score_weight: 1.0,
        }
    }
}

/// The `dynamo-cost` policy.
#[derive(Debug)]
pub struct DynamoCost {
    config: PlaceConfig,
    rng: SharedRng,
}

impl DynamoCost {
    /// The policy with `config` (its seed drives tie-breaking).
    pub fn new(config: PlaceConfig) -> Self {
        let rng = SharedRng::new(config.seed);
        Self { config, rng }
    }
}

impl Policy for DynamoCost {
    fn name(&self) -> &'static str {
        "dynamo-cost"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let weight = self.config.dynamo.overlap_score_weight;
        let new_decode = (req.prompt_blocks + req.decode_blocks) as f64;
        let prefill = |w: &WorkerState| {
            weight * (w.load().prefill_blocks as f64 + req.uncached_on(w.id) as f64)
        };
        let decode = argmin_random(
            decode_candidates(workers).map(|w| {
                let cost = prefill(w) + w.load().decode_blocks as f64 + new_decode;
                (w.id, cost, 0)
            }),
            &self.rng,
        )
        .ok_or(PlaceError::NoDecodeWorker)?;
        Ok(finish(decode, req, &self.config, workers, |candidates| {
            argmin_random(candidates.map(|w| (w.id, prefill(w), 0)), &self.rng)
        }))
    }
}
