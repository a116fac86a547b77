//! The model as the router serves it: its text layer (tokenizer, chat template, context length;
//! never its weights) and the name clients send. The HTTP server and the endpoint picker read it
//! the same way.

use cleave_text::ModelText;

use crate::config::RouterConfig;
use crate::RouterError;

/// The tokenizer, chat template (`--chat-template` when given) and context length of
/// `--model`.
pub(crate) fn open_model(config: &RouterConfig) -> Result<ModelText, RouterError> {
    let text = ModelText::open(&config.model).map_err(|source| RouterError::Model {
        path: config.model.clone(),
        source,
    })?;
    Ok(text.with_chat_template(config.chat_template.as_deref())?)
}

/// The name clients send by default: a GGUF file's name without `.gguf`, a Hugging Face
/// directory's name.
pub(crate) fn default_model_name(model: &std::path::Path) -> String {
    let name = if model.is_dir() {
        model.file_name()
    } else {
        model.file_stem()
    };
    name.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}
