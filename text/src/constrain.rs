//! Constrained decoding: output that must match a JSON schema, a regular expression, a Lark
//! grammar or one of a fixed set of strings, enforced every step by a token mask from
//! llguidance (the engine behind the llguidance backends of llama.cpp, vLLM and SGLang).
//!
//! The constraint travels with the request ([`crate::sample::SamplingParams::constraint`]), so a
//! disaggregated request is constrained on the prefill worker (the first token) and on the
//! decode worker (the rest, after its matcher has consumed the first token).

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON schema.
    JsonSchema {
        /// The schema.
        schema: serde_json::Value,
    },
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex {
        /// The pattern.
        pattern: String,
    },
    /// Text in the language of this grammar (llguidance's Lark dialect; `%json {…}` embeds a
    /// JSON schema).
    Lark {
        /// The grammar.
        grammar: String,
    },
    /// Exactly one of these strings.
    Choice {
        /// The alternatives.
        choices: Vec<String>,
    },
}

/// Why a constraint does not compile, or why decoding under it cannot go on.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    /// A JSON schema that is neither an object nor `true`.
    #[error("a JSON schema must be an object")]
    SchemaNotObject,
    /// A choice constraint with no alternatives.
    #[error("choice needs at least one string")]
    EmptyChoice,
    /// The vocabulary has no token that could end a finished grammar.
    #[error("the tokenizer has no end-of-sequence token")]
    NoEos,
    /// Tokens beyond the model's logits could never be masked.
    #[error("the tokenizer has {tokens} tokens but the model only {logits} logits")]
    VocabExceedsLogits {
        /// The tokenizer's vocabulary size.
        tokens: usize,
        /// The model's logits per position.
        logits: usize,
    },
    /// llguidance refused the grammar (its message: regex, schema or Lark syntax).
    #[error("{0}")]
    Grammar(String),
    /// llguidance could not compute the next mask.
    #[error("{0}")]
    Mask(String),
    /// The grammar allows no next token: nothing could be sampled.
    #[error("the grammar allows no next token")]
    NoNextToken,
    /// A token (the first one of a disaggregated request, say) the grammar does not accept.
    #[error("token {token} does not fit the grammar: {reason}")]
    Rejected {
        /// The token.
        token: u32,
        /// llguidance's reason.
        reason: String,
    },
}

/// How JSON is laid out under a schema: one space after `,` and `:`, no other whitespace (as
/// Python's `json.dumps` writes it). Free whitespace lets a small model fill `max_tokens` with
/// newlines; OpenAI's structured outputs are compact too.
fn json_layout() -> serde_json::Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// `schema` with cleave's JSON layout, unless the schema sets its own `x-guidance` options.
fn with_layout(schema: &serde_json::Value) -> Result<serde_json::Value, ConstraintError> {
    let mut s = schema.clone();
    match &mut s {
        serde_json::Value::Object(m) => {
            m.entry("x-guidance").or_insert_with(json_layout);
            Ok(s)
        }
        serde_json::Value::Bool(true) => Ok(serde_json::json!({"x-guidance": json_layout()})),
        _ => Err(ConstraintError::SchemaNotObject),
    }
}

/// `schema` as a Lark `%json` rule body with cleave's JSON layout, for grammars that embed JSON
/// (e.g. tool-call arguments).
pub fn lark_json(schema: &serde_json::Value) -> Result<String, ConstraintError> {
    Ok(format!("%json {}", with_layout(schema)?))
}

/// `s` as a Lark string literal.
pub fn lark_literal(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

impl Constraint {
    /// The llguidance grammar of this constraint.
    fn grammar(&self) -> Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_layout(
                &serde_json::json!({"type": "object"}),
            )?),
            Constraint::JsonSchema { schema } => {
                TopLevelGrammar::from_json_schema(with_layout(schema)?)
            }
            Constraint::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
            Constraint::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
            Constraint::Choice { choices } => {
                if choices.is_empty() {
                    return Err(ConstraintError::EmptyChoice);
                }
                let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        })
    }
}

/// The tokenizer as llguidance sees it: every token's bytes (control tokens marked with
/// llguidance's special-token byte so that no grammar text can match them) in a token trie.
struct TokenEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        // Greedy longest-match is not the model's BPE: no forced-token shortcuts.
        false
    }
}

/// Compiles constraints for one tokenizer. Build it once per model: the token trie over the
/// vocabulary is the expensive part; compiling a grammar against it is cheap.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The compiler for `tok`'s vocabulary. A finished grammar ends with the tokenizer's
    /// end-of-sequence token (or its first end-of-generation token).
    pub fn new(tok: &Tokenizer) -> Result<Self, ConstraintError> {
        let eos = tok
            .eos()
            .or_else(|| tok.eog_ids().first().copied())
            .ok_or(ConstraintError::NoEos)?;
        let words: Vec<Vec<u8>> = (0..tok.vocab_size() as u32)
            .map(|id| {
                let b = tok.token_bytes(id);
                if tok.is_control(id) || id == eos {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_str(id).unwrap_or_default().as_bytes());
                    w
                } else {
                    b.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: eos,
            tok_bos: tok.bos(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env = Arc::new(TokenEnv {
            trie: TokTrie::from(&info, &words),
        });
        let mut factory = ParserFactory::new_simple(&(env as _))
            .map_err(|e| ConstraintError::Grammar(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh matcher for `c`, or why `c` does not compile.
    pub fn compile(&self, c: &Constraint) -> Result<ConstraintState, ConstraintError> {
        let grammar = c.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Grammar(e));
        }
        Ok(ConstraintState {
            matcher,
            mask: None,
        })
    }
}

/// A [`Grammars`] built on first use (building one takes tens of milliseconds), shared by every
/// request of an engine or a router.
pub struct LazyGrammars {
    tokenizer: Arc<Tokenizer>,
    /// The model's logits per position, when known: a vocabulary larger than that cannot be
    /// masked.
    logits: Option<usize>,
    cell: OnceLock<Result<Arc<Grammars>, ConstraintError>>,
}

impl LazyGrammars {
    /// Grammars for `tokenizer`'s vocabulary (checked against `logits`, the model's vocabulary
    /// size, when given).
    pub fn new(tokenizer: Arc<Tokenizer>, logits: Option<usize>) -> Self {
        LazyGrammars {
            tokenizer,
            logits,
            cell: OnceLock::new(),
        }
    }

    /// The compiler, or why there is none for this vocabulary.
    pub fn get(&self) -> Result<Arc<Grammars>, ConstraintError> {
        self.cell
            .get_or_init(|| match self.logits {
                Some(logits) if self.tokenizer.vocab_size() > logits => {
                    Err(ConstraintError::VocabExceedsLogits {
                        tokens: self.tokenizer.vocab_size(),
                        logits,
                    })
                }
                _ => Grammars::new(&self.tokenizer).map(Arc::new),
            })
            .clone()
    }

    /// A fresh matcher for `c`, or why `c` does not compile.
    pub fn compile(&self, c: &Constraint) -> Result<ConstraintState, ConstraintError> {
        self.get()?.compile(c)
    }
}

/// One sequence's position in its grammar.
pub struct ConstraintState {
    matcher: Matcher,
    /// The allowed next tokens, once computed for this step.
    mask: Option<Result<SimpleVob, ConstraintError>>,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// What consuming a token did to the grammar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// More tokens may follow.
    Continue,
    /// The grammar is complete and nothing can follow.
    Finished,
}

impl ConstraintState {
    /// Computes the allowed next tokens (for the step about to be sampled). Meant to run on
    /// another thread while the forward pass runs.
    pub fn prepare_mask(&mut self) {
        if self.mask.is_none() {
            self.mask = Some(
                self.matcher
                    .compute_mask()
                    .map_err(|e| ConstraintError::Mask(e.to_string())),
            );
        }
    }

    /// The allowed next tokens (computing them now if [`Self::prepare_mask`] did not), or
    /// why there are none. An empty mask is an error: nothing could be sampled.
    pub fn take_mask(&mut self) -> Result<SimpleVob, ConstraintError> {
        self.prepare_mask();
        let m = self.mask.take().expect("prepared above")?;
        if m.is_zero() {
            return Err(ConstraintError::NoNextToken);
        }
        Ok(m)
    }

    /// Advances the grammar over `tok` (sampled under the mask, or the first token of a
    /// disaggregated request).
    pub fn consume(&mut self, tok: u32) -> Result<Progress, ConstraintError> {
        self.mask = None;
        self.matcher
            .consume_token(tok)
            .map_err(|e| ConstraintError::Rejected {
                token: tok,
                reason: e.to_string(),
            })?;
        Ok(if self.matcher.is_stopped() {
            Progress::Finished
        } else {
            Progress::Continue
        })
    }
}

#[cfg(test)]
mod tests;
