//! `prefix-load`: prefix affinity weighed against load (the cost of the default policy,
//! [`super::prefix_optimistic`], which runs it over matches that include in-flight placements).
//!
//! For each healthy decode-capable worker `w`, with its effective load (reports and the
//! router's optimistic charges, [`super::WorkerView`]):
//!
//! ```text
//! cost(w) = prefill_weight · uncached_prompt_blocks(w)
//!         + queued_prefill_weight · active_prefill_blocks(w)
//!         + recent_prefill_weight · recent_prefill_blocks(w)
//!         + active_decode_blocks(w) + new_decode_blocks
//! ```
//!
//! With `queued_prefill_weight` and `free_prefill_weight` equal to `prefill_weight` and
//! `recent_prefill_weight` 0 this is ARCHITECTURE.md's
//! `prefill_weight · (active_prefill + uncached) + active_decode + new_decode`
//! ([`PlaceConfig`]'s defaults are 24, 3, 16 and 2). The two weights are separate because the trace simulation showed
//! that charging queued prefill work at the full prefill weight pushes requests off the worker
//! holding their prefix at the first sign of a queue, halving the hit rate; see `router::sim`.
//!
//! where `uncached_prompt_blocks(w)` is the prompt minus the leading blocks the prefix index says
//! `w` holds, and `new_decode_blocks` the request's prompt and decode blocks. The uncached blocks
//! that fit in `w`'s free KV space (its reported `kv_capacity_blocks` minus the blocks the index
//! says it holds and the prefill blocks queued on it) weigh `free_prefill_weight` instead of
//! `prefill_weight`: storing them evicts nothing, so they cost the compute but none of the hits
//! that the full weight protects. A worker that reports no capacity has no free space.
//! `recent_prefill_blocks(w)` is the prefill work the router placed on `w` lately, queued or done
//! ([`super::WorkerState::recent_prefill_blocks`]), corrected with the cached tokens the worker
//! reports when each request finishes ([`super::WorkerView::prefill_measured`]): it steers work
//! that could go anywhere to the workers that have had less of it, which the queue alone does
//! not (at moderate load queues are mostly empty when a request arrives).
//!
//! Lowest cost wins; ties go to the smaller cached tree (keeps room where caches are full), then
//! to a seeded random pick, never the first in the list. If the prompt's uncached part on the
//! winner is long enough to disaggregate, the prefill worker is the prefill-capable worker with
//! the lowest prefill terms of the same cost (uncached blocks, free-space discount included, and
//! queued prefill blocks), same tie rules.
//!

use super::rng::SharedRng;
use super::{
    argmin_random, decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest,
    Policy, WorkerView,
};

/// The `prefix-load` policy.
#[derive(Debug)]
pub struct PrefixLoad {
    config: PlaceConfig,
    rng: SharedRng,
}

impl PrefixLoad {
    /// The policy with `config` (its seed drives tie-breaking).
    pub fn new(config: PlaceConfig) -> Self {
        let rng = SharedRng::new(config.seed);
        Self { config, rng }
    }
}

impl Policy for PrefixLoad {
    fn name(&self) -> &'static str {
        "prefix-load"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let c = &self.config;
        let new_decode = (req.prompt_blocks + req.decode_blocks) as f64;
        let tree = |id| req.matches.get(id).map_or(0, |e| e.cached_blocks);
        let prefill_cost = |w: &super::WorkerState| {
            let load = w.load();
            let uncached = req.uncached_on(w.id) as u64;
            let free = load
                .kv_capacity_blocks
                .saturating_sub(tree(w.id) as u64 + load.prefill_blocks);
            let fits = uncached.min(free);
            c.prefill_weight * (uncached - fits) as f64
                + c.free_prefill_weight * fits as f64
                + c.queued_prefill_weight * load.prefill_blocks as f64
                + c.recent_prefill_weight * w.recent_prefill_blocks
        };
        let decode = argmin_random(
            decode_candidates(workers).map(|w| {
                let cost = prefill_cost(w) + w.load().decode_blocks as f64 + new_decode;
                (w.id, cost, tree(w.id))
            }),
            &self.rng,
        )
        .ok_or(PlaceError::NoDecodeWorker)?;
        Ok(finish(decode, req, c, workers, |candidates| {
            argmin_random(
                candidates.map(|w| (w.id, prefill_cost(w), tree(w.id))),
                &self.rng,
            )
        }))
    }
}
