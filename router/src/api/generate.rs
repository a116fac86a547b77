//! Running a [`Job`]: starting one backend generation per choice, following each choice's
//! events (timings, token counts, logprobs), and rendering OpenAI objects from them. The
//! non-streaming path collects everything here; [`super::sse`] streams the same events.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cleave_text::tokenizer::Tokenizer;
use tokio::time::Instant;
use tokio_stream::{StreamExt, StreamMap};

use super::backend::{Backend, BackendEvent, BackendRequest, BackendStream, FinishReason};
use super::error::ApiError;
use super::ids;
use super::metrics::RouterMetrics;
use super::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatLogprobs, TextChoice, TextCompletion,
    TextLogprobs, TokenLogprob, TopLogprob, Usage,
};
use super::prepare::{Endpoint, Job};
use super::toolparse;

/// What every object of one response shares.
#[derive(Clone, Debug)]
pub struct Meta {
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// Which format to render.
    pub endpoint: Endpoint,
    /// Whether logprobs are rendered.
    pub logprobs: bool,
    /// The W3C `traceparent` the workers continue (the client's, or a new trace).
    pub traceparent: String,
}

impl Meta {
    /// A fresh id for `endpoint`.
    pub fn new(endpoint: Endpoint, model: &str, logprobs: bool) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completion => "cmpl-",
        };
        Meta {
            id: format!("{prefix}{}", ids::random_hex()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or(Duration::ZERO)
                .as_secs(),
            model: model.to_string(),
            endpoint,
            logprobs,
            traceparent: String::new(),
        }
    }

    /// Continues the client's W3C trace context when it sent a valid `traceparent`, else
    /// starts a new trace (a new span id either way: the router's own span).
    pub fn with_trace(mut self, incoming: Option<&str>) -> Self {
        let span_id = &ids::random_hex()[..16];
        let trace_id = incoming
            .and_then(|t| {
                let parts: Vec<&str> = t.trim().split('-').collect();
                let hex =
                    |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
                (parts.len() == 4
                    && hex(parts[0], 2)
                    && hex(parts[1], 32)
                    && hex(parts[2], 16)
                    && hex(parts[3], 2))
                .then(|| parts[1].to_ascii_lowercase())
            })
            .unwrap_or_else(ids::random_hex);
        self.traceparent = format!("00-{trace_id}-{span_id}-01");
        self
    }

    /// Passes `traceparent` (the router's exported `api` span) on to the workers as is.
    pub fn with_traceparent(mut self, traceparent: String) -> Self {
        self.traceparent = traceparent;
        self
    }
}

/// Starts `prompts × n` generations, keyed by choice index (`prompt * n + i`). If one fails
/// to start, the ones already started are dropped, which cancels them.
pub async fn start(
    backend: &dyn Backend,
    job: &Job,
    meta: &Meta,
) -> Result<StreamMap<usize, BackendStream>, ApiError> {
    let mut map = StreamMap::with_capacity(job.prompts.len() * job.n);
    for (p, prompt) in job.prompts.iter().enumerate() {
        for i in 0..job.n {
            let index = p * job.n + i;
            let req = BackendRequest {
                request_id: format!("{}-{index}", meta.id),
                prompt: prompt.tokens.clone(),
                params: job.params_for(p, i),
                traceparent: Some(meta.traceparent.clone()),
            };
            map.insert(index, backend.generate(req).await?);
        }
    }
    Ok(map)
}

/// One generated token with what logprobs need.
#[derive(Clone, Debug)]
pub struct Token {
    /// Token id.
    pub id: u32,
    /// Log-probability, if requested.
    pub logprob: Option<f32>,
    /// Alternatives, if requested.
    pub top: Vec<(u32, f32)>,
}

/// What one event means for the response.
#[derive(Debug)]
pub enum Step {
    /// New text (possibly empty) and the token that produced it.
    Token(String, Token),
    /// The choice is done; trailing text and `stop`/`length`.
    Done(String, &'static str),
}

/// The running state of one choice.
#[derive(Debug)]
pub struct Choice {
    /// Choice index.
    pub index: usize,
    /// Whether this choice counts its prompt's tokens in `usage` (the first choice of each
    /// prompt, so that a prompt is counted once however many choices it has).
    counts_prompt: bool,
    last_token: Option<Instant>,
    /// Set once the choice has finished.
    pub finished: bool,
}

impl Choice {
    /// Choices for `job`, in index order.
    pub fn all(job: &Job) -> Vec<Choice> {
        (0..job.prompts.len() * job.n)
            .map(|index| Choice {
                index,
                counts_prompt: index % job.n == 0,
                last_token: None,
                finished: false,
            })
            .collect()
    }

    /// Interprets `event`, recording metrics and usage; an error ends the whole response.
    pub fn on_event(
        &mut self,
        event: BackendEvent,
        arrived: Instant,
        metrics: &RouterMetrics,
        usage: &mut Usage,
    ) -> Result<Step, ApiError> {
        if self.finished {
            return Err(ApiError::Internal(format!(
                "choice {} got an event after it finished",
                self.index
            )));
        }
        match event {
            BackendEvent::Token {
                id,
                text,
                logprob,
                top,
            } => {
                let now = Instant::now();
                match self.last_token {
                    None => metrics
                        .time_to_first_token
                        .observe((now - arrived).as_secs_f64()),
                    Some(t) => metrics.inter_token_latency.observe((now - t).as_secs_f64()),
                }
                self.last_token = Some(now);
                Ok(Step::Token(text, Token { id, logprob, top }))
            }
            BackendEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                text,
            } => {
                self.finished = true;
                let reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Cancelled => {
                        return Err(ApiError::Internal(format!(
                            "generation of choice {} was cancelled",
                            self.index
                        )))
                    }
                    FinishReason::Aborted => {
                        return Err(ApiError::Unavailable(format!(
                            "the worker aborted the generation of choice {}",
                            self.index
                        )))
                    }
                };
                metrics.generation_tokens.inc_by(completion_tokens as u64);
                usage.completion_tokens += completion_tokens;
                if self.counts_prompt {
                    metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                    usage.prompt_tokens += prompt_tokens;
                    usage.prompt_tokens_details.cached_tokens += cached_tokens;
                }
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
                Ok(Step::Done(text, reason))
            }
            BackendEvent::Lost(why) => Err(ApiError::WorkerLost(why)),
            BackendEvent::Error(detail) => Err(ApiError::Internal(format!(
                "worker failed generating choice {}: {detail}",
                self.index
            ))),
        }
    }
}

/// The error for a stream that ended before its choice finished.
pub fn ended_early(index: usize) -> ApiError {
    ApiError::Internal(format!(
        "the stream of choice {index} ended without finishing"
    ))
}

/// Chat-format logprobs of `tokens`.
pub fn chat_logprobs(tok: &Tokenizer, tokens: &[Token]) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let bytes = tok.token_bytes(id).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), logprob, bytes)
    };
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| {
                let (token, logprob, bytes) = entry(t.id, t.logprob.unwrap_or(0.0));
                TokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|&(id, lp)| {
                            let (token, logprob, bytes) = entry(id, lp);
                            TopLogprob {
                                token,
                                logprob,
                                bytes,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Legacy completions logprobs of `tokens`, offsets counted in characters from `start`.
pub fn text_logprobs(tok: &Tokenizer, tokens: &[Token], start: usize) -> TextLogprobs {
    let text = |id: u32| String::from_utf8_lossy(tok.token_bytes(id)).into_owned();
    let mut out = TextLogprobs::default();
    let mut offset = start;
    for t in tokens {
        let s = text(t.id);
        out.text_offset.push(offset);
        offset += s.chars().count();
        out.tokens.push(s);
        out.token_logprobs.push(t.logprob.unwrap_or(0.0));
        out.top_logprobs.push(
            t.top
                .iter()
                .map(|&(id, lp)| (text(id), serde_json::json!(lp)))
                .collect(),
        );
    }
    out
}

/// What one choice produced, collected for a non-streaming response.
#[derive(Debug, Default)]
struct Collected {
    text: String,
    tokens: Vec<Token>,
    finish: Option<&'static str>,
}

/// Runs the job to completion and renders the whole JSON response.
pub async fn collect(
    mut streams: StreamMap<usize, BackendStream>,
    job: &Job,
    meta: &Meta,
    tok: &Tokenizer,
    metrics: &RouterMetrics,
    arrived: Instant,
) -> Result<serde_json::Value, ApiError> {
    let mut choices = Choice::all(job);
    let mut out: Vec<Collected> = choices.iter().map(|_| Collected::default()).collect();
    let mut usage = Usage::default();
    while let Some((index, event)) = streams.next().await {
        match choices[index].on_event(event, arrived, metrics, &mut usage)? {
            Step::Token(text, token) => {
                out[index].text.push_str(&text);
                if meta.logprobs {
                    out[index].tokens.push(token);
                }
            }
            Step::Done(text, reason) => {
                out[index].text.push_str(&text);
                out[index].finish = Some(reason);
            }
        }
    }
    if let Some(c) = choices.iter().find(|c| !c.finished) {
        return Err(ended_early(c.index));
    }
    let value = match meta.endpoint {
        Endpoint::Chat => serde_json::to_value(ChatCompletion {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: out
                .into_iter()
                .enumerate()
                .map(|(index, c)| {
                    let (content, tool_calls) = match job.tools {
                        Some(_) => toolparse::split_message(&c.text),
                        None => (Some(c.text), Vec::new()),
                    };
                    let reason = c.finish.unwrap_or("stop");
                    ChatChoice {
                        index,
                        logprobs: meta.logprobs.then(|| chat_logprobs(tok, &c.tokens)),
                        finish_reason: toolparse::finish_reason(reason, tool_calls.len()),
                        message: AssistantMessage {
                            role: "assistant",
                            content,
                            tool_calls,
                        },
                    }
                })
                .collect(),
            usage,
        }),
        Endpoint::Completion => serde_json::to_value(TextCompletion {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: out
                .into_iter()
                .enumerate()
                .map(|(index, c)| TextChoice {
                    logprobs: meta.logprobs.then(|| text_logprobs(tok, &c.tokens, 0)),
                    text: c.text,
                    index,
                    finish_reason: c.finish,
                })
                .collect(),
            usage: Some(usage),
        }),
    };
    value.map_err(|e| ApiError::Internal(format!("serializing a response: {e}")))
}

/// Shared pieces a response stream needs besides the job.
#[derive(Clone)]
pub struct Shared {
    /// For logprob token texts.
    pub tokenizer: Arc<Tokenizer>,
    /// Where timings and counts go.
    pub metrics: Arc<RouterMetrics>,
}

#[cfg(test)]
mod trace_tests {
    use super::*;

    #[test]
    fn traceparent_continues_a_valid_trace_or_starts_one() {
        let m = Meta::new(Endpoint::Completion, "m", false).with_trace(Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ));
        assert!(m
            .traceparent
            .starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(
            !m.traceparent.contains("00f067aa0ba902b7"),
            "the router's span id is its own"
        );
        let fresh = Meta::new(Endpoint::Completion, "m", false).with_trace(Some("garbage"));
        let parts: Vec<&str> = fresh.traceparent.split('-').collect();
        assert_eq!(parts.len(), 4);
        assert_eq!((parts[1].len(), parts[2].len()), (32, 16));
    }
}
