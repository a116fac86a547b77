//! [`PrefixIndex`]: which block hashes each worker holds, and the longest cached prefix per worker.
//!
//! Layout. Block hashes are chained (each identifies its whole prefix), so the index needs no
//! tree: one flat table `BlockHash → Holders` keyed with a one-multiply hasher, whose entries lie
//! in first-store order so that a chain stored in one event is consecutive (`blocks.rs`). A
//! block's holders are worker *slots* (dense numbers the index gives its workers), kept in the
//! entry as a list of up to six, spilling to a bitset over all slots (8 words at 512 workers) in a
//! shared arena when more workers hold the block. A lookup walks the query's hashes once, keeping
//! the set of workers still matching (seeded from the first block's holders, then intersected
//! with each block's), records each worker's match length when it drops out, and stops at the
//! first block no remaining worker holds. Each next block is first looked for in the entry after
//! the previous block's (no hash probe along a chain stored together); where that fails, the walk
//! probes the map a few blocks ahead (2, 4, …, 16 at a time) so the probes' cache misses overlap.
//! The result is written in worker order into a buffer the caller may reuse
//! ([`PrefixIndex::find_matches_into`]), from slot order kept sorted by worker when workers come
//! and go, so a lookup neither sorts nor allocates. Per worker, a map of the
//! hashes it holds (with an insertion stamp) and a FIFO of stamps for the memory cap.
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

mod blocks;
mod worker_set;

use std::collections::{HashMap, VecDeque};

use smallvec::SmallVec;

use crate::{BlockHash, Gap, KvEvent, KvEventRecord, WorkerId};
use blocks::BlockTable;
use worker_set::{Holders, MixBuild, SetArena, INLINE};

/// Default cap on (worker, hash) entries: 16 M (≈ 1 GiB worst case).
pub const DEFAULT_MAX_ENTRIES: usize = 1 << 24;

/// Most map probes a lookup issues before using their results.
const MAX_AHEAD: usize = 16;

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

    /// Raises `worker`'s match to at least `matched` blocks (no-op for an unknown worker): for
    /// callers that know of blocks the index has not been told of yet (the router's in-flight
    /// placements).
    pub fn raise(&mut self, worker: WorkerId, matched: usize) {
        if let Ok(i) = self.entries.binary_search_by_key(&worker, |e| e.worker) {
            let e = &mut self.entries[i];
            e.matched_blocks = e.matched_blocks.max(matched);
        }
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

/// A worker's slot as lookups read it: dense, so building a result touches one array.
#[derive(Clone, Copy, Debug)]
struct SlotInfo {
    id: WorkerId,
    /// Blocks the worker holds.
    held: usize,
    /// Index of the slot in `by_worker` (its entry's place in a result).
    rank: u32,
}

/// The set of workers still matching during a lookup.
enum Active {
    /// At most [`INLINE`] slots.
    List(SmallVec<[u32; INLINE]>),
    /// Bitset over slots (the arena's width).
    Bits(SmallVec<[u64; 8]>),
}

/// The router's prefix index. See the module docs for the layout, sequencing and memory rules.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Hash → the slots holding it.
    blocks: BlockTable,
    /// Bitsets of blocks held by more than [`INLINE`] workers.
    sets: SetArena,
    slot_of: HashMap<WorkerId, usize, MixBuild>,
    slots: Vec<Option<WorkerState>>,
    /// Per slot (free slots keep a stale entry, outside `by_worker`).
    info: Vec<SlotInfo>,
    /// Live slots sorted by worker id.
    by_worker: Vec<u32>,
    free_slots: Vec<usize>,
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
            blocks: BlockTable::default(),
            sets: SetArena::default(),
            slot_of: HashMap::default(),
            slots: Vec::new(),
            info: Vec::new(),
            by_worker: Vec::new(),
            free_slots: Vec::new(),
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
        let rank = self.info[slot].rank as usize;
        self.by_worker.remove(rank);
        self.rerank(rank);
        self.free_slots.push(slot);
    }

    /// For each known worker, how many leading blocks of `query` it holds.
    pub fn find_matches(&self, query: &[BlockHash]) -> Matches {
        let mut out = Matches::default();
        self.find_matches_into(query, &mut out);
        out
    }

    /// [`Self::find_matches`] into `out`, reusing its buffer (a caller doing many lookups
    /// allocates nothing).
    pub fn find_matches_into(&self, query: &[BlockHash], out: &mut Matches) {
        let entries = &mut out.entries;
        entries.clear();
        entries.extend(self.by_worker.iter().map(|&slot| {
            let s = &self.info[slot as usize];
            MatchEntry {
                worker: s.id,
                matched_blocks: 0,
                cached_blocks: s.held,
            }
        }));
        let Some(mut at) = query.first().and_then(|&h| self.blocks.find(h)) else {
            return;
        };
        let mut active = match *self.blocks.holders(at) {
            Holders::Few { n, slots } => {
                Active::List(slots[..n as usize].iter().map(|&s| u32::from(s)).collect())
            }
            Holders::Many { set, .. } => Active::Bits(self.sets.set(set).iter().copied().collect()),
        };
        let info = &self.info;
        let mut drop_out = |slot: usize, depth: usize| {
            entries[info[slot].rank as usize].matched_blocks = depth;
        };
        // Blocks `..depth` are held by every active worker.
        let mut depth = 1;
        let mut ahead = 2;
        let mut probes = [None::<u32>; MAX_AHEAD];
        'walk: while depth < query.len() {
            let n = match self.blocks.next_is(at, query[depth]) {
                // Along a chain stored together: the next entry, no probe.
                Some(next) => {
                    probes[0] = Some(next);
                    ahead = 2;
                    1
                }
                None => {
                    let n = ahead.min(query.len() - depth);
                    for (p, &h) in probes.iter_mut().zip(&query[depth..depth + n]) {
                        *p = self.blocks.find(h);
                    }
                    ahead = (ahead * 2).min(MAX_AHEAD);
                    n
                }
            };
            for p in &probes[..n] {
                let Some(next) = *p else {
                    break 'walk;
                };
                if !self.narrow(&mut active, self.blocks.holders(next), depth, &mut drop_out) {
                    return;
                }
                at = next;
                depth += 1;
            }
        }
        match active {
            Active::List(list) => list.iter().for_each(|&s| drop_out(s as usize, depth)),
            Active::Bits(words) => for_each_bit(&words, |s| drop_out(s, depth)),
        }
    }

    /// Keeps in `active` the workers that hold the block at `depth` (its `holders`), reporting
    /// the others as matching `depth` blocks; returns whether any worker is left.
    #[inline]
    fn narrow(
        &self,
        active: &mut Active,
        holders: &Holders,
        depth: usize,
        drop_out: &mut impl FnMut(usize, usize),
    ) -> bool {
        match active {
            Active::List(list) => {
                list.retain(|s| {
                    let keep = holders.contains(&self.sets, *s as usize);
                    if !keep {
                        drop_out(*s as usize, depth);
                    }
                    keep
                });
                !list.is_empty()
            }
            Active::Bits(words) => {
                let mut left = 0;
                match *holders {
                    Holders::Many { set, .. } => {
                        let set = self.sets.set(set);
                        // The common case on a long match: every active worker holds the block.
                        if words.iter().zip(set).all(|(a, s)| a & !s == 0) {
                            return true;
                        }
                        for (i, (a, &s)) in words.iter_mut().zip(set).enumerate() {
                            let keep = *a & s;
                            let mut lost = *a & !keep;
                            while lost != 0 {
                                drop_out(i * 64 + lost.trailing_zeros() as usize, depth);
                                lost &= lost - 1;
                            }
                            *a = keep;
                            left += keep.count_ones() as usize;
                        }
                        // Words past the arena's width (it only grows) are already zero.
                    }
                    Holders::Few { n, slots } => {
                        let mut keep: SmallVec<[u32; INLINE]> = SmallVec::new();
                        for &s in &slots[..n as usize] {
                            let (w, b) = (s as usize / 64, s % 64);
                            if words.get(w).is_some_and(|x| x & (1 << b) != 0) {
                                words[w] &= !(1 << b);
                                keep.push(u32::from(s));
                            }
                        }
                        for_each_bit(words, |b| drop_out(b, depth));
                        left = keep.len();
                        *active = Active::List(keep);
                        return left > 0;
                    }
                }
                if left <= INLINE {
                    let mut list = SmallVec::new();
                    for_each_bit(words, |b| list.push(b as u32));
                    *active = Active::List(list);
                }
                left > 0
            }
        }
    }

    /// Whether `worker` holds `hash`.
    pub fn contains(&self, worker: WorkerId, hash: BlockHash) -> bool {
        self.slot_of.get(&worker).is_some_and(|&slot| {
            self.blocks
                .get(hash)
                .is_some_and(|h| h.contains(&self.sets, slot))
        })
    }

    /// Blocks `worker` holds (0 if unknown).
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.slot_of.get(&worker).map_or(0, |&s| self.info[s].held)
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
        self.blocks.find(hash).is_some()
    }

    /// Heap bytes the index holds, estimated from its tables' capacities (hash tables count one
    /// control byte per bucket, as hashbrown does); `heap_bytes() / entries()` is the memory per
    /// cached (worker, block) entry.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let table = |cap: usize, item: usize| cap * (item + 1);
        let blocks = self.blocks.heap_bytes() + self.sets.heap_bytes();
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
            + self.info.capacity() * size_of::<SlotInfo>()
            + self.by_worker.capacity() * size_of::<u32>()
            + self.free_slots.capacity() * size_of::<usize>()
    }

    fn slot(&mut self, worker: WorkerId) -> usize {
        if let Some(&slot) = self.slot_of.get(&worker) {
            return slot;
        }
        let state = WorkerState::new(worker, Some(0));
        let info = SlotInfo {
            id: worker,
            held: 0,
            rank: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(state);
                self.info[slot] = info;
                slot
            }
            None => {
                self.slots.push(Some(state));
                self.info.push(info);
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(worker, slot);
        let rank = self
            .by_worker
            .partition_point(|&s| self.info[s as usize].id < worker);
        self.by_worker
            .insert(rank, u32::try_from(slot).expect("fewer than 2^32 workers"));
        self.rerank(rank);
        self.sets.fit(self.slots.len());
        slot
    }

    /// Renumbers the ranks of `by_worker[from..]`.
    fn rerank(&mut self, from: usize) {
        for (rank, &slot) in self.by_worker.iter().enumerate().skip(from) {
            self.info[slot as usize].rank = rank as u32;
        }
    }

    fn insert(&mut self, slot: usize, h: BlockHash) {
        let state = self.slots[slot].as_mut().expect("live slot");
        let stamp = state.next_stamp;
        state.next_stamp += 1;
        if state.held.insert(h, stamp).is_none() {
            self.blocks.insert(&mut self.sets, h, slot);
            self.entries += 1;
            self.info[slot].held += 1;
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

    /// Removes `slot` from `h`'s holders (dropping the block when none is left) and counts the
    /// entry gone.
    fn unlink(&mut self, slot: usize, h: BlockHash) {
        self.blocks.remove(&mut self.sets, h, slot);
        self.entries -= 1;
        self.info[slot].held -= 1;
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
            let Some(&slot) = self
                .by_worker
                .iter()
                .max_by_key(|&&s| self.info[s as usize].held)
            else {
                return;
            };
            let slot = slot as usize;
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

/// Calls `f` with the index of each set bit of `words`, in increasing order.
#[inline]
fn for_each_bit(words: &[u64], mut f: impl FnMut(usize)) {
    for (w, &word) in words.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            f(w * 64 + rest.trailing_zeros() as usize);
            rest &= rest - 1;
        }
    }
}

#[cfg(test)]
mod tests;
