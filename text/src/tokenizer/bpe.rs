//! Byte-level BPE: GPT-2's byte-to-character mapping and the merge loop.
//!
//! GPT-2 vocabularies spell every byte as one printable character (printable Latin-1 bytes as
//! themselves, the rest as U+0100 onwards), so a piece of text becomes one initial symbol per
//! byte. Merges are then applied lowest rank first, leftmost first among equal ranks, exactly as
//! llama.cpp does.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Whether GPT-2 spells byte `b` as the character with the same code point.
fn is_direct(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Table from bytes to their byte-level characters.
pub(crate) fn byte_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        table[usize::from(b)] = if is_direct(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
    }
    table
}

/// Decodes a byte-level token spelling into the bytes it stands for. Characters outside the
/// mapping (which byte-level vocabularies do not contain) are kept as their UTF-8 bytes.
pub(super) fn decode_spelling(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        let cp = u32::from(c);
        let byte = match cp {
            0..=0xFF if is_direct(cp as u8) => Some(cp as u8),
            0x100..=0x143 => {
                let rank = (cp - 0x100) as usize;
                (0..=255u8).filter(|&x| !is_direct(x)).nth(rank)
            }
            _ => None,
        };
        match byte {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

/// The merge table: for each mergeable pair of token ids, its rank and the merged token id.
#[derive(Clone, Debug, Default)]
pub(super) struct Merges {
    pairs: HashMap<(u32, u32), (u32, u32)>,
}

impl Merges {
    /// Adds the merge of `left` and `right` into `merged` with `rank`, keeping the first rank if
    /// the pair is listed twice.
    pub fn insert(&mut self, left: u32, right: u32, rank: u32, merged: u32) {
        self.pairs.entry((left, right)).or_insert((rank, merged));
    }

    fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.pairs.get(&(left, right)).copied()
    }

    /// Number of merges.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }
}

/// A symbol of the word being merged; a doubly linked list over indices.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

/// Applies `merges` to the symbols `ids` (token ids of single characters) and appends the
/// resulting token ids to `out`.
pub(super) fn merge(ids: &[u32], merges: &Merges, out: &mut Vec<u32>) {
    if ids.len() < 2 {
        out.extend_from_slice(ids);
        return;
    }
    let n = ids.len();
    let mut syms: Vec<Symbol> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| Symbol {
            id,
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            alive: true,
        })
        .collect();
    // Min-heap on (rank, left position); entries record the ids they were made for so stale
    // ones can be recognised and skipped.
    let mut heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, syms: &[Symbol], left: usize| {
        let right = syms[left].next;
        if right == NONE {
            return;
        }
        let (l, r) = (syms[left].id, syms[right].id);
        if let Some((rank, _)) = merges.get(l, r) {
            heap.push(Reverse((rank, left, l, r)));
        }
    };
    for i in 0..n - 1 {
        push(&mut heap, &syms, i);
    }
    while let Some(Reverse((_, left, l, r))) = heap.pop() {
        let right = syms[left].next;
        if !syms[left].alive || right == NONE || syms[left].id != l || syms[right].id != r {
            continue;
        }
        let Some((_, merged)) = merges.get(l, r) else {
            continue;
        };
        syms[left].id = merged;
        syms[right].alive = false;
        let after = syms[right].next;
        syms[left].next = after;
        if after != NONE {
            syms[after].prev = left;
        }
        let before = syms[left].prev;
        if before != NONE {
            push(&mut heap, &syms, before);
        }
        push(&mut heap, &syms, left);
    }
    let mut i = 0;
    while i != NONE {
        out.push(syms[i].id);
        i = syms[i].next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_table();
        assert_eq!(t[usize::from(b' ')], 'Ġ');
        assert_eq!(t[usize::from(b'\n')], 'Ċ');
        assert_eq!(t[usize::from(b'a')], 'a');
        assert_eq!(t[0], '\u{100}');
        assert_eq!(t[0xAD], '\u{143}');
        // Bytes spelled as themselves, then the rest from U+0100 in byte order.
        let mut next = 0x100;
        for b in 0..=255u8 {
            let c = t[usize::from(b)];
            if is_direct(b) {
                assert_eq!(u32::from(c), u32::from(b));
            } else {
                assert_eq!(u32::from(c), next);
                next += 1;
            }
            let mut out = Vec::new();
            decode_spelling(&t[usize::from(b)].to_string(), &mut out);
            assert_eq!(out, vec![b]);
        }
    }

    #[test]
    fn merges_lowest_rank_then_leftmost() {
        // ids: a=0 b=1 ab=2 aa=3 aaa=4
        let mut m = Merges::default();
        m.insert(0, 0, 0, 3);
        m.insert(3, 0, 1, 4);
        m.insert(0, 1, 2, 2);
        let mut out = Vec::new();
        merge(&[0, 0, 0, 1], &m, &mut out);
        // The leftmost "a a" merges first; then (aa, a) at rank 1 beats (a, b) at rank 2.
        assert_eq!(out, vec![4, 1]);
        out.clear();
        merge(&[0, 1, 0, 1], &m, &mut out);
        assert_eq!(out, vec![2, 2]);
        out.clear();
        merge(&[1], &m, &mut out);
        assert_eq!(out, vec![1]);
    }
}
