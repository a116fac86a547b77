//! Deterministic prompt content: every block id maps to a fixed run of token ids (or words), so
//! requests that share block ids share an identical prompt prefix, on any machine, in any run.

use serde::Serialize;

/// How prompts are sent: token ids (exact lengths and block boundaries; the completions
/// endpoint's `prompt: [ids]`) or text (one common English word per token, for endpoints or
/// routes that only take text; the server's tokenizer decides the real length).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PromptFormat {
    /// `prompt: [token ids]`.
    Tokens,
    /// `prompt: "words ..."`.
    Text,
}

/// A prompt ready to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids.
    Tokens(Vec<u32>),
    /// Text.
    Text(String),
}

/// Maps (block id, position) to a token id in `[lo, hi)`; pure, so the same id always gives
/// the same run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TokenMap {
    /// Lowest token id used (skips special tokens at the start of most vocabularies).
    pub lo: u32,
    /// One past the highest token id used (stays inside small vocabularies).
    pub hi: u32,
    /// Mixed into every id, so two seeds give unrelated prompts.
    pub seed: u64,
}

impl Default for TokenMap {
    fn default() -> Self {
        // Inside every common vocabulary (SmolLM2 has 49152, Llama 32000+), past special tokens.
        TokenMap {
            lo: 1000,
            hi: 30000,
            seed: 0,
        }
    }
}

/// SplitMix64's finaliser: a good 64-bit mix of one word.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl TokenMap {
    /// The token at position `pos` of block `block`.
    pub fn token(&self, block: u64, pos: u64) -> u32 {
        let h = mix64(mix64(block ^ self.seed.rotate_left(17)).wrapping_add(pos));
        self.lo + (h % u64::from(self.hi - self.lo)) as u32
    }

    /// The first `len` tokens of block `block`.
    pub fn block(&self, block: u64, len: usize) -> impl Iterator<Item = u32> + '_ {
        (0..len as u64).map(move |p| self.token(block, p))
    }

    /// A prompt made of `blocks` (id, length) in order, as tokens or text.
    pub fn prompt(&self, blocks: &[(u64, usize)], format: PromptFormat) -> Prompt {
        let ids: Vec<u32> = blocks.iter().flat_map(|&(b, n)| self.block(b, n)).collect();
        match format {
            PromptFormat::Tokens => Prompt::Tokens(ids),
            PromptFormat::Text => Prompt::Text(
                ids.iter()
                    .map(|&t| WORDS[t as usize % WORDS.len()])
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
        }
    }
}

/// Common short words: each is one token in most BPE vocabularies (after a space).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "day", "house",
    "water", "light", "river", "stone", "city", "paper", "music", "green", "small", "long", "old",
    "new", "good",
];
