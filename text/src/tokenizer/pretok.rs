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

/// DeepSeek LLM: Latin, Greek, Cyrillic and other cased letters (as llama.cpp lists them).
const DEEPSEEK_LETTERS: &str = r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+";
/// DeepSeek LLM: ASCII and full-width punctuation.
const DEEPSEEK_PUNCT: &str = r"\s?[!-/:-~！-／：-～‘-‟　-。]+";
/// DeepSeek: CJK ideographs and Hangul.
const DEEPSEEK_CJK: &str = r"[一-龥ࠀ-一가-퟿]+";
/// Qwen 3.5: Qwen 2's pattern with combining marks kept with letters.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Falcon: punctuation runs.
const FALCON_PUNCT: &str = r"[\p{P}\$\+<=>\^~\|`]+";

/// The pre-tokenizer names llama.cpp gives Llama 3's split rules (these also add BOS by
/// default).
const LLAMA3_NAMES: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
];

/// Whether llama.cpp adds BOS by default for BPE pre-tokenizer `name` (when the GGUF file has
/// no `tokenizer.ggml.add_bos_token`).
pub(super) fn adds_bos(name: &str) -> bool {
    LLAMA3_NAMES.contains(&name)
}

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
            | "minerva-7b" | "mellum2" => (&[r"\p{N}", GPT2], false),
            "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "exaone4"
            | "granite-docling" | "gigachat" | "mellum" | "a.x-4.0" | "jina-es" | "jina-de"
            | "jina-v2-es" | "jina-v2-de" | "modern-bert" => (&[GPT2], false),
            _ if LLAMA3_NAMES.contains(&name) => (&[LLAMA3], true),
            "dbrx" | "smaug-bpe" => (&[LLAMA3], false),
            "qwen2" | "stablelm2" | "deepseek-r1-qwen" | "megrez" | "kormo" | "f2llmv2" => {
                (&[QWEN2], false)
            }
            "qwen35" => (&[QWEN35], false),
            "falcon" => (&[FALCON_PUNCT, GPT2, r"[0-9][0-9][0-9]"], false),
            "deepseek-llm" => (
                &[
                    r"[\r\n]",
                    DEEPSEEK_LETTERS,
                    DEEPSEEK_PUNCT,
                    r"\s+$",
                    DEEPSEEK_CJK,
                    r"\p{N}+",
                ],
                false,
            ),
            "deepseek-coder" => (
                &[
                    r"[\r\n]",
                    r"\s?\p{L}+",
                    r"\s?\p{P}+",
                    DEEPSEEK_CJK,
                    r"\p{N}",
                ],
                false,
            ),
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
