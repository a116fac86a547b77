//! Chat templates: rendering a conversation into a prompt string the way Hugging Face does.
//!
//! A model's `tokenizer.chat_template` is a Jinja template written for Python's Jinja2 as
//! Hugging Face `transformers` configures it: `trim_blocks` and `lstrip_blocks` on, loop
//! controls, a `raise_exception` function, an optional `strftime_now` function, and Python
//! methods on strings and dicts (`.strip()`, `.startswith()`, `.items()`, ...). This module runs
//! such templates with minijinja, set up to match (`pycompat` supplies the Python methods).

pub mod builtin;
mod pycompat;

use std::sync::Arc;

use minijinja::{context, Environment, Error, ErrorKind, Value};

use crate::gguf::{GgufError, GgufFile};
use crate::tokenizer::Tokenizer;

/// Name under which the template is stored in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The GGUF file has no `tokenizer.chat_template`, or it is not a string.
    #[error("model has no usable chat template")]
    Missing(#[source] GgufError),
    /// `--chat-template` names neither a built-in template nor a readable file.
    #[error("--chat-template {value:?}: {reason}")]
    Choice {
        /// What was given.
        value: String,
        /// Why it names no template.
        reason: String,
    },
    /// The template does not compile.
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    /// The template called `raise_exception` (typically to reject a conversation shape).
    #[error("chat template raised: {0}")]
    Raised(String),
    /// Rendering failed for another reason.
    #[error("chat template render error: {0}")]
    Render(String),
}

/// One message of a conversation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant turn's tool calls, as templates expect them: `{"id", "type": "function",
    /// "function": {"name", "arguments": {...}}}` with the arguments as an object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` turn: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A compiled chat template with the model's BOS and EOS strings.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template reads a `tools` variable (renders tool definitions itself).
    tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// Marks errors raised by the template's own `raise_exception` calls.
const RAISED_PREFIX: &str = "raise_exception: ";

impl ChatTemplate {
    /// Compiles `source` once, with Hugging Face's Jinja settings.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(pycompat::call_method);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED_PREFIX}{msg}"),
            ))
        });
        env.add_function("strftime_now", pycompat::strftime_now);
        env.add_filter("tojson", pycompat::tojson);
        env.add_test("iterable", pycompat::is_iterable);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            tools: source.contains("tools"),
        })
    }

    /// The template in `tokenizer.chat_template`, with BOS/EOS strings from `tok`.
    pub fn from_gguf(g: &GgufFile, tok: &Tokenizer) -> Result<Self, ChatError> {
        let source = g
            .get_str("tokenizer.chat_template")
            .map_err(ChatError::Missing)?;
        Self::with_tokens_of(source, tok)
    }

    /// [`Self::new`] with the BOS/EOS strings of `tok`.
    fn with_tokens_of(source: &str, tok: &Tokenizer) -> Result<Self, ChatError> {
        let text = |id: Option<u32>| {
            id.and_then(|id| tok.token_str(id))
                .unwrap_or_default()
                .to_string()
        };
        Self::new(source, &text(tok.bos()), &text(tok.eos()))
    }

    /// The template `--chat-template VALUE` names, with BOS/EOS strings from `tok`: a built-in
    /// name ([`builtin::names`]), the template text itself when it contains `{{` or `{%` (as
    /// vLLM's flag accepts), or else the path of a Jinja file.
    pub fn from_flag(value: &str, tok: &Tokenizer) -> Result<Self, ChatError> {
        let owned;
        let source = if let Some(s) = builtin::source(value) {
            s
        } else if value.contains("{{") || value.contains("{%") {
            value
        } else {
            owned = std::fs::read_to_string(value).map_err(|e| ChatError::Choice {
                value: value.to_string(),
                reason: format!(
                    "not a built-in template ({}) and not a readable file: {e}",
                    builtin::names()
                ),
            })?;
            &owned
        };
        Self::with_tokens_of(source, tok)
    }

    /// Renders `messages`; with `add_generation_prompt` the result ends with the opening of an
    /// assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Whether the template renders tool definitions itself (it reads `tools`), as Qwen's,
    /// Hermes' and Llama 3.1's do. Otherwise callers describe the tools in a system message.
    pub fn supports_tools(&self) -> bool {
        self.tools
    }

    /// [`Self::render`] with `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) in
    /// the template's context, as Hugging Face's `apply_chat_template(tools=...)` passes them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        let ctx = context! {
            messages => messages,
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        // minijinja 2.24 panics on some inputs instead of failing (a negative-step slice of an
        // empty list, `messages[::-1]` with no messages, indexes past the end): the render runs
        // under `catch_unwind` so such a conversation is refused like any other render error.
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tmpl.render(ctx)))
            .map_err(|panic| {
                ChatError::Render(format!(
                    "the template engine failed: {}",
                    panic_text(&panic)
                ))
            })?;
        rendered.map_err(|e| {
            let detail = e.detail().unwrap_or_default();
            match detail.strip_prefix(RAISED_PREFIX) {
                Some(msg) if e.kind() == ErrorKind::InvalidOperation => {
                    ChatError::Raised(msg.to_string())
                }
                _ => ChatError::Render(describe(&e)),
            }
        })
    }
}

/// The template a model serves with: the one `--chat-template` names when given (a bad choice is
/// an error: the user asked for it), else the model's own.
pub fn choose(
    flag: Option<&str>,
    tok: &Tokenizer,
    from_model: Option<Arc<ChatTemplate>>,
) -> Result<Option<Arc<ChatTemplate>>, ChatError> {
    match flag {
        Some(v) => Ok(Some(Arc::new(ChatTemplate::from_flag(v, tok)?))),
        None => Ok(from_model),
    }
}

/// The message of a caught panic.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// An error's message with its cause chain and template line, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests;
