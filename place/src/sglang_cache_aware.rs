//! `sglang-cache-aware`: SGLang router's cache-aware policy, re-implemented from its documented
//! algorithm (SGLang router / SGLang Model Gateway docs, "Cache-Aware Routing": `--cache-threshold`
//! 0.3, `--balance-abs-threshold` 64, `--balance-rel-threshold` 1.5).
//!
//! Load is the number of requests the router has in flight on a worker (`queue_depth`). The
//! cluster is *imbalanced* when both `max − min > balance_abs_threshold` and
//! `max > balance_rel_threshold · min`; then the request goes to the shortest queue. Otherwise the
//! worker with the longest prefix match wins if `matched / prompt_blocks > cache_threshold`, and
//! the shortest queue if not. Ties at random (seeded). When disaggregating, the prefill worker is
//! chosen by the same match rule among prefill-capable workers, with queued prefill blocks as load.
//!
//! SGLang's router matches against a radix tree of the requests *it routed* to each worker (it
//! gets no KV events), so it does not see evictions. The policy itself is a pure function of the
//! matches it is given: the simulator feeds it matches from such a tree of routed requests
//! ([`super::PolicyKind::matches_routed_requests`]), the live router from the KV-event index.

use super::rng::SharedRng;
use super::{
    argmin_random, decode_candidates, finish, PlaceConfig, PlaceError, Placement, PlacementRequest,
    Policy, WorkerState, WorkerView,
};

/// Parameters of `sglang-cache-aware`, named as in SGLang router's flags.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SglangConfig {
    /// `--cache-threshold`: minimum prefix match ratio to route by cache (default 0.3).
    pub cache_threshold: f64,
    /// `--balance-abs-threshold`: in-flight difference beyond which load wins (default 64).
    pub balance_abs_threshold: u64,
    /// `--balance-rel-threshold`: in-flight ratio beyond which load wins (default 1.5).
    pub balance_rel_threshold: f64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
        }
    }
}

/// The `sglang-cache-aware` policy.
#[derive(Debug)]
pub struct SglangCacheAware {
    config: PlaceConfig,
    rng: SharedRng,
}

impl SglangCacheAware {
    /// The policy with `config` (its seed drives tie-breaking).
    pub fn new(config: PlaceConfig) -> Self {
        let rng = SharedRng::new(config.seed);
        Self { config, rng }
    }

    /// Whether loads `max` and `min` count as imbalanced.
    pub fn imbalanced(config: &SglangConfig, max: u64, min: u64) -> bool {
        max.saturating_sub(min) > config.balance_abs_threshold
            && max as f64 > config.balance_rel_threshold * min as f64
    }

    /// SGLang's rule over `candidates` with `load` per worker.
    fn pick<'a>(
        &self,
        req: &PlacementRequest,
        candidates: impl Iterator<Item = &'a WorkerState> + Clone,
        load: impl Fn(&WorkerState) -> u64,
    ) -> Option<super::WorkerId> {
        let sg = &self.config.sglang;
        let (max, min) = candidates
            .clone()
            .map(&load)
            .fold((0, u64::MAX), |(hi, lo), l| (hi.max(l), lo.min(l)));
        let shortest = || {
            argmin_random(
                candidates.clone().map(|w| (w.id, load(w) as f64, 0)),
                &self.rng,
            )
        };
        if min == u64::MAX || Self::imbalanced(sg, max, min) {
            return shortest();
        }
        let longest = candidates
            .clone()
            .map(|w| req.matches.matched(w.id))
            .max()
            .unwrap_or(0);
        let ratio = longest as f64 / req.prompt_blocks.max(1) as f64;
        if longest > 0 && ratio > sg.cache_threshold {
            argmin_random(
                candidates
                    .filter(|w| req.matches.matched(w.id) == longest)
                    .map(|w| (w.id, 0.0, 0)),
                &self.rng,
            )
        } else {
            shortest()
        }
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang-cache-aware"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        let candidates: Vec<&WorkerState> = decode_candidates(workers).collect();
        let decode = self
            .pick(req, candidates.iter().copied(), |w| w.load().queue_depth)
            .ok_or(PlaceError::NoDecodeWorker)?;
        Ok(finish(decode, req, &self.config, workers, |candidates| {
            let all: Vec<&WorkerState> = candidates.collect();
            self.pick(req, all.iter().copied(), |w| w.load().prefill_blocks)
        }))
    }
}
