//! One streamed request against an OpenAI-compatible endpoint, timed token by token.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::sse::{classify, SseEvent, SseParser};
use crate::tokens::Prompt;
use crate::workload::RequestSpec;

/// Which OpenAI route to call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `/v1/completions` (token-id or text prompts).
    Completions,
    /// `/v1/chat/completions` (the prompt as one user message; text prompts only).
    Chat,
}

/// Where and how to send.
#[derive(Clone, Debug)]
pub struct Target {
    /// Base URL up to and including `/v1`.
    pub base: String,
    /// The `model` field.
    pub model: String,
    /// The route.
    pub api: Api,
    /// Send `ignore_eos: true` so outputs have exactly `max_tokens` tokens.
    pub ignore_eos: bool,
    /// Per-request timeout.
    pub timeout: Duration,
}

/// The outcome of one request.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestResult {
    /// When it was sent, seconds from the start of the load point.
    pub sent_s: f64,
    /// Time to first token, seconds (None: no token arrived).
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive token chunks, seconds.
    pub itl_s: Vec<f64>,
    /// Send to end of stream, seconds.
    pub e2e_s: f64,
    /// Generated tokens (the usage chunk's count, else the token chunks counted).
    pub output_tokens: u64,
    /// Prompt tokens (usage, else as built).
    pub prompt_tokens: u64,
    /// Prompt tokens the server served from its prefix cache, if it reports them.
    pub cached_tokens: Option<u64>,
    /// The kind of error, None on success.
    pub error: Option<String>,
}

/// Sends `spec` and streams the answer.
pub async fn send(
    client: &reqwest::Client,
    target: &Target,
    spec: &RequestSpec,
    t0: Instant,
) -> RequestResult {
    let start = Instant::now();
    let mut r = RequestResult {
        sent_s: start.duration_since(t0).as_secs_f64(),
        prompt_tokens: spec.prompt_tokens as u64,
        ..RequestResult::default()
    };
    let mut body = serde_json::json!({
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if target.ignore_eos {
        body["ignore_eos"] = true.into();
    }
    let route = match (target.api, &spec.prompt) {
        (Api::Completions, Prompt::Tokens(ids)) => {
            body["prompt"] = serde_json::json!(ids);
            "completions"
        }
        (Api::Completions, Prompt::Text(t)) => {
            body["prompt"] = t.as_str().into();
            "completions"
        }
        (Api::Chat, Prompt::Text(t)) => {
            body["messages"] = serde_json::json!([{"role": "user", "content": t}]);
            "chat/completions"
        }
        (Api::Chat, Prompt::Tokens(_)) => {
            r.error = Some("config: chat needs text prompts".into());
            return r;
        }
    };
    let url = format!("{}/{route}", target.base.trim_end_matches('/'));
    let outcome =
        tokio::time::timeout(target.timeout, stream(client, &url, &body, start, &mut r)).await;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(kind)) => r.error = Some(kind),
        Err(_) => r.error = Some("timeout".into()),
    }
    r.e2e_s = start.elapsed().as_secs_f64();
    if r.error.is_none() && r.ttft_s.is_none() {
        r.error = Some("no_tokens".into());
    }
    r
}

async fn stream(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    start: Instant,
    r: &mut RequestResult,
) -> Result<(), String> {
    let mut resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| {
            if e.is_connect() {
                "connect".to_string()
            } else {
                "send".to_string()
            }
        })?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("http_{}", status.as_u16()));
    }
    let mut parser = SseParser::default();
    let mut last: Option<Instant> = None;
    let mut chunks = 0u64;
    let mut usage_completion = None;
    loop {
        let bytes = match resp.chunk().await {
            Ok(Some(b)) => b,
            Ok(None) => return Err("stream_ended_early".into()),
            Err(_) => return Err("stream_broken".into()),
        };
        let now = Instant::now();
        for data in parser.feed(&bytes) {
            match classify(&data) {
                SseEvent::Token => {
                    chunks += 1;
                    match last {
                        None => r.ttft_s = Some(now.duration_since(start).as_secs_f64()),
                        Some(prev) => r.itl_s.push(now.duration_since(prev).as_secs_f64()),
                    }
                    last = Some(now);
                }
                SseEvent::Usage {
                    prompt,
                    completion,
                    cached,
                } => {
                    if prompt > 0 {
                        r.prompt_tokens = prompt;
                    }
                    usage_completion = Some(completion);
                    r.cached_tokens = cached;
                }
                SseEvent::Other => {}
                SseEvent::Error(_) => return Err("stream_error".into()),
                SseEvent::Done => {
                    r.output_tokens = usage_completion.unwrap_or(chunks);
                    return Ok(());
                }
            }
        }
    }
}
