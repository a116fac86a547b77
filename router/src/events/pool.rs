//! A pool of OpenAI-compatible engine pods (vLLM, SGLang) placed by the router's policy.
//!
//! Each pod is an HTTP endpoint plus a KV-event [`Source`]. The pool adds every pod to the
//! [`Cluster`] as a worker that prefills and decodes (engines do not take cleave's remote
//! prefill, so the pool never disaggregates), follows its events into the prefix index
//! ([`super::subscribe`]) and probes `GET /health` for its health. [`Pool`] is the router's
//! [`Backend`] in this mode: it tokenizes nothing itself (the API layer did, with the same
//! model's tokenizer), hashes the prompt the router's way, places it with the configured
//! policy over the index and the router's own in-flight charges, and forwards it to the chosen
//! pod's `/v1/completions` as token ids, streaming the text back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cleave_kv_index::WorkerId;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::chain::ChainConfig;
use super::feed::FeedStats;
use super::subscribe::{self, Source};
use crate::api::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, BackendStream, FinishReason,
};
use crate::dispatch::Cluster;
use crate::place::Reservation;
use crate::place::{PlaceError, Policy, Role};

/// One engine pod: where it serves and where it publishes KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSpec {
    /// Its OpenAI-compatible HTTP base URL, e.g. `http://10.0.0.7:8000`.
    pub url: String,
    /// Its KV-event publisher.
    pub events: Source,
}

/// Defaults for [`PodSpec::parse`]: the ports of the engines' `--kv-events-config`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodDefaults {
    /// The PUB port on the pod's host (vLLM's default endpoint is `tcp://*:5557`).
    pub events_port: u16,
    /// The replay (ROUTER) port, if the engines run one.
    pub replay_port: Option<u16>,
    /// The topic.
    pub topic: String,
    /// How long a replay answer may take.
    pub replay_timeout: Duration,
}

impl Default for PodDefaults {
    fn default() -> Self {
        Self {
            events_port: 5557,
            replay_port: None,
            topic: String::new(),
            replay_timeout: Duration::from_secs(2),
        }
    }
}

/// A `--kv-events-pod` that does not parse; the message quotes it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodSpecError {
    /// It does not start with the engine's `http://` URL.
    #[error("pod {spec:?}: expected an http:// URL first")]
    NoUrl {
        /// The spec.
        spec: String,
    },
    /// A part after the URL without `=`.
    #[error("pod {spec:?}: {part:?} is not key=value")]
    NotKeyValue {
        /// The spec.
        spec: String,
        /// The part.
        part: String,
    },
    /// `events=` or `replay=` that is not a ZeroMQ `tcp://` endpoint.
    #[error("pod {spec:?}: {key} must be a tcp:// endpoint")]
    NotTcp {
        /// The spec.
        spec: String,
        /// `events` or `replay`.
        key: String,
    },
    /// A key other than `events`, `replay` and `topic`.
    #[error("pod {spec:?}: unknown key {key:?} (events, replay, topic)")]
    UnknownKey {
        /// The spec.
        spec: String,
        /// The key.
        key: String,
    },
}

/// Why the pool of engine pods could not start.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The HTTP client for the pods' health and requests.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
    /// A pod's URL.
    #[error(transparent)]
    Endpoint(#[from] crate::dispatch::BadEndpoint),
    /// A `--kv-events-pod` spec.
    #[error("--kv-events-pod: {0}")]
    Spec(#[from] PodSpecError),
}

impl PodSpec {
    /// Parses `URL[,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT][,topic=T]`; the event
    /// endpoints default to the URL's host with `defaults`' ports.
    pub fn parse(s: &str, defaults: &PodDefaults) -> Result<PodSpec, PodSpecError> {
        let spec = || s.to_string();
        let mut parts = s.split(',');
        let url = parts
            .next()
            .unwrap_or_default()
            .trim()
            .trim_end_matches('/');
        let host = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"))
            .and_then(|rest| rest.split('/').next())
            .filter(|authority| !authority.is_empty())
            .ok_or_else(|| PodSpecError::NoUrl { spec: spec() })?;
        // The host without the port (an IPv6 literal keeps its brackets).
        let host = match host.rfind(':') {
            Some(i) if !host[i..].contains(']') => &host[..i],
            _ => host,
        };
        let mut events = Source::new(format!("tcp://{host}:{}", defaults.events_port));
        events.replay = defaults.replay_port.map(|p| format!("tcp://{host}:{p}"));
        events.topic = defaults.topic.clone();
        events.replay_timeout = defaults.replay_timeout;
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| PodSpecError::NotKeyValue {
                    spec: spec(),
                    part: part.to_string(),
                })?;
            let zmq = |v: &str| {
                if v.starts_with("tcp://") {
                    Ok(v.to_string())
                } else {
                    Err(PodSpecError::NotTcp {
                        spec: spec(),
                        key: key.to_string(),
                    })
                }
            };
            match key.trim() {
                "events" => events.events = zmq(value.trim())?,
                "replay" => events.replay = Some(zmq(value.trim())?),
                "topic" => events.topic = value.to_string(),
                other => {
                    return Err(PodSpecError::UnknownKey {
                        spec: spec(),
                        key: other.to_string(),
                    })
                }
            }
        }
        Ok(PodSpec {
            url: url.to_string(),
            events,
        })
    }
}

/// The router's backend over a pool of engine pods.
pub struct Pool {
    cluster: Arc<Cluster>,
    policy: Box<dyn Policy>,
    model: String,
    client: reqwest::Client,
    urls: HashMap<WorkerId, String>,
    feeds: HashMap<WorkerId, watch::Receiver<FeedStats>>,
}

impl Pool {
    /// Adds `pods` to `cluster` (ids 0, 1, … in order), starts following their events and
    /// health until `shutdown`, and places with `policy` (built without disaggregation).
    pub fn start(
        pods: &[PodSpec],
        chain: &ChainConfig,
        cluster: Arc<Cluster>,
        policy: Box<dyn Policy>,
        model: String,
        shutdown: CancellationToken,
    ) -> Result<Pool, PoolError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()?;
        let mut urls = HashMap::new();
        let mut feeds = HashMap::new();
        for (i, pod) in pods.iter().enumerate() {
            let id = WorkerId(i as u64);
            cluster.add(id, Role::Both, &pod.url)?;
            let rx = subscribe::spawn(
                cluster.clone(),
                id,
                pod.events.clone(),
                chain.clone(),
                shutdown.clone(),
            );
            cluster.spawn(probe(
                cluster.clone(),
                client.clone(),
                id,
                pod.url.clone(),
                shutdown.clone(),
            ));
            tracing::info!(worker = %id, url = %pod.url, events = %pod.events.events, replay = ?pod.events.replay, "engine pod added");
            urls.insert(id, pod.url.clone());
            feeds.insert(id, rx);
        }
        Ok(Pool {
            cluster,
            policy,
            model,
            client,
            urls,
            feeds,
        })
    }

    /// The KV-event counters of `worker`'s feed, updated after every message.
    pub fn feed(&self, worker: WorkerId) -> Option<watch::Receiver<FeedStats>> {
        self.feeds.get(&worker).cloned()
    }

    /// The placement state.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Places a prompt: the chosen pod and what is now counted against it.
    pub fn place(
        &self,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Result<(WorkerId, Reservation), PlaceError> {
        let (placement, reservation) =
            self.cluster
                .placement()
                .place_prompt(prompt, max_tokens, |req, view| {
                    let mut placement = self.policy.place(req, view)?;
                    // Engines prefill what they decode.
                    if placement.prefill.take().is_some() {
                        placement.cached_blocks =
                            req.matches.matched(placement.decode).min(req.prompt_blocks);
                    }
                    Ok(placement)
                })?;
        Ok((placement.decode, reservation))
    }

    fn body(&self, req: &BackendRequest) -> serde_json::Value {
        let p = &req.params;
        let mut body = serde_json::json!({
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let o = body.as_object_mut().expect("object");
        if p.top_k > 0 {
            o.insert("top_k".into(), p.top_k.into());
        }
        if let Some(seed) = p.seed {
            o.insert("seed".into(), seed.into());
        }
        if !p.stop.is_empty() {
            o.insert("stop".into(), p.stop.clone().into());
        }
        if !p.stop_token_ids.is_empty() {
            o.insert("stop_token_ids".into(), p.stop_token_ids.clone().into());
        }
        if p.ignore_eos {
            o.insert("ignore_eos".into(), true.into());
        }
        body
    }
}

#[async_trait::async_trait]
impl Backend for Pool {
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError> {
        if req.params.logprobs.is_some() {
            return Err(BackendError::BadRequest(
                "logprobs are not supported when routing to engine pods".into(),
            ));
        }
        let body = self.body(&req);
        // An unreachable pod is marked unhealthy and the request placed again (nothing has
        // been streamed yet).
        for _attempt in 0..4 {
            let (pod, release) = match self.place(&req.prompt, req.params.max_tokens) {
                Ok(p) => p,
                Err(PlaceError::NoDecodeWorker) => return Err(BackendError::NoWorkers),
            };
            let url = self.urls.get(&pod).ok_or(BackendError::NoWorkers)?;
            tracing::debug!(%pod, %url, "placed on engine pod");
            let sent = self
                .client
                .post(format!("{url}/v1/completions"))
                .header("x-request-id", &req.request_id)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_string())
                .send()
                .await;
            let resp = match sent {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(%pod, error = %e, "engine pod unreachable: placing the request again");
                    self.cluster.placement().set_healthy(pod, false);
                    continue;
                }
            };
            let status = resp.status();
            if status.is_client_error() {
                let text = resp.text().await.unwrap_or_default();
                return Err(BackendError::BadRequest(error_message(&text)));
            }
            if !status.is_success() {
                let text = resp.text().await.unwrap_or_default();
                tracing::warn!(%pod, %status, body = %error_message(&text), "engine pod refused the request: placing it again");
                continue;
            }
            let (tx, rx) = mpsc::channel(64);
            let prompt_tokens = req.prompt.len();
            self.cluster.spawn(relay(resp, tx, release, prompt_tokens));
            return Ok(Box::pin(ReceiverStream::new(rx)));
        }
        Err(BackendError::Unavailable("no engine pod answered".into()))
    }

    fn model_name(&self) -> &str {
        &self.model
    }

    fn healthy_decode_workers(&self) -> usize {
        self.cluster.placement().healthy_decode_workers()
    }
}

/// The `message` of an OpenAI-style error body, else the body itself (shortened).
fn error_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.pointer("/message"))
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.chars().take(200).collect())
}

/// Streams the pod's server-sent events as backend events until the end, an error, or the
/// receiver going away (which drops the response and so cancels the request on the pod). The
/// charge is given back before the last event, so a caller that saw it sees the load gone.
async fn relay(
    resp: reqwest::Response,
    tx: mpsc::Sender<BackendEvent>,
    mut release: Reservation,
    prompt_tokens: usize,
) {
    let last = relay_until_end(resp, &tx, &mut release, prompt_tokens).await;
    drop(release);
    if let Some(ev) = last {
        let _ = tx.send(ev).await;
    }
}

/// Sends the tokens; returns the final event (`None`: the receiver went away).
async fn relay_until_end(
    mut resp: reqwest::Response,
    tx: &mpsc::Sender<BackendEvent>,
    release: &mut Reservation,
    prompt_tokens: usize,
) -> Option<BackendEvent> {
    let mut buf: Vec<u8> = Vec::new();
    let mut state = Relay {
        prompt_tokens,
        ..Default::default()
    };
    loop {
        let chunk = tokio::select! {
            _ = tx.closed() => return None,
            c = resp.chunk() => c,
        };
        let chunk = match chunk {
            Ok(Some(c)) => c,
            Ok(None) => return Some(state.end(release)),
            Err(e) => {
                return Some(BackendEvent::Error(format!(
                    "engine pod stream failed: {e}"
                )))
            }
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                return Some(state.end(release));
            }
            for ev in state.on_chunk(data) {
                match ev {
                    BackendEvent::Error(_) => return Some(ev),
                    BackendEvent::Token { .. } => release.prefill_done(),
                    _ => {}
                }
                if tx.send(ev).await.is_err() {
                    return None;
                }
            }
        }
    }
}

/// What a stream has said so far.
#[derive(Debug, Default)]
struct Relay {
    prompt_tokens: usize,
    completion_tokens: Option<usize>,
    /// `None` until the pod reports it (vLLM only with `--enable-prompt-tokens-details`).
    cached_tokens: Option<usize>,
    tokens_seen: usize,
    reason: Option<FinishReason>,
}

impl Relay {
    /// One `data:` payload of `/v1/completions` streaming.
    fn on_chunk(&mut self, data: &str) -> Vec<BackendEvent> {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            return vec![BackendEvent::Error(format!(
                "engine pod sent a bad event: {}",
                data.chars().take(100).collect::<String>()
            ))];
        };
        if let Some(msg) = v.pointer("/error/message").and_then(|m| m.as_str()) {
            return vec![BackendEvent::Error(format!("engine pod: {msg}"))];
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let n = |p: &str| u.pointer(p).and_then(|x| x.as_u64()).map(|x| x as usize);
            if let Some(p) = n("/prompt_tokens") {
                self.prompt_tokens = p;
            }
            self.completion_tokens = n("/completion_tokens").or(self.completion_tokens);
            self.cached_tokens = n("/prompt_tokens_details/cached_tokens");
        }
        let mut out = Vec::new();
        let choice = v.pointer("/choices/0");
        if let Some(text) = choice.and_then(|c| c.get("text")).and_then(|t| t.as_str()) {
            if !text.is_empty() {
                self.tokens_seen += 1;
                out.push(BackendEvent::Token {
                    // The pods stream text, not token ids (only logprobs would need them).
                    id: 0,
                    text: text.to_string(),
                    logprob: None,
                    top: Vec::new(),
                });
            }
        }
        if let Some(r) = choice
            .and_then(|c| c.get("finish_reason"))
            .and_then(|r| r.as_str())
        {
            self.reason = Some(match r {
                "length" => FinishReason::Length,
                "stop" => FinishReason::Stop,
                _ => FinishReason::Aborted,
            });
        }
        out
    }

    /// The final event, after correcting the router's guess of the prefill work with what the
    /// pod says it had cached (when it says, and when a token came: the prefill ran).
    fn end(&self, release: &mut Reservation) -> BackendEvent {
        let completed = self.completion_tokens.unwrap_or(self.tokens_seen);
        if let (Some(cached), true) = (self.cached_tokens, completed > 0) {
            release.prefill_measured(cached);
        }
        self.finished()
    }

    fn finished(&self) -> BackendEvent {
        BackendEvent::Finished {
            reason: self.reason.unwrap_or(FinishReason::Aborted),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens.unwrap_or(self.tokens_seen),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            text: String::new(),
        }
    }
}

/// Marks `worker` healthy while `GET {url}/health` answers 2xx (checked every second).
async fn probe(
    cluster: Arc<Cluster>,
    client: reqwest::Client,
    worker: WorkerId,
    url: String,
    shutdown: CancellationToken,
) {
    let health = format!("{url}/health");
    let mut was = None;
    loop {
        let ok = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = client.get(&health).timeout(Duration::from_secs(2)).send() => {
                r.is_ok_and(|r| r.status().is_success())
            }
        };
        if was != Some(ok) {
            tracing::info!(%worker, %url, healthy = ok, "engine pod health");
            was = Some(ok);
        }
        cluster.placement().set_healthy(worker, ok);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_specs_parse_with_defaults_and_overrides() {
        let d = PodDefaults {
            replay_port: Some(5558),
            ..Default::default()
        };
        let p = PodSpec::parse("http://10.1.2.3:8000/", &d).unwrap();
        assert_eq!(p.url, "http://10.1.2.3:8000");
        assert_eq!(p.events.events, "tcp://10.1.2.3:5557");
        assert_eq!(p.events.replay.as_deref(), Some("tcp://10.1.2.3:5558"));
        let p = PodSpec::parse(
            "http://[::1]:8000,events=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2,topic=kv",
            &PodDefaults::default(),
        )
        .unwrap();
        assert_eq!(p.events.events, "tcp://127.0.0.1:1");
        assert_eq!(p.events.replay.as_deref(), Some("tcp://127.0.0.1:2"));
        assert_eq!(p.events.topic, "kv");
        let v6 = PodSpec::parse("http://[::1]:8000", &PodDefaults::default()).unwrap();
        assert_eq!(v6.events.events, "tcp://[::1]:5557");
        for bad in [
            "10.0.0.1:8000",
            "http://h:1,events=h:2",
            "http://h:1,foo=1",
            "http://h:1,x",
        ] {
            assert!(PodSpec::parse(bad, &d).is_err(), "{bad}");
        }
    }

    /// A reservation for a 5-block prompt the index said pod 0 held 4 blocks of.
    fn reserved() -> (Arc<Cluster>, Reservation) {
        let cluster = Arc::new(Cluster::default());
        cluster
            .placement()
            .with_view(|view| view.upsert(WorkerId(0), Role::Both));
        let prompt: Vec<u32> = (0..70).collect();
        let placement = crate::place::Placement {
            prefill: None,
            decode: WorkerId(0),
            cached_blocks: 4,
        };
        let (_, r) = cluster
            .placement()
            .place_prompt(&prompt, 4, |_, _| {
                Ok::<_, std::convert::Infallible>(placement)
            })
            .unwrap();
        (cluster, r)
    }

    fn recent(cluster: &Cluster) -> f64 {
        cluster
            .placement()
            .with_view(|view| view.get(WorkerId(0)).unwrap().recent_prefill_blocks)
    }

    #[test]
    fn the_pods_cached_tokens_correct_the_recent_prefill_work() {
        let usage = |details: &str| {
            format!(
                r#"{{"choices":[],"usage":{{"prompt_tokens":70,"completion_tokens":1{details}}}}}"#
            )
        };
        // The pod had nothing cached: it computed all 5 blocks, not the 1 charged.
        let (cluster, mut res) = reserved();
        assert_eq!(recent(&cluster), 1.0);
        let mut r = Relay::default();
        r.on_chunk(&usage(r#","prompt_tokens_details":{"cached_tokens":0}"#));
        r.end(&mut res);
        assert_eq!(recent(&cluster), 5.0);
        // A pod that does not report cached tokens leaves the router's guess alone.
        let (cluster, mut res) = reserved();
        let mut r = Relay::default();
        r.on_chunk(&usage(""));
        r.end(&mut res);
        assert_eq!(recent(&cluster), 1.0);
        // Nor does a request that produced no token (its prefill may never have run).
        let (cluster, mut res) = reserved();
        let mut r = Relay::default();
        r.on_chunk(r#"{"choices":[],"usage":{"prompt_tokens":70,"completion_tokens":0,"prompt_tokens_details":{"cached_tokens":0}}}"#);
        r.end(&mut res);
        assert_eq!(recent(&cluster), 1.0);
    }

    #[test]
    fn completion_stream_chunks_become_backend_events() {
        let mut r = Relay {
            prompt_tokens: 5,
            ..Default::default()
        };
        let ev = r.on_chunk(r#"{"choices":[{"index":0,"text":" Paris","finish_reason":null}]}"#);
        assert!(matches!(&ev[..], [BackendEvent::Token { text, .. }] if text == " Paris"));
        assert!(r
            .on_chunk(r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#)
            .is_empty());
        r.on_chunk(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#);
        assert_eq!(
            r.finished(),
            BackendEvent::Finished {
                reason: FinishReason::Length,
                prompt_tokens: 7,
                completion_tokens: 3,
                cached_tokens: 4,
                text: String::new()
            }
        );
        assert!(matches!(
            &r.on_chunk("{not json")[..],
            [BackendEvent::Error(_)]
        ));
        assert_eq!(
            error_message(r#"{"error":{"message":"too long"}}"#),
            "too long"
        );
    }
}
