//! The block pool: reference counts, free list, prefix-cache map and LRU of idle cached blocks.
//!
//! Every block is in exactly one of three places:
//!
//! | place       | refcount | hash   | where                                   |
//! |-------------|----------|--------|-----------------------------------------|
//! | free        | 0        | `None` | the free list (a stack)                 |
//! | cached idle | 0        | `Some` | the LRU list, least recently released first |
//! | used        | > 0      | either | held by one or more sequences           |
//!
//! A block with a hash is *cached*: the map `hash -> block` finds it, whether it is used or idle.
//! [`BlockPool::allocate`] takes a free block if there is one, else evicts the head of the LRU
//! list (its hash leaves the map, with a [`KvEvent::Removed`]).
//!
//! All operations are O(1) (amortized, for the hash map) except [`BlockPool::match_prefix`] /
//! [`BlockPool::count_prefix`] (O(length of the prefix)), [`BlockPool::clear_cache`]
//! (O(cached blocks)) and [`BlockPool::check_invariants`] (O(total)). The LRU list is an
//! intrusive doubly linked list over block indices.
//!
//! Caller bugs (releasing a block nobody holds, retaining a free block, committing a block one
//! does not hold, an id out of range) trip a `debug_assert!` and are otherwise ignored, so a
//! release build never panics or double-frees because of them.

use std::collections::HashMap;

use super::events::{EventLog, DEFAULT_EVENT_CAPACITY};
use super::tiers::Move;
use super::{BlockHash, BlockId, KvEvent, KvEventRecord};

/// "No block" in the LRU links.
const NIL: u32 = u32::MAX;

/// Counts of blocks in each place; `free + cached_idle + used == total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub total: usize,
    /// Never used, or released without a hash.
    pub free: usize,
    /// Cached, refcount 0: findable by `match_prefix`, evictable by `allocate`.
    pub cached_idle: usize,
    /// Refcount > 0.
    pub used: usize,
}

#[derive(Clone, Debug)]
struct Slot {
    refcount: u32,
    hash: Option<BlockHash>,
    /// The hash of the block before this one in its sequence (cached blocks).
    parent: Option<BlockHash>,
    /// LRU neighbours (towards the least / most recently released end); `NIL` when not idle.
    prev: u32,
    next: u32,
}

/// Block ids with reference counts, a prefix cache and its event log. See the module docs.
#[derive(Debug)]
pub struct BlockPool {
    slots: Vec<Slot>,
    /// Free blocks; `allocate` pops from the end.
    free: Vec<u32>,
    /// Least recently released idle cached block.
    lru_head: u32,
    /// Most recently released idle cached block.
    lru_tail: u32,
    lru_len: usize,
    used: usize,
    cached: HashMap<BlockHash, BlockId>,
    events: EventLog,
    hits: u64,
    queried: u64,
    /// With KV tiers below the pool: the block copies to run before the next forward pass
    /// (evicted blocks are copied out instead of announced as removed), in order.
    moves: Option<Vec<Move>>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, ids `0..num_blocks` (handed out in that order at
    /// first), keeping at most [`DEFAULT_EVENT_CAPACITY`] undrained events.
    ///
    /// # Panics
    /// If `num_blocks >= u32::MAX`.
    pub fn new(num_blocks: usize) -> Self {
        Self::with_event_capacity(num_blocks, DEFAULT_EVENT_CAPACITY)
    }

    /// Like [`BlockPool::new`], keeping at most `event_capacity` (at least 1) undrained events;
    /// older ones are dropped and counted by [`BlockPool::dropped_events`].
    pub fn with_event_capacity(num_blocks: usize, event_capacity: usize) -> Self {
        assert!(
            num_blocks < NIL as usize,
            "BlockPool: {num_blocks} blocks do not fit in a u32 block id"
        );
        let slot = Slot {
            refcount: 0,
            hash: None,
            parent: None,
            prev: NIL,
            next: NIL,
        };
        Self {
            slots: vec![slot; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            used: 0,
            cached: HashMap::new(),
            events: EventLog::new(event_capacity),
            hits: 0,
            queried: 0,
            moves: None,
        }
    }

    /// Keeps evicted blocks for the KV tiers below the pool: from now on an eviction records a
    /// [`Move::Out`] (drained by [`BlockPool::drain_moves`]) instead of a [`KvEvent::Removed`];
    /// the tiers announce the hashes they drop ([`BlockPool::forget`]).
    pub fn keep_evicted(&mut self) {
        self.moves.get_or_insert_with(Vec::new);
    }

    /// The block copies recorded since the last drain, in the order they must run.
    pub fn drain_moves(&mut self) -> Vec<Move> {
        self.moves.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Records that `block` (held by the caller) must receive a tier's copy of `hash` before
    /// the next forward pass, and caches it under `hash` without an event: the hash never left
    /// this worker, so the router still knows it.
    pub fn restore(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        data: std::sync::Arc<[u8]>,
    ) -> bool {
        let fresh = self
            .slots
            .get(block.0 as usize)
            .is_some_and(|s| s.refcount > 0 && s.hash.is_none());
        let Some(moves) = self.moves.as_mut().filter(|_| fresh) else {
            debug_assert!(
                false,
                "BlockPool::restore: no tiers, or {block:?} is not fresh"
            );
            return false;
        };
        if self.cached.contains_key(&hash) {
            return false;
        }
        moves.push(Move::In { block, data });
        let slot = &mut self.slots[block.0 as usize];
        slot.hash = Some(hash);
        slot.parent = parent;
        self.cached.insert(hash, block);
        true
    }

    /// Whether `hash` is cached in the pool (used or idle).
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// The tiers dropped these hashes: each one the pool does not hold either is announced as
    /// removed.
    pub fn forget(&mut self, hashes: Vec<BlockHash>) {
        let gone: Vec<BlockHash> = hashes
            .into_iter()
            .filter(|h| !self.cached.contains_key(h))
            .collect();
        if !gone.is_empty() {
            self.events.push(KvEvent::Removed { hashes: gone });
        }
    }

    /// Announces a hash a tier holds (a disk tier found again at start).
    pub fn announce(&mut self, hash: BlockHash, parent: Option<BlockHash>) {
        self.events.push(KvEvent::Stored {
            parent,
            blocks: vec![hash],
        });
    }

    /// Number of blocks in the pool.
    pub fn total(&self) -> usize {
        self.slots.len()
    }

    /// Free plus idle cached blocks: how many `allocate` calls can succeed now.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.slots.len(),
            free: self.free.len(),
            cached_idle: self.lru_len,
            used: self.used,
        }
    }

    /// A block with refcount 1 and no hash: a free one if any, else the least recently released
    /// idle cached block, whose hash is evicted (emits [`KvEvent::Removed`]). `None` when every
    /// block is used.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = self.lru_head;
                if i == NIL {
                    return None;
                }
                self.lru_unlink(i);
                let slot = &mut self.slots[i as usize];
                let hash = slot
                    .hash
                    .take()
                    .expect("BlockPool: idle block in the LRU list without a hash");
                let parent = slot.parent.take();
                self.cached.remove(&hash);
                match self.moves.as_mut() {
                    Some(moves) => moves.push(Move::Out {
                        block: BlockId(i),
                        hash,
                        parent,
                    }),
                    None => self.events.push(KvEvent::Removed { hashes: vec![hash] }),
                }
                i
            }
        };
        self.slots[i as usize].refcount = 1;
        self.used += 1;
        Some(BlockId(i))
    }

    /// Adds a reference to `id`, which must be used or cached idle (an idle block becomes used
    /// and leaves the LRU list).
    pub fn retain(&mut self, id: BlockId) {
        let i = id.0;
        let Some(slot) = self.slots.get(i as usize) else {
            debug_assert!(false, "BlockPool::retain: block {i} out of range");
            return;
        };
        if slot.refcount == 0 {
            if slot.hash.is_none() {
                debug_assert!(false, "BlockPool::retain: block {i} is free");
                return;
            }
            self.lru_unlink(i);
            self.used += 1;
        }
        let slot = &mut self.slots[i as usize];
        slot.refcount = slot
            .refcount
            .checked_add(1)
            .expect("BlockPool::retain: refcount overflow");
    }

    /// Drops a reference to `id`. At refcount 0 a cached block becomes idle (most recently
    /// released end of the LRU list) and an uncached one goes to the free list. Releasing a
    /// block whose refcount is already 0 is a caller bug: `debug_assert!`, otherwise ignored.
    pub fn release(&mut self, id: BlockId) {
        let i = id.0;
        let Some(slot) = self.slots.get_mut(i as usize) else {
            debug_assert!(false, "BlockPool::release: block {i} out of range");
            return;
        };
        if slot.refcount == 0 {
            debug_assert!(false, "BlockPool::release: block {i} has refcount 0");
            return;
        }
        slot.refcount -= 1;
        if slot.refcount == 0 {
            self.used -= 1;
            if slot.hash.is_some() {
                self.lru_push_back(i);
            } else {
                self.free.push(i);
            }
        }
    }

    /// Reference count of `id` (0 for free, idle or out-of-range ids).
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.slots.get(id.0 as usize).map_or(0, |s| s.refcount)
    }

    /// Hash `id` is cached under, if any.
    pub fn hash_of(&self, id: BlockId) -> Option<BlockHash> {
        self.slots.get(id.0 as usize).and_then(|s| s.hash)
    }

    /// Longest run of leading `hashes` that are cached; retains each matched block (refcount
    /// += 1) and returns them in order. Counts towards [`hits`](Self::hits) /
    /// [`queried`](Self::queried).
    pub fn match_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&id) = self.cached.get(h) else { break };
            self.retain(id);
            out.push(id);
        }
        self.queried += hashes.len() as u64;
        self.hits += out.len() as u64;
        out
    }

    /// Number of leading `hashes` that are cached, changing nothing (for admission checks).
    pub fn count_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Registers `id` (held by the caller, refcount > 0) as holding the KV of the block with
    /// `hash`, whose parent block has hash `parent`: `match_prefix` finds it from now on and
    /// [`KvEvent::Stored`]`{parent, blocks: [hash]}` is emitted. Returns true when registered.
    ///
    /// - If `hash` is already cached in another block, nothing happens and it returns false:
    ///   the caller keeps its uncached copy, which goes to the free list on release.
    /// - If `id` is already cached under `hash`, nothing happens (no event) and it returns true.
    /// - Committing a block the caller does not hold, or one already cached under a different
    ///   hash, is a caller bug: `debug_assert!`, otherwise returns false.
    pub fn commit(&mut self, id: BlockId, hash: BlockHash, parent: Option<BlockHash>) -> bool {
        let i = id.0;
        let Some(slot) = self.slots.get(i as usize) else {
            debug_assert!(false, "BlockPool::commit: block {i} out of range");
            return false;
        };
        if slot.refcount == 0 {
            debug_assert!(
                false,
                "BlockPool::commit: block {i} is not held (refcount 0)"
            );
            return false;
        }
        match slot.hash {
            Some(h) if h == hash => return true,
            Some(h) => {
                debug_assert!(
                    false,
                    "BlockPool::commit: block {i} is already cached under {h:?}, not {hash:?}"
                );
                return false;
            }
            None => {}
        }
        if self.cached.contains_key(&hash) {
            return false;
        }
        self.slots[i as usize].hash = Some(hash);
        self.slots[i as usize].parent = parent;
        self.cached.insert(hash, id);
        self.events.push(KvEvent::Stored {
            parent,
            blocks: vec![hash],
        });
        true
    }

    /// Empties the prefix cache and always emits one [`KvEvent::Cleared`].
    ///
    /// Every cached block loses its hash: idle ones go to the free list; used ones keep their
    /// references and go to the free list when released. (Used blocks are uncached too so that
    /// `Cleared` tells the router exactly the truth: nothing of this pool is findable any more.)
    pub fn clear_cache(&mut self) {
        let mut i = self.lru_head;
        while i != NIL {
            let slot = &mut self.slots[i as usize];
            let next = slot.next;
            slot.prev = NIL;
            slot.next = NIL;
            slot.hash = None;
            slot.parent = None;
            self.free.push(i);
            i = next;
        }
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.lru_len = 0;
        for (_, id) in self.cached.drain() {
            self.slots[id.0 as usize].hash = None;
            self.slots[id.0 as usize].parent = None;
        }
        self.events.push(KvEvent::Cleared);
    }

    /// Events since the last drain, oldest first. If more than the event capacity were pending,
    /// the oldest were dropped (their ids are skipped; see [`dropped_events`](Self::dropped_events)).
    pub fn drain_events(&mut self) -> Vec<KvEventRecord> {
        self.events.drain()
    }

    /// Events dropped because nobody drained them in time, since creation.
    pub fn dropped_events(&self) -> u64 {
        self.events.dropped()
    }

    /// Blocks found by `match_prefix`, in total.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Blocks asked for by `match_prefix`, in total.
    pub fn queried(&self) -> u64 {
        self.queried
    }

    /// Panics with a precise message if the internal accounting is inconsistent.
    pub fn check_invariants(&self) {
        let total = self.slots.len();
        let s = self.stats();
        assert_eq!(
            s.free + s.cached_idle + s.used,
            total,
            "free + cached_idle + used != total: {s:?}"
        );
        // 0 = not seen, 1 = free list, 2 = LRU list.
        let mut place = vec![0u8; total];
        for &i in &self.free {
            let slot = self
                .slots
                .get(i as usize)
                .unwrap_or_else(|| panic!("free list holds out-of-range block {i}"));
            assert_eq!(place[i as usize], 0, "block {i} is twice in the free list");
            place[i as usize] = 1;
            assert_eq!(
                slot.refcount, 0,
                "free block {i} has refcount {}",
                slot.refcount
            );
            assert_eq!(slot.hash, None, "free block {i} has a hash");
            assert!(
                slot.prev == NIL && slot.next == NIL,
                "free block {i} has LRU links"
            );
        }
        let mut prev = NIL;
        let mut i = self.lru_head;
        let mut n = 0usize;
        while i != NIL {
            let slot = self
                .slots
                .get(i as usize)
                .unwrap_or_else(|| panic!("LRU list holds out-of-range block {i}"));
            match place[i as usize] {
                0 => place[i as usize] = 2,
                1 => panic!("block {i} is both free and in the LRU list"),
                _ => panic!("LRU list has a cycle through block {i}"),
            }
            assert_eq!(
                slot.refcount, 0,
                "idle block {i} has refcount {}",
                slot.refcount
            );
            assert!(slot.hash.is_some(), "idle block {i} has no hash");
            assert_eq!(slot.prev, prev, "idle block {i}: wrong prev link");
            n += 1;
            prev = i;
            i = slot.next;
        }
        assert_eq!(
            self.lru_tail, prev,
            "LRU tail is not the last block of the list"
        );
        assert_eq!(
            n, self.lru_len,
            "LRU list length {n} != counter {}",
            self.lru_len
        );
        let mut used = 0;
        let mut hashed = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.refcount > 0 {
                used += 1;
                assert_eq!(place[i], 0, "used block {i} is free or idle");
                assert!(
                    slot.prev == NIL && slot.next == NIL,
                    "used block {i} has LRU links"
                );
            } else {
                assert_ne!(
                    place[i], 0,
                    "block {i} has refcount 0 but is neither free nor idle"
                );
            }
            if let Some(h) = slot.hash {
                hashed += 1;
                assert_eq!(
                    self.cached.get(&h),
                    Some(&BlockId(i as u32)),
                    "block {i} has hash {h:?} but the map does not point to it"
                );
            }
        }
        assert_eq!(
            used, self.used,
            "{used} blocks have refcount > 0, counter says {}",
            self.used
        );
        assert_eq!(
            hashed,
            self.cached.len(),
            "{hashed} blocks have a hash, the map has {} entries",
            self.cached.len()
        );
        for (h, id) in &self.cached {
            assert_eq!(
                self.hash_of(*id),
                Some(*h),
                "map sends {h:?} to block {} which does not hold it",
                id.0
            );
        }
        assert!(
            self.hits <= self.queried,
            "more prefix hits than blocks queried"
        );
    }

    /// Removes idle block `i` from the LRU list.
    fn lru_unlink(&mut self, i: u32) {
        let (prev, next) = {
            let s = &self.slots[i as usize];
            (s.prev, s.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        let s = &mut self.slots[i as usize];
        s.prev = NIL;
        s.next = NIL;
        self.lru_len -= 1;
    }

    /// Appends block `i` at the most recently released end of the LRU list.
    fn lru_push_back(&mut self, i: u32) {
        let tail = self.lru_tail;
        {
            let s = &mut self.slots[i as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.lru_head = i;
        } else {
            self.slots[tail as usize].next = i;
        }
        self.lru_tail = i;
        self.lru_len += 1;
    }
}
