//! From request bytes to a [`Job`]: JSON parsing with errors that name the field, parameter
//! validation with OpenAI's ranges, chat template rendering, tokenization, and the context
//! length check.

use std::sync::Arc;

use cleave_text::chat::{ChatError, ChatMessage, ChatTemplate};
use cleave_text::constrain::{Constraint, LazyGrammars};
use cleave_text::sample::SamplingParams;
use cleave_text::tokenizer::Tokenizer;

use super::error::ApiError;
use super::openai::{CompletionRequest, Content, Logprobs, Message, Prompt, Stop};
use super::tools::{self, Tools};

/// Most choices per prompt (`n`).
pub const MAX_N: u64 = 16;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 16;
/// Most stop strings, as OpenAI.
pub const MAX_STOP: usize = 4;
/// Most top alternatives per token.
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// `max_tokens` when the request gives none: what fits in the context, capped at this.
pub const DEFAULT_MAX_TOKENS_CAP: usize = 4096;

/// Which OpenAI endpoint a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// One tokenized prompt and the most tokens it may generate.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptJob {
    /// Token ids, BOS and template applied.
    pub tokens: Vec<u32>,
    /// `max_tokens` for this prompt's choices.
    pub max_tokens: usize,
}

/// A validated, tokenized request, ready to be run as `prompts.len() * n` generations.
#[derive(Clone, Debug)]
pub struct Job {
    /// The endpoint (decides the response format).
    pub endpoint: Endpoint,
    /// The prompts.
    pub prompts: Vec<PromptJob>,
    /// Choices per prompt.
    pub n: usize,
    /// Sampling parameters shared by all choices (`max_tokens` and `seed` are set per choice).
    pub params: SamplingParams,
    /// Whether to stream SSE.
    pub stream: bool,
    /// Whether a streamed response ends with a usage chunk.
    pub include_usage: bool,
    /// Chat: the tools in play (their calls are parsed out of the output).
    pub tools: Option<Tools>,
    /// The request field `params.constraint` came from, for compile errors.
    pub constraint_field: String,
}

impl Job {
    /// The sampling parameters of choice `choice` (of prompt `prompt`).
    pub fn params_for(&self, prompt: usize, choice: usize) -> SamplingParams {
        let mut p = self.params.clone();
        p.max_tokens = self.prompts[prompt].max_tokens;
        p.seed = p.seed.map(|s| s.wrapping_add(choice as u64));
        p
    }
}

/// What the tokenizer step needs; owned so it can run on a blocking thread.
pub struct Tokenize {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, if the model has one.
    pub template: Option<Arc<ChatTemplate>>,
    /// The model's context length.
    pub max_context: usize,
}

/// Parses a request body; syntax errors and type errors become 400s naming the field.
pub fn parse_body(bytes: &[u8]) -> Result<CompletionRequest, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, CompletionRequest>(de) {
        Ok(r) => Ok(r),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                return Err(ApiError::bad_request(format!(
                    "we could not parse the JSON body of your request ({inner}); \
                     the body must be valid JSON"
                )));
            }
            if path == "." {
                return Err(ApiError::bad_request(
                    "the request body must be a JSON object",
                ));
            }
            let detail = inner.to_string();
            let detail = if detail.contains("untagged enum") {
                "it has the wrong type".to_string()
            } else {
                detail
            };
            Err(ApiError::invalid(
                path.clone(),
                format!("invalid value for `{path}`: {detail}"),
            ))
        }
    }
}

/// Validates everything that does not need the tokenizer and returns the job's shape with an
/// empty prompt list, plus the raw input to tokenize and the requested `max_tokens`.
pub fn validate(
    endpoint: Endpoint,
    mut req: CompletionRequest,
    served_model: &str,
) -> Result<(Job, Input, Option<usize>), ApiError> {
    if let Some(model) = &req.model {
        if model != served_model {
            return Err(ApiError::ModelNotFound(model.clone()));
        }
    }
    let (tools, constraint, constraint_field) = output_rules(endpoint, &mut req)?;
    let input = input(endpoint, &mut req, &tools)?;
    let n = req.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be in [1, {MAX_N}], got {n}"),
        ));
    }
    let max_tokens = max_tokens(&req)?;
    let params = sampling(endpoint, &mut req, constraint)?;
    let stream = req.stream.unwrap_or(false);
    let job = Job {
        endpoint,
        prompts: Vec::new(),
        n: n as usize,
        params,
        stream,
        include_usage: stream && req.stream_options.is_some_and(|o| o.include_usage),
        tools,
        constraint_field,
    };
    Ok((job, input, max_tokens))
}

/// What shapes the output: the tools (chat only) or a structured-output request, never both;
/// the constraint either one puts on the output and the request field that asked for it.
fn output_rules(
    endpoint: Endpoint,
    req: &mut CompletionRequest,
) -> Result<(Option<tools::Tools>, Option<Constraint>, String), ApiError> {
    let structured = super::structured::requested(req)?;
    let tools = match endpoint {
        Endpoint::Chat => tools::parse(
            req.tools.take(),
            req.tool_choice.take(),
            req.parallel_tool_calls,
        )?,
        Endpoint::Completion if req.tools.is_some() || req.tool_choice.is_some() => {
            return Err(ApiError::invalid(
                "tools",
                "`tools` is only supported in /v1/chat/completions",
            ))
        }
        Endpoint::Completion => None,
    };
    let (constraint, field) = match (&tools, structured) {
        (Some(_), Some(r)) => {
            return Err(ApiError::invalid(
                r.field,
                "constraining the output together with `tools` is not supported: give one",
            ))
        }
        (Some(t), None) => (t.constraint()?, "tool_choice".to_string()),
        (None, Some(r)) => (Some(r.constraint), r.field),
        (None, None) => (None, String::new()),
    };
    Ok((tools, constraint, field))
}

/// The text to tokenize: the chat's messages (with its tools), or the completion's prompt.
fn input(
    endpoint: Endpoint,
    req: &mut CompletionRequest,
    tools: &Option<tools::Tools>,
) -> Result<Input, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let messages = req
                .messages
                .take()
                .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
            if messages.is_empty() {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must not be empty",
                ));
            }
            Ok(Input::Chat {
                messages: chat_messages(messages)?,
                tools: tools.clone(),
            })
        }
        Endpoint::Completion => {
            let prompt = req
                .prompt
                .take()
                .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
            if req.echo == Some(true) {
                return Err(ApiError::invalid("echo", "`echo` is not supported"));
            }
            let n = req.n.unwrap_or(1);
            if matches!(req.best_of, Some(b) if b != 1 && b != n) {
                return Err(ApiError::invalid(
                    "best_of",
                    "`best_of` must be 1 or equal to `n`",
                ));
            }
            prompt_input(prompt)
        }
    }
}

/// The requested output length, under whichever name the client used
/// (`max_completion_tokens` wins over `max_tokens`).
fn max_tokens(req: &CompletionRequest) -> Result<Option<usize>, ApiError> {
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) => Some(("max_completion_tokens", m)),
        (None, Some(m)) => Some(("max_tokens", m)),
        (None, None) => None,
    };
    if let Some((name, 0)) = max_tokens {
        return Err(ApiError::invalid(
            name,
            format!("`{name}` must be at least 1"),
        ));
    }
    Ok(max_tokens.map(|(_, m)| usize::try_from(m).unwrap_or(usize::MAX)))
}

/// The sampling parameters (`max_tokens` is set per prompt once the prompt's length is known).
/// `temperature`, `top_p`, `top_logprobs`' bound and empty stop strings are checked once, by
/// `SamplingParams::validate` (the workers run the same rules on what they receive); this
/// checks what the sampling parameters do not hold.
fn sampling(
    endpoint: Endpoint,
    req: &mut CompletionRequest,
    constraint: Option<Constraint>,
) -> Result<SamplingParams, ApiError> {
    let top_k = match req.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    for (name, v) in [
        ("presence_penalty", req.presence_penalty),
        ("frequency_penalty", req.frequency_penalty),
    ] {
        if let Some(v) = v {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be in [-2, 2], got {v}"),
                ));
            }
        }
    }
    let stop = match req.stop.take() {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` may hold at most {MAX_STOP} strings, got {}",
                stop.len()
            ),
        ));
    }
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_k,
        top_p: req.top_p.unwrap_or(1.0),
        seed: req.seed,
        max_tokens: 1,
        stop,
        stop_token_ids: Vec::new(),
        ignore_eos: req.ignore_eos.unwrap_or(false),
        logprobs: logprobs(endpoint, req.logprobs, req.top_logprobs)?,
        constraint,
    };
    params
        .validate()
        .map_err(|e| ApiError::invalid(e.field(), e.to_string()))?;
    Ok(params)
}

/// Compiles the job's output constraint and its tools' parameter schemas: a schema, regex or
/// grammar that cannot be enforced is a 400 naming its field, before anything is placed.
pub fn check_constraint(
    grammars: &LazyGrammars,
    constraint: Option<&Constraint>,
    field: &str,
    tools: Option<&Tools>,
) -> Result<(), ApiError> {
    if let Some(t) = tools {
        t.check(grammars)?;
    }
    if let Some(c) = constraint {
        grammars
            .compile(c)
            .map_err(|e| ApiError::invalid(field, format!("`{field}` cannot be enforced: {e}")))?;
    }
    Ok(())
}

/// The prompt material before tokenization.
#[derive(Debug)]
pub enum Input {
    /// A conversation to render with the chat template, and the tools to describe.
    Chat {
        /// The conversation.
        messages: Vec<ChatMessage>,
        /// The tools in play.
        tools: Option<Tools>,
    },
    /// Prompt texts (BOS added when the model wants it).
    Texts(Vec<String>),
    /// Prompts already tokenized by the client.
    Tokens(Vec<Vec<u32>>),
}

/// Renders and tokenizes `input`, sets each prompt's `max_tokens` and checks the context
/// length. Runs on a blocking thread: tokenizing a long prompt takes milliseconds.
pub fn tokenize(
    t: &Tokenize,
    input: Input,
    max_tokens: Option<usize>,
) -> Result<Vec<PromptJob>, ApiError> {
    let (prompts, what) = match input {
        Input::Chat { messages, tools } => {
            let template = t.template.as_ref().ok_or_else(|| {
                ApiError::bad_request(format!(
                    "this model has no chat template: serve it with --chat-template (a built-in \
                     name: {}; a Jinja file; or the template text), or use /v1/completions",
                    cleave_text::chat::builtin::names()
                ))
            })?;
            let rendered = if template.supports_tools() {
                let defs = tools.as_ref().map(Tools::definitions);
                template.render_with_tools(&messages, defs.as_deref(), true)
            } else {
                template.render(&tools::fallback_messages(messages, tools.as_ref()), true)
            };
            let text = rendered.map_err(|e| match e {
                ChatError::Raised(m) => ApiError::invalid("messages", m),
                // The template compiled at load, so a failure now comes from these messages
                // (a shape the model's template does not handle): the client's to fix.
                ChatError::Render(m) => ApiError::invalid(
                    "messages",
                    format!("the model's chat template cannot render these messages: {m}"),
                ),
                other => ApiError::Internal(format!("chat template: {other}")),
            })?;
            (vec![t.tokenizer.encode(&text, true)], "messages")
        }
        Input::Texts(texts) => {
            let bos = t.tokenizer.bos().filter(|_| t.tokenizer.add_bos());
            let prompts = texts
                .iter()
                .map(|text| {
                    let mut ids: Vec<u32> = bos.into_iter().collect();
                    ids.extend(t.tokenizer.encode(text, false));
                    ids
                })
                .collect();
            (prompts, "prompt")
        }
        Input::Tokens(lists) => {
            let vocab = t.tokenizer.vocab_size();
            if let Some(bad) = lists.iter().flatten().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            (lists, "prompt")
        }
    };
    prompts
        .into_iter()
        .map(|tokens| {
            if tokens.is_empty() {
                return Err(ApiError::invalid(
                    what,
                    format!("`{what}` must not be empty"),
                ));
            }
            let max_tokens = fit_context(t.max_context, tokens.len(), max_tokens, what)?;
            Ok(PromptJob { tokens, max_tokens })
        })
        .collect()
}

/// `max_tokens` for a prompt of `prompt_len` tokens, or OpenAI's context-length error.
fn fit_context(
    context: usize,
    prompt_len: usize,
    requested: Option<usize>,
    what: &str,
) -> Result<usize, ApiError> {
    let too_long = |message: String| ApiError::InvalidRequest {
        message,
        param: Some(what.to_string()),
        code: Some("context_length_exceeded"),
    };
    match requested {
        Some(m) if prompt_len.saturating_add(m) > context => Err(too_long(format!(
            "This model's maximum context length is {context} tokens. However, you requested \
             {} tokens ({prompt_len} in the {what}, {m} in the completion). Please reduce the \
             length of the {what} or completion.",
            prompt_len.saturating_add(m)
        ))),
        Some(m) => Ok(m),
        None if prompt_len >= context => Err(too_long(format!(
            "This model's maximum context length is {context} tokens. However, your {what} \
             resulted in {prompt_len} tokens. Please reduce the length of the {what}."
        ))),
        None => Ok((context - prompt_len).min(DEFAULT_MAX_TOKENS_CAP)),
    }
}

/// Chat messages with their content flattened to text (text parts joined by newlines, as
/// vLLM does).
fn chat_messages(messages: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut call_ids: Vec<String> = Vec::new();
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(s)) => s,
                Some(Content::Parts(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, p) in parts.into_iter().enumerate() {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => texts.push(t),
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}].text"),
                                    "a text content part needs `text`",
                                ))
                            }
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}].type"),
                                    format!("content parts of type `{kind}` are not supported"),
                                ))
                            }
                        }
                    }
                    texts.join("\n")
                }
            };
            let mut msg = ChatMessage::new(m.role, content);
            if let Some(calls) = m.tool_calls {
                if msg.role != "assistant" {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_calls"),
                        "only assistant messages carry `tool_calls`",
                    ));
                }
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| tools::history_call(c, &format!("messages[{i}].tool_calls[{j}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                call_ids.extend(
                    calls
                        .iter()
                        .filter_map(|c| c["id"].as_str().map(str::to_string)),
                );
                msg.tool_calls = Some(calls);
            }
            if msg.role == "tool" {
                let id = m.tool_call_id.ok_or_else(|| {
                    ApiError::invalid(
                        format!("messages[{i}].tool_call_id"),
                        "a `tool` message needs the `tool_call_id` it answers",
                    )
                })?;
                if !call_ids.contains(&id) {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_call_id"),
                        format!("no earlier assistant message made the tool call `{id}`"),
                    ));
                }
                msg.tool_call_id = Some(id);
            }
            Ok(msg)
        })
        .collect()
}

/// The completions prompt as texts or token lists.
fn prompt_input(prompt: Prompt) -> Result<Input, ApiError> {
    let count = match &prompt {
        Prompt::Text(_) | Prompt::Tokens(_) => 1,
        Prompt::Texts(v) => v.len(),
        Prompt::TokenLists(v) => v.len(),
    };
    if count == 0 {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    if count > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!("`prompt` may hold at most {MAX_PROMPTS} prompts, got {count}"),
        ));
    }
    Ok(match prompt {
        Prompt::Text(s) => Input::Texts(vec![s]),
        Prompt::Texts(v) => Input::Texts(v),
        Prompt::Tokens(t) => Input::Tokens(vec![t]),
        Prompt::TokenLists(v) => Input::Tokens(v),
    })
}

/// The number of top alternatives to return per token, if logprobs are requested.
fn logprobs(
    endpoint: Endpoint,
    logprobs: Option<Logprobs>,
    top_logprobs: Option<u64>,
) -> Result<Option<usize>, ApiError> {
    let check = |name: &str, k: u64| {
        if k > MAX_TOP_LOGPROBS {
            Err(ApiError::invalid(
                name,
                format!("`{name}` must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
            ))
        } else {
            Ok(Some(k as usize))
        }
    };
    match endpoint {
        Endpoint::Chat => match (logprobs, top_logprobs) {
            (Some(Logprobs::Count(_)), _) => Err(ApiError::invalid(
                "logprobs",
                "`logprobs` must be a boolean; use `top_logprobs` for alternatives",
            )),
            (Some(Logprobs::Bool(true)), k) => check("top_logprobs", k.unwrap_or(0)),
            (_, Some(k)) if k > 0 => Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            )),
            _ => Ok(None),
        },
        Endpoint::Completion => match logprobs {
            None => Ok(None),
            Some(Logprobs::Count(k)) => check("logprobs", k),
            Some(Logprobs::Bool(_)) => Err(ApiError::invalid(
                "logprobs",
                "`logprobs` must be an integer (the number of alternatives) in completions",
            )),
        },
    }
}
