//! The router's view of its workers: role, health, reported load, and the load the router has
//! itself dispatched and not yet seen finish (optimistic accounting).
//!
//! Effective load = per field, the larger of the last report and the router's own in-flight
//! charges. A request counts against its workers the moment it is placed ([`WorkerView::charge`]),
//! so a burst placed between two load reports spreads instead of herding onto the worker that
//! looked idle; reports still bring in load the router does not know about (other routers,
//! requests it lost track of). The prefill part of a charge is released at
//! [`WorkerView::prefill_done`], the rest at [`WorkerView::release`].
//!
//! Each charge also adds its prefill blocks to the worker's *recent prefill work*
//! ([`WorkerState::recent_prefill_blocks`]), a figure that is never released but decays with
//! every placement: the worker's share of the prefill work over the last
//! [`RECENT_HALF_LIFE_PER_WORKER`] placements per worker, whether or not it is still queued.
//! What the router charges is what the prefix index expected the worker to have cached; when the
//! worker says what it had ([`WorkerView::prefill_measured`], from the `cached_tokens` of its
//! usage), the figure is corrected to the work it did. The two differ where the index lags the
//! worker's evictions, and that is where the work piles up: on a worker that evicts prefixes it
//! is still being sent (issue 17's tenants trace at 32 workers, docs/routing.md).

use cleave_kv_index::WorkerId;

use super::{Placement, PlacementRequest};

/// Half-life of [`WorkerState::recent_prefill_blocks`], in placements per worker of the view:
/// with `n` workers, every placement multiplies every worker's figure by `2^(-1 / (32 n))`, so it
/// covers about the last 32 requests per worker whatever the pool's size. 16 to 128 did about
/// as well in `cleave bench route --sweep` (docs/routing.md).
pub const RECENT_HALF_LIFE_PER_WORKER: f64 = 32.0;

/// What a worker does.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Prefills only (pushes KV to decode workers).
    Prefill,
    /// Decodes only (prefills locally when not disaggregated).
    Decode,
    /// Both.
    #[default]
    Both,
}

impl Role {
    /// Whether the worker can run a remote prefill.
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether the worker can own and decode a sequence.
    pub fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// Load of one worker, in KV blocks and requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Load {
    /// Prompt blocks waiting to be or being prefilled.
    pub prefill_blocks: u64,
    /// Blocks of sequences it owns for decoding.
    pub decode_blocks: u64,
    /// Requests queued or running.
    pub queue_depth: u64,
    /// Blocks in the worker's KV pool (0: not reported). With the blocks the prefix index says it
    /// holds, this tells `prefix-load` whether a request's uncached blocks fit without evicting.
    #[serde(default)]
    pub kv_capacity_blocks: u64,
}

impl Load {
    fn max(self, o: Load) -> Load {
        Load {
            prefill_blocks: self.prefill_blocks.max(o.prefill_blocks),
            decode_blocks: self.decode_blocks.max(o.decode_blocks),
            queue_depth: self.queue_depth.max(o.queue_depth),
            kv_capacity_blocks: self.kv_capacity_blocks.max(o.kv_capacity_blocks),
        }
    }
}

/// One worker as the router sees it.
#[derive(Clone, Debug)]
pub struct WorkerState {
    pub id: WorkerId,
    pub role: Role,
    pub healthy: bool,
    /// The worker's last load report.
    pub reported: Load,
    /// What this router has placed on it and not yet released.
    pub inflight: Load,
    /// Prefill blocks this router placed on it, decayed by every placement in the view (half-life
    /// [`RECENT_HALF_LIFE_PER_WORKER`] placements per worker) and never released, corrected to
    /// what the worker computed once it says ([`WorkerView::prefill_measured`]): how much of
    /// the recent prefill work went here, queued or done. `prefix-load` weighs it so that work
    /// that could go anywhere (a prompt nobody holds) goes where less has gone lately, which
    /// evens out the workers' busy time over minutes as well as their queues now.
    pub recent_prefill_blocks: f64,
}

impl WorkerState {
    /// The load policies use: the larger of report and in-flight charges, per field.
    pub fn load(&self) -> Load {
        self.reported.max(self.inflight)
    }
}

/// What [`WorkerView::charge`] added; give it back with [`WorkerView::prefill_done`] and
/// [`WorkerView::release`]. Not `Clone`, so it cannot be released twice.
#[derive(Debug, PartialEq, Eq)]
pub struct Charge {
    prefill: Option<(WorkerId, u64)>,
    decode: (WorkerId, u64),
    /// Until measured: the worker whose recent prefill work this charge added to, the prompt's
    /// blocks and the uncached blocks added.
    recent: Option<(WorkerId, u64, u64)>,
}

/// The router's workers, sorted by id.
#[derive(Clone, Debug, Default)]
pub struct WorkerView {
    workers: Vec<WorkerState>,
}

impl WorkerView {
    /// An empty view.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `id` (healthy, no load) or updates its role.
    pub fn upsert(&mut self, id: WorkerId, role: Role) {
        match self.position(id) {
            Ok(i) => self.workers[i].role = role,
            Err(i) => self.workers.insert(
                i,
                WorkerState {
                    id,
                    role,
                    healthy: true,
                    reported: Load::default(),
                    inflight: Load::default(),
                    recent_prefill_blocks: 0.0,
                },
            ),
        }
    }

    /// Drops `id`. Charges on it are released as no-ops later.
    pub fn remove(&mut self, id: WorkerId) {
        if let Ok(i) = self.position(id) {
            self.workers.remove(i);
        }
    }

    /// Marks `id` healthy or not; unhealthy workers are never chosen.
    pub fn set_healthy(&mut self, id: WorkerId, healthy: bool) {
        if let Some(w) = self.get_mut(id) {
            w.healthy = healthy;
        }
    }

    /// Records `id`'s latest load report.
    pub fn report(&mut self, id: WorkerId, load: Load) {
        if let Some(w) = self.get_mut(id) {
            w.reported = load;
        }
    }

    /// The worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerState> {
        self.position(id).ok().map(|i| &self.workers[i])
    }

    /// All workers, by id.
    pub fn iter(&self) -> impl Iterator<Item = &WorkerState> {
        self.workers.iter()
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Counts `placement` of `req` against its workers now: the uncached prompt blocks as prefill
    /// load (and recent prefill work, after every worker's has decayed by one placement) on the
    /// prefilling worker, the prompt and decode blocks plus one queued request on the decode
    /// worker.
    pub fn charge(&mut self, req: &PlacementRequest, placement: &Placement) -> Charge {
        let uncached = req.prompt_blocks.saturating_sub(placement.cached_blocks) as u64;
        let decode_blocks = (req.prompt_blocks + req.decode_blocks) as u64;
        let prefill = (placement.prefill_worker(), uncached);
        let half_life = RECENT_HALF_LIFE_PER_WORKER * self.workers.len().max(1) as f64;
        let decay = 0.5f64.powf(half_life.recip());
        for w in &mut self.workers {
            w.recent_prefill_blocks *= decay;
        }
        if let Some(w) = self.get_mut(prefill.0) {
            w.inflight.prefill_blocks += uncached;
            w.recent_prefill_blocks += uncached as f64;
        }
        if let Some(w) = self.get_mut(placement.decode) {
            w.inflight.decode_blocks += decode_blocks;
            w.inflight.queue_depth += 1;
        }
        Charge {
            prefill: Some(prefill),
            decode: (placement.decode, decode_blocks),
            recent: Some((prefill.0, req.prompt_blocks as u64, uncached)),
        }
    }

    /// The prefill of `charge` is done: its prefill load goes away (idempotent).
    pub fn prefill_done(&mut self, charge: &mut Charge) {
        if let Some((id, blocks)) = charge.prefill.take() {
            if let Some(w) = self.get_mut(id) {
                w.inflight.prefill_blocks = w.inflight.prefill_blocks.saturating_sub(blocks);
            }
        }
    }

    /// The worker said it had the first `cached_blocks` of the prompt cached (its usage's
    /// `cached_tokens`, in blocks): the recent prefill work of `charge`'s prefilling worker is
    /// corrected from the blocks the router expected it to compute to the blocks it computed
    /// (at most once per charge; before [`WorkerView::release`]). The correction counts as work
    /// done now, undecayed.
    pub fn prefill_measured(&mut self, charge: &mut Charge, cached_blocks: u64) {
        if let Some((id, prompt, charged)) = charge.recent.take() {
            if let Some(w) = self.get_mut(id) {
                let computed = prompt.saturating_sub(cached_blocks);
                w.recent_prefill_blocks =
                    (w.recent_prefill_blocks + computed as f64 - charged as f64).max(0.0);
            }
        }
    }

    /// The request finished (or failed): everything left of `charge` goes away.
    pub fn release(&mut self, mut charge: Charge) {
        self.prefill_done(&mut charge);
        let (id, blocks) = charge.decode;
        if let Some(w) = self.get_mut(id) {
            w.inflight.decode_blocks = w.inflight.decode_blocks.saturating_sub(blocks);
            w.inflight.queue_depth = w.inflight.queue_depth.saturating_sub(1);
        }
    }

    fn position(&self, id: WorkerId) -> Result<usize, usize> {
        self.workers.binary_search_by_key(&id, |w| w.id)
    }

    fn get_mut(&mut self, id: WorkerId) -> Option<&mut WorkerState> {
        self.position(id).ok().map(|i| &mut self.workers[i])
    }
}
