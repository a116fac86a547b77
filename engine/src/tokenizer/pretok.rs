//! Pre-tokenization: splitting text into the pieces that BPE merges never cross.
//!
//! As in llama.cpp, a pre-tokenizer is a list of regexes applied in sequence. Each regex splits
//! every piece produced so far: its matches become pieces, and so do the stretches of text
//! between matches. A later regex sees each earlier piece on its own, so lookaheads stop at the
//! piece's end.

use std::ops::Range;

use fancy_regex::Regex;

use super::TokenizerError;

/// GPT-2's split pattern (English contractions, letters, numbers, other symbols, whitespace).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's pattern (case-insensitive contractions, numbers in groups of up to three).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's pattern: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A compiled pre-tokenizer.
#[derive(Clone, Debug)]
pub(super) struct PreTokenizer {
    regexes: Vec<Regex>,
    /// Whether a piece that is itself a token skips BPE (llama.cpp's `ignore_merges`).
    pub ignore_merges: bool,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` = `name`.
    pub fn new(name: &str) -> Result<Self, TokenizerError> {
        let (patterns, ignore_merges): (&[&str], bool) = match name {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => (&[r"\p{N}", GPT2], false),
            "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => (&[GPT2], false),
            "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" => (&[LLAMA3], true),
            "dbrx" | "smaug-bpe" => (&[LLAMA3], false),
            "qwen2" | "stablelm2" | "deepseek-r1-qwen" | "megrez" => (&[QWEN2], false),
            "default" => (
                &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
                false,
            ),
            other => return Err(TokenizerError::UnknownPreTokenizer(other.to_string())),
        };
        let regexes = patterns
            .iter()
            .map(|p| {
                Regex::new(p).map_err(|e| TokenizerError::Regex {
                    pattern: (*p).to_string(),
                    message: e.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(PreTokenizer {
            regexes,
            ignore_merges,
        })
    }

    /// Splits `text` into pieces, returned as byte ranges that tile `text` in order.
    pub fn split(&self, text: &str) -> Vec<Range<usize>> {
        let mut pieces = Vec::with_capacity(text.len() / 4 + 1);
        pieces.push(0..text.len());
        let mut next = Vec::new();
        for re in &self.regexes {
            next.clear();
            for piece in &pieces {
                split_one(re, text, piece.clone(), &mut next);
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        pieces.retain(|r| !r.is_empty());
        pieces
    }
}

/// Splits `text[range]` by the matches of `re` into `out`: matches and the gaps between them.
fn split_one(re: &Regex, text: &str, range: Range<usize>, out: &mut Vec<Range<usize>>) {
    let base = range.start;
    let hay = &text[range.clone()];
    let mut last = 0;
    for m in re.find_iter(hay) {
        // A backtracking-limit error leaves the rest of the piece unsplit.
        let Ok(m) = m else { break };
        if m.start() == m.end() {
            continue;
        }
        if m.start() > last {
            out.push(base + last..base + m.start());
        }
        out.push(base + m.start()..base + m.end());
        last = m.end();
    }
    if last < hay.len() {
        out.push(base + last..range.end);
    }
}
