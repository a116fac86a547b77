//! SentencePiece-style (`tokenizer.ggml.model = "llama"`) encoding, as llama.cpp does it.
//!
//! The text (spaces already replaced by `▁`, U+2581) starts as one symbol per character.
//! Repeatedly, of all adjacent symbol pairs whose concatenation is a token, the pair with the
//! highest token score is merged (ties: the leftmost pair). When no pair can merge any more,
//! every symbol that is a token becomes that token; the others are spelled byte by byte with
//! the `<0xNN>` byte-fallback tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece space marker.
pub(super) const SPACE_MARK: &str = "\u{2581}";

/// The tables SPM encoding needs beyond the shared token-to-id map.
#[derive(Debug)]
pub(super) struct Spm {
    scores: Vec<f32>,
    /// Token of each byte: `<0xNN>`, else the one-byte token spelled by that byte.
    byte_ids: [Option<u32>; 256],
    /// Used for a byte that has no token (llama.cpp aborts there).
    unk: Option<u32>,
    /// Whether a space is put in front of the text (and of text after a special token).
    pub add_space_prefix: bool,
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text, to recognise candidates made stale by other merges.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's maximum is the highest score, and among equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// One symbol: a byte range of the text, linked to its neighbours. `len == 0` once merged away.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl Spm {
    /// Builds the byte-fallback table; `scores` is indexed by token id.
    pub fn new(
        to_id: &HashMap<String, u32>,
        scores: Vec<f32>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = to_id.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                // A byte spelled by itself only exists for ASCII (a lone byte >= 0x80 is not
                // a string).
                u8::try_from(b)
                    .ok()
                    .filter(u8::is_ascii)
                    .and_then(|b| to_id.get(&char::from(b).to_string()).copied())
            });
        }
        Spm {
            scores,
            byte_ids,
            unk,
            add_space_prefix,
        }
    }

    /// Encodes `text` (already `▁`-escaped) and appends the ids to `out`.
    pub fn encode(&self, text: &str, to_id: &HashMap<String, u32>, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let i = syms.len();
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        let mut heap = BinaryHeap::with_capacity(syms.len());
        let try_add =
            |heap: &mut BinaryHeap<Bigram>, syms: &[Symbol], left: usize, right: usize| {
                if left == NONE || right == NONE {
                    return;
                }
                let (l, r) = (syms[left], syms[right]);
                let merged = &text[l.start..r.start + r.len];
                if let Some(&id) = to_id.get(merged) {
                    heap.push(Bigram {
                        score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                        left,
                        right,
                        len: merged.len(),
                    });
                }
            };
        for i in 1..syms.len() {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            syms[b.left].len += r.len;
            syms[b.right].len = 0;
            syms[b.left].next = r.next;
            if r.next != NONE {
                syms[r.next].prev = b.left;
            }
            try_add(&mut heap, &syms, syms[b.left].prev, b.left);
            try_add(&mut heap, &syms, b.left, syms[b.left].next);
        }
        let mut i = if syms.is_empty() { NONE } else { 0 };
        while i != NONE {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            match to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.extend(self.byte_ids[usize::from(b)].or(self.unk));
                    }
                }
            }
            i = s.next;
        }
    }
}

/// The bytes an SPM token of type `ty` stands for (llama.cpp's `token_to_piece` with specials
/// shown): normal tokens with `▁` as spaces, byte tokens as their byte, control, unknown and
/// user-defined tokens as their text, anything else as nothing.
pub(super) fn token_bytes(text: &str, ty: i32, out: &mut Vec<u8>) {
    use super::{TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_USER_DEFINED};
    match ty {
        TYPE_NORMAL => out.extend_from_slice(text.replace(SPACE_MARK, " ").as_bytes()),
        TYPE_CONTROL | TYPE_UNKNOWN | TYPE_USER_DEFINED => out.extend_from_slice(text.as_bytes()),
        TYPE_BYTE => match super::parse_byte_token(text) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(text.as_bytes()),
        },
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[(&str, f32)]) -> (HashMap<String, u32>, Vec<f32>) {
        let to_id = tokens
            .iter()
            .enumerate()
            .map(|(i, (t, _))| (t.to_string(), i as u32))
            .collect();
        (to_id, tokens.iter().map(|t| t.1).collect())
    }

    #[test]
    fn best_score_merges_first_and_bytes_fall_back() {
        // "▁ab" can be reached through "▁a"+"b" or "▁"+"ab"; the higher-scoring bigram wins
        // first, and either way the result is one token. "c" has no token: byte fallback.
        let (to_id, scores) = vocab(&[
            ("<unk>", 0.0),
            ("<0x63>", 0.0),
            ("▁", -1.0),
            ("a", -1.0),
            ("b", -1.0),
            ("▁a", -5.0),
            ("ab", -2.0),
            ("▁ab", -3.0),
            ("ba", -0.5),
        ]);
        let spm = Spm::new(&to_id, scores, Some(0), true);
        let mut out = Vec::new();
        spm.encode("▁abc", &to_id, &mut out);
        assert_eq!(out, vec![7, 1]);
        // "bab": "ba" (-0.5) beats "ab" (-2.0), leaving "ba" + "b".
        out.clear();
        spm.encode("bab", &to_id, &mut out);
        assert_eq!(out, vec![8, 4]);
        // A byte with no token at all becomes unk.
        out.clear();
        spm.encode("é", &to_id, &mut out);
        assert_eq!(out, vec![0, 0]);
        out.clear();
        spm.encode("", &to_id, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let (to_id, scores) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("ab", -1.0),
            ("bc", -1.0),
        ]);
        let spm = Spm::new(&to_id, scores, None, false);
        let mut out = Vec::new();
        spm.encode("abc", &to_id, &mut out);
        assert_eq!(out, vec![3, 2]);
    }

    #[test]
    fn pieces() {
        let mut out = Vec::new();
        token_bytes("▁hi▁there", 1, &mut out);
        assert_eq!(out, b" hi there");
        out.clear();
        token_bytes("<0xE2>", 6, &mut out);
        assert_eq!(out, [0xE2]);
        out.clear();
        token_bytes("<s>", 3, &mut out);
        assert_eq!(out, b"<s>");
        out.clear();
        token_bytes("<unused0>", 5, &mut out);
        assert!(out.is_empty());
    }
}
