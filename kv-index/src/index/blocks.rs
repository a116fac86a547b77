//! The block table: each held block hash and its [`Holders`], laid out in the order blocks were
//! first stored.
//!
//! A `Stored` event brings a chain of blocks, and the blocks no worker held yet are appended to
//! one array in that order, so a chain first stored in one event sits in consecutive entries. A
//! lookup walks the query's chain; at each block it first checks the entry right after the
//! previous block's ([`BlockTable::next_is`]): along a chain stored together that is the next
//! block, read from the same or the next cache line, with no hash probe. Only where the chain
//! forks (or was stored piecewise) does the walk probe the hash map. A hash has at most one live
//! entry (a new one is appended only while no worker holds it), so a live entry whose hash
//! matches is *the* entry and the shortcut is exact. Entries of blocks no worker holds any more
//! stay in place, dead, until they outnumber the live ones; then the array is compacted in order
//! (amortised O(1) per removal, never during a lookup).

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;

use super::worker_set::{Holders, MixBuild, SetArena};
use crate::BlockHash;

/// Dead entries tolerated before a compaction (also at least as many as live ones); small under
/// test so the property tests compact often.
const COMPACT_AT: usize = if cfg!(test) { 8 } else { 1024 };

#[derive(Clone, Copy, Debug)]
struct Entry {
    hash: BlockHash,
    /// Empty: dead (no worker holds the hash through this entry).
    holders: Holders,
}

/// Hash → holders, with the holders in first-store order. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    /// Hash → its live entry's index.
    at: HashMap<BlockHash, u32, MixBuild>,
    entries: Vec<Entry>,
    dead: usize,
}

impl BlockTable {
    /// Distinct hashes held by at least one worker.
    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    /// The entry of `h`, if any worker holds it.
    #[inline]
    pub(crate) fn find(&self, h: BlockHash) -> Option<u32> {
        self.at.get(&h).copied()
    }

    /// The entry of `h` when `h` is the block stored right after entry `prev` (the next block of
    /// a chain stored together), without probing the map; `None` if it is not there.
    #[inline]
    pub(crate) fn next_is(&self, prev: u32, h: BlockHash) -> Option<u32> {
        let next = prev as usize + 1;
        match self.entries.get(next) {
            Some(e) if e.hash == h && e.holders.len() > 0 => Some(next as u32),
            _ => None,
        }
    }

    /// The holders of entry `at` (an index [`Self::find`] or [`Self::next_is`] returned since the
    /// last change).
    #[inline]
    pub(crate) fn holders(&self, at: u32) -> &Holders {
        &self.entries[at as usize].holders
    }

    /// The holders of `h`, if any worker holds it.
    pub(crate) fn get(&self, h: BlockHash) -> Option<&Holders> {
        self.find(h).map(|at| self.holders(at))
    }

    /// Adds `slot` to the holders of `h`, appending an entry if no worker held it.
    pub(crate) fn insert(&mut self, sets: &mut SetArena, h: BlockHash, slot: usize) {
        match self.at.entry(h) {
            MapEntry::Occupied(e) => {
                self.entries[*e.get() as usize].holders.insert(sets, slot);
            }
            MapEntry::Vacant(e) => {
                let at = u32::try_from(self.entries.len()).expect("fewer than 2^32 block entries");
                e.insert(at);
                self.entries.push(Entry {
                    hash: h,
                    holders: Holders::one(sets, slot),
                });
            }
        }
    }

    /// Removes `slot` from the holders of `h` (the entry dies when none is left).
    pub(crate) fn remove(&mut self, sets: &mut SetArena, h: BlockHash, slot: usize) {
        let Some(&at) = self.at.get(&h) else {
            return;
        };
        let holders = &mut self.entries[at as usize].holders;
        holders.remove(sets, slot);
        if holders.len() == 0 {
            self.at.remove(&h);
            self.dead += 1;
            if self.dead >= COMPACT_AT && self.dead >= self.at.len() {
                self.compact();
            }
        }
    }

    /// Drops the dead entries, keeping the live ones in order.
    fn compact(&mut self) {
        self.entries.retain(|e| e.holders.len() > 0);
        for (i, e) in self.entries.iter().enumerate() {
            *self
                .at
                .get_mut(&e.hash)
                .expect("a live entry is in the map") = i as u32;
        }
        self.dead = 0;
        if self.entries.capacity() > 2 * self.entries.len() + COMPACT_AT {
            self.entries.shrink_to(self.entries.len() * 5 / 4);
        }
    }

    /// Heap bytes, from capacities (one control byte per map bucket, as hashbrown keeps).
    pub(crate) fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.at.capacity() * (size_of::<(BlockHash, u32)>() + 1)
            + self.entries.capacity() * size_of::<Entry>()
    }

    /// Live entries, dead entries (for tests).
    #[cfg(test)]
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.at.len(), self.dead)
    }
}
