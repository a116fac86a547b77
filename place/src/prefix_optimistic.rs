//! `prefix-optimistic`: `prefix-load`'s cost over matches that also count the router's own
//! placements whose KV events have not arrived yet.
//!
//! A worker reports a prompt's blocks only once it has computed them, which under load is long
//! after the router placed the request; meanwhile `prefix-load` sees no match on that worker and
//! sends the next request of the same conversation elsewhere, which lowers the hit rate, which
//! raises the load — the simulator showed this spiral. The router already charges its placements
//! to load optimistically; this policy does the same for the prefix: the caller adds each placed
//! prompt's blocks to the chosen worker's matches until that request's prefill is done (when the
//! worker's own events take over). The cost function is `prefix-load`'s unchanged.
//!
//! Inputs: the policy itself is a pure function of [`PlacementRequest`] and [`WorkerView`] like
//! every other; the caller extends the matches with [`super::in_flight::InFlight`]
//! ([`super::PolicyKind::matches_in_flight`]). The simulator and the live router
//! (`dispatch::Cluster`, for the decode-worker, engine-pod and endpoint-picker paths alike) use
//! the same overlay, so the policy the simulator measures is the one the router runs.

use super::prefix_load::PrefixLoad;
use super::{PlaceConfig, PlaceError, Placement, PlacementRequest, Policy, WorkerView};

/// The `prefix-optimistic` policy.
#[derive(Debug)]
pub struct PrefixOptimistic {
    inner: PrefixLoad,
}

impl PrefixOptimistic {
    /// The policy with `config` (its seed drives tie-breaking).
    pub fn new(config: PlaceConfig) -> Self {
        Self {
            inner: PrefixLoad::new(config),
        }
    }
}

impl Policy for PrefixOptimistic {
    fn name(&self) -> &'static str {
        "prefix-optimistic"
    }

    fn place(&self, req: &PlacementRequest, workers: &WorkerView) -> Result<Placement, PlaceError> {
        self.inner.place(req, workers)
    }
}
