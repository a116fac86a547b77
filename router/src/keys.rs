//! API keys (`--api-keys-file`) and their per-key limits, checked by the API layer when it
//! admits a request ([`crate::admit`]).
//!
//! The file has one key per line; after the key, optional whitespace-separated fields set
//! the key's limits and its metrics name (docs/security.md):
//!
//! ```text
//! # comment lines and blank lines are ignored
//! sk-plain-key
//! sk-team-a  rpm=60 tpm=90000 concurrency=4 name=team-a
//! ```
//!
//! A file of bare keys (the older format) reads as keys without limits.
//!
//! Limits are token buckets that refill continuously: `rpm=N` holds N requests and refills N
//! per minute, `tpm=N` the same in tokens, `concurrency=N` caps the key's requests in
//! flight. A request reserves `prompt + n·max_tokens` tokens once it is tokenized and gives
//! back what it did not use when it ends with usage ([`KeyLease::settle`]); a request that
//! ends without usage (an error, a client that left) keeps its whole reservation.
//!
//! Keys are held as SHA-256 digests: a presented key is hashed and looked up by digest, so
//! lookup time depends on the digest, never on how much of a real key the client guessed,
//! and the keys themselves are not kept in memory or logged. [`Keys::reload`] reads the file
//! again; keys that stay keep their buckets (with the usage in the current window carried
//! over to the new limits) and their requests in flight.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

/// A key's limits; `None`: unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// Requests per minute (`rpm=`).
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute, prompt plus completion (`tpm=`).
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once (`concurrency=`).
    pub concurrency: Option<u64>,
}

/// Why the keys file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The file could not be read.
    #[error("reading {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line is malformed (the message never repeats the key).
    #[error("{}:{line}: {message}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The file holds no key.
    #[error("{} holds no API keys", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// Which limit refused a request (the `limit` label of the per-key metrics).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
    /// Requests in flight.
    Concurrency,
}

impl EncodeLabelValue for LimitKind {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        let s = match self {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
            LimitKind::Concurrency => "concurrency",
        };
        std::fmt::Write::write_str(encoder, s)
    }
}

/// A continuously refilling bucket of `capacity` units, `capacity` per minute.
#[derive(Clone, Debug)]
struct Bucket {
    capacity: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(per_minute: u64, now: Instant) -> Self {
        Bucket {
            capacity: per_minute as f64,
            level: per_minute as f64,
            at: now,
        }
    }

    fn per_sec(&self) -> f64 {
        self.capacity / 60.0
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_sec()).min(self.capacity);
        self.at = now;
    }

    /// Changes the limit, keeping what was used in the current window.
    fn set_capacity(&mut self, per_minute: u64, now: Instant) {
        self.refill(now);
        let used = self.capacity - self.level;
        self.capacity = per_minute as f64;
        self.level = (self.capacity - used).max(0.0);
    }

    /// Takes `n` units, or says how long until they are there (`None`: never, `n` exceeds
    /// the capacity).
    fn take(&mut self, n: f64, now: Instant) -> Result<(), Option<Duration>> {
        self.refill(now);
        if n > self.capacity {
            return Err(None);
        }
        if self.level >= n {
            self.level -= n;
            return Ok(());
        }
        Err(Some(Duration::from_secs_f64(
            (n - self.level) / self.per_sec(),
        )))
    }

    /// Returns `n` units (negative: takes them unconditionally, e.g. usage above the
    /// reservation).
    fn give_back(&mut self, n: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level + n).min(self.capacity);
    }

    fn status(&self) -> BucketStatus {
        BucketStatus {
            limit: self.capacity as u64,
            remaining: self.level.max(0.0).floor() as u64,
            reset: Duration::from_secs_f64(
                ((self.capacity - self.level) / self.per_sec()).max(0.0),
            ),
        }
    }
}

/// One limit's state, as OpenAI's `x-ratelimit-*` headers report it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketStatus {
    /// The limit per minute.
    pub limit: u64,
    /// What is left now.
    pub remaining: u64,
    /// How long until the bucket is full again.
    pub reset: Duration,
}

/// A key's limits as seen by one request: the `x-ratelimit-*` headers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateStatus {
    /// The requests-per-minute limit, if the key has one.
    pub requests: Option<BucketStatus>,
    /// The tokens-per-minute limit, if the key has one.
    pub tokens: Option<BucketStatus>,
}

impl RateStatus {
    /// Adds `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the limits the key has.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (kind, status) in [("requests", self.requests), ("tokens", self.tokens)] {
            let Some(s) = status else { continue };
            for (what, value) in [
                ("limit", s.limit.to_string()),
                ("remaining", s.remaining.to_string()),
                ("reset", openai_duration(s.reset)),
            ] {
                let name = HeaderName::try_from(format!("x-ratelimit-{what}-{kind}"))
                    .expect("static header name");
                headers.insert(name, HeaderValue::try_from(value).expect("ascii value"));
            }
        }
    }
}

/// A duration the way OpenAI's reset headers write it: `250ms`, `1.5s`, `6m0s`.
pub fn openai_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64();
    let minutes = (secs / 60.0).floor();
    let rest = secs - minutes * 60.0;
    let rest = format!("{:.3}", rest);
    let rest = rest.trim_end_matches('0').trim_end_matches('.');
    if minutes >= 1.0 {
        format!("{minutes}m{rest}s")
    } else {
        format!("{rest}s")
    }
}

/// A request refused by one of its key's limits: HTTP 429 with `Retry-After` and the
/// `x-ratelimit-*` headers.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Limited {
    /// The limit that refused it.
    pub kind: LimitKind,
    /// For the client.
    pub message: String,
    /// When to try again.
    pub retry_after: Duration,
    /// The key's limits now.
    pub status: RateStatus,
}

impl Limited {
    /// `Retry-After` in whole seconds, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }
}

#[derive(Debug)]
struct KeyState {
    limits: KeyLimits,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    in_flight: u64,
}

impl KeyState {
    fn new(limits: KeyLimits, now: Instant) -> Self {
        KeyState {
            requests: limits.requests_per_minute.map(|n| Bucket::full(n, now)),
            tokens: limits.tokens_per_minute.map(|n| Bucket::full(n, now)),
            limits,
            in_flight: 0,
        }
    }

    fn set_limits(&mut self, limits: KeyLimits, now: Instant) {
        let update = |b: &mut Option<Bucket>, n: Option<u64>| match (b.as_mut(), n) {
            (Some(b), Some(n)) => b.set_capacity(n, now),
            (_, n) => *b = n.map(|n| Bucket::full(n, now)),
        };
        update(&mut self.requests, limits.requests_per_minute);
        update(&mut self.tokens, limits.tokens_per_minute);
        self.limits = limits;
    }

    fn status(&self) -> RateStatus {
        RateStatus {
            requests: self.requests.as_ref().map(Bucket::status),
            tokens: self.tokens.as_ref().map(Bucket::status),
        }
    }
}

/// One configured key: its limits and their state.
#[derive(Debug)]
pub struct KeyEntry {
    label: Mutex<String>,
    state: Mutex<KeyState>,
    metrics: Option<Arc<KeyMetrics>>,
}

impl KeyEntry {
    /// The key's metrics name: `name=` from the file, else `key-` and 8 hex digits of its
    /// digest (never the key).
    pub fn label(&self) -> String {
        self.label.lock().expect("key label").clone()
    }

    /// The key's limits in force.
    pub fn limits(&self) -> KeyLimits {
        self.state.lock().expect("key state").limits
    }

    fn refuse(&self, kind: LimitKind, message: String, retry_after: Duration) -> Limited {
        let status = self.state.lock().expect("key state").status();
        if let Some(m) = &self.metrics {
            m.limited
                .get_or_create(&LimitedLabels {
                    key: self.label(),
                    limit: kind,
                })
                .inc();
        }
        Limited {
            kind,
            message,
            retry_after,
            status,
        }
    }

    /// Admits one request of this key: takes a concurrency slot and one request from the
    /// requests-per-minute bucket, or says which limit refuses it.
    pub fn admit(self: &Arc<Self>) -> Result<KeyLease, Limited> {
        let now = Instant::now();
        let mut s = self.state.lock().expect("key state");
        if let Some(cap) = s.limits.concurrency {
            if s.in_flight >= cap {
                drop(s);
                return Err(self.refuse(
                    LimitKind::Concurrency,
                    format!(
                        "this API key has {cap} requests in flight, its concurrency limit; \
                         retry when one finishes"
                    ),
                    Duration::from_secs(1),
                ));
            }
        }
        if let Some(b) = s.requests.as_mut() {
            if let Err(wait) = b.take(1.0, now) {
                let limit = b.capacity as u64;
                drop(s);
                let wait = wait.unwrap_or(Duration::from_secs(60));
                return Err(self.refuse(
                    LimitKind::Requests,
                    format!(
                        "rate limit reached for requests: this API key's limit is {limit} \
                         requests per minute; retry in {}",
                        openai_duration(wait)
                    ),
                    wait,
                ));
            }
        }
        s.in_flight += 1;
        let status = s.status();
        drop(s);
        if let Some(m) = &self.metrics {
            m.requests
                .get_or_create(&KeyLabels { key: self.label() })
                .inc();
        }
        Ok(KeyLease {
            entry: self.clone(),
            took_request: true,
            reserved: 0,
            status,
        })
    }
}

/// An admitted request of a key: holds its concurrency slot (freed on drop) and its token
/// reservation.
#[derive(Debug)]
pub struct KeyLease {
    entry: Arc<KeyEntry>,
    took_request: bool,
    reserved: u64,
    status: RateStatus,
}

impl KeyLease {
    /// The key's limits as of this request's admission and reservation.
    pub fn status(&self) -> RateStatus {
        self.status
    }

    /// Reserves `tokens` from the tokens-per-minute bucket. When refused, the request taken
    /// at admission is given back (a refused request counts against one limit, not two).
    pub fn reserve_tokens(&mut self, tokens: u64) -> Result<(), Limited> {
        let now = Instant::now();
        let mut s = self.entry.state.lock().expect("key state");
        if let Some(b) = s.tokens.as_mut() {
            if let Err(wait) = b.take(tokens as f64, now) {
                let limit = b.capacity as u64;
                if let (Some(r), true) = (s.requests.as_mut(), self.took_request) {
                    r.give_back(1.0, now);
                    self.took_request = false;
                }
                drop(s);
                let (message, wait) = match wait {
                    Some(w) => (
                        format!(
                            "rate limit reached for tokens: this request needs {tokens} \
                             tokens (prompt + max_tokens) and this API key's limit is {limit} \
                             tokens per minute; retry in {}",
                            openai_duration(w)
                        ),
                        w,
                    ),
                    None => (
                        format!(
                            "request too large: it needs {tokens} tokens (prompt + \
                             max_tokens), more than this API key's limit of {limit} tokens \
                             per minute; shorten the prompt or lower max_tokens"
                        ),
                        Duration::from_secs(60),
                    ),
                };
                return Err(self.entry.refuse(LimitKind::Tokens, message, wait));
            }
        }
        self.reserved += tokens;
        self.status = s.status();
        Ok(())
    }

    /// The request ended having used `tokens` (prompt + completion): the unused part of the
    /// reservation goes back to the bucket (usage above it is taken).
    pub fn settle(&mut self, tokens: u64) {
        let now = Instant::now();
        let unused = self.reserved as f64 - tokens as f64;
        self.reserved = 0;
        if let Some(m) = &self.entry.metrics {
            m.tokens
                .get_or_create(&KeyLabels {
                    key: self.entry.label(),
                })
                .inc_by(tokens);
        }
        let mut s = self.entry.state.lock().expect("key state");
        if let Some(b) = s.tokens.as_mut() {
            b.give_back(unused, now);
        }
    }
}

impl Drop for KeyLease {
    fn drop(&mut self) {
        let mut s = self.entry.state.lock().expect("key state");
        s.in_flight = s.in_flight.saturating_sub(1);
    }
}

/// Labels of the per-key request and token counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    /// The key's `name=`, or `key-` and 8 hex digits of its digest.
    pub key: String,
}

/// Labels of `cleave_router_key_rate_limited_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitedLabels {
    /// The key.
    pub key: String,
    /// The limit that refused.
    pub limit: LimitKind,
}

/// Per-key metrics, only with `--key-metrics` (one series per key: the operator opts into
/// that cardinality).
#[derive(Debug, Default)]
pub struct KeyMetrics {
    requests: Family<KeyLabels, Counter>,
    tokens: Family<KeyLabels, Counter>,
    limited: Family<LimitedLabels, Counter>,
}

impl KeyMetrics {
    /// Registers `cleave_router_key_requests_total`, `cleave_router_key_tokens_total` and
    /// `cleave_router_key_rate_limited_total` into `registry`.
    pub fn new(registry: &mut Registry) -> Arc<Self> {
        let m = KeyMetrics::default();
        registry.register(
            "cleave_router_key_requests",
            "Requests admitted per API key",
            m.requests.clone(),
        );
        registry.register(
            "cleave_router_key_tokens",
            "Tokens (prompt + completion) used per API key, counted when a request ends with usage",
            m.tokens.clone(),
        );
        registry.register(
            "cleave_router_key_rate_limited",
            "Requests refused by a per-key limit, by key and limit",
            m.limited.clone(),
        );
        Arc::new(m)
    }
}

type Digest32 = [u8; 32];

fn digest(key: &str) -> Digest32 {
    Sha256::digest(key.as_bytes()).into()
}

/// One parsed line.
struct Line {
    digest: Digest32,
    name: Option<String>,
    limits: KeyLimits,
}

/// Parses the keys file's text; `path` names it in errors.
fn parse(path: &Path, text: &str) -> Result<Vec<Line>, KeysError> {
    let mut out: Vec<Line> = Vec::new();
    let mut seen = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let err = |message: String| KeysError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let key = fields.next().expect("a non-empty line has a field");
        if key.contains('=') {
            return Err(err(
                "the line must start with the key; `name=value` fields follow it".into(),
            ));
        }
        let mut limits = KeyLimits::default();
        let mut name = None;
        for field in fields {
            let Some((k, v)) = field.split_once('=') else {
                return Err(err(format!(
                    "expected `rpm=N`, `tpm=N`, `concurrency=N` or `name=LABEL` after the key, \
                     found `{field}`"
                )));
            };
            let number = |v: &str| {
                v.parse::<u64>()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| err(format!("`{k}` must be a whole number ≥ 1, got `{v}`")))
            };
            match k {
                "rpm" => limits.requests_per_minute = Some(number(v)?),
                "tpm" => limits.tokens_per_minute = Some(number(v)?),
                "concurrency" => limits.concurrency = Some(number(v)?),
                "name" => {
                    let ok = !v.is_empty()
                        && v.len() <= 64
                        && v.chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
                    if !ok {
                        return Err(err(format!(
                            "`name` must be 1-64 characters of A-Z a-z 0-9 - _ ., got `{v}`"
                        )));
                    }
                    name = Some(v.to_string());
                }
                other => {
                    return Err(err(format!(
                        "unknown field `{other}` (known: rpm, tpm, concurrency, name)"
                    )))
                }
            }
        }
        let d = digest(key);
        if let Some(first) = seen.insert(d, i + 1) {
            return Err(err(format!("the same key is already on line {first}")));
        }
        out.push(Line {
            digest: d,
            name,
            limits,
        });
    }
    if out.is_empty() {
        return Err(KeysError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// The accepted API keys, reloadable from their file.
#[derive(Debug)]
pub struct Keys {
    path: PathBuf,
    by_digest: RwLock<HashMap<Digest32, Arc<KeyEntry>>>,
    /// The file's text as last loaded or refused.
    last: Mutex<Option<String>>,
    metrics: Option<Arc<KeyMetrics>>,
    generation: watch::Sender<u64>,
}

impl Keys {
    /// Reads `path`; `metrics`: per-key counters (`--key-metrics`).
    pub fn load(path: &Path, metrics: Option<Arc<KeyMetrics>>) -> Result<Self, KeysError> {
        let text = read(path)?;
        let keys = Keys::from_text(path, &text, metrics)?;
        Ok(keys)
    }

    /// Keys from a file's `text` (`path` names it in errors and for reloads).
    pub fn from_text(
        path: &Path,
        text: &str,
        metrics: Option<Arc<KeyMetrics>>,
    ) -> Result<Self, KeysError> {
        let lines = parse(path, text)?;
        let keys = Keys {
            path: path.to_path_buf(),
            by_digest: RwLock::new(HashMap::new()),
            last: Mutex::new(Some(text.to_string())),
            metrics,
            generation: watch::Sender::new(0),
        };
        keys.install(lines);
        Ok(keys)
    }

    /// Replaces the key set with `lines`, keeping the state of keys that stay.
    fn install(&self, lines: Vec<Line>) {
        let now = Instant::now();
        let mut map = self.by_digest.write().expect("keys");
        let mut next = HashMap::with_capacity(lines.len());
        for l in lines {
            let label = l
                .name
                .unwrap_or_else(|| format!("key-{:08x}", u32::from_be_bytes(first4(&l.digest))));
            let entry = match map.remove(&l.digest) {
                Some(e) => {
                    e.state.lock().expect("key state").set_limits(l.limits, now);
                    *e.label.lock().expect("key label") = label;
                    e
                }
                None => Arc::new(KeyEntry {
                    label: Mutex::new(label),
                    state: Mutex::new(KeyState::new(l.limits, now)),
                    metrics: self.metrics.clone(),
                }),
            };
            next.insert(l.digest, entry);
        }
        *map = next;
    }

    /// The number of keys.
    pub fn len(&self) -> usize {
        self.by_digest.read().expect("keys").len()
    }

    /// Whether there are no keys (never true for a loaded file).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry of `presented`, if it is a configured key (looked up by digest).
    pub fn find(&self, presented: &str) -> Option<Arc<KeyEntry>> {
        let d = digest(presented);
        self.by_digest.read().expect("keys").get(&d).cloned()
    }

    /// Reads the file again; `Ok(true)` when a changed key set is now in force. A changed
    /// file that fails to parse is reported once and the previous keys stay.
    pub fn reload(&self) -> Result<bool, KeysError> {
        let text = read(&self.path)?;
        let mut last = self.last.lock().expect("keys text");
        if last.as_deref() == Some(text.as_str()) {
            return Ok(false);
        }
        *last = Some(text.clone());
        drop(last);
        let lines = parse(&self.path, &text)?;
        self.install(lines);
        self.generation.send_modify(|g| *g += 1);
        Ok(true)
    }

    /// Counts the reloads that took effect.
    pub fn generation(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The file the keys come from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn first4(d: &Digest32) -> [u8; 4] {
    [d[0], d[1], d[2], d[3]]
}

fn read(path: &Path) -> Result<String, KeysError> {
    std::fs::read_to_string(path).map_err(|source| KeysError::Read {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests;
