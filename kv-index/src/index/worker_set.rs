//! A small bitset of worker slots, and the cheap hasher the index keys block hashes with.

use std::hash::{BuildHasherDefault, Hasher};

use smallvec::SmallVec;

/// Bitset over worker slots; inline up to 128 slots, heap beyond. Words past the end are zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct WorkerSet {
    words: SmallVec<[u64; 2]>,
}

impl WorkerSet {
    pub(crate) fn insert(&mut self, slot: usize) {
        let (w, b) = (slot / 64, slot % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << b;
    }

    pub(crate) fn remove(&mut self, slot: usize) {
        let (w, b) = (slot / 64, slot % 64);
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1 << b);
        }
    }

    pub(crate) fn contains(&self, slot: usize) -> bool {
        self.word(slot / 64) & (1 << (slot % 64)) != 0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Word `i` (zero past the end).
    #[inline]
    pub(crate) fn word(&self, i: usize) -> u64 {
        self.words.get(i).copied().unwrap_or(0)
    }

    pub(crate) fn num_words(&self) -> usize {
        self.words.len()
    }

    /// Bytes on the heap (0 while inline).
    pub(crate) fn heap_bytes(&self) -> usize {
        if self.words.spilled() {
            self.words.capacity() * std::mem::size_of::<u64>()
        } else {
            0
        }
    }
}

/// Hasher for keys that are already hashes (`BlockHash`, `WorkerId`): one multiply and a fold,
/// which spreads both random 64-bit hashes and small sequential ids (trace hash ids) well.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let y = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        y ^ (y >> 29)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 ^= x;
    }
}

pub(crate) type MixBuild = BuildHasherDefault<MixHasher>;

/// The worker sets of all indexed blocks, `words` u64 each, side by side in one vector: a block's
/// set is one contiguous run (one cache line up to 512 slots) instead of a heap allocation per
/// block, and the map from hash to set holds a 4-byte handle.
#[derive(Clone, Debug)]
pub(crate) struct SetArena {
    words: usize,
    data: Vec<u64>,
    free: Vec<u32>,
}

impl Default for SetArena {
    fn default() -> Self {
        Self {
            words: 1,
            data: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl SetArena {
    /// Words per set.
    #[inline]
    pub(crate) fn words(&self) -> usize {
        self.words
    }

    /// A new empty set.
    pub(crate) fn alloc(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            return i;
        }
        let i = self.data.len() / self.words;
        self.data.resize(self.data.len() + self.words, 0);
        u32::try_from(i).expect("fewer than 2^32 distinct blocks")
    }

    /// Returns the (empty) set `i` for reuse.
    pub(crate) fn release(&mut self, i: u32) {
        debug_assert!(self.set(i).iter().all(|&w| w == 0));
        self.free.push(i);
    }

    /// The words of set `i`.
    #[inline]
    pub(crate) fn set(&self, i: u32) -> &[u64] {
        let at = i as usize * self.words;
        &self.data[at..at + self.words]
    }

    /// Adds `slot` to set `i`, widening every set first if `slot` does not fit.
    pub(crate) fn insert(&mut self, i: u32, slot: usize) {
        if slot / 64 >= self.words {
            self.widen(slot / 64 + 1);
        }
        self.data[i as usize * self.words + slot / 64] |= 1 << (slot % 64);
    }

    /// Removes `slot` from set `i`; returns whether the set is now empty.
    pub(crate) fn remove(&mut self, i: u32, slot: usize) -> bool {
        if slot / 64 < self.words {
            self.data[i as usize * self.words + slot / 64] &= !(1 << (slot % 64));
        }
        self.set(i).iter().all(|&w| w == 0)
    }

    /// Whether set `i` holds `slot`.
    pub(crate) fn contains(&self, i: u32, slot: usize) -> bool {
        slot / 64 < self.words && self.set(i)[slot / 64] & (1 << (slot % 64)) != 0
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.data.capacity() * std::mem::size_of::<u64>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }

    fn widen(&mut self, words: usize) {
        let words = words.next_power_of_two().max(self.words);
        let sets = self.data.len() / self.words;
        let mut data = vec![0u64; sets * words];
        for s in 0..sets {
            data[s * words..s * words + self.words]
                .copy_from_slice(&self.data[s * self.words..(s + 1) * self.words]);
        }
        self.data = data;
        self.words = words;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_sets_survive_widening_and_reuse() {
        let mut a = SetArena::default();
        let x = a.alloc();
        let y = a.alloc();
        a.insert(x, 3);
        a.insert(y, 63);
        a.insert(y, 500);
        assert_eq!(a.words(), 8);
        assert!(a.contains(x, 3) && !a.contains(x, 500));
        assert!(a.contains(y, 63) && a.contains(y, 500));
        assert!(!a.remove(y, 63));
        assert!(a.remove(y, 500));
        a.release(y);
        assert_eq!(a.alloc(), y);
        assert!(a.set(y).iter().all(|&w| w == 0));
        assert!(!a.contains(x, 9999));
    }
}
