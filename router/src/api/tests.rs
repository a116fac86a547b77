//! HTTP-layer tests: the real axum router over the real SmolLM2 tokenizer and chat template,
//! with a fake [`Backend`] that streams canned tokens (a test double for everything behind
//! the API layer). Responses are parsed and checked field by field.

mod errors;
mod streaming;
mod tools;

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use cleave_text::chat::{ChatMessage, ChatTemplate};
use cleave_text::gguf::{default_model_path, GgufFile};
use cleave_text::tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio_stream::Stream;
use tower::ServiceExt;

use super::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use super::metrics::RouterMetrics;
use super::{router, ApiState};
use crate::admit::{Admission, AdmitConfig};

pub(super) const MODEL: &str = "smollm2-135m";
pub(super) const REPLY: &str = "Hello there, how are you today?";

/// The real tokenizer and template, loaded once; `None` (test skipped) without the model.
pub(super) fn model() -> Option<(Arc<Tokenizer>, Arc<ChatTemplate>)> {
    static CELL: OnceLock<Option<(Arc<Tokenizer>, Arc<ChatTemplate>)>> = OnceLock::new();
    CELL.get_or_init(|| {
        let path = default_model_path();
        if !path.exists() {
            eprintln!(
                "SKIPPED: model {} not found (run `cleave model fetch`)",
                path.display()
            );
            return None;
        }
        let g = GgufFile::open(&path).expect("open gguf");
        let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
        let tmpl = ChatTemplate::from_gguf(&g, &tok).expect("chat template");
        Some((Arc::new(tok), Arc::new(tmpl)))
    })
    .clone()
}

/// What the fake backend does with each request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Mode {
    /// Streams [`REPLY`] token by token (up to `max_tokens`), then finishes.
    Reply,
    /// Streams two tokens, then fails.
    FailMidStream,
    /// Streams one token, then nothing ever again.
    Hang,
    /// Streams one token, then finishes `Aborted`.
    Abort,
    /// Refuses with `NoWorkers`.
    NoWorkers,
    /// Streams this text token by token, then finishes `Stop`.
    Text(&'static str),
}

/// A fake backend: canned tokens, a record of requests, a count of streams alive.
pub(super) struct Fake {
    pub tok: Arc<Tokenizer>,
    pub mode: Mode,
    pub ready: bool,
    pub requests: Mutex<Vec<BackendRequest>>,
    pub live: Arc<AtomicUsize>,
}

/// A stream that counts itself alive until dropped.
struct Tracked {
    inner: BackendStream,
    live: Arc<AtomicUsize>,
}

impl Stream for Tracked {
    type Item = BackendEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Backend for Fake {
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError> {
        if self.mode == Mode::NoWorkers {
            return Err(BackendError::NoWorkers);
        }
        self.requests.lock().unwrap().push(req.clone());
        let reply = match self.mode {
            Mode::Text(t) => t,
            _ => REPLY,
        };
        let ids = self.tok.encode(reply, false);
        let take = ids.len().min(req.params.max_tokens);
        let token = |id: u32| BackendEvent::Token {
            id,
            text: self.tok.decode(&[id]),
            logprob: req.params.logprobs.map(|_| -0.5),
            top: (0..req.params.logprobs.unwrap_or(0))
                .map(|k| (id + k as u32, -1.0 - k as f32))
                .collect(),
        };
        let finished = |reason, n| BackendEvent::Finished {
            reason,
            prompt_tokens: req.prompt.len(),
            completion_tokens: n,
            cached_tokens: 1,
            text: String::new(),
        };
        let events: Vec<BackendEvent> = match self.mode {
            Mode::Reply | Mode::Text(_) => {
                let mut ev: Vec<_> = ids[..take].iter().map(|&id| token(id)).collect();
                let reason = if take < ids.len() {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                ev.push(finished(reason, take));
                ev
            }
            Mode::FailMidStream => vec![
                token(ids[0]),
                token(ids[1]),
                BackendEvent::Error("worker exploded".into()),
            ],
            Mode::Abort => vec![token(ids[0]), finished(FinishReason::Aborted, 1)],
            Mode::Hang => vec![token(ids[0])],
            Mode::NoWorkers => unreachable!(),
        };
        let inner: BackendStream = if self.mode == Mode::Hang {
            Box::pin(tokio_stream::StreamExt::chain(
                tokio_stream::iter(events),
                tokio_stream::pending(),
            ))
        } else {
            Box::pin(tokio_stream::iter(events))
        };
        self.live.fetch_add(1, Ordering::SeqCst);
        Ok(Box::pin(Tracked {
            inner,
            live: self.live.clone(),
        }))
    }

    fn model_name(&self) -> &str {
        MODEL
    }

    fn healthy_decode_workers(&self) -> usize {
        usize::from(self.ready)
    }
}

/// A test server: the router and its fake backend.
pub(super) struct Harness {
    pub app: axum::Router,
    pub fake: Arc<Fake>,
}

/// Options of [`harness`].
pub(super) struct Opts {
    pub mode: Mode,
    pub keys: Option<&'static [&'static str]>,
    pub admit: AdmitConfig,
    pub max_context: usize,
    pub ready: bool,
    /// A chat template source to use instead of the model's.
    pub template: Option<&'static str>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            mode: Mode::Reply,
            keys: None,
            admit: AdmitConfig::default(),
            max_context: 2048,
            ready: true,
            template: None,
        }
    }
}

pub(super) fn harness(opts: Opts) -> Option<Harness> {
    let (tok, mut tmpl) = model()?;
    if let Some(source) = opts.template {
        tmpl = Arc::new(ChatTemplate::new(source, "", "").expect("test template"));
    }
    let fake = Arc::new(Fake {
        tok: tok.clone(),
        mode: opts.mode,
        ready: opts.ready,
        requests: Mutex::new(Vec::new()),
        live: Arc::new(AtomicUsize::new(0)),
    });
    let mut registry = Registry::default();
    let metrics = Arc::new(RouterMetrics::new(&mut registry));
    let state = Arc::new(ApiState {
        backend: fake.clone(),
        grammars: Arc::new(cleave_text::constrain::LazyGrammars::new(tok.clone(), None)),
        tokenizer: tok,
        template: Some(tmpl),
        max_context: opts.max_context,
        api_keys: opts.keys.map(|k| {
            let text = k.join("\n");
            Arc::new(
                crate::keys::Keys::from_text(std::path::Path::new("keys"), &text, None)
                    .expect("test keys"),
            )
        }),
        admission: Admission::new(opts.admit, metrics.queue_depth.clone()),
        metrics,
        registry: Arc::new(registry),
    });
    Some(Harness {
        app: router(state),
        fake,
    })
}

/// A test server with the defaults but for the backend, which behaves as `mode`.
pub(super) fn harness_in(mode: Mode) -> Option<Harness> {
    harness(Opts {
        mode,
        ..Opts::default()
    })
}

/// A finished response: status, headers, body bytes.
pub(super) struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts an OpenAI error with this status, and returns its `error` object.
    pub fn error(&self, status: StatusCode) -> Value {
        let v = self.json();
        assert_eq!(self.status, status, "body: {v}");
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e
    }

    /// The SSE `data:` payloads, in order.
    pub fn events(&self) -> Vec<String> {
        let text = std::str::from_utf8(&self.body).unwrap();
        assert!(text.ends_with("\n\n"), "{text}");
        text.split("\n\n")
            .filter(|s| !s.is_empty())
            .map(|ev| {
                ev.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data event: {ev:?}"))
                    .to_string()
            })
            .collect()
    }
}

impl Harness {
    pub async fn call(
        &self,
        method: &str,
        uri: &str,
        body: Option<&str>,
        key: Option<&str>,
    ) -> Reply {
        let mut req = Request::builder().method(method).uri(uri);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let req = req
            .body(body.map(|b| Body::from(b.to_string())).unwrap_or_default())
            .unwrap();
        let resp = self.app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn post(&self, uri: &str, body: Value) -> Reply {
        self.call("POST", uri, Some(&body.to_string()), None).await
    }

    /// Streams a chat completion of [`hello`]; asserts a 200 and returns its SSE payloads.
    pub async fn stream_hello(&self) -> Vec<String> {
        let r = self
            .post(
                "/v1/chat/completions",
                json!({"messages": hello(), "stream": true}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        r.events()
    }

    pub fn requests(&self) -> Vec<BackendRequest> {
        self.fake.requests.lock().unwrap().clone()
    }

    pub async fn metrics(&self) -> String {
        String::from_utf8(self.call("GET", "/metrics", None, None).await.body).unwrap()
    }
}

pub(super) fn hello() -> Value {
    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
}

#[tokio::test]
async fn chat_completion_has_openai_shape_and_the_templated_prompt() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], REPLY);
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["logprobs"].is_null());

    let (tok, tmpl) = model().unwrap();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
    ];
    let expected = tok.encode(&tmpl.render(&msgs, true).unwrap(), true);
    let reqs = h.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].prompt, expected);
    assert_eq!(reqs[0].params.temperature, 0.0);
    assert_eq!(reqs[0].params.max_tokens, 2048 - expected.len());

    let u = &v["usage"];
    let completion = tok.encode(REPLY, false).len();
    assert_eq!(u["prompt_tokens"], expected.len());
    assert_eq!(u["completion_tokens"], completion);
    assert_eq!(u["total_tokens"], expected.len() + completion);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 1);
}

#[tokio::test]
async fn content_parts_render_like_a_string() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]);
    let plain = json!([{"role": "user", "content": "Hi!"}]);
    for messages in [parts, plain] {
        let r = h
            .post("/v1/chat/completions", json!({"messages": messages}))
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json());
    }
    let reqs = h.requests();
    assert_eq!(reqs[0].prompt, reqs[1].prompt);
}

#[tokio::test]
async fn completion_adds_bos_only_when_the_model_wants_it() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    let (tok, _) = model().unwrap();
    let ids = tok.encode(REPLY, false);
    assert_eq!(c["text"], tok.decode(&ids[..3]));
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["index"], 0);
    assert!(c["logprobs"].is_null());
    assert_eq!(v["usage"]["completion_tokens"], 3);

    let mut expected: Vec<u32> = tok.bos().filter(|_| tok.add_bos()).into_iter().collect();
    expected.extend(tok.encode("Once upon a time", false));
    assert_eq!(h.requests()[0].prompt, expected);
    assert_eq!(h.requests()[0].params.max_tokens, 3);
}

#[tokio::test]
async fn several_prompts_times_n_choices_are_indexed_prompt_major() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": [[1, 2, 3], [4, 5]], "n": 2, "seed": 7, "max_tokens": 2, "unknown_field": {"x": 1}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json());
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let mut reqs = h.requests();
    reqs.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    let prompts: Vec<_> = reqs.iter().map(|r| r.prompt.clone()).collect();
    assert_eq!(
        prompts,
        [vec![1, 2, 3], vec![1, 2, 3], vec![4, 5], vec![4, 5]]
    );
    let seeds: Vec<_> = reqs.iter().map(|r| r.params.seed).collect();
    assert_eq!(seeds, [Some(7), Some(8), Some(7), Some(8)]);
    // Each prompt's tokens are counted once, completions over all choices.
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn chat_n_runs_n_generations_with_derived_seeds_and_stop_passes_through() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": hello(), "n": 3, "seed": 100, "stop": "\n", "max_completion_tokens": 5, "max_tokens": 9}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    let reqs = h.requests();
    let mut seeds: Vec<_> = reqs.iter().map(|r| r.params.seed.unwrap()).collect();
    seeds.sort();
    assert_eq!(seeds, [100, 101, 102]);
    assert!(reqs
        .iter()
        .all(|r| r.params.stop == ["\n"] && r.params.max_tokens == 5));
    assert_eq!(v["usage"]["completion_tokens"], 15);
}

#[tokio::test]
async fn chat_logprobs_have_openai_shape() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": hello(), "logprobs": true, "top_logprobs": 2, "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 2);
    let (tok, _) = model().unwrap();
    let first = tok.encode(REPLY, false)[0];
    assert_eq!(content[0]["logprob"], -0.5);
    assert_eq!(content[0]["bytes"], json!(tok.token_bytes(first).to_vec()));
    assert_eq!(content[0]["token"], tok.decode(&[first]));
    let top = content[0]["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[1]["logprob"], -2.0);
    assert!(top[1]["token"].is_string() && top[1]["bytes"].is_array());
    assert_eq!(h.requests()[0].params.logprobs, Some(2));
}

#[tokio::test]
async fn completion_logprobs_have_legacy_shape() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "Hi", "logprobs": 1, "max_tokens": 3}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let lp = r.json()["choices"][0]["logprobs"].clone();
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 3);
    assert_eq!(lp["token_logprobs"], json!([-0.5, -0.5, -0.5]));
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert_eq!(
        offsets[1],
        tokens[0].as_str().unwrap().chars().count() as u64
    );
}

#[tokio::test]
async fn models_health_ready_and_metrics() {
    let Some(h) = harness(Opts {
        ready: false,
        ..Opts::default()
    }) else {
        return;
    };
    let v = h.call("GET", "/v1/models", None, None).await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(
        h.call("GET", "/health", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        h.call("GET", "/ready", None, None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    h.post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2}))
        .await;
    h.post("/v1/completions", json!({"prompt": "Hi", "temperature": 5}))
        .await;
    let m = h.metrics().await;
    assert!(
        m.contains("cleave_router_requests_total{status=\"ok\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("cleave_router_requests_total{status=\"bad_request\"} 1"),
        "{m}"
    );
    assert!(m.contains("cleave_router_generation_tokens_total 2"), "{m}");
    assert!(
        m.contains("cleave_router_time_to_first_token_seconds_count 1"),
        "{m}"
    );
    assert!(
        m.contains("cleave_router_inter_token_latency_seconds_count 1"),
        "{m}"
    );
    assert!(
        m.contains("cleave_router_e2e_request_latency_seconds_count 1"),
        "{m}"
    );
    assert!(m.contains("cleave_router_queue_depth 0"), "{m}");
    assert!(m.contains("cleave_router_prompt_tokens_total"), "{m}");
    assert!(m.contains("# TYPE cleave_router_placements counter"), "{m}");
    assert!(m.ends_with("# EOF\n"));
}

#[tokio::test]
async fn unknown_route_is_an_openai_404() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let e = h
        .call("GET", "/v2/nothing", None, None)
        .await
        .error(StatusCode::NOT_FOUND);
    assert_eq!(e["code"], "unknown_url");
}
