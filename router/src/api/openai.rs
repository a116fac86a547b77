//! OpenAI's wire format: the request bodies of `/v1/chat/completions` and `/v1/completions`
//! (one lenient struct, unknown fields ignored) and the response objects `chat.completion`,
//! `chat.completion.chunk` and `text_completion`.

use serde::{Deserialize, Serialize};

/// The body of a chat or text completion request; which fields apply is checked per endpoint.
///
/// Integer fields are unsigned so that a negative value is reported as a type error naming the
/// field. `presence_penalty`, `frequency_penalty` and `user` are accepted and ignored (the
/// engine has no repetition penalties); fields this struct does not know are ignored too.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    /// Must name the served model when present.
    pub model: Option<String>,
    /// Chat: the conversation.
    pub messages: Option<Vec<Message>>,
    /// Completions: the prompt(s).
    pub prompt: Option<Prompt>,
    /// Most tokens to generate (legacy name).
    pub max_tokens: Option<u64>,
    /// Most tokens to generate (current name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature in [0, 2]; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f32>,
    /// Extension: keep the k most likely tokens; 0 or -1 keeps all.
    pub top_k: Option<i64>,
    /// Seed for reproducible sampling; choice i of n uses `seed + i`.
    pub seed: Option<u64>,
    /// Up to 4 stop strings.
    pub stop: Option<Stop>,
    /// Choices per prompt, 1..=16.
    pub n: Option<u64>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Chat: a boolean; completions: the number of top alternatives (0..=20).
    pub logprobs: Option<Logprobs>,
    /// Chat: top alternatives per token, 0..=20 (needs `logprobs: true`).
    pub top_logprobs: Option<u64>,
    /// Accepted in [-2, 2] and ignored.
    pub presence_penalty: Option<f32>,
    /// Accepted in [-2, 2] and ignored.
    pub frequency_penalty: Option<f32>,
    /// Accepted and ignored.
    pub user: Option<String>,
    /// Extension: keep generating past end-of-generation tokens.
    pub ignore_eos: Option<bool>,
    /// Completions: echoing the prompt is not supported (`true` is refused).
    pub echo: Option<bool>,
    /// Completions: only 1 (or equal to `n`) is supported.
    pub best_of: Option<u64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<serde_json::Value>,
    /// Extension (vLLM's): `{"json" | "regex" | "grammar" | "choice": ...}`.
    pub structured_outputs: Option<serde_json::Value>,
    /// Extension (vLLM's older names): a JSON schema.
    pub guided_json: Option<serde_json::Value>,
    /// Extension: a regular expression.
    pub guided_regex: Option<String>,
    /// Extension: a Lark grammar.
    pub guided_grammar: Option<String>,
    /// Extension: one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// Chat: function tools the model may call.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Chat: `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<serde_json::Value>,
    /// Chat: whether the model may call several tools in one turn (default true).
    pub parallel_tool_calls: Option<bool>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant`, `tool`.
    pub role: String,
    /// A string, an array of content parts, or null.
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant message's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A tool call, in a request's history or a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// `call_...`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// What is called.
    pub function: FunctionCall,
}

/// The function of a tool call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON object as a string.
    pub arguments: String,
}

/// A streamed fragment of a tool call: the first names it, the rest add argument text.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the message (0, 1, ...).
    pub index: usize,
    /// The call's id (first fragment only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first fragment only).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name (first fragment) and argument text.
    pub function: FunctionDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionDelta {
    /// The function's name (first fragment only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More argument text.
    pub arguments: String,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only `{"type":"text","text":...}` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// The `prompt` of a text completion.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts.
    Texts(Vec<String>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// `logprobs`: a boolean (chat) or an integer (completions).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat form.
    Bool(bool),
    /// Completions form.
    Count(u64),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with empty `choices` and the request's `usage`.
    pub include_usage: bool,
}

/// Token counts of a response.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt(s), each prompt counted once however many choices it has.
    pub prompt_tokens: usize,
    /// Tokens generated over all choices.
    pub completion_tokens: usize,
    /// The sum of both.
    pub total_tokens: usize,
    /// Prompt details.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Prompt token details.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV was reused from the prefix cache.
    pub cached_tokens: usize,
}

/// `chat.completion`.
#[derive(Debug, Serialize)]
pub struct ChatCompletion<'a> {
    /// `chatcmpl-...`.
    pub id: &'a str,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: &'a str,
    /// One per choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a `chat.completion`.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    /// Choice index.
    pub index: usize,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// Per-token logprobs, or null.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// The generated message.
#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text (null when the message is only tool calls).
    pub content: Option<String>,
    /// The tool calls the model made (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    /// Same id in every chunk of a response.
    pub id: &'a str,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: &'a str,
    /// Zero or one choice delta (empty in the usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// Only in the last chunk, when `stream_options.include_usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice delta of a chunk.
#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    /// Choice index.
    pub index: usize,
    /// What is new.
    pub delta: Delta,
    /// The new tokens' logprobs, or null.
    pub logprobs: Option<ChatLogprobs>,
    /// Null until the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// A chunk's delta.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    /// `assistant` in a choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool-call fragments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// Chat logprobs: one entry per generated token.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    /// The entries.
    pub content: Vec<TokenLogprob>,
}

/// One token's logprob in chat format.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    /// The token's text (invalid UTF-8 replaced).
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its exact bytes.
    pub bytes: Vec<u8>,
    /// The most likely alternatives.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative.
#[derive(Debug, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its exact bytes.
    pub bytes: Vec<u8>,
}

/// `text_completion` (also the object of each streamed completion chunk).
#[derive(Debug, Serialize)]
pub struct TextCompletion<'a> {
    /// `cmpl-...`.
    pub id: &'a str,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: &'a str,
    /// One per choice (or one delta per chunk).
    pub choices: Vec<TextChoice>,
    /// Token counts (streaming: only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a text completion.
#[derive(Debug, Serialize)]
pub struct TextChoice {
    /// The generated text (or the new text, streaming).
    pub text: String,
    /// Choice index.
    pub index: usize,
    /// Legacy-format logprobs, or null.
    pub logprobs: Option<TextLogprobs>,
    /// `stop`, `length`, or null while streaming.
    pub finish_reason: Option<&'static str>,
}

/// Legacy completions logprobs.
#[derive(Debug, Default, Serialize)]
pub struct TextLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// Each position's alternatives, token text → log-probability.
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Each token's character offset in the generated text.
    pub text_offset: Vec<usize>,
}

/// `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList<'a> {
    /// Always `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<Model<'a>>,
}

/// One model.
#[derive(Debug, Serialize)]
pub struct Model<'a> {
    /// The model name requests must use.
    pub id: &'a str,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds (when the router started).
    pub created: u64,
    /// Always `cleave`.
    pub owned_by: &'static str,
}
