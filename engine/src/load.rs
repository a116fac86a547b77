//! Everything one model provides, loaded together: the model, its tokenizer and its chat
//! template. A model is a GGUF file or a Hugging Face directory (`config.json`, safetensors,
//! `tokenizer.json`, `tokenizer_config.json`); every `--model` flag takes either.

use std::path::Path;
use std::sync::Arc;

use crate::chat::{ChatError, ChatTemplate};
use crate::collective::{Collective, SingleRank};
use crate::gguf::GgufFile;
use crate::kernels::Threads;
use crate::model::config::ModelConfig;
use crate::model::{hf, Model, ModelError};
use crate::tokenizer::{Tokenizer, TokenizerError, TokenizerSpec};

/// Errors loading a model bundle.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// The template when it compiled. A model without a usable one still loads, so the reason is
/// logged, not returned.
fn usable(template: Result<ChatTemplate, ChatError>) -> Option<ChatTemplate> {
    template
        .inspect_err(|e| tracing::warn!("no usable chat template: {e}"))
        .ok()
}

/// What the front end (the router, the CLI) needs of a model without its weights.
pub struct ModelText {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, when the model carries one that compiles.
    pub template: Option<Arc<ChatTemplate>>,
    /// The model's context length (prompt plus completion).
    pub max_context: usize,
}

impl ModelText {
    fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>, config: &ModelConfig) -> Self {
        ModelText {
            tokenizer: Arc::new(tokenizer),
            template: template.map(Arc::new),
            max_context: config.context_length,
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
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if path.is_dir() {
            return Self::from_hf_dir(path, &hf::read_config(path)?);
        }
        let g = GgufFile::open(path).map_err(ModelError::from)?;
        Self::from_gguf(&g, &ModelConfig::from_gguf(&g)?)
    }

    fn from_gguf(g: &GgufFile, config: &ModelConfig) -> Result<Self, LoadError> {
        let tokenizer = Tokenizer::from_gguf(g)?;
        let template = usable(ChatTemplate::from_gguf(g, &tokenizer));
        Ok(ModelText::new(tokenizer, template, config))
    }

    /// The byte-level BPE of `tokenizer.json` and the `chat_template` of
    /// `tokenizer_config.json` when it has one that compiles.
    fn from_hf_dir(dir: &Path, config: &ModelConfig) -> Result<Self, LoadError> {
        let tokenizer = Tokenizer::new(TokenizerSpec::from_hf_dir(dir)?)?;
        let template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|c| {
                let text = |v: &serde_json::Value| {
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
        Ok(ModelText::new(tokenizer, template, config))
    }
}

/// A model with its tokenizer and (if it has one) chat template.
pub struct Loaded {
    /// The model.
    pub model: Arc<Model>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, when the model carries one that compiles.
    pub template: Option<Arc<ChatTemplate>>,
}

impl Loaded {
    /// Loads the whole model (GGUF file or Hugging Face directory) into this process.
    pub fn open(path: &Path, threads: Threads) -> Result<Self, LoadError> {
        Self::open_rank(path, Arc::new(SingleRank), threads)
    }

    /// Loads rank `collective.rank()` of `collective.world()` of the GGUF file or Hugging Face
    /// directory at `path`: this rank's heads, FFN slices, vocabulary slice and experts.
    pub fn open_rank(
        path: &Path,
        collective: Arc<dyn Collective>,
        threads: Threads,
    ) -> Result<Self, LoadError> {
        if path.is_dir() {
            return Self::open_hf(path, collective, threads);
        }
        let g = GgufFile::open(path).map_err(ModelError::from)?;
        let model = Model::load(&g, collective, threads)?;
        let text = ModelText::from_gguf(&g, &model.config)?;
        Ok(Loaded {
            model: Arc::new(model),
            tokenizer: text.tokenizer,
            template: text.template,
        })
    }

    /// Loads rank `collective.rank()` of a Hugging Face directory: `config.json` + safetensors,
    /// the byte-level BPE of `tokenizer.json`, and `chat_template` of `tokenizer_config.json`
    /// when it has one that compiles.
    pub fn open_hf(
        dir: &Path,
        collective: Arc<dyn Collective>,
        threads: Threads,
    ) -> Result<Self, LoadError> {
        let model = Model::load_hf(dir, collective, threads)?;
        let text = ModelText::from_hf_dir(dir, &model.config)?;
        Ok(Loaded {
            model: Arc::new(model),
            tokenizer: text.tokenizer,
            template: text.template,
        })
    }

    /// The same, serving with the template `--chat-template` names when `flag` is given
    /// ([`crate::chat::choose`]).
    pub fn with_chat_template(mut self, flag: Option<&str>) -> Result<Self, ChatError> {
        self.template = crate::chat::choose(flag, &self.tokenizer, self.template)?;
        Ok(self)
    }

    /// Tokenizes a prompt as plain text, adding BOS when the model asks for it.
    pub fn encode_text(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        if self.tokenizer.add_bos() {
            ids.extend(self.tokenizer.bos());
        }
        ids.extend(self.tokenizer.encode(text, false));
        ids
    }
}
