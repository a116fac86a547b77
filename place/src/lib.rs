//! `cleave-place`: the router's placement hop, pure (no network, no async): pick a decode worker
//! and, unless the uncached part of the prompt is short, a separate prefill worker. The router
//! (`cleave_router::place` re-exports this crate) and the routing simulator (`cleave-route-sim`)
//! run the same code.
//!
//! The caller asks the prefix index for the prompt's per-worker matches, builds a
//! [`PlacementRequest`], calls [`Policy::place`] with its [`WorkerView`], and then *charges* the
//! placement to the view right away ([`WorkerView::charge`], optimistic accounting) and releases
//! it when prefill is done and when the request finishes. In the router (the decode-worker,
//! engine-pod and endpoint-picker paths alike) these steps are one call on the one owner of that
//! state, [`state::PlacementState::place`]; the simulator runs them on its own copy. Policies are pure functions of request and view (plus a seeded RNG for
//! ties), one per file below:
//! - [`prefix_optimistic`] (default): `prefix-load` over matches extended with the router's
//!   in-flight placements ([`in_flight`]);
//! - [`prefix_load`]: lowest `prefill_weight·uncached + queued_prefill_weight·
//!   active_prefill + recent_prefill_weight·recent_prefill + active_decode + new_decode` wins
//!   (uncached blocks that fit in free KV space weigh `free_prefill_weight`), ties by smaller
//!   cached tree, then at random;
//! - [`round_robin`], [`least_load`], [`random`]: baselines that ignore the prefix cache;
//! - [`sglang_cache_aware`], [`dynamo_cost`]: the placement of SGLang's router and of Dynamo's KV
//!   router, re-implemented from their documented algorithms so `cleave bench route` can put
//!   them side by side with `prefix-load` (docs/routing.md names the sources and parameters).
//!
//! Conditional disaggregation (shared by all policies, [`PlaceConfig::disagg_min_uncached_blocks`]):
//! the decode worker prefills locally (`Placement::prefill == None`) when the prompt's uncached
//! part on it is below the threshold, when no healthy worker can prefill, or when the chosen
//! prefill worker is the decode worker itself.

#![forbid(unsafe_code)]

pub mod dynamo_cost;
pub mod in_flight;
pub mod least_load;
pub mod prefix_load;
pub mod prefix_optimistic;
pub mod random;
pub mod rng;
pub mod round_robin;
pub mod sglang_cache_aware;
pub mod state;
pub mod view;

#[cfg(test)]
mod tests;

use cleave_kv_index::{Matches, WorkerId};

pub use in_flight::{InFlight, Ticket};
pub use state::{PlacementState, Reservation};
pub use view::{Charge, Load, Role, WorkerState, WorkerView};

/// What a policy needs to know about one request.
#[derive(Clone, Debug, Default)]
pub struct PlacementRequest {
    /// Blocks the prompt occupies (full blocks hashed, plus a partial last one if any).
    pub prompt_blocks: usize,
    /// Blocks the request will add while decoding (estimated from `max_tokens`).
    pub decode_blocks: usize,
    /// Per-worker leading matches of the prompt's block hashes ([`cleave_kv_index::PrefixIndex::find_matches`]).
    pub matches: Matches,
}

impl PlacementRequest {
    /// Prompt blocks `worker` would have to compute.
    pub fn uncached_on(&self, worker: WorkerId) -> usize {
        self.prompt_blocks
            .saturating_sub(self.matches.matched(worker))
    }
}

/// Where a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The worker that prefills and pushes the KV to `decode`; `None`: `decode` prefills locally.
    pub prefill: Option<WorkerId>,
    /// The worker that owns the sequence and decodes it.
    pub decode: WorkerId,
    /// Prompt blocks already cached on the worker that prefills.
    pub cached_blocks: usize,
}

impl Placement {
    /// The worker that runs the prefill.
    pub fn prefill_worker(&self) -> WorkerId {
        self.prefill.unwrap_or(self.decode)
    }
}

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// No healthy worker with the decode (or both) role is known.
    #[error("no healthy decode worker")]
    NoDecodeWorker,
}

/// Tunables shared by the policies.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlaceConfig {
    /// Weight of the request's uncached prompt blocks against decode blocks in the cost (prefill
    /// is compute-bound).
    pub prefill_weight: f64,
    /// Weight of the prefill blocks already queued or running on a worker (ARCHITECTURE.md's
    /// cost uses `prefill_weight` for both; see [`prefix_load`]). Defaults 24 and 3 (decode
    /// blocks weigh 1) were tuned with `cleave bench route --sweep` for `prefix-optimistic`
    /// (docs/routing.md): 16 and 1 at first, 48 and 3 until workers evicted a finished
    /// sequence's tail before its prefix.
    pub queued_prefill_weight: f64,
    /// Weight of the uncached prompt blocks that fit in the worker's free KV space, in place of
    /// `prefill_weight`: holding them evicts nothing, so they cost compute but no future hits.
    /// Free = the worker's reported pool capacity minus the blocks the prefix index says it holds
    /// and the prefill blocks queued on it; a worker that reports no capacity (a scraped
    /// vLLM/SGLang server) has none. Default 16 (tuned with `cleave bench route --sweep`,
    /// docs/routing.md); `prefill_weight`'s value turns it off.
    pub free_prefill_weight: f64,
    /// Weight of the prefill blocks the router placed on the worker lately, queued or done
    /// ([`WorkerState::recent_prefill_blocks`], decayed per placement): spreads the work that
    /// could go anywhere by how much each worker has had, so the workers' busy time stays even
    /// over minutes. Default 2 (tuned with `cleave bench route --sweep` over ten seeds,
    /// docs/routing.md); 0 turns it off.
    pub recent_prefill_weight: f64,
    /// Prefill on a separate worker only when at least this many prompt blocks are uncached on
    /// the decode worker (`usize::MAX`: never disaggregate).
    pub disagg_min_uncached_blocks: usize,
    /// Seed of the tie-breaking / random RNG.
    pub seed: u64,
    /// Parameters of the `sglang-cache-aware` policy.
    pub sglang: sglang_cache_aware::SglangConfig,
    /// Parameters of the `dynamo-cost` policy.
    pub dynamo: dynamo_cost::DynamoConfig,
}

impl Default for PlaceConfig {
    /// The router's flag defaults ([`PlacementArgs::DEFAULT`]).
    fn default() -> Self {
        PlaceConfig::from(&PlacementArgs::DEFAULT)
    }
}

impl From<&PlacementArgs> for PlaceConfig {
    fn from(a: &PlacementArgs) -> Self {
        Self {
            prefill_weight: a.prefill_weight,
            queued_prefill_weight: a.queued_prefill_weight,
            free_prefill_weight: a.free_prefill_weight,
            recent_prefill_weight: a.recent_prefill_weight,
            disagg_min_uncached_blocks: a.disagg_min_uncached_blocks,
            seed: 0x5eed,
            sglang: sglang_cache_aware::SglangConfig::default(),
            dynamo: dynamo_cost::DynamoConfig::default(),
        }
    }
}

/// The placement flags (defined with the router's flags in [`cleave_config::placement`]).
pub use cleave_config::placement::PlacementArgs;

/// A placement policy.
pub trait Policy: Send + Sync {
    /// The policy's kebab-case name (as in [`PolicyKind`]).
    fn name(&self) -> &'static str;

    /// Chooses the workers for `req` given the current `workers` view.
    ///
    /// # Errors
    /// [`PlaceError::NoDecodeWorker`] when no healthy worker can decode.
    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError>;
}

/// Which policy (`--policy`): defined with the router's flags in [`cleave_config::router`].
pub use cleave_config::router::PolicyKind;

/// Builds a [`PolicyKind`]'s policy (the kind is defined with the router's flags, in
/// `cleave-config`, so this is a trait the router implements for it).
pub trait BuildPolicy {
    /// Builds the policy with `config`.
    fn build(self, config: &PlaceConfig) -> Box<dyn Policy>;
}

impl BuildPolicy for PolicyKind {
    fn build(self, config: &PlaceConfig) -> Box<dyn Policy> {
        match self {
            PolicyKind::PrefixLoad => Box::new(prefix_load::PrefixLoad::new(config.clone())),
            PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::new(config.clone())),
            PolicyKind::LeastLoad => Box::new(least_load::LeastLoad::new(config.clone())),
            PolicyKind::Random => Box::new(random::Random::new(config.clone())),
            PolicyKind::SglangCacheAware => {
                Box::new(sglang_cache_aware::SglangCacheAware::new(config.clone()))
            }
            PolicyKind::DynamoCost => Box::new(dynamo_cost::DynamoCost::new(config.clone())),
            PolicyKind::PrefixOptimistic => {
                Box::new(prefix_optimistic::PrefixOptimistic::new(config.clone()))
            }
        }
    }
}

/// Healthy workers that can decode.
pub(crate) fn decode_candidates(view: &WorkerView) -> impl Iterator<Item = &WorkerState> {
    view.iter().filter(|w| w.healthy && w.role.can_decode())
}

/// Healthy workers that can prefill.
pub(crate) fn prefill_candidates(view: &WorkerView) -> impl Iterator<Item = &WorkerState> {
    view.iter().filter(|w| w.healthy && w.role.can_prefill())
}

/// Applies conditional disaggregation once the decode worker is chosen: `pick_prefill` is called
/// only when a separate prefill is worth it, with the healthy prefill-capable workers.
pub(crate) fn finish<'a>(
    decode: WorkerId,
    req: &PlacementRequest,
    config: &PlaceConfig,
    view: &'a WorkerView,
    pick_prefill: impl FnOnce(&mut dyn Iterator<Item = &'a WorkerState>) -> Option<WorkerId>,
) -> Placement {
    let local = Placement {
        prefill: None,
        decode,
        cached_blocks: req.matches.matched(decode).min(req.prompt_blocks),
    };
    if req.uncached_on(decode) < config.disagg_min_uncached_blocks {
        return local;
    }
    match pick_prefill(&mut prefill_candidates(view)) {
        Some(p) if p != decode => Placement {
            prefill: Some(p),
            decode,
            cached_blocks: req.matches.matched(p).min(req.prompt_blocks),
        },
        _ => local,
    }
}

/// Among `items` with the lowest key, then the smallest `tie` key, one chosen by `rng`.
pub(crate) fn argmin_random<T: Copy>(
    items: impl Iterator<Item = (T, f64, usize)>,
    rng: &rng::SharedRng,
) -> Option<T> {
    let mut best: Vec<T> = Vec::new();
    let mut best_key = (f64::INFINITY, usize::MAX);
    for (item, cost, tie) in items {
        match cost.total_cmp(&best_key.0).then(tie.cmp(&best_key.1)) {
            std::cmp::Ordering::Less => {
                best.clear();
                best.push(item);
                best_key = (cost, tie);
            }
            std::cmp::Ordering::Equal => best.push(item),
            std::cmp::Ordering::Greater => {}
        }
    }
    match best.len() {
        0 => None,
        1 => Some(best[0]),
        n => Some(best[rng.below(n)]),
    }
}
