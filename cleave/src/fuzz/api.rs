//! `--target api`: OpenAI request bodies through the router's HTTP layer.
//!
//! Each case takes one of a corpus of valid bodies (chat, streaming, `n` > 1, logprobs, tools,
//! JSON schema, completions with token prompts) and mutates it: as JSON (a member replaced by a
//! value of another type, at an edge, deleted, duplicated; unknown members), then, for a third
//! of the cases, as bytes. A few cases are 10 MB bodies or have a wrong content type. In
//! process, the real axum router serves them with the model's real tokenizer and template over
//! [`Echo`], a backend that streams canned tokens (and sometimes loses its worker mid-stream
//! or has no workers, so those paths run too).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use cleave_router::admit::{Admission, AdmitConfig};
use cleave_router::api::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use cleave_router::api::metrics::RouterMetrics;
use cleave_router::api::{router, ApiState};
use cleave_text::tokenizer::Tokenizer;
use cleave_text::ModelText;
use prometheus_client::registry::Registry;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{mutate, Cases, Tally};

/// The model name the in-process router serves (and the corpus asks for).
const MODEL: &str = "fuzz-model";
/// Longest a case may take before it counts as a hang.
const CASE_TIMEOUT: Duration = Duration::from_secs(20);

/// A backend that streams the same few tokens for every request.
pub struct Echo {
    tok: Arc<Tokenizer>,
    ids: Vec<u32>,
}

impl Echo {
    /// Streams the tokens of a fixed sentence.
    pub fn new(tok: Arc<Tokenizer>) -> Self {
        let ids = tok.encode("Hello! {\"a\": [1, 2]} 😀 done.", false);
        Echo { tok, ids }
    }
}

#[async_trait::async_trait]
impl Backend for Echo {
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError> {
        // A few prompts see the failure paths: no workers, or a worker failing mid-stream.
        let salt = req.prompt.len();
        if salt % 97 == 13 {
            return Err(BackendError::NoWorkers);
        }
        let vocab = self.tok.vocab_size().max(1) as u32;
        let n = req.params.max_tokens.min(self.ids.len());
        let k = req.params.logprobs.unwrap_or(0).min(20);
        let mut events: Vec<BackendEvent> = self.ids[..n]
            .iter()
            .map(|&id| BackendEvent::Token {
                id,
                text: self.tok.decode(&[id]),
                logprob: req.params.logprobs.map(|_| -0.5),
                top: (0..k)
                    .map(|j| ((id + j as u32) % vocab, -1.0 - j as f32))
                    .collect(),
            })
            .collect();
        events.push(if salt % 89 == 7 {
            // The worker died and the request could not be moved (a 503 by design).
            BackendEvent::Lost("fuzz: the worker failed".into())
        } else {
            BackendEvent::Finished {
                reason: if n < self.ids.len() {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                },
                prompt_tokens: req.prompt.len(),
                completion_tokens: n,
                cached_tokens: 0,
                text: String::new(),
            }
        });
        Ok(Box::pin(tokio_stream::iter(events)))
    }

    fn model_name(&self) -> &str {
        MODEL
    }

    fn healthy_decode_workers(&self) -> usize {
        1
    }
}

/// The in-process router: the model's tokenizer and template, [`Echo`] behind it.
pub fn app(model: &Path) -> anyhow::Result<axum::Router> {
    let text = ModelText::open(model).with_context(|| {
        format!(
            "loading {} (run `cleave model fetch`, or pass --model)",
            model.display()
        )
    })?;
    let mut registry = Registry::default();
    let metrics = Arc::new(RouterMetrics::new(&mut registry));
    let state = Arc::new(ApiState {
        backend: Arc::new(Echo::new(text.tokenizer.clone())),
        grammars: Arc::new(cleave_text::constrain::LazyGrammars::new(
            text.tokenizer.clone(),
            None,
        )),
        tokenizer: text.tokenizer,
        template: text.template,
        max_context: text.max_context,
        api_keys: None,
        admission: Admission::new(AdmitConfig::default(), metrics.queue_depth.clone()),
        metrics,
        registry: Arc::new(registry),
    });
    Ok(router(state))
}

/// Valid bodies the mutations start from.
fn corpus() -> Vec<Value> {
    let user = json!([{"role": "user", "content": "Say hello."}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}}}]);
    vec![
        json!({"model": MODEL, "messages": user, "max_tokens": 8}),
        json!({"model": MODEL, "messages": user, "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}, "temperature": 0.7, "top_p": 0.9,
               "seed": 3, "stop": ["\n", "done"], "n": 2}),
        json!({"model": MODEL, "messages": user, "logprobs": true, "top_logprobs": 3,
               "max_completion_tokens": 5, "frequency_penalty": 0.0, "user": "u"}),
        json!({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
               "tools": tools, "tool_choice": "auto", "parallel_tool_calls": true}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
               "tools": tools, "tool_choice": {"type": "function",
               "function": {"name": "get_weather"}}, "stream": true}),
        json!({"model": MODEL, "messages": user, "response_format": {"type": "json_schema",
               "json_schema": {"name": "r", "strict": true, "schema": {"type": "object",
               "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
               "required": ["a"]}}}}),
        json!({"model": MODEL, "messages": user, "response_format": {"type": "json_object"}}),
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "echo": true,
               "logprobs": 2}),
        json!({"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "stream": true,
               "n": 2}),
        json!({"model": MODEL, "prompt": ["a", "b"], "suffix": "x", "best_of": 1,
               "stop": "\n"}),
    ]
}

/// One request of the campaign.
struct Case {
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
}

fn case(rng: &mut StdRng, corpus: &[Value]) -> Case {
    let mut v = corpus.choose(rng).expect("corpus").clone();
    let chat = v.get("messages").is_some();
    let body = if rng.gen_bool(0.001) {
        // 10 MB: over the body limit, so refused whole.
        let big = "a".repeat(10 << 20);
        v["messages"] = json!([{"role": "user", "content": big}]);
        mutate::render(&v)
    } else {
        // A quarter stay valid JSON of the right shape except for the byte edits (or none).
        for _ in 0..*[0, 1, 1, 2, 3].choose(rng).expect("counts") {
            mutate::json(rng, &mut v);
        }
        let mut b = mutate::render(&v);
        if rng.gen_bool(0.33) {
            mutate::bytes(rng, &mut b);
        }
        b
    };
    let swap = rng.gen_bool(0.05);
    Case {
        path: if chat != swap {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        },
        content_type: match rng.gen_range(0..40) {
            0 => "text/plain",
            1 => "",
            2 => "application/json; charset=latin1",
            _ => "application/json",
        },
        body,
    }
}

/// Whether `v` is OpenAI's error object: `{"error": {"message": "...", "type": "..."}}`.
fn openai_error(v: &Value) -> bool {
    let e = &v["error"];
    e["message"].as_str().is_some_and(|m| !m.is_empty()) && e["type"].is_string()
}

/// Why a response is not acceptable, if it is not.
fn check(status: StatusCode, content_type: &str, body: &[u8]) -> Result<(), String> {
    let text = || {
        String::from_utf8_lossy(body)
            .chars()
            .take(300)
            .collect::<String>()
    };
    if status.is_server_error()
        && status != StatusCode::SERVICE_UNAVAILABLE
        && status != StatusCode::GATEWAY_TIMEOUT
    {
        return Err(format!("status {status}: {}", text()));
    }
    if !status.is_success() {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            format!(
                "status {status} with a body that is not JSON ({e}): {}",
                text()
            )
        })?;
        if !openai_error(&v) {
            return Err(format!("status {status} without OpenAI's error shape: {v}"));
        }
        return Ok(());
    }
    if content_type.starts_with("text/event-stream") {
        let text = std::str::from_utf8(body).map_err(|e| format!("SSE not UTF-8: {e}"))?;
        let mut last = None;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            last = Some(data);
            if data != "[DONE]" {
                serde_json::from_str::<Value>(data)
                    .map_err(|e| format!("SSE data not JSON ({e}): {data}"))?;
            }
        }
        // A stream ends with `[DONE]`, or with one error event in OpenAI's shape (a failure
        // after the headers went out).
        return match last {
            Some("[DONE]") => Ok(()),
            Some(data) if openai_error(&serde_json::from_str(data).unwrap_or_default()) => Ok(()),
            _ => Err(format!(
                "SSE stream without [DONE] or an error event: {}",
                text.trim_end()
            )),
        };
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("200 body not JSON ({e}): {}", text()))?;
    if !v["choices"].is_array() {
        return Err(format!("200 body without choices: {v}"));
    }
    Ok(())
}

/// A response, read to its end.
struct Answer {
    status: StatusCode,
    content_type: String,
    body: Vec<u8>,
}

/// A response's `content-type`, empty when absent.
fn content_type(headers: &axum::http::HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

async fn send_in_process(app: &axum::Router, c: &Case) -> Result<Answer, String> {
    let mut req = Request::post(c.path);
    if !c.content_type.is_empty() {
        req = req.header(header::CONTENT_TYPE, c.content_type);
    }
    let req = req
        .body(Body::from(c.body.clone()))
        .map_err(|e| e.to_string())?;
    let app = app.clone();
    // The handler runs in its own task so a panic in it is reported, not propagated.
    let task = tokio::spawn(async move {
        let resp = app.oneshot(req).await.expect("infallible");
        let status = resp.status();
        let content_type = content_type(resp.headers());
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .map_err(|e| format!("reading the body: {e}"))?;
        Ok::<_, String>(Answer {
            status,
            content_type,
            body: body.to_vec(),
        })
    });
    match tokio::time::timeout(CASE_TIMEOUT, task).await {
        Err(_) => Err(format!("no answer within {CASE_TIMEOUT:?}")),
        Ok(Err(e)) if e.is_panic() => Err(format!("the handler panicked: {e}")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(answer)) => answer,
    }
}

async fn send_url(client: &reqwest::Client, base: &str, c: &Case) -> Result<Answer, String> {
    let mut req = client
        .post(format!("{base}{}", c.path))
        .body(c.body.clone());
    if !c.content_type.is_empty() {
        req = req.header(header::CONTENT_TYPE, c.content_type);
    }
    let fut = async {
        let resp = req.send().await.map_err(|e| format!("sending: {e}"))?;
        let status = StatusCode::from_u16(resp.status().as_u16()).map_err(|e| e.to_string())?;
        let content_type = content_type(resp.headers());
        let body = resp.bytes().await.map_err(|e| format!("reading: {e}"))?;
        Ok(Answer {
            status,
            content_type,
            body: body.to_vec(),
        })
    };
    tokio::time::timeout(CASE_TIMEOUT, fut)
        .await
        .map_err(|_| format!("no answer within {CASE_TIMEOUT:?}"))?
}

fn outcome(tally: &mut Tally, case: u64, c: &Case, answer: Result<Answer, String>) {
    let shown = || {
        String::from_utf8_lossy(&c.body)
            .chars()
            .take(300)
            .collect::<String>()
    };
    match answer.and_then(|a| check(a.status, &a.content_type, &a.body).map(|()| a)) {
        Ok(a) => tally.ok(a.status.as_u16().to_string()),
        Err(e) => tally.fail(
            case,
            format!("{} {}: {e}; body: {}", c.path, c.content_type, shown()),
        ),
    }
}

/// Checks a server after the campaign: `/health` answers 200.
async fn healthy(get: impl std::future::Future<Output = Result<u16, String>>, tally: &mut Tally) {
    match get.await {
        Ok(200) => {}
        Ok(s) => tally.fail_after(format!("/health answered {s}")),
        Err(e) => tally.fail_after(format!("/health: {e}")),
    }
}

/// The campaign against the in-process router over `model`'s tokenizer and template.
pub fn fuzz_in_process(model: &Path, cases: Cases) -> anyhow::Result<Tally> {
    let app = app(model)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let corpus = corpus();
    rt.block_on(async {
        let mut tally = Tally::new("api");
        for i in cases.range() {
            let c = case(&mut cases.rng(i), &corpus);
            let answer = send_in_process(&app, &c).await;
            outcome(&mut tally, i, &c, answer);
        }
        let health = async {
            let req = Request::get("/health")
                .body(Body::empty())
                .expect("request");
            let resp = app.clone().oneshot(req).await.expect("infallible");
            Ok(resp.status().as_u16())
        };
        healthy(health, &mut tally).await;
        Ok(tally)
    })
}

/// The campaign over HTTP against a running endpoint at `url` (its model name is read from
/// `/v1/models`).
pub fn fuzz_url(url: &str, cases: Cases) -> anyhow::Result<Tally> {
    let rt = tokio::runtime::Runtime::new()?;
    let base = url.trim_end_matches('/').to_string();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let models = client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .with_context(|| format!("GET {base}/v1/models"))?
            .bytes()
            .await?;
        let models: Value = serde_json::from_slice(&models).context("/v1/models")?;
        let served = models["data"][0]["id"]
            .as_str()
            .context("/v1/models names no model")?
            .to_string();
        // The corpus names the served model, so mutations start from bodies it accepts.
        let corpus: Vec<Value> = corpus()
            .into_iter()
            .map(|mut v| {
                v["model"] = json!(served);
                v
            })
            .collect();
        let mut tally = Tally::new("api");
        for i in cases.range() {
            let c = case(&mut cases.rng(i), &corpus);
            let answer = send_url(&client, &base, &c).await;
            outcome(&mut tally, i, &c, answer);
        }
        let health = async {
            let r = client.get(format!("{base}/health")).send().await;
            r.map(|r| r.status().as_u16()).map_err(|e| e.to_string())
        };
        healthy(health, &mut tally).await;
        Ok(tally)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_refuses_what_the_api_must_not_answer() {
        let openai = br#"{"error":{"message":"bad","type":"invalid_request_error"}}"#;
        assert!(check(StatusCode::BAD_REQUEST, "application/json", openai).is_ok());
        assert!(check(StatusCode::SERVICE_UNAVAILABLE, "application/json", openai).is_ok());
        assert!(check(
            StatusCode::INTERNAL_SERVER_ERROR,
            "application/json",
            openai
        )
        .is_err());
        assert!(check(StatusCode::BAD_REQUEST, "text/plain", b"Bad Request").is_err());
        assert!(check(
            StatusCode::BAD_REQUEST,
            "application/json",
            br#"{"error":"x"}"#
        )
        .is_err());
        let sse = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
        assert!(check(StatusCode::OK, "text/event-stream", sse).is_ok());
        assert!(check(StatusCode::OK, "text/event-stream", b"data: {\"a\":1}\n\n").is_err());
        assert!(check(StatusCode::OK, "text/event-stream", b"data: {oops\n\n").is_err());
        let failed = b"data: {\"a\":1}\n\ndata: {\"error\":{\"message\":\"m\",\"type\":\"t\"}}\n\n";
        assert!(check(StatusCode::OK, "text/event-stream", failed).is_ok());
        assert!(check(StatusCode::OK, "application/json", br#"{"id":"x"}"#).is_err());
    }
}
