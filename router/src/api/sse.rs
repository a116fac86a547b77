//! Streaming responses: OpenAI's server-sent events, `data: {json}\n\n` per chunk, then
//! `data: [DONE]\n\n`.
//!
//! [`SseBody`] is a plain [`Stream`] that owns the backend streams, the admission permit and
//! the deadline, and polls them only when the HTTP connection asks for more bytes. No task is
//! spawned, so when the client disconnects hyper drops the body and with it every backend
//! stream (which cancels the generations downstream) and the in-flight slot.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use cleave_text::tokenizer::Tokenizer;
use serde::Serialize;
use tokio::time::{Instant, Sleep};
use tokio_stream::{Stream, StreamMap};

use super::backend::BackendStream;
use super::error::ApiError;
use super::generate::{chat_logprobs, ended_early, text_logprobs, Choice, Meta, Step, Token};
use super::metrics::RouterMetrics;
use super::openai::{ChatChunk, ChunkChoice, Delta, TextChoice, TextCompletion, Usage};
use super::prepare::{Endpoint, Job};
use super::toolparse::{self, CallParser, Piece};
use crate::admit::Permit;

/// The body of a streamed response.
pub struct SseBody {
    meta: Meta,
    streams: StreamMap<usize, BackendStream>,
    choices: Vec<Choice>,
    /// Characters streamed so far per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Per choice, when tools are in play: the parser that turns text into tool-call deltas.
    calls: Vec<Option<CallParser>>,
    usage: Usage,
    include_usage: bool,
    out: VecDeque<Bytes>,
    done: bool,
    deadline: Option<Pin<Box<Sleep>>>,
    arrived: Instant,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<RouterMetrics>,
    permit: Permit,
}

impl SseBody {
    /// A body streaming `streams` for `job`; the first chunks (roles) are queued already.
    pub fn new(
        meta: Meta,
        job: &Job,
        streams: StreamMap<usize, BackendStream>,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<RouterMetrics>,
        permit: Permit,
        arrived: Instant,
    ) -> Self {
        let choices = Choice::all(job);
        let mut body = SseBody {
            offsets: vec![0; choices.len()],
            calls: (0..choices.len())
                .map(|_| job.tools.as_ref().map(|_| CallParser::new()))
                .collect(),
            deadline: permit
                .deadline()
                .map(|d| Box::pin(tokio::time::sleep_until(d))),
            meta,
            streams,
            choices,
            usage: Usage::default(),
            include_usage: job.include_usage,
            out: VecDeque::new(),
            done: false,
            arrived,
            tokenizer,
            metrics,
            permit,
        };
        if body.meta.endpoint == Endpoint::Chat {
            for index in 0..body.choices.len() {
                let delta = Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                };
                body.chat_chunk(index, delta, None, None);
            }
        }
        body
    }

    fn push(&mut self, bytes: Result<Bytes, serde_json::Error>) {
        match bytes {
            Ok(b) => self.out.push_back(b),
            Err(e) => self.fail(ApiError::Internal(format!("serializing a chunk: {e}"))),
        }
    }

    fn chat_chunk(
        &mut self,
        index: usize,
        delta: Delta,
        token: Option<&Token>,
        finish: Option<&'static str>,
    ) {
        let logprobs = match token {
            Some(t) if self.meta.logprobs => {
                Some(chat_logprobs(&self.tokenizer, std::slice::from_ref(t)))
            }
            _ => None,
        };
        let chunk = ChatChunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            choices: vec![ChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
        };
        let bytes = event(&chunk);
        self.push(bytes);
    }

    fn text_chunk(
        &mut self,
        index: usize,
        text: String,
        token: Option<&Token>,
        finish: Option<&'static str>,
    ) {
        let logprobs = match token {
            Some(t) if self.meta.logprobs => Some(text_logprobs(
                &self.tokenizer,
                std::slice::from_ref(t),
                self.offsets[index],
            )),
            _ => None,
        };
        if let Some(lp) = &logprobs {
            self.offsets[index] = lp.text_offset[0] + lp.tokens[0].chars().count();
        }
        let chunk = TextCompletion {
            id: &self.meta.id,
            object: "text_completion",
            created: self.meta.created,
            model: &self.meta.model,
            choices: vec![TextChoice {
                text,
                index,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
        };
        let bytes = event(&chunk);
        self.push(bytes);
    }

    /// Chat with tools: the text goes through the choice's call parser; each piece is a chunk
    /// (the token's logprobs ride on the first, or on an empty one).
    fn tool_step(&mut self, index: usize, step: Step) {
        let Some(parser) = self.calls[index].as_mut() else {
            return;
        };
        let (text, token, done) = match step {
            Step::Token(text, token) => (text, Some(token), None),
            Step::Done(text, reason) => (text, None, Some(reason)),
        };
        // Calls begun before each piece (a `Call` piece begins the next one).
        let mut begun = parser.calls();
        let mut pieces = parser.push(&text);
        if done.is_some() {
            pieces.extend(parser.finish());
        }
        let mut token = token.filter(|_| self.meta.logprobs);
        if pieces.is_empty() && token.is_some() {
            pieces.push(Piece::Text(String::new()));
        }
        for piece in pieces {
            let is_call = matches!(piece, Piece::Call(_));
            let delta = toolparse::delta(piece, begun);
            self.chat_chunk(index, delta, token.take().as_ref(), None);
            begun += usize::from(is_call);
        }
        if let Some(reason) = done {
            let finish = toolparse::finish_reason(reason, begun);
            self.chat_chunk(index, Delta::default(), None, Some(finish));
        }
    }

    fn on_step(&mut self, index: usize, step: Step) {
        if self.calls[index].is_some() {
            return self.tool_step(index, step);
        }
        match (self.meta.endpoint, step) {
            (Endpoint::Chat, Step::Token(text, token)) => {
                if !text.is_empty() || self.meta.logprobs {
                    let delta = Delta {
                        content: Some(text),
                        ..Delta::default()
                    };
                    self.chat_chunk(index, delta, Some(&token), None);
                }
            }
            (Endpoint::Chat, Step::Done(text, reason)) => {
                if !text.is_empty() {
                    let delta = Delta {
                        content: Some(text),
                        ..Delta::default()
                    };
                    self.chat_chunk(index, delta, None, None);
                }
                self.chat_chunk(index, Delta::default(), None, Some(reason));
            }
            (Endpoint::Completion, Step::Token(text, token)) => {
                if !text.is_empty() || self.meta.logprobs {
                    self.text_chunk(index, text, Some(&token), None);
                }
            }
            (Endpoint::Completion, Step::Done(text, reason)) => {
                self.text_chunk(index, text, None, Some(reason));
            }
        }
    }

    /// Ends the stream with an error event in OpenAI's shape and cancels the generations. (The
    /// request was already counted as `ok` when its headers went out; `ApiError::body` logs
    /// internal details.)
    fn fail(&mut self, error: ApiError) {
        self.streams.clear();
        self.out.clear();
        match event(&error.body()) {
            Ok(b) => self.out.push_back(b),
            Err(_) => self.out.push_back(Bytes::from_static(
                b"data: {\"error\":{\"message\":\"internal error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n",
            )),
        }
        self.done = true;
    }

    /// All backend streams ended: usage chunk, `[DONE]`, or an error if a choice is missing.
    fn complete(&mut self) {
        if let Some(c) = self.choices.iter().find(|c| !c.finished) {
            let e = ended_early(c.index);
            return self.fail(e);
        }
        if self.include_usage {
            let usage = Some(self.usage);
            let bytes = match self.meta.endpoint {
                Endpoint::Chat => event(&ChatChunk {
                    id: &self.meta.id,
                    object: "chat.completion.chunk",
                    created: self.meta.created,
                    model: &self.meta.model,
                    choices: Vec::new(),
                    usage,
                }),
                Endpoint::Completion => event(&TextCompletion {
                    id: &self.meta.id,
                    object: "text_completion",
                    created: self.meta.created,
                    model: &self.meta.model,
                    choices: Vec::new(),
                    usage,
                }),
            };
            self.push(bytes);
            if self.done {
                return;
            }
        }
        self.permit.settle(self.usage.total_tokens as u64);
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.metrics
            .e2e_request_latency
            .observe(self.arrived.elapsed().as_secs_f64());
        self.done = true;
    }
}

impl Stream for SseBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(bytes)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(sleep) = this.deadline.as_mut() {
                if sleep.as_mut().poll(cx).is_ready() {
                    this.fail(ApiError::Timeout);
                    continue;
                }
            }
            match Pin::new(&mut this.streams).poll_next(cx) {
                Poll::Ready(Some((index, event))) => {
                    let step = this.choices[index].on_event(
                        event,
                        this.arrived,
                        &this.metrics,
                        &mut this.usage,
                    );
                    match step {
                        Ok(step) => this.on_step(index, step),
                        Err(e) => this.fail(e),
                    }
                }
                Poll::Ready(None) => this.complete(),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// One SSE event: `data: {json}\n\n`.
fn event(value: &impl Serialize) -> Result<Bytes, serde_json::Error> {
    let mut buf = b"data: ".to_vec();
    serde_json::to_writer(&mut buf, value)?;
    buf.extend_from_slice(b"\n\n");
    Ok(Bytes::from(buf))
}
