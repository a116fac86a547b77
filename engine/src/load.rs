//! Everything one model provides, loaded together: the model, its tokenizer and its chat
//! template. A model is a GGUF file or a Hugging Face directory (`config.json`, safetensors,
//! `tokenizer.json`, `tokenizer_config.json`); every `--model` flag takes either. The text half
//! ([`ModelText`]) is `cleave-text`'s, which the router reads without the weights.

use std::path::Path;
use std::sync::Arc;

pub use cleave_text::model_text::{ModelText, TextError};

use crate::kernels::Threads;
use crate::model::{Model, ModelError};
use cleave_text::chat::{ChatError, ChatTemplate};
use cleave_text::gguf::GgufFile;
use cleave_text::tokenizer::Tokenizer;
use cleave_types::collective::{Collective, SingleRank};

/// Errors loading a model bundle.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer or chat template could not be read (boxed: it is the larger error).
    #[error(transparent)]
    Text(Box<TextError>),
}

impl From<TextError> for LoadError {
    fn from(e: TextError) -> Self {
        LoadError::Text(Box::new(e))
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
        let text = ModelText::from_gguf(&g)?;
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
        let text = ModelText::from_hf_dir(dir)?;
        Ok(Loaded {
            model: Arc::new(model),
            tokenizer: text.tokenizer,
            template: text.template,
        })
    }

    /// The same, serving with the template `--chat-template` names when `flag` is given
    /// ([`cleave_text::chat::choose`]).
    pub fn with_chat_template(mut self, flag: Option<&str>) -> Result<Self, ChatError> {
        self.template = cleave_text::chat::choose(flag, &self.tokenizer, self.template)?;
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
