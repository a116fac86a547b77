//! A block's holders — the worker slots that hold it — and the cheap hasher the index keys block
//! hashes with.
//!
//! Most blocks are held by one or a few workers, so [`Holders`] keeps up to [`INLINE`] slots in
//! place (16 bytes, stored in the hash map's bucket next to the key: a lookup reads one bucket
//! per block). A block held by more workers spills to a bitset over all slots in a shared
//! [`SetArena`] (512 workers = 8 words, one cache line), and shrinks back when few holders remain.

use std::hash::{BuildHasherDefault, Hasher};

/// Slots a block holds in place before spilling to a bitset.
pub(crate) const INLINE: usize = 6;

/// Slots at or above this never go in the inline list (they do not fit a `u16`).
const INLINE_LIMIT: usize = u16::MAX as usize;

/// Spilled sets shrink back to the inline list at this many holders (below [`INLINE`], so a set
/// hovering at the boundary does not spill and shrink on every event).
const SHRINK_AT: usize = INLINE / 2;

/// The worker slots holding one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holders {
    /// `slots[..n]`, unordered, each below [`INLINE_LIMIT`].
    Few { n: u8, slots: [u16; INLINE] },
    /// Bitset `set` of the arena, holding `n` slots.
    Many { set: u32, n: u32 },
}

impl Holders {
    /// The holders `{slot}`.
    pub(crate) fn one(arena: &mut SetArena, slot: usize) -> Self {
        let mut h = Holders::Few {
            n: 0,
            slots: [0; INLINE],
        };
        h.insert(arena, slot);
        h
    }

    /// Number of holders.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match *self {
            Holders::Few { n, .. } => n as usize,
            Holders::Many { n, .. } => n as usize,
        }
    }

    /// Whether `slot` holds the block.
    #[inline]
    pub(crate) fn contains(&self, arena: &SetArena, slot: usize) -> bool {
        match self {
            Holders::Few { n, slots } => slots[..*n as usize].iter().any(|&s| s as usize == slot),
            Holders::Many { set, .. } => arena.contains(*set, slot),
        }
    }

    /// Adds `slot`; returns whether it was new.
    pub(crate) fn insert(&mut self, arena: &mut SetArena, slot: usize) -> bool {
        if self.contains(arena, slot) {
            return false;
        }
        match self {
            Holders::Few { n, slots } if (*n as usize) < INLINE && slot < INLINE_LIMIT => {
                slots[*n as usize] = slot as u16;
                *n += 1;
            }
            Holders::Few { n, slots } => {
                let set = arena.alloc();
                for &s in &slots[..*n as usize] {
                    arena.insert(set, s as usize);
                }
                arena.insert(set, slot);
                *self = Holders::Many {
                    set,
                    n: u32::from(*n) + 1,
                };
            }
            Holders::Many { set, n } => {
                arena.insert(*set, slot);
                *n += 1;
            }
        }
        true
    }

    /// Removes `slot`; returns whether it was there. Shrinks a spilled set back in place when
    /// [`SHRINK_AT`] or fewer holders remain (and all fit), releasing its bitset.
    pub(crate) fn remove(&mut self, arena: &mut SetArena, slot: usize) -> bool {
        match self {
            Holders::Few { n, slots } => {
                let len = *n as usize;
                let Some(i) = slots[..len].iter().position(|&s| s as usize == slot) else {
                    return false;
                };
                slots[i] = slots[len - 1];
                *n -= 1;
                true
            }
            Holders::Many { set, n } => {
                if !arena.remove(*set, slot) {
                    return false;
                }
                *n -= 1;
                if *n as usize <= SHRINK_AT {
                    let mut slots = [0u16; INLINE];
                    let mut k = 0;
                    let mut fits = true;
                    arena.for_each(*set, |s| {
                        if s < INLINE_LIMIT {
                            slots[k] = s as u16;
                            k += 1;
                        } else {
                            fits = false;
                        }
                    });
                    if fits {
                        arena.clear(*set);
                        arena.release(*set);
                        *self = Holders::Few { n: k as u8, slots };
                    }
                }
                true
            }
        }
    }

    /// Whether the holders live in an arena bitset.
    #[cfg(test)]
    pub(crate) fn spilled(&self) -> bool {
        matches!(self, Holders::Many { .. })
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

/// The spilled holder sets, `words` u64 each, side by side in one vector: a set is one contiguous
/// run (one cache line up to 512 slots) and a block refers to it by a 4-byte handle.
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
    #[cfg(test)]
    pub(crate) fn words(&self) -> usize {
        self.words
    }

    /// Makes every set at least wide enough for `slots` slots.
    pub(crate) fn fit(&mut self, slots: usize) {
        let words = slots.div_ceil(64).max(1);
        if words > self.words {
            self.widen(words);
        }
    }

    /// A new empty set.
    pub(crate) fn alloc(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            return i;
        }
        let i = self.data.len() / self.words;
        self.data.resize(self.data.len() + self.words, 0);
        u32::try_from(i).expect("fewer than 2^32 spilled blocks")
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

    /// Removes `slot` from set `i`; returns whether it was there.
    pub(crate) fn remove(&mut self, i: u32, slot: usize) -> bool {
        if slot / 64 >= self.words {
            return false;
        }
        let word = &mut self.data[i as usize * self.words + slot / 64];
        let bit = 1 << (slot % 64);
        let was = *word & bit != 0;
        *word &= !bit;
        was
    }

    /// Whether set `i` holds `slot`.
    #[inline]
    pub(crate) fn contains(&self, i: u32, slot: usize) -> bool {
        slot / 64 < self.words
            && self.data[i as usize * self.words + slot / 64] & (1 << (slot % 64)) != 0
    }

    /// Calls `f` with each slot of set `i`, in increasing order.
    pub(crate) fn for_each(&self, i: u32, mut f: impl FnMut(usize)) {
        for (w, &word) in self.set(i).iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                f(w * 64 + rest.trailing_zeros() as usize);
                rest &= rest - 1;
            }
        }
    }

    /// Empties set `i`.
    pub(crate) fn clear(&mut self, i: u32) {
        let at = i as usize * self.words;
        self.data[at..at + self.words].fill(0);
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
        assert!(a.remove(y, 63));
        assert!(!a.remove(y, 63));
        assert!(a.remove(y, 500));
        a.release(y);
        assert_eq!(a.alloc(), y);
        assert!(a.set(y).iter().all(|&w| w == 0));
        assert!(!a.contains(x, 9999));
    }

    #[test]
    fn holders_spill_past_inline_and_shrink_back() {
        let mut a = SetArena::default();
        let mut h = Holders::one(&mut a, 0);
        for s in 1..INLINE {
            assert!(h.insert(&mut a, s * 100));
        }
        assert!(!h.spilled());
        assert!(!h.insert(&mut a, 100), "already held");
        assert!(h.insert(&mut a, 7));
        assert!(h.spilled());
        assert_eq!(h.len(), INLINE + 1);
        assert!(h.contains(&a, 500) && h.contains(&a, 7) && !h.contains(&a, 8));
        for s in [0, 100, 200, 300] {
            assert!(h.remove(&mut a, s));
        }
        assert!(!h.remove(&mut a, 0));
        assert!(!h.spilled(), "shrinks at {SHRINK_AT} holders");
        assert_eq!(h.len(), 3);
        assert!(h.contains(&a, 400) && h.contains(&a, 500) && h.contains(&a, 7));
        // The released bitset is reused, empty.
        let s = a.alloc();
        assert!(a.set(s).iter().all(|&w| w == 0));
    }

    #[test]
    fn slots_beyond_u16_always_spill() {
        let mut a = SetArena::default();
        let big = INLINE_LIMIT + 5;
        let mut h = Holders::one(&mut a, big);
        assert!(h.spilled());
        assert!(h.contains(&a, big) && !h.contains(&a, 5));
        assert!(h.insert(&mut a, 1));
        assert!(h.remove(&mut a, 1));
        assert!(h.spilled(), "cannot shrink while a wide slot holds it");
        assert!(h.remove(&mut a, big));
        assert!(!h.spilled());
        assert_eq!(h.len(), 0);
    }
}
