//! The in-flight prefix overlay: the blocks of prompts the router has placed but whose KV events
//! have not arrived yet, counted as cached on the worker they were placed on.
//!
//! A worker reports a prompt's blocks (`Stored`) only once it has computed them. Until then the
//! KV-event index says the worker does not hold them, and a policy reading the index alone sends
//! the next request with the same prefix elsewhere (the simulator showed this lowering the hit
//! rate under load, which raises the load). [`InFlight`] remembers each placement's block hashes
//! on its worker ([`InFlight::add`] → [`Ticket`]) and extends a lookup's [`Matches`] over them
//! ([`InFlight::extend`]). `prefix-optimistic` is `prefix-load`'s cost over these extended
//! matches ([`super::PolicyKind::matches_in_flight`]).
//!
//! One structure, two callers with the same rules:
//! - the simulator adds at placement and [`InFlight::settle`]s when the prefill is done, the
//!   moment its simulated worker's events reach the index;
//! - the live router (`dispatch::Cluster`) adds at placement, marks the ticket
//!   [`InFlight::prefill_done`] at the first token, and lets [`InFlight::expire`] drop it once the
//!   index shows the worker holding the prompt's last block (its events arrived) or
//!   [`InFlight::grace`] after the first token (events lost or the blocks already evicted).
//!   A request dropped before its first token is [`InFlight::release`]d at once (the worker
//!   computed nothing); one that never reports a first token expires [`InFlight::ttl`] after
//!   its placement.
//!
//! The overlay can only add matches the worker is about to have; a stale entry costs one
//! mis-placement, never a wrong answer (the worker computes what it lacks).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use cleave_kv_index::{BlockHash, Matches, PrefixIndex, WorkerId};

/// Longest time a placement's blocks count before its first token ([`InFlight::ttl`]).
pub const DEFAULT_TTL: Duration = Duration::from_secs(60);

/// How long after the first token the blocks count while the worker's events are on their way
/// ([`InFlight::grace`]).
pub const DEFAULT_EVENT_GRACE: Duration = Duration::from_secs(5);

/// One placement's entry in the overlay. Not `Clone`: given back once, by
/// [`InFlight::settle`] or [`InFlight::release`].
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket(u64);

#[derive(Debug)]
struct Entry {
    worker: WorkerId,
    hashes: Vec<BlockHash>,
    /// When the entry expires (the caller's clock).
    deadline: Duration,
    /// The first token came: the entry waits for the worker's events.
    prefilled: bool,
}

/// Blocks of in-flight placements per worker. Times are [`Duration`]s since an epoch the caller
/// chooses (the simulator's clock, or the router's start), so tests drive it without sleeping.
#[derive(Debug)]
pub struct InFlight {
    /// Per worker, hash → how many in-flight placements on it include the block.
    blocks: HashMap<WorkerId, HashMap<BlockHash, u32>>,
    entries: HashMap<u64, Entry>,
    /// (deadline, ticket) in placement order; tickets already gone are skipped.
    by_deadline: VecDeque<(Duration, u64)>,
    /// Tickets whose first token came, waiting for the worker's events.
    awaiting: Vec<u64>,
    next: u64,
    ttl: Duration,
    grace: Duration,
}

impl Default for InFlight {
    fn default() -> Self {
        Self::new(DEFAULT_TTL, DEFAULT_EVENT_GRACE)
    }
}

impl InFlight {
    /// An empty overlay whose entries count at most `ttl` before the first token and `grace`
    /// after it.
    pub fn new(ttl: Duration, grace: Duration) -> Self {
        Self {
            blocks: HashMap::new(),
            entries: HashMap::new(),
            by_deadline: VecDeque::new(),
            awaiting: Vec::new(),
            next: 0,
            ttl,
            grace,
        }
    }

    /// The bound before the first token.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The bound after the first token.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// Counts `hashes` (a placed prompt's block hashes) as cached on `worker` from `now`.
    pub fn add(&mut self, worker: WorkerId, hashes: Vec<BlockHash>, now: Duration) -> Ticket {
        let pending = self.blocks.entry(worker).or_default();
        for h in &hashes {
            *pending.entry(*h).or_default() += 1;
        }
        let id = self.next;
        self.next += 1;
        let deadline = now + self.ttl;
        self.entries.insert(
            id,
            Entry {
                worker,
                hashes,
                deadline,
                prefilled: false,
            },
        );
        self.by_deadline.push_back((deadline, id));
        Ticket(id)
    }

    /// The prefill of `ticket` is done at `now`: its blocks count until the worker's events
    /// arrive, at most [`Self::grace`] longer.
    pub fn prefill_done(&mut self, ticket: &Ticket, now: Duration) {
        if let Some(e) = self.entries.get_mut(&ticket.0) {
            if !e.prefilled {
                e.prefilled = true;
                e.deadline = e.deadline.min(now + self.grace);
                self.awaiting.push(ticket.0);
            }
        }
    }

    /// The request ended: before its first token its blocks stop counting now (the worker
    /// computed nothing); after it they wait for the events ([`Self::expire`]).
    pub fn release(&mut self, ticket: Ticket) {
        if self.entries.get(&ticket.0).is_some_and(|e| !e.prefilled) {
            self.settle(ticket);
        }
    }

    /// `ticket`'s blocks stop counting now (its worker's events reached the index).
    pub fn settle(&mut self, ticket: Ticket) {
        self.drop_entry(ticket.0);
    }

    /// Drops the entries past their deadline at `now`, and those whose first token came and
    /// whose worker `index` shows holding the prompt's last block (the events arrived).
    pub fn expire(&mut self, now: Duration, index: &PrefixIndex) {
        while let Some(&(deadline, id)) = self.by_deadline.front() {
            if deadline > now {
                break;
            }
            self.by_deadline.pop_front();
            // A prefilled entry's deadline moved earlier; it is checked below.
            if self.entries.get(&id).is_some_and(|e| !e.prefilled) {
                self.drop_entry(id);
            }
        }
        let mut i = 0;
        while i < self.awaiting.len() {
            let id = self.awaiting[i];
            let done = self.entries.get(&id).is_none_or(|e| {
                e.deadline <= now || e.hashes.last().is_none_or(|&h| index.contains(e.worker, h))
            });
            if done {
                self.awaiting.swap_remove(i);
                self.drop_entry(id);
            } else {
                i += 1;
            }
        }
    }

    /// Raises each worker's entry in `matches` (the index's answer for `query`) over the blocks
    /// of its in-flight placements: the leading blocks of `query` that the index or the overlay
    /// has on the worker.
    pub fn extend(&self, index: &PrefixIndex, query: &[BlockHash], matches: &mut Matches) {
        for (&worker, pending) in &self.blocks {
            if pending.is_empty() {
                continue;
            }
            let base = matches.matched(worker).min(query.len());
            let more = query[base..]
                .iter()
                .take_while(|h| pending.contains_key(h) || index.contains(worker, **h))
                .count();
            if more > 0 {
                matches.raise(worker, base + more);
            }
        }
    }

    /// Forgets `worker`'s blocks (it left).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.blocks.remove(&worker);
        self.entries.retain(|_, e| e.worker != worker);
    }

    /// Placements whose blocks count now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no placement's blocks count.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn drop_entry(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        let Some(pending) = self.blocks.get_mut(&e.worker) else {
            return;
        };
        for h in &e.hashes {
            if let Some(n) = pending.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    pending.remove(h);
                }
            }
        }
        if pending.is_empty() {
            self.blocks.remove(&e.worker);
        }
    }
}

#[cfg(test)]
mod tests {
    use cleave_kv_index::{KvEvent, KvEventRecord};

    use super::*;

    fn hashes(r: std::ops::Range<u64>) -> Vec<BlockHash> {
        r.map(BlockHash).collect()
    }

    fn index(workers: u64) -> PrefixIndex {
        let mut index = PrefixIndex::default();
        for w in 0..workers {
            index.add_worker(WorkerId(w));
        }
        index
    }

    fn matched(o: &InFlight, index: &PrefixIndex, q: &[BlockHash], w: u64) -> usize {
        let mut m = index.find_matches(q);
        o.extend(index, q, &mut m);
        m.matched(WorkerId(w))
    }

    /// Worker `w`'s first event: it stored `blocks`, a chain from the root.
    fn store(index: &mut PrefixIndex, w: u64, blocks: std::ops::Range<u64>) {
        let record = KvEventRecord {
            id: 0,
            event: KvEvent::Stored {
                parent: None,
                blocks: hashes(blocks),
            },
        };
        index.apply(WorkerId(w), &record).unwrap();
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn placed_blocks_count_on_their_worker_only() {
        let index = index(2);
        let mut o = InFlight::default();
        let _t = o.add(WorkerId(0), hashes(0..10), Duration::ZERO);
        let q = hashes(0..12);
        assert_eq!(matched(&o, &index, &q, 0), 10);
        assert_eq!(matched(&o, &index, &q, 1), 0);
        // A diverging prompt matches only the shared leading blocks.
        let mut other = hashes(0..4);
        other.extend(hashes(100..110));
        assert_eq!(matched(&o, &index, &other, 0), 4);
    }

    #[test]
    fn overlay_continues_the_index_match() {
        let mut index = index(1);
        store(&mut index, 0, 0..3);
        let mut o = InFlight::default();
        // In flight: blocks 3..6 (the rest of a longer prompt whose start was cached).
        let _t = o.add(WorkerId(0), hashes(3..6), Duration::ZERO);
        assert_eq!(matched(&o, &index, &hashes(0..8), 0), 6);
    }

    #[test]
    fn counts_are_per_placement() {
        let index = index(1);
        let mut o = InFlight::default();
        let a = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        let b = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        o.settle(a);
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 5);
        o.settle(b);
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 0);
        assert!(o.is_empty());
    }

    #[test]
    fn released_before_the_first_token_stops_counting_at_once() {
        let index = index(1);
        let mut o = InFlight::default();
        let t = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        o.release(t);
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 0);
    }

    #[test]
    fn after_the_first_token_blocks_count_until_events_or_grace() {
        let mut index = index(1);
        let mut o = InFlight::new(60 * S, 5 * S);
        let a = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        let b = o.add(WorkerId(0), hashes(10..15), Duration::ZERO);
        o.prefill_done(&a, S);
        o.prefill_done(&b, S);
        // The stream ended, but the events are not in yet: the blocks still count.
        o.release(a);
        o.expire(2 * S, &index);
        assert_eq!(o.len(), 2);
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 5);
        // a's events arrive: a goes; b's never do: it goes at the grace bound.
        store(&mut index, 0, 0..5);
        o.expire(3 * S, &index);
        assert_eq!(o.len(), 1);
        o.expire(6 * S, &index);
        assert!(o.is_empty());
        assert_eq!(matched(&o, &index, &hashes(10..15), 0), 0);
        o.release(b);
    }

    #[test]
    fn no_first_token_expires_at_the_ttl() {
        let index = index(1);
        let mut o = InFlight::new(10 * S, S);
        let _t = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        o.expire(9 * S, &index);
        assert_eq!(o.len(), 1);
        o.expire(10 * S, &index);
        assert!(o.is_empty());
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 0);
    }

    #[test]
    fn a_removed_worker_is_forgotten() {
        let index = index(1);
        let mut o = InFlight::default();
        let t = o.add(WorkerId(0), hashes(0..5), Duration::ZERO);
        o.remove_worker(WorkerId(0));
        assert!(o.is_empty());
        assert_eq!(matched(&o, &index, &hashes(0..5), 0), 0);
        o.settle(t);
    }
}
