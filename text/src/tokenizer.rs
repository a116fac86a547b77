//! Tokenizers that reproduce llama.cpp's token ids: byte-level BPE (`tokenizer.ggml.model =
//! "gpt2"`) and SentencePiece-style vocabularies (`"llama"`: scores, `▁` for spaces, `<0xNN>`
//! byte fallback).
//!
//! Encoding follows llama.cpp step by step:
//! 1. special tokens written literally in the text are cut out first, longest first (control
//!    tokens only when `parse_special`; user-defined tokens always, as llama.cpp does);
//! 2. BPE: each remaining stretch of text is pre-tokenized by the model's regex list
//!    (`pretok`, chosen by `tokenizer.ggml.pre`), each piece's bytes become byte-level symbols
//!    and BPE merges apply lowest rank first (`bpe`);
//! 3. SPM: each stretch gets a leading space when it starts the text or follows a special token
//!    (`add_space_prefix`), spaces become `▁`, and the best-scoring adjacent pairs merge (`spm`).
//!
//! Decoding maps each token back to the bytes it spells; [`StreamDecoder`] does so incrementally
//! without ever splitting a UTF-8 character.

mod bpe;
pub(crate) use bpe::byte_table;
mod hf_json;
mod pretok;
mod spm;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::gguf::{GgufError, GgufFile};

/// Errors from building a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer key in the GGUF file is missing or has the wrong type.
    #[error("reading tokenizer metadata")]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer other than byte-level BPE (`gpt2`) or
    /// SentencePiece-style (`llama`).
    #[error(
        "unsupported tokenizer model {0:?} (supported: \"gpt2\" byte-level bpe, \"llama\" sentencepiece)"
    )]
    UnsupportedModel(String),
    /// The score list of a SentencePiece vocabulary is shorter than the token list.
    #[error("{scores} token scores for {tokens} tokens")]
    ScoresMismatch {
        /// Number of tokens.
        tokens: usize,
        /// Number of scores.
        scores: usize,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know.
    #[error("unknown pre-tokenizer {0:?}")]
    UnknownPreTokenizer(String),
    /// A pre-tokenizer regex failed to compile.
    #[error("pre-tokenizer regex {pattern:?} does not compile: {message}")]
    Regex {
        /// The pattern.
        pattern: String,
        /// The regex engine's message.
        message: String,
    },
    /// A Hugging Face `tokenizer.json` / `tokenizer_config.json` is missing or malformed.
    #[error("{path}: {why}")]
    HfJson {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The vocabulary is empty or too large for `u32` ids.
    #[error("vocabulary has {0} tokens")]
    BadVocabSize(usize),
    /// The token type list is not as long as the token list.
    #[error("{types} token types for {tokens} tokens")]
    TokenTypesMismatch {
        /// Number of tokens.
        tokens: usize,
        /// Number of token types.
        types: usize,
    },
    /// A special token id (bos or eos) is outside the vocabulary.
    #[error("{which} token id {id} is outside the vocabulary")]
    BadSpecialId {
        /// Which special token.
        which: &'static str,
        /// The id.
        id: u32,
    },
    /// A merge rule is not two space-separated tokens.
    #[error("merge {index} ({merge:?}) is not of the form \"left right\"")]
    BadMerge {
        /// Position in the merge list.
        index: usize,
        /// The rule.
        merge: String,
    },
}

/// llama.cpp's token types.
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;
const TYPE_UNUSED: i32 = 5;
const TYPE_BYTE: i32 = 6;

/// Token texts llama.cpp treats as end of generation when present.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
    // Fill-in-the-middle pad / repository / file separators also end generation in llama.cpp.
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// The kind of vocabulary (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE with merge ranks (`gpt2`).
    #[default]
    Bpe,
    /// SentencePiece-style: token scores, `▁` for spaces, `<0xNN>` byte fallback (`llama`).
    Spm,
}

/// Everything needed to build a [`Tokenizer`], as stored under `tokenizer.ggml.*`.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// The vocabulary kind.
    pub kind: VocabKind,
    /// Token spellings (byte-level encoded for normal BPE tokens, `▁` for spaces in SPM),
    /// indexed by id.
    pub tokens: Vec<String>,
    /// Token scores (SPM merge priority, higher first); empty means all zero.
    pub scores: Vec<f32>,
    /// llama.cpp token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte);
    /// empty means all normal.
    pub token_types: Vec<i32>,
    /// Merge rules `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// Pre-tokenizer name (`tokenizer.ggml.pre`).
    pub pre: String,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Whether prompts should start with `bos` (callers add it; `encode` never does).
    pub add_bos: bool,
    /// Whether llama.cpp appends `eos` to a prompt (only [`Tokenizer::encode_special`] does).
    pub add_eos: bool,
    /// Unknown-token id (SPM: used for bytes without a byte-fallback token).
    pub unk: Option<u32>,
    /// Padding-token id.
    pub pad: Option<u32>,
    /// SPM: whether a space is put before the text and before text that follows a special
    /// token (and stripped again from the start of decoded text).
    pub add_space_prefix: bool,
    /// Whether whitespace right after a special token is dropped (llama.cpp's `rstrip`
    /// attribute, which it sets for Phi-3 vocabularies).
    pub rstrip_specials: bool,
}

impl TokenizerSpec {
    /// Reads the `tokenizer.ggml.*` keys, with llama.cpp's defaults for keys that are absent;
    /// fails unless `tokenizer.ggml.model` is `gpt2` or `llama`.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let kind = match model {
            "gpt2" => VocabKind::Bpe,
            "llama" => VocabKind::Spm,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let optional_u32 = |key: &str| match g.meta(key) {
            None => Ok(None),
            Some(_) => g.get_u32(key).map(Some),
        };
        let optional_bool = |key: &str| match g.meta(key) {
            None => Ok(None),
            Some(_) => g.get_bool(key).map(Some),
        };
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let pre = match g.meta("tokenizer.ggml.pre") {
            None => "default".to_string(),
            Some(_) => g.get_str("tokenizer.ggml.pre")?.to_string(),
        };
        let n = tokens.len();
        // llama.cpp's defaults: SPM vocabularies have <unk>=0, <s>=1, </s>=2 (when in range) and
        // add BOS; the Llama-3 family of BPE pre-tokenizers adds BOS too.
        let (default_ids, default_add_bos) = match kind {
            VocabKind::Spm => ([Some(1), Some(2), Some(0)], true),
            VocabKind::Bpe => ([None; 3], pretok::adds_bos(&pre)),
        };
        let default_ids = default_ids.map(|id| id.filter(|&id| (id as usize) < n));
        let name = g.get_str("general.name").unwrap_or_default().to_lowercase();
        Ok(TokenizerSpec {
            kind,
            scores: match (kind, g.meta("tokenizer.ggml.scores")) {
                (VocabKind::Spm, Some(v)) => scores(v).ok_or_else(|| GgufError::WrongType {
                    key: "tokenizer.ggml.scores".into(),
                    expected: "an array of numbers",
                })?,
                _ => Vec::new(),
            },
            tokens,
            token_types: match g.meta("tokenizer.ggml.token_type") {
                None => Vec::new(),
                Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?,
            },
            merges: match kind {
                VocabKind::Bpe => g.get_str_array("tokenizer.ggml.merges")?,
                VocabKind::Spm => Vec::new(),
            },
            pre,
            bos: optional_u32("tokenizer.ggml.bos_token_id")?.or(default_ids[0]),
            eos: optional_u32("tokenizer.ggml.eos_token_id")?.or(default_ids[1]),
            unk: optional_u32("tokenizer.ggml.unknown_token_id")?.or(default_ids[2]),
            pad: optional_u32("tokenizer.ggml.padding_token_id")?,
            add_bos: optional_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos),
            add_eos: optional_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            add_space_prefix: kind == VocabKind::Spm
                && optional_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true),
            rstrip_specials: name.contains("phi-3") || name.contains("phi3"),
        })
    }
}

/// A score array of floats or integers.
fn scores(v: &crate::gguf::MetaValue) -> Option<Vec<f32>> {
    v.as_array()?
        .iter()
        .map(|x| {
            x.as_f64()
                .map(|f| f as f32)
                .or_else(|| x.as_i64().map(|i| i as f32))
        })
        .collect()
}

/// A special token that is cut out of the text before pre-tokenization.
#[derive(Debug)]
struct Special {
    text: String,
    id: u32,
    /// Control and unknown tokens are only matched when parsing specials is requested.
    only_when_parsing: bool,
    /// Whitespace right after the token is dropped.
    rstrip: bool,
}

#[derive(Debug)]
struct Inner {
    kind: VocabKind,
    /// SPM tables (for SPM vocabularies only).
    spm: Option<spm::Spm>,
    tokens: Vec<String>,
    types: Vec<i32>,
    to_id: HashMap<String, u32>,
    /// Bytes of every token, concatenated; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// Token id of each byte's single-character spelling.
    byte_ids: [Option<u32>; 256],
    /// Byte-level spelling of each byte (for whole-piece lookups).
    byte_chars: [char; 256],
    merges: bpe::Merges,
    specials: Vec<Special>,
    pre: pretok::PreTokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

/// A BPE or SPM tokenizer; cheap to clone (the tables are shared).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

/// A stretch of input: text still to be tokenized, or a special token already recognised.
enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

impl Tokenizer {
    /// Builds the tokenizer's tables from `spec`.
    pub fn new(spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(TokenizerError::BadVocabSize(n));
        }
        let types = if spec.token_types.is_empty() {
            vec![1; n]
        } else if spec.token_types.len() == n {
            spec.token_types
        } else {
            return Err(TokenizerError::TokenTypesMismatch {
                tokens: n,
                types: spec.token_types.len(),
            });
        };
        for (which, id) in [
            ("bos", spec.bos),
            ("eos", spec.eos),
            ("unknown", spec.unk),
            ("padding", spec.pad),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::BadSpecialId { which, id });
            }
        }
        if spec.kind == VocabKind::Spm && !spec.scores.is_empty() && spec.scores.len() < n {
            return Err(TokenizerError::ScoresMismatch {
                tokens: n,
                scores: spec.scores.len(),
            });
        }
        // SPM vocabularies have no pre-tokenizer (llama.cpp ignores `tokenizer.ggml.pre`).
        let pre = pretok::PreTokenizer::new(match spec.kind {
            VocabKind::Bpe => &spec.pre,
            VocabKind::Spm => "default",
        })?;
        let rstrip_exempt = ["<unk>", "<s>", "<|endoftext|>"];

        let mut to_id = HashMap::with_capacity(n);
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut specials = Vec::new();
        for (i, (text, &ty)) in spec.tokens.iter().zip(&types).enumerate() {
            let id = i as u32;
            // Later duplicates win, as in llama.cpp.
            to_id.insert(text.clone(), id);
            offsets.push(bytes.len());
            if matches!(ty, TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN) && !text.is_empty() {
                specials.push(Special {
                    text: text.clone(),
                    id,
                    only_when_parsing: ty != TYPE_USER_DEFINED,
                    rstrip: spec.rstrip_specials && !rstrip_exempt.contains(&text.as_str()),
                });
            }
            match (spec.kind, ty) {
                (VocabKind::Spm, _) => spm::token_bytes(text, ty, &mut bytes),
                (_, TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN) => {
                    bytes.extend_from_slice(text.as_bytes());
                }
                (_, TYPE_UNUSED) => {}
                (_, TYPE_BYTE) => match parse_byte_token(text) {
                    Some(b) => bytes.push(b),
                    None => bpe::decode_spelling(text, &mut bytes),
                },
                _ => bpe::decode_spelling(text, &mut bytes),
            }
        }
        offsets.push(bytes.len());
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));

        let byte_chars = bpe::byte_table();
        let mut byte_ids = [None; 256];
        for (slot, c) in byte_ids.iter_mut().zip(byte_chars) {
            *slot = to_id.get(c.encode_utf8(&mut [0; 4]) as &str).copied();
        }

        let mut merges = bpe::Merges::default();
        let mut joined = String::new();
        for (rank, rule) in spec.merges.iter().enumerate() {
            // The separator is the first space after the first byte (a space is never inside a
            // multi-byte character, so both halves are valid strings).
            let split = rule
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1)
                .ok_or_else(|| TokenizerError::BadMerge {
                    index: rank,
                    merge: rule.clone(),
                })?;
            let (left, right) = (&rule[..split], &rule[split + 1..]);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            // Rules over non-tokens, or producing non-tokens, can never fire on token ids.
            if let (Some(&l), Some(&r), Some(&m)) =
                (to_id.get(left), to_id.get(right), to_id.get(&joined))
            {
                merges.insert(l, r, rank as u32, m);
            }
        }

        let spm = (spec.kind == VocabKind::Spm)
            .then(|| spm::Spm::new(&to_id, spec.scores, spec.unk, spec.add_space_prefix));
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                kind: spec.kind,
                spm,
                tokens: spec.tokens,
                types,
                to_id,
                bytes,
                offsets,
                byte_ids,
                byte_chars,
                merges,
                specials,
                pre,
                bos: spec.bos,
                eos: spec.eos,
                unk: spec.unk,
                pad: spec.pad,
                add_bos: spec.add_bos,
                add_eos: spec.add_eos,
            }),
        })
    }

    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TokenizerError> {
        Self::new(TokenizerSpec::from_gguf(g)?)
    }

    /// Tokenizes `text`. Never adds BOS. With `parse_special`, control tokens written literally
    /// (e.g. `<|im_start|>`) become their ids; user-defined tokens always do.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut prev_special = true;
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                // Empty text has no fragment in llama.cpp (no space prefix either).
                Fragment::Text(range) if range.is_empty() => {}
                Fragment::Text(range) => {
                    let piece = &text[range];
                    match &self.inner.spm {
                        Some(spm) => {
                            let mut escaped = String::with_capacity(piece.len() * 2 + 3);
                            if spm.add_space_prefix && prev_special {
                                escaped.push_str(spm::SPACE_MARK);
                            }
                            escaped.push_str(&piece.replace(' ', spm::SPACE_MARK));
                            spm.encode(&escaped, &self.inner.to_id, &mut out);
                        }
                        None => self.encode_text(piece, &mut out),
                    }
                    prev_special = false;
                }
            }
        }
        out
    }

    /// Tokenizes `text` as llama.cpp's `llama_tokenize(text, add_special, parse_special)` does:
    /// with `add_special`, BOS first when the vocabulary asks for it and EOS last likewise.
    pub fn encode_special(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.inner.add_bos {
            out.extend(self.inner.bos);
        }
        out.extend(self.encode(text, parse_special));
        if add_special && self.inner.add_eos {
            out.extend(self.inner.eos);
        }
        out
    }

    /// Cuts the special tokens out of `text`, longest first.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = vec![Fragment::Text(0..text.len())];
        let mut next = Vec::new();
        for sp in &self.inner.specials {
            if sp.only_when_parsing && !parse_special {
                continue;
            }
            next.clear();
            for frag in frags.drain(..) {
                let Fragment::Text(range) = frag else {
                    next.push(frag);
                    continue;
                };
                let mut start = range.start;
                while let Some(pos) = text[start..range.end].find(sp.text.as_str()) {
                    let at = start + pos;
                    if at > start {
                        next.push(Fragment::Text(start..at));
                    }
                    next.push(Fragment::Token(sp.id));
                    start = at + sp.text.len();
                    if sp.rstrip {
                        // C's isspace, as llama.cpp uses.
                        let skip = text.as_bytes()[start..range.end]
                            .iter()
                            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
                            .count();
                        start += skip;
                    }
                }
                if start < range.end {
                    next.push(Fragment::Text(start..range.end));
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        frags
    }

    /// Pre-tokenizes and BPE-encodes text that contains no special tokens.
    fn encode_text(&self, text: &str, out: &mut Vec<u32>) {
        let inner = &*self.inner;
        let mut spelled = String::new();
        let mut run = Vec::new();
        for piece in inner.pre.split(text) {
            let piece = &text.as_bytes()[piece];
            if inner.pre.ignore_merges {
                spelled.clear();
                spelled.extend(piece.iter().map(|&b| inner.byte_chars[usize::from(b)]));
                if let Some(&id) = inner.to_id.get(&spelled) {
                    out.push(id);
                    continue;
                }
            }
            // A byte without a token (impossible in a complete byte-level vocabulary) is
            // dropped, as llama.cpp does, and no merge crosses it.
            run.clear();
            for &b in piece {
                match inner.byte_ids[usize::from(b)] {
                    Some(id) => run.push(id),
                    None => {
                        bpe::merge(&run, &inner.merges, out);
                        run.clear();
                    }
                }
            }
            bpe::merge(&run, &inner.merges, out);
        }
    }

    /// Detokenizes `ids`; invalid UTF-8 becomes U+FFFD and control tokens appear as their text.
    /// As llama.cpp's detokenizer does, an SPM vocabulary with `add_space_prefix` loses one
    /// leading space of the first token (the one encoding put there), so
    /// `decode(&encode(text, false)) == text`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id);
            if i == 0 && self.strips_leading_space() {
                bytes.extend_from_slice(piece.strip_prefix(b" ").unwrap_or(piece));
            } else {
                bytes.extend_from_slice(piece);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether decoding a whole text drops one leading space (SPM with `add_space_prefix`).
    fn strips_leading_space(&self) -> bool {
        self.inner.spm.as_ref().is_some_and(|s| s.add_space_prefix)
    }

    /// The raw bytes token `id` stands for (its piece: `▁` as a space and `<0xNN>` as its byte in
    /// SPM vocabularies; empty for unknown ids and unused tokens).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let inner = &*self.inner;
        let i = id as usize;
        match (inner.offsets.get(i), inner.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &inner.bytes[a..b],
            _ => &[],
        }
    }

    /// The id of the token spelled exactly `text`, e.g. `"<|im_end|>"`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.to_id.get(text).copied()
    }

    /// The spelling of token `id` as stored in the vocabulary.
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.inner.tokens.get(id as usize).map(String::as_str)
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.inner.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.inner.eos
    }

    /// Whether prompts should start with BOS.
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos
    }

    /// Whether llama.cpp appends EOS to prompts ([`Tokenizer::encode_special`] does).
    pub fn add_eos(&self) -> bool {
        self.inner.add_eos
    }

    /// Unknown token.
    pub fn unk(&self) -> Option<u32> {
        self.inner.unk
    }

    /// Padding token.
    pub fn pad(&self) -> Option<u32> {
        self.inner.pad
    }

    /// The vocabulary kind.
    pub fn kind(&self) -> VocabKind {
        self.inner.kind
    }

    /// Whether `id` is a control token (type 3).
    pub fn is_control(&self, id: u32) -> bool {
        self.inner.types.get(id as usize) == Some(&TYPE_CONTROL)
    }

    /// Tokens that end generation, sorted: eos plus the end-of-turn, end-of-text and
    /// fill-in-the-middle separator tokens llama.cpp recognises by their text.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = EOG_TEXTS
            .iter()
            .filter_map(|t| self.token_id(t))
            .chain(self.inner.eos)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Number of usable merge rules (for diagnostics).
    pub fn n_merges(&self) -> usize {
        self.inner.merges.len()
    }
}

/// Parses a byte token spelled `<0xAB>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Incremental detokenizer: turns a stream of token ids into text without ever emitting part
/// of a UTF-8 character.
///
/// [`StreamDecoder::new`] continues a text (generated tokens after a prompt): every token's
/// piece is emitted whole, as llama.cpp's server streams them. [`StreamDecoder::text_start`]
/// starts a text and drops the leading space like [`Tokenizer::decode`], so its output is
/// exactly `decode` of the same ids.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    /// Drop one leading space of the next token when the tokenizer strips it.
    at_text_start: bool,
}

impl StreamDecoder {
    /// A decoder with nothing pending that continues a text.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder for a whole text from its first token (see the type's documentation).
    pub fn text_start() -> Self {
        StreamDecoder {
            pending: Vec::new(),
            at_text_start: true,
        }
    }

    /// Adds token `id` and returns the text that is complete now. Bytes that can never form a
    /// valid character are emitted as U+FFFD; an incomplete trailing character is held back.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        let piece = tok.token_bytes(id);
        if std::mem::take(&mut self.at_text_start) && tok.strips_leading_space() {
            self.pending
                .extend_from_slice(piece.strip_prefix(b" ").unwrap_or(piece));
        } else {
            self.pending.extend_from_slice(piece);
        }
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated, so this conversion cannot fail.
                    out.push_str(&String::from_utf8_lossy(
                        &self.pending[start..start + valid],
                    ));
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += bad;
                        }
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Returns whatever is still pending, with incomplete characters as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests;
