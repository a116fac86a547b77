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
