//! What the front end (the router, the CLI) needs of a model without its weights: the
//! tokenizer, the chat template and the context length, read from a GGUF file's metadata or a
//! Hugging Face directory (`config.json`, `tokenizer.json`, `tokenizer_config.json`). The engine
//! builds the same bundle when it loads the weights, from the same functions.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::chat::{ChatError, ChatTemplate};
use crate::gguf::{GgufError, GgufFile};
use crate::tokenizer::{Tokenizer, TokenizerError, TokenizerSpec};

/// The context length a model states nothing about (llama.cpp's and the engine's default).
const DEFAULT_CONTEXT: usize = 2048;

/// Errors reading a model's text layer.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A Hugging Face directory's `config.json` is missing or is not JSON.
    #[error("{path}: {why}")]
    HfConfig {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
}

/// The context length (prompt plus completion) a GGUF file states: `{arch}.context_length`.
pub fn gguf_context_length(g: &GgufFile) -> usize {
    g.architecture()
        .and_then(|arch| g.get_u32(&format!("{arch}.context_length")))
        .map_or(DEFAULT_CONTEXT, |v| v as usize)
}

/// The context length a Hugging Face `config.json` states: `max_position_embeddings`.
pub fn hf_context_length(config: &Value) -> usize {
    config
        .get("max_position_embeddings")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_CONTEXT, |v| v as usize)
}

/// The template when it compiled. A model without a usable one still loads, so the reason is
/// logged, not returned.
fn usable(template: Result<ChatTemplate, ChatError>) -> Option<ChatTemplate> {
    template
        .inspect_err(|e| tracing::warn!("no usable chat template: {e}"))
        .ok()
}

/// A model's tokenizer, chat template and context length.
pub struct ModelText {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, when the model carries one that compiles.
    pub template: Option<Arc<ChatTemplate>>,
    /// The model's context length (prompt plus completion).
    pub max_context: usize,
}

impl ModelText {
    fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>, max_context: usize) -> Self {
        ModelText {
            tokenizer: Arc::new(tokenizer),
            template: template.map(Arc::new),
            max_context,
        }
    }

    /// The same, serving with the template `--chat-template` names when `flag` is given
    /// ([`crate::chat::choose`]).
    pub fn with_chat_template(mut self, flag: Option<&str>) -> Result<Self, ChatError> {
        self.template = crate::chat::choose(flag, &self.tokenizer, self.template)?;
        Ok(self)
    }

    /// Reads the tokenizer, chat template and context length of the GGUF file or Hugging Face
    /// directory at `path`.
    pub fn open(path: &Path) -> Result<Self, TextError> {
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// The tokenizer, chat template and context length of an open GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_gguf(g)?;
        let template = usable(ChatTemplate::from_gguf(g, &tokenizer));
        Ok(ModelText::new(tokenizer, template, gguf_context_length(g)))
    }

    /// The byte-level BPE of `tokenizer.json`, the `chat_template` of `tokenizer_config.json`
    /// when it has one that compiles, and the context length of `config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("config.json");
        let err = |why: String| TextError::HfConfig {
            path: path.clone(),
            why,
        };
        let config = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let config: Value =
            serde_json::from_str(&config).map_err(|e| err(format!("not JSON: {e}")))?;
        let tokenizer = Tokenizer::new(TokenizerSpec::from_hf_dir(dir)?)?;
        let template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|c| {
                let text = |v: &Value| {
                    v.as_str()
                        .or_else(|| v["content"].as_str())
                        .unwrap_or("")
                        .to_string()
                };
                let source = c["chat_template"].as_str()?.to_string();
                usable(ChatTemplate::new(
                    &source,
                    &text(&c["bos_token"]),
                    &text(&c["eos_token"]),
                ))
            });
        Ok(ModelText::new(
            tokenizer,
            template,
            hf_context_length(&config),
        ))
    }
}
