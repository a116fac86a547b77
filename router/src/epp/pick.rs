//! Picking the endpoints of one request: the request is parsed and tokenized by the router's
//! own API layer ([`crate::api::prepare`]: the same validation, chat template and token ids as
//! `cleave-router` in HTTP mode), its prompt's block hashes are looked up in the prefix index,
//! and the router's placement policy ([`crate::place`]) chooses among the pool's healthy
//! members, restricted to the proxy's subset hint when there is one.
//!
//! - No eligible member: [`PickError::NoEndpoint`] (or [`PickError::NoneInSubset`]), a 503.
//! - Every eligible member has at least `shed_queue_depth` requests queued or running (reported
//!   or charged by this picker): [`PickError::Shed`], a 429. Saturated members are never
//!   picked while another is not.
//! - Bad requests get the HTTP router's 4xx (OpenAI's error JSON).
//!
//! The primary endpoint is followed by up to `fallbacks` more, each the policy's choice with the
//! ones before it removed (Envoy tries them in order when retries are configured). Only the
//! primary is charged (optimistic accounting, [`crate::place::WorkerView::charge`]); the charge
//! lives in [`Picked`] until the request ends. Disaggregation is off: the picked server
//! prefills itself.

use crate::dispatch::Cluster;
use std::sync::Arc;

use cleave_kv_index::WorkerId;
use cleave_text::chat::ChatTemplate;
use cleave_text::tokenizer::Tokenizer;

use super::pool::Pool;
use super::scrape::PromptBlocks;
use crate::api::error::ApiError;
use crate::api::prepare::{self, Endpoint, Tokenize};
use crate::dispatch::BLOCK_SIZE;
use crate::place::Reservation;
use crate::place::{Placement, Policy, WorkerView};

/// Why no endpoint was picked.
#[derive(Debug, thiserror::Error)]
pub enum PickError {
    /// No healthy member in the pool.
    #[error("no ready endpoint in the pool")]
    NoEndpoint,
    /// The subset hint names no healthy member (or is empty).
    #[error("none of the {0} endpoints of the subset hint is ready")]
    NoneInSubset(usize),
    /// Every eligible member is saturated.
    #[error("every eligible endpoint is saturated")]
    Shed,
    /// The request is malformed (or names another model).
    #[error(transparent)]
    Request(ApiError),
}

impl PickError {
    fn api(&self) -> ApiError {
        match self {
            PickError::NoEndpoint => ApiError::NoWorkers,
            PickError::NoneInSubset(_) => ApiError::NoWorkers,
            PickError::Shed => ApiError::RateLimited,
            PickError::Request(e) => match e {
                ApiError::InvalidRequest {
                    message,
                    param,
                    code,
                } => ApiError::InvalidRequest {
                    message: message.clone(),
                    param: param.clone(),
                    code: *code,
                },
                ApiError::ModelNotFound(m) => ApiError::ModelNotFound(m.clone()),
                other => ApiError::Internal(other.to_string()),
            },
        }
    }

    /// The HTTP status of the immediate response.
    pub fn status(&self) -> u16 {
        self.api().status().as_u16()
    }

    /// The immediate response's body, OpenAI's error JSON.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&self.api().body()).unwrap_or_default()
    }
}

/// The model text the request is tokenized with.
#[derive(Clone)]
pub struct Text {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The chat template, if any.
    pub template: Option<Arc<ChatTemplate>>,
    /// The context length in tokens.
    pub max_context: usize,
}

/// Picker tunables.
#[derive(Clone, Debug)]
pub struct PickConfig {
    /// Shed when every eligible member has this many requests queued or running.
    pub shed_queue_depth: u64,
    /// Fallback endpoints after the primary.
    pub fallbacks: usize,
}

/// One request as the picker sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Request<'a> {
    /// The `:path` header.
    pub path: Option<&'a str>,
    /// The whole request body.
    pub body: &'a [u8],
    /// The proxy's subset hint ([`super::protocol::subset_hint`]).
    pub subset: Option<&'a [String]>,
}

/// The picked endpoints, and the primary's charge (released on drop).
pub struct Picked {
    /// `ip:port` of the primary, then the fallbacks.
    pub destinations: Vec<String>,
    /// The primary's worker id.
    pub worker: WorkerId,
    reservation: Reservation,
}

impl std::fmt::Debug for Picked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picked")
            .field("destinations", &self.destinations)
            .field("worker", &self.worker)
            .finish()
    }
}

impl Picked {
    /// The header and metadata value: `ip:port[,ip:port...]`.
    pub fn value(&self) -> String {
        self.destinations.join(",")
    }

    /// The server started answering: its prefill is done.
    pub fn prefill_done(&mut self) {
        self.reservation.prefill_done();
    }

    /// The response ended; `tail` is its last bytes. If they hold the OpenAI usage with
    /// `prompt_tokens_details.cached_tokens` and at least one completion token (a prefill that
    /// ran), the server's count corrects the router's guess of the prefill work
    /// ([`Reservation::prefill_measured`]).
    pub fn response_ended(&mut self, tail: &[u8]) {
        if let Some(cached) = cached_tokens_in(tail) {
            self.reservation.prefill_measured(cached);
        }
    }
}

/// How many bytes of a response's end [`Picked::response_ended`] needs: the usage object (the
/// last SSE event of a stream with `include_usage`, the last field of a JSON body).
pub const RESPONSE_TAIL_BYTES: usize = 4096;

/// `usage.prompt_tokens_details.cached_tokens` from the last `"usage"` object in `tail`, when
/// `usage.completion_tokens` is above 0.
fn cached_tokens_in(tail: &[u8]) -> Option<usize> {
    const KEY: &[u8] = b"\"usage\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &tail[at + KEY.len()..];
    let colon = rest.iter().position(|&b| b == b':')?;
    let mut values =
        serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<serde_json::Value>();
    let usage = values.next()?.ok()?;
    let n = |p: &str| usage.pointer(p).and_then(|v| v.as_u64());
    (n("/completion_tokens")? > 0)
        .then(|| n("/prompt_tokens_details/cached_tokens"))
        .flatten()
        .map(|c| c as usize)
}

/// Picks endpoints from a pool.
pub struct Picker {
    pool: Arc<Pool>,
    policy: Box<dyn Policy>,
    text: Text,
    model: String,
    config: PickConfig,
    prompts: Arc<PromptBlocks>,
}

impl Picker {
    /// The pool's placement state (it owns the picker's tasks).
    pub fn cluster(&self) -> &Arc<Cluster> {
        self.pool.cluster()
    }

    /// A picker over `pool` placing with `policy` for the served `model`.
    pub fn new(
        pool: Arc<Pool>,
        policy: Box<dyn Policy>,
        text: Text,
        model: String,
        config: PickConfig,
        prompts: Arc<PromptBlocks>,
    ) -> Picker {
        Picker {
            pool,
            policy,
            text,
            model,
            config,
            prompts,
        }
    }

    /// The pool picked from.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// What placement needs to know about `req`: nothing for routes other than the two
    /// completion endpoints (picked by load alone).
    async fn prepare(&self, req: Request<'_>) -> Result<(Vec<u32>, usize, usize), PickError> {
        let path = req.path.map(|p| p.split('?').next().unwrap_or(p));
        let endpoint = match path {
            Some("/v1/chat/completions") => Endpoint::Chat,
            Some("/v1/completions") => Endpoint::Completion,
            _ => return Ok((Vec::new(), 0, 0)),
        };
        let parsed = prepare::parse_body(req.body).map_err(PickError::Request)?;
        let (job, input, max_tokens) =
            prepare::validate(endpoint, parsed, &self.model).map_err(PickError::Request)?;
        let t = Tokenize {
            tokenizer: self.text.tokenizer.clone(),
            template: self.text.template.clone(),
            max_context: self.text.max_context,
        };
        let prompts = tokio::task::spawn_blocking(move || prepare::tokenize(&t, input, max_tokens))
            .await
            .map_err(|e| {
                PickError::Request(ApiError::Internal(format!("tokenizer task failed: {e}")))
            })?
            .map_err(PickError::Request)?;
        let prompt_blocks: usize = prompts
            .iter()
            .map(|p| p.tokens.len().div_ceil(BLOCK_SIZE))
            .sum();
        let decode_blocks: usize = prompts
            .iter()
            .map(|p| p.max_tokens.div_ceil(BLOCK_SIZE) * job.n)
            .sum();
        let first = prompts.into_iter().next().map(|p| p.tokens);
        Ok((first.unwrap_or_default(), prompt_blocks, decode_blocks))
    }

    /// Picks the endpoints of `req`.
    pub async fn pick(&self, req: Request<'_>) -> Result<Picked, PickError> {
        let (tokens, prompt_blocks, decode_blocks) = self.prepare(req).await?;
        // The pool's members before the placement lock (the pool takes that lock when members
        // change, so it must not be taken under it).
        let members = self.pool.destinations();
        let dest = |id| {
            members
                .iter()
                .find(|(m, _)| *m == id)
                .map(|(_, d)| d.clone())
                .ok_or(PickError::NoEndpoint)
        };
        let mut destinations = Vec::with_capacity(1 + self.config.fallbacks);
        let (placement, reservation) = self.pool.cluster().placement().place(
            &tokens,
            prompt_blocks,
            decode_blocks,
            |preq, view| {
                let mut view = self.candidates(view, &members, req.subset)?;
                let placement = self
                    .policy
                    .place(preq, &view)
                    .map_err(|_| PickError::NoEndpoint)?;
                // Never disaggregate here: the server Envoy sends the request to prefills it.
                let placement = Placement {
                    prefill: None,
                    cached_blocks: preq.matches.matched(placement.decode).min(prompt_blocks),
                    ..placement
                };
                destinations.push(dest(placement.decode)?);
                let mut last = placement.decode;
                for _ in 0..self.config.fallbacks {
                    view.remove(last);
                    match self.policy.place(preq, &view) {
                        Ok(p) => {
                            destinations.push(dest(p.decode)?);
                            last = p.decode;
                        }
                        Err(_) => break,
                    }
                }
                Ok(placement)
            },
        )?;
        if prompt_blocks > 0 {
            self.prompts.observe(prompt_blocks);
        }
        tracing::debug!(worker = %placement.decode, destinations = ?destinations, prompt_blocks, cached = placement.cached_blocks, "picked");
        Ok(Picked {
            destinations,
            worker: placement.decode,
            reservation,
        })
    }

    /// `view` restricted to healthy, unsaturated pool `members` (in the subset when there is
    /// one).
    fn candidates(
        &self,
        view: &WorkerView,
        members: &[(WorkerId, String)],
        subset: Option<&[String]>,
    ) -> Result<WorkerView, PickError> {
        let mut view = view.clone();
        let all: Vec<WorkerId> = view.iter().map(|w| w.id).collect();
        for id in all {
            let dest = members.iter().find(|(m, _)| *m == id).map(|(_, d)| d);
            let keep = match (dest, subset) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(d), Some(s)) => s.iter().any(|e| e == d),
            };
            let healthy = view
                .get(id)
                .is_some_and(|w| w.healthy && w.role.can_decode());
            if !keep || !healthy {
                view.remove(id);
            }
        }
        if view.is_empty() {
            return Err(match subset {
                Some(s) => PickError::NoneInSubset(s.len()),
                None => PickError::NoEndpoint,
            });
        }
        let saturated: Vec<WorkerId> = view
            .iter()
            .filter(|w| w.load().queue_depth >= self.config.shed_queue_depth)
            .map(|w| w.id)
            .collect();
        if saturated.len() == view.len() {
            return Err(PickError::Shed);
        }
        for id in saturated {
            view.remove(id);
        }
        Ok(view)
    }
}

#[cfg(test)]
mod tests {
    use super::cached_tokens_in;

    #[test]
    fn cached_tokens_come_from_the_last_usage_of_a_stream_or_a_body() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":70,\"completion_tokens\":3,",
            "\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(cached_tokens_in(sse.as_bytes()), Some(48));
        let body = r#"{"id":"x","choices":[{"message":{"content":"Hi"}}],"usage": {"prompt_tokens":70,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        assert_eq!(cached_tokens_in(body.as_bytes()), Some(0));
        // Not reported, no token (the prefill may never have run), cut off, or no usage at all.
        for none in [
            r#"{"usage":{"prompt_tokens":70,"completion_tokens":3}}"#,
            r#"{"usage":{"completion_tokens":0,"prompt_tokens_details":{"cached_tokens":9}}}"#,
            r#"{"usage":{"completion_tokens":3,"prompt_tokens_de"#,
            "data: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n",
            "data: {\"usage\":null}\n\n",
        ] {
            assert_eq!(cached_tokens_in(none.as_bytes()), None, "{none}");
        }
    }
}
