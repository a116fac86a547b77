//! The placement state, with one owner and one lock: the prefix index (which worker caches which
//! blocks), the load view (health, reported load, optimistic charges) and the in-flight overlay
//! (blocks of placed prompts whose KV events have not arrived).
//!
//! Every placement is one critical section, [`PlacementState::place`]: look the prompt's block
//! hashes up, let the policy decide, charge the decision. No other placement and no worker
//! update can fall between the lookup and the charge, which is what keeps concurrent requests
//! from herding onto the worker that looked best to each of them. The watchers that apply
//! workers' events and reports go through [`PlacementState::with_index`] and
//! [`PlacementState::with_view`] under the same lock.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cleave_kv_index::{BlockHash, Matches, PrefixIndex, WorkerId};
use cleave_types::kv::{block_hashes, DEFAULT_BLOCK_SIZE};

use super::{Charge, InFlight, Placement, PlacementRequest, PolicyKind, Role, Ticket, WorkerView};

/// Token slots per KV block on the workers (the engine's default).
pub const BLOCK_SIZE: usize = DEFAULT_BLOCK_SIZE;

/// Matches buffers kept for reuse; more requests placed at once allocate.
const SPARE_MATCHES: usize = 16;

/// What the lock guards.
struct State {
    index: PrefixIndex,
    view: WorkerView,
    /// `None`: the policy reads the index alone.
    in_flight: Option<InFlight>,
    /// Matches buffers of finished placements, reused by the next lookups.
    spare: Vec<Matches>,
}

/// The router's placement state (see the module's documentation).
pub struct PlacementState {
    state: Mutex<State>,
    /// The overlay's clock starts here.
    epoch: Instant,
}

impl Default for PlacementState {
    fn default() -> Self {
        PlacementState {
            state: Mutex::new(State {
                index: PrefixIndex::default(),
                view: WorkerView::new(),
                in_flight: None,
                spare: Vec::new(),
            }),
            epoch: Instant::now(),
        }
    }
}

impl PlacementState {
    /// The state a router placing with `policy` needs: with the in-flight overlay when the
    /// policy reads it ([`PolicyKind::matches_in_flight`]).
    pub fn for_policy(policy: PolicyKind) -> Self {
        let s = PlacementState::default();
        if policy.matches_in_flight() {
            s.with_in_flight(InFlight::default())
        } else {
            s
        }
    }

    /// Extends every lookup over `overlay` (the blocks of placements whose KV events have not
    /// arrived yet; [`super::in_flight`]).
    pub fn with_in_flight(self, overlay: InFlight) -> Self {
        self.lock().in_flight = Some(overlay);
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("placement state")
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Places a request whose prefix is `prompt` and that occupies `prompt_blocks` and
    /// `decode_blocks` (callers that count several prompts of one request pass their sums; an
    /// empty `prompt` matches nothing): `decide` picks from the request and the view, and what
    /// it returns is charged before the lock is let go. Dropping the [`Reservation`] gives the
    /// charge back.
    pub fn place<E>(
        self: &Arc<Self>,
        prompt: &[u32],
        prompt_blocks: usize,
        decode_blocks: usize,
        decide: impl FnOnce(&PlacementRequest, &WorkerView) -> Result<Placement, E>,
    ) -> Result<(Placement, Reservation), E> {
        let hashes = if prompt.is_empty() {
            Vec::new()
        } else {
            block_hashes(prompt, BLOCK_SIZE, 0)
        };
        let now = self.now();
        let mut s = self.lock();
        let req = s.request(&hashes, prompt_blocks, decode_blocks, now);
        let placement = decide(&req, &s.view);
        let placement = match placement {
            Ok(p) => p,
            Err(e) => {
                s.recycle(req.matches);
                return Err(e);
            }
        };
        let charge = s.view.charge(&req, &placement);
        let ticket = match &mut s.in_flight {
            Some(o) if !hashes.is_empty() => Some(o.add(placement.decode, hashes, now)),
            _ => None,
        };
        s.recycle(req.matches);
        drop(s);
        Ok((
            placement,
            Reservation {
                state: self.clone(),
                charge: Some(charge),
                ticket,
            },
        ))
    }

    /// [`Self::place`] for a prompt of `prompt.len()` tokens and `max_tokens` of output.
    pub fn place_prompt<E>(
        self: &Arc<Self>,
        prompt: &[u32],
        max_tokens: usize,
        decide: impl FnOnce(&PlacementRequest, &WorkerView) -> Result<Placement, E>,
    ) -> Result<(Placement, Reservation), E> {
        let blocks = prompt.len().div_ceil(BLOCK_SIZE);
        self.place(prompt, blocks, max_tokens.div_ceil(BLOCK_SIZE), decide)
    }

    /// How many leading blocks of `prompt` each worker caches (the router's block hashes looked
    /// up in the index, with the in-flight overlay when there is one).
    pub fn matches(&self, prompt: &[u32]) -> Matches {
        let hashes = block_hashes(prompt, BLOCK_SIZE, 0);
        let now = self.now();
        self.lock().request(&hashes, 0, 0, now).matches
    }

    /// Runs `f` on the prefix index (applying a worker's events or snapshot).
    pub fn with_index<R>(&self, f: impl FnOnce(&mut PrefixIndex) -> R) -> R {
        f(&mut self.lock().index)
    }

    /// Runs `f` on the load view (health, load reports).
    pub fn with_view<R>(&self, f: impl FnOnce(&mut WorkerView) -> R) -> R {
        f(&mut self.lock().view)
    }

    /// A copy of the load view.
    pub fn view(&self) -> WorkerView {
        self.lock().view.clone()
    }

    /// A worker joins: known to the index and the view, not healthy until its watch says so.
    pub fn add_worker(&self, id: WorkerId, role: Role) {
        let mut s = self.lock();
        s.index.add_worker(id);
        s.view.upsert(id, role);
        s.view.set_healthy(id, false);
    }

    /// A worker leaves, with everything known about it.
    pub fn remove_worker(&self, id: WorkerId) {
        let mut s = self.lock();
        s.index.remove_worker(id);
        if let Some(o) = &mut s.in_flight {
            o.remove_worker(id);
        }
        s.view.remove(id);
    }

    /// Marks a worker healthy or not (placement skips unhealthy ones).
    pub fn set_healthy(&self, id: WorkerId, healthy: bool) {
        self.lock().view.set_healthy(id, healthy);
    }

    /// Whether every placement's load charge has been given back (no worker carries any).
    pub fn no_load_charged(&self) -> bool {
        self.lock()
            .view
            .iter()
            .all(|w| w.inflight == Default::default())
    }

    /// In-flight placements whose blocks count in lookups (0 without the overlay).
    pub fn in_flight_len(&self) -> usize {
        self.lock().in_flight.as_ref().map_or(0, InFlight::len)
    }

    /// How many decode-capable workers are healthy.
    pub fn healthy_decode_workers(&self) -> usize {
        self.lock()
            .view
            .iter()
            .filter(|w| w.healthy && w.role.can_decode())
            .count()
    }
}

impl State {
    /// The policy's request for `hashes`: the index's matches, extended over the in-flight
    /// overlay (whose expired placements are dropped first).
    fn request(
        &mut self,
        hashes: &[BlockHash],
        prompt_blocks: usize,
        decode_blocks: usize,
        now: Duration,
    ) -> PlacementRequest {
        let mut matches = self.spare.pop().unwrap_or_default();
        if hashes.is_empty() {
            matches = Matches::default();
        } else {
            self.index.find_matches_into(hashes, &mut matches);
            if let Some(o) = &mut self.in_flight {
                o.expire(now, &self.index);
                o.extend(&self.index, hashes, &mut matches);
            }
        }
        PlacementRequest {
            prompt_blocks,
            decode_blocks,
            matches,
        }
    }

    fn recycle(&mut self, matches: Matches) {
        if self.spare.len() < SPARE_MATCHES {
            self.spare.push(matches);
        }
    }
}

/// What [`PlacementState::place`] counted for one placed request: the optimistic load charge
/// and the in-flight overlay ticket. [`Reservation::prefill_done`] at the first token; dropping
/// it (the stream ended or was dropped) releases the charge and, before the first token, the
/// ticket (after it, the ticket waits for the worker's KV events).
pub struct Reservation {
    state: Arc<PlacementState>,
    charge: Option<Charge>,
    ticket: Option<Ticket>,
}

impl Reservation {
    /// The request's prefill is done (its first token came).
    pub fn prefill_done(&mut self) {
        let now = self.state.now();
        let mut s = self.state.lock();
        if let Some(c) = &mut self.charge {
            s.view.prefill_done(c);
        }
        if let (Some(o), Some(t)) = (&mut s.in_flight, &self.ticket) {
            o.prefill_done(t, now);
        }
    }

    /// The worker said it had `cached_tokens` of the prompt cached (its usage, reported when the
    /// request finished): corrects the recent prefill work the charge added, from what the
    /// index expected to what the worker computed ([`WorkerView::prefill_measured`]). Call it
    /// only for a request whose prefill ran (a token came).
    pub fn prefill_measured(&mut self, cached_tokens: usize) {
        if let Some(c) = &mut self.charge {
            self.state
                .lock()
                .view
                .prefill_measured(c, (cached_tokens / BLOCK_SIZE) as u64);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut s = self.state.lock();
        if let Some(c) = self.charge.take() {
            s.view.release(c);
        }
        if let (Some(o), Some(t)) = (&mut s.in_flight, self.ticket.take()) {
            o.release(t);
        }
    }
}
