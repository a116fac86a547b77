//! [`PrefixIndex`]: which block hashes each worker holds, and the longest cached prefix per worker.
//!
//! Layout: one map `BlockHash → set handle`, the sets (bitsets over *slots*, dense indices the
//! index gives its workers) side by side in one arena, so a lookup walks the query once,
//! intersecting the set of workers that still match with each block's set and stopping at the
//! first block no remaining worker holds. The walk probes the map a few blocks ahead (1, 2, 4,
//! then 8 at a time) so the probes' cache misses overlap instead of queueing one behind the other. Per
//! worker, a map of the hashes it holds (with an insertion stamp) and a FIFO of stamps for the
//! memory cap.
//!
//! Event sequence: the first event of a newly seen worker must have id 0 (the start of its
//! stream); after that every id must be the previous one + 1. Otherwise [`PrefixIndex::apply`]
//! returns a [`Gap`] and applies nothing: the caller fetches a snapshot of the worker's cache and
//! calls [`PrefixIndex::apply_snapshot`] with the id of the next event it will feed.
//!
//! Memory bound: at most `max_entries` (worker, hash) pairs. Beyond it, the index evicts from the
//! worker holding the most entries its *oldest stored* entry (re-storing a held hash refreshes it).
//! Workers evict their own caches and report it with `Removed`, so the cap only binds when the
//! configured cap is below the sum of the workers' cache sizes or a worker's `Removed` events
//! were lost; set it above the sum of the workers' capacities. An evicted entry makes the index
//! under-report that worker's prefix, never over-report it.

mod worker_set;

use std::collections::{HashMap, VecDeque};

use smallvec::SmallVec;

use crate::{BlockHash, Gap, KvEvent, KvEventRecord, WorkerId};
use worker_set::{MixBuild, SetArena, WorkerSet};

/// Default cap on (worker, hash) entries: 16 M (≈ 1 GiB worst case).
pub const DEFAULT_MAX_ENTRIES: usize = 1 << 24;

/// What one worker has in the index.
#[derive(Debug)]
struct WorkerState {
    id: WorkerId,
    /// Id the next event must carry (`None`: accept any, after a reset).
    expected: Option<u64>,
    /// Hash → stamp of its latest store.
    held: HashMap<BlockHash, u64, MixBuild>,
    /// (stamp, hash) in store order; entries whose stamp no longer matches `held` are stale.
    order: VecDeque<(u64, BlockHash)>,
    next_stamp: u64,
}

impl WorkerState {
    fn new(id: WorkerId, expected: Option<u64>) -> Self {
        Self {
            id,
            expected,
            held: HashMap::default(),
            order: VecDeque::new(),
            next_stamp: 0,
        }
    }
}

/// One worker's answer to a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchEntry {
    pub worker: WorkerId,
    /// Leading blocks of the query the worker holds.
    pub matched_blocks: usize,
    /// All blocks the worker holds (its cached tree's size; a placement tie-breaker).
    pub cached_blocks: usize,
}

/// Result of [`PrefixIndex::find_matches`]: one entry per known worker, sorted by worker id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    entries: Vec<MatchEntry>,
}

impl Matches {
    /// Builds a result by hand (tests, policies fed from elsewhere). Sorts by worker.
    pub fn from_entries(mut entries: Vec<MatchEntry>) -> Self {
        entries.sort_unstable_by_key(|e| e.worker);
        Self { entries }
    }

    /// Every known worker's entry, sorted by worker id.
    pub fn entries(&self) -> &[MatchEntry] {
        &self.entries
    }

    /// The entry of `worker`, if the index knows it.
    pub fn get(&self, worker: WorkerId) -> Option<&MatchEntry> {
        self.entries
            .binary_search_by_key(&worker, |e| e.worker)
            .ok()
            .map(|i| &self.entries[i])
    }

    /// Leading blocks `worker` holds (0 if unknown).
    pub fn matched(&self, worker: WorkerId) -> usize {
        self.get(worker).map_or(0, |e| e.matched_blocks)
    }

    /// The longest match over all workers.
    pub fn longest(&self) -> usize {
        self.entries
            .iter()
            .map(|e| e.matched_blocks)
            .max()
            .unwrap_or(0)
    }
}

/// The router's prefix index. See the module docs for the sequencing and memory rules.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Hash → handle of its worker set in `sets`.
    blocks: HashMap<BlockHash, u32, MixBuild>,
    sets: SetArena,
    slot_of: HashMap<WorkerId, usize>,
    slots: Vec<Option<WorkerState>>,
    free_slots: Vec<usize>,
    /// Bits of occupied slots.
    live: WorkerSet,
    entries: usize,
    max_entries: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ENTRIES)
    }
}

impl PrefixIndex {
    /// An empty index holding at most `max_entries` (worker, hash) pairs (at least 1).
    pub fn new(max_entries: usize) -> Self {
        Self {
            blocks: HashMap::default(),
            sets: SetArena::default(),
            slot_of: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            live: WorkerSet::default(),
            entries: 0,
            max_entries: max_entries.max(1),
        }
    }

    /// Registers `worker` (no-op if known); its first event must have id 0.
    pub fn add_worker(&mut self, worker: WorkerId) {
        self.slot(worker);
    }

    /// Applies one event of `worker`'s stream (registering the worker if new).
    ///
    /// # Errors
    /// [`Gap`] if `record.id` is not the expected next id; nothing is applied then.
    pub fn apply(&mut self, worker: WorkerId, record: &KvEventRecord) -> Result<(), Gap> {
        let slot = self.slot(worker);
        let state = self.slots[slot].as_mut().expect("slot of a known worker");
        if let Some(expected) = state.expected {
            if record.id != expected {
                return Err(Gap {
                    worker,
                    expected,
                    got: record.id,
                });
            }
        }
        state.expected = Some(record.id + 1);
        match &record.event {
            KvEvent::Stored { blocks, .. } => {
                for &h in blocks {
                    self.insert(slot, h);
                }
                self.enforce_cap();
            }
            KvEvent::Removed { hashes } => {
                for h in hashes {
                    self.remove(slot, *h);
                }
            }
            KvEvent::Cleared => self.clear_slot(slot),
        }
        Ok(())
    }

    /// Forgets everything `worker` holds and accepts its next event whatever its id (the caller
    /// restarts the stream from a point it knows is complete).
    pub fn reset_worker(&mut self, worker: WorkerId) {
        let slot = self.slot(worker);
        self.clear_slot(slot);
        self.slots[slot].as_mut().expect("known worker").expected = None;
    }

    /// Replaces `worker`'s entries by `hashes` (a full snapshot of its cache); the next event must
    /// carry `next_event_id` (`None`: any id).
    pub fn apply_snapshot(
        &mut self,
        worker: WorkerId,
        hashes: impl IntoIterator<Item = BlockHash>,
        next_event_id: Option<u64>,
    ) {
        let slot = self.slot(worker);
        self.clear_slot(slot);
        for h in hashes {
            self.insert(slot, h);
        }
        self.slots[slot].as_mut().expect("known worker").expected = next_event_id;
        self.enforce_cap();
    }

    /// Drops `worker` and all its entries (it left or died). Unknown workers are ignored.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let Some(slot) = self.slot_of.remove(&worker) else {
            return;
        };
        self.clear_slot(slot);
        self.slots[slot] = None;
        self.live.remove(slot);
        self.free_slots.push(slot);
    }

    /// For each known worker, how many leading blocks of `query` it holds.
    pub fn find_matches(&self, query: &[BlockHash]) -> Matches {
        const MAX_AHEAD: usize = 8;
        let words = self.sets.words();
        let mut active: SmallVec<[u64; 8]> = (0..words).map(|i| self.live.word(i)).collect();
        let mut matched: SmallVec<[u32; 64]> = SmallVec::from_elem(0, self.slots.len());
        let mut depth = 0u32;
        let mut ahead = 1;
        let mut at = 0;
        'walk: while at < query.len() {
            let n = ahead.min(query.len() - at);
            let mut handles = [u32::MAX; MAX_AHEAD];
            for (j, h) in query[at..at + n].iter().enumerate() {
                handles[j] = self.blocks.get(h).copied().unwrap_or(u32::MAX);
            }
            for &handle in &handles[..n] {
                if handle == u32::MAX {
                    break 'walk;
                }
                let set = self.sets.set(handle);
                let mut any = 0;
                for (i, (a, &s)) in active.iter_mut().zip(set).enumerate() {
                    let keep = *a & s;
                    let mut lost = *a & !keep;
                    while lost != 0 {
                        matched[i * 64 + lost.trailing_zeros() as usize] = depth;
                        lost &= lost - 1;
                    }
                    *a = keep;
                    any |= keep;
                }
                if any == 0 {
                    break 'walk;
                }
                depth += 1;
            }
            at += n;
            ahead = (ahead * 2).min(MAX_AHEAD);
        }
        for (i, a) in active.iter().enumerate() {
            let mut rest = *a;
            while rest != 0 {
                matched[i * 64 + rest.trailing_zeros() as usize] = depth;
                rest &= rest - 1;
            }
        }
        let entries = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                s.as_ref().map(|s| MatchEntry {
                    worker: s.id,
                    matched_blocks: matched[slot] as usize,
                    cached_blocks: s.held.len(),
                })
            })
            .collect();
        Matches::from_entries(entries)
    }

    /// Whether `worker` holds `hash`.
    pub fn contains(&self, worker: WorkerId, hash: BlockHash) -> bool {
        self.slot_of
            .get(&worker)
            .is_some_and(|&slot| {
                self.blocks
                    .get(&hash)
                    .is_some_and(|&i| self.sets.contains(i, slot))
            })
    }

    /// Blocks `worker` holds (0 if unknown).
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.slot_of
            .get(&worker)
            .map_or(0, |&s| self.slots[s].as_ref().map_or(0, |s| s.held.len()))
    }

    /// Known workers, in slot order.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.slots.iter().flatten().map(|s| s.id)
    }

    /// Total (worker, hash) entries.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct hashes held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The cap on entries.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// Whether any worker holds `hash`.
    pub fn holds_any(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Heap bytes the index holds, estimated from its tables' capacities (hash tables count one
    /// control byte per bucket, as hashbrown does); `heap_bytes() / entries()` is the memory per
    /// cached (worker, block) entry.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let table = |cap: usize, item: usize| cap * (item + 1);
        let blocks =
            table(self.blocks.capacity(), size_of::<(BlockHash, u32)>()) + self.sets.heap_bytes();
        let workers: usize = self
            .slots
            .iter()
            .flatten()
            .map(|s| {
                table(s.held.capacity(), size_of::<(BlockHash, u64)>())
                    + s.order.capacity() * size_of::<(u64, BlockHash)>()
            })
            .sum();
        blocks
            + workers
            + table(self.slot_of.capacity(), size_of::<(WorkerId, usize)>())
            + self.slots.capacity() * size_of::<Option<WorkerState>>()
            + self.free_slots.capacity() * size_of::<usize>()
    }

    fn slot(&mut self, worker: WorkerId) -> usize {
        if let Some(&slot) = self.slot_of.get(&worker) {
            return slot;
        }
        let state = WorkerState::new(worker, Some(0));
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(state);
                slot
            }
            None => {
                self.slots.push(Some(state));
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(worker, slot);
        self.live.insert(slot);
        slot
    }

    fn insert(&mut self, slot: usize, h: BlockHash) {
        let state = self.slots[slot].as_mut().expect("live slot");
        let stamp = state.next_stamp;
        state.next_stamp += 1;
        if state.held.insert(h, stamp).is_none() {
            let sets = &mut self.sets;
            let handle = *self.blocks.entry(h).or_insert_with(|| sets.alloc());
            sets.insert(handle, slot);
            self.entries += 1;
        }
        state.order.push_back((stamp, h));
        if state.order.len() > 2 * state.held.len() + 64 {
            let held = &state.held;
            state.order.retain(|(s, h)| held.get(h) == Some(s));
        }
    }

    fn remove(&mut self, slot: usize, h: BlockHash) {
        let state = self.slots[slot].as_mut().expect("live slot");
        if state.held.remove(&h).is_some() {
            self.unlink(slot, h);
        }
    }

    /// Clears `slot`'s bit in `h`'s set (dropping the set when empty) and counts the entry gone.
    fn unlink(&mut self, slot: usize, h: BlockHash) {
        if let Some(&handle) = self.blocks.get(&h) {
            if self.sets.remove(handle, slot) {
                self.blocks.remove(&h);
                self.sets.release(handle);
            }
        }
        self.entries -= 1;
    }

    fn clear_slot(&mut self, slot: usize) {
        let state = self.slots[slot].as_mut().expect("live slot");
        let held = std::mem::take(&mut state.held);
        state.order.clear();
        for h in held.into_keys() {
            self.unlink(slot, h);
        }
    }

    fn enforce_cap(&mut self) {
        while self.entries > self.max_entries {
            let Some(slot) = (0..self.slots.len())
                .filter(|&s| self.slots[s].is_some())
                .max_by_key(|&s| self.slots[s].as_ref().map_or(0, |s| s.held.len()))
            else {
                return;
            };
            let state = self.slots[slot].as_mut().expect("live slot");
            let victim = loop {
                match state.order.pop_front() {
                    Some((stamp, h)) if state.held.get(&h) == Some(&stamp) => break Some(h),
                    Some(_) => continue,
                    None => break None,
                }
            };
            match victim {
                Some(h) => {
                    state.held.remove(&h);
                    self.unlink(slot, h);
                }
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests;
