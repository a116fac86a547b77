//! The handle async code uses: `submit` a request and read its stream of events, `cancel` it,
//! read `stats`. Model compute runs on a thread of its own and talks to callers through channels.

pub mod group;
mod stop;
mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::kv::memory::{KvCache, KvDtype};
use crate::kv::tiers::{TierConfig, TierStats};
use crate::kv::{BlockId, KvEventRecord, PoolStats};
use crate::model::Model;
use crate::schedule::{SchedulerConfig, SchedulerCounters, SeqId};
use cleave_text::constrain::{ConstraintError, ConstraintState, LazyGrammars};
use cleave_text::sample::{ParamError, SamplingParams, TokenLogprob};
use cleave_types::collective::CollectiveError;

pub use crate::schedule::PrefillMode;
use cleave_text::tokenizer::Tokenizer;

pub use group::{run_follower, run_follower_with, FollowerError, GroupLink};
pub use stop::StopMatcher;

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// KV element type.
    pub kv_dtype: KvDtype,
    /// Longest sequence (prompt + generated) accepted; defaults to the model's context length.
    pub max_model_len: Option<usize>,
    /// Batching limits.
    pub scheduler: SchedulerConfig,
    /// KV tiers below the pool (host memory, disk); off by default.
    pub tiers: TierConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            num_blocks: 1024,
            kv_dtype: KvDtype::F16,
            max_model_len: None,
            scheduler: SchedulerConfig::default(),
            tiers: TierConfig::default(),
        }
    }
}

/// A generation request: prompt token ids and sampling rules.
#[derive(Clone, Debug, Default)]
pub struct GenerateRequest {
    /// Prompt token ids (already templated and tokenized).
    pub prompt: Vec<u32>,
    /// Sampling and stopping rules.
    pub params: SamplingParams,
    /// Where the prompt's KV comes from (local by default; export/import for disaggregation).
    pub mode: PrefillMode,
    /// Tokens this request already generated elsewhere (a migrated request whose decode worker
    /// failed mid-stream): they are computed as context and fed to the output state (decoder,
    /// stop strings, grammar, the RNG's position) without being streamed again, and count
    /// towards `max_tokens` and the usage's completion tokens. Only with [`PrefillMode::Local`].
    pub resume: Vec<u32>,
}

impl GenerateRequest {
    /// A request computed entirely in this engine.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        GenerateRequest {
            prompt,
            params,
            mode: PrefillMode::Local,
            resume: Vec::new(),
        }
    }
}

/// Why a sequence ended (defined in `cleave-types`, shared with the router).
pub use cleave_types::FinishReason;

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum SeqEvent {
    /// Export mode: these blocks of the block table (index in the table, block) now hold their
    /// final KV (full blocks as they fill; at the end, the last partial block too).
    KvReady {
        /// `(index in the block table, block)`, in table order.
        blocks: Vec<(usize, BlockId)>,
    },
    /// Import mode: the sequence is parked; write the prompt's KV into `blocks` (the whole
    /// block table; the first `cached_tokens / block_size` already hold this engine's cached
    /// prefix) and then call [`Engine::kv_imported`] or [`Engine::kv_import_failed`].
    KvNeeded {
        /// The block table.
        blocks: Vec<BlockId>,
        /// Leading prompt tokens already cached here (no need to send them).
        cached_tokens: usize,
    },
    /// Export mode: the blocks stay allocated until this lease is dropped.
    Held(BlockLease),
    /// A generated token and the text that became final with it (possibly empty: text is held
    /// back while it could still be the start of a stop string or of a UTF-8 character).
    Token {
        /// The token id.
        id: u32,
        /// New text.
        text: String,
        /// Log-probabilities, when requested.
        logprob: Option<TokenLogprob>,
    },
    /// The end of the stream.
    Done {
        /// Why it ended.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
        /// Text still held back at the end (already cut at a stop string).
        text: String,
    },
}

/// Drains one request's events: its token ids, and how it finished (`None` when the stream
/// ended without [`SeqEvent::Done`]). Other events are skipped.
pub async fn token_ids(mut rx: UnboundedReceiver<SeqEvent>) -> (Vec<u32>, Option<FinishReason>) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token { id, .. } => ids.push(id),
            SeqEvent::Done { reason, .. } => return (ids, Some(reason)),
            _ => {}
        }
    }
    (ids, None)
}

/// Why a relay to a worker group's followers failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RelayError {
    /// The engine thread has stopped.
    #[error("the engine stopped")]
    Stopped,
    /// The group's collective failed (the engine fails with it).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// Errors submitting a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus max_tokens exceeds what the engine can hold.
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the limit of {limit} tokens")]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested completion tokens.
        max_tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// A sampling parameter is out of range.
    #[error("invalid sampling parameters: {0}")]
    BadParams(#[from] ParamError),
    /// Resumed tokens (a migrated request) on a request not prefilled here.
    #[error("a resumed request is prefilled locally")]
    ResumeNotLocal,
    /// Resumed tokens that already reach `max_tokens`.
    #[error(
        "{resumed} tokens to resume from, max_tokens {max_tokens}: nothing is left to generate"
    )]
    NothingToResume {
        /// Tokens to resume from.
        resumed: usize,
        /// The request's max_tokens.
        max_tokens: usize,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    /// The request's output constraint (schema, regex, grammar) does not compile.
    #[error("invalid constraint: {0}")]
    BadConstraint(#[from] ConstraintError),
    /// The engine thread has stopped.
    #[error("the engine has shut down")]
    Stopped,
    /// A rank of this engine's worker group failed; the engine serves nothing more.
    #[error("the engine stopped: a rank of its worker group failed")]
    GroupFailed,
}

/// Keeps an exported sequence's blocks allocated; dropping it releases them.
#[derive(Debug)]
pub struct BlockLease {
    id: SeqId,
    blocks: Vec<BlockId>,
    tx: mpsc::Sender<Command>,
}

impl BlockLease {
    /// The held block table.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
}

impl Drop for BlockLease {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::ReleaseHeld(self.id));
    }
}

/// A snapshot of the engine's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// KV block pool accounting.
    pub pool: PoolStats,
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting.
    pub waiting: usize,
    /// Sequences parked while their KV arrives from another process.
    pub parked: usize,
    /// Exported sequences whose blocks are still leased.
    pub held: usize,
    /// Steps run.
    pub steps: u64,
    /// The engine stopped because a step failed (a rank of its group died); it serves nothing
    /// more and every request it held ended as aborted.
    pub failed: bool,
    /// Scheduler counters (prefix hits, computed tokens, preemptions).
    pub counters: SchedulerCounters,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Requests finished (any reason).
    pub finished: u64,
    /// KV tier counters (zero without tiers).
    pub tiers: TierStats,
}

pub(crate) enum Command {
    Submit {
        id: SeqId,
        req: Box<GenerateRequest>,
        /// The compiled `req.params.constraint`, if any.
        constraint: Option<Box<ConstraintState>>,
        events: UnboundedSender<SeqEvent>,
    },
    Cancel(SeqId),
    KvImported {
        id: SeqId,
        first_token: u32,
        logprob: Option<TokenLogprob>,
    },
    KvImportFailed {
        id: SeqId,
        fallback_local: bool,
    },
    ReleaseHeld(SeqId),
    Relay {
        payload: Vec<u8>,
        reply: bool,
        done: tokio::sync::oneshot::Sender<Result<f32, RelayError>>,
    },
    ReadBlocks {
        blocks: Vec<BlockId>,
        reply: tokio::sync::oneshot::Sender<Vec<u8>>,
    },
    WriteBlocks {
        blocks: Vec<BlockId>,
        data: Vec<u8>,
        reply: tokio::sync::oneshot::Sender<bool>,
    },
    /// Stop (true) or resume (false) running steps; commands are still handled.
    Hold(bool),
    Shutdown,
}

pub(crate) struct Shared {
    stats: Mutex<EngineStats>,
    kv_events: Mutex<Vec<KvEventRecord>>,
}

/// The engine handle. Cheap to share behind an `Arc`; dropping it stops the compute thread.
pub struct Engine {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
    limit: usize,
    vocab: usize,
    model: Arc<Model>,
    /// The constraint compiler, built on the first constrained request.
    grammars: LazyGrammars,
}

impl Engine {
    /// Starts the compute thread with a heap-allocated KV pool.
    pub fn start(model: Arc<Model>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Self {
        let layout = model.kv_layout(config.scheduler.block_size, config.kv_dtype);
        let cache = KvCache::on_heap(layout, config.num_blocks);
        Self::start_with_cache(model, tokenizer, config, cache)
    }

    /// Starts the compute thread over a caller-provided KV cache (e.g. transport memory).
    pub fn start_with_cache(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        cache: KvCache,
    ) -> Self {
        Self::start_leader(model, tokenizer, config, cache, None)
    }

    /// Starts the compute thread as the leader of a worker group: every step's batch is
    /// broadcast to the followers ([`run_follower`]) before the forward pass. A failed step or
    /// heartbeat stops the engine ([`EngineStats::failed`]). `group: None` is a single rank.
    pub fn start_leader(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        cache: KvCache,
        group: Option<GroupLink>,
    ) -> Self {
        let ctx = config.max_model_len.unwrap_or(model.config.context_length);
        let limit = ctx.min(cache.num_blocks() * config.scheduler.block_size);
        let vocab = model.config.vocab;
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats::default()),
            kv_events: Mutex::new(Vec::new()),
        });
        let worker = worker::Worker::new(
            model.clone(),
            tokenizer.clone(),
            config,
            cache,
            shared.clone(),
            tx.clone(),
            group,
        );
        let thread = std::thread::Builder::new()
            .name("cleave-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawning the engine thread");
        Engine {
            tx,
            shared,
            next_id: AtomicU64::new(1),
            thread: Some(thread),
            limit,
            vocab,
            model,
            grammars: LazyGrammars::new(tokenizer, Some(vocab)),
        }
    }

    /// Tokens routed to each expert so far, `[layer][expert]` (empty for dense models); see
    /// [`Model::expert_counts`].
    pub fn expert_counts(&self) -> Vec<Vec<u64>> {
        self.model.expert_counts()
    }

    /// Longest sequence (prompt + completion) this engine accepts.
    pub fn max_sequence_len(&self) -> usize {
        self.limit
    }

    /// Queues a request; its events arrive on the returned stream, ending with `Done`.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<(SeqId, UnboundedReceiver<SeqEvent>), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        req.params.validate().map_err(EngineError::BadParams)?;
        if let Some(&bad) = req
            .prompt
            .iter()
            .chain(&req.resume)
            .find(|&&t| t as usize >= self.vocab)
        {
            return Err(EngineError::BadToken(bad));
        }
        if !req.resume.is_empty() {
            if req.mode != PrefillMode::Local {
                return Err(EngineError::ResumeNotLocal);
            }
            if req.resume.len() >= req.params.max_tokens {
                return Err(EngineError::NothingToResume {
                    resumed: req.resume.len(),
                    max_tokens: req.params.max_tokens,
                });
            }
        }
        if req.prompt.len() + req.params.max_tokens > self.limit {
            return Err(EngineError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.params.max_tokens,
                limit: self.limit,
            });
        }
        if self.shared.stats.lock().expect("stats lock").failed {
            return Err(EngineError::GroupFailed);
        }
        let constraint = match &req.params.constraint {
            None => None,
            Some(c) => Some(Box::new(
                self.grammars
                    .compile(c)
                    .map_err(EngineError::BadConstraint)?,
            )),
        };
        let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = unbounded_channel();
        self.tx
            .send(Command::Submit {
                id,
                req: Box::new(req),
                constraint,
                events,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok((id, rx))
    }

    /// Stops running steps until [`Engine::resume`]; requests submitted meanwhile are all
    /// queued before the next step, in submission order (commands are handled in order). For
    /// tests that need several requests to meet in one schedule, and for maintenance.
    pub fn hold(&self) {
        let _ = self.tx.send(Command::Hold(true));
    }

    /// Resumes after [`Engine::hold`].
    pub fn resume(&self) {
        let _ = self.tx.send(Command::Hold(false));
    }

    /// Cancels a request; its blocks are freed at the start of the next step.
    pub fn cancel(&self, id: SeqId) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// Import mode: the prompt's KV has been written into the blocks named by `KvNeeded`, and
    /// the first generated token is `first_token` (with its log-probabilities when the request
    /// asked for them); the sequence joins the running batch.
    pub fn kv_imported(&self, id: SeqId, first_token: u32, logprob: Option<TokenLogprob>) {
        let _ = self.tx.send(Command::KvImported {
            id,
            first_token,
            logprob,
        });
    }

    /// Import mode: the KV will not arrive. With `fallback_local` the prompt is computed here;
    /// otherwise the request ends with [`FinishReason::Aborted`]. Either way nothing leaks.
    pub fn kv_import_failed(&self, id: SeqId, fallback_local: bool) {
        let _ = self.tx.send(Command::KvImportFailed { id, fallback_local });
    }

    /// Worker groups: hands `payload` to every follower's relay handler between two steps
    /// (see [`run_follower_with`]). With `reply` the result is the sum of the followers'
    /// statuses (0: every follower succeeded); without, `Ok(0.0)` once it was sent. A single
    /// process has no followers: `Ok(0.0)`. A failed collective fails the engine.
    pub async fn group_relay(&self, payload: Vec<u8>, reply: bool) -> Result<f32, RelayError> {
        let (done, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::Relay {
                payload,
                reply,
                done,
            })
            .map_err(|_| RelayError::Stopped)?;
        rx.await.map_err(|_| RelayError::Stopped)?
    }

    /// Copies the bytes of `blocks` (each `block_bytes` long, in order) out of the KV region,
    /// on the engine thread. A staged path for transports without direct region access.
    pub async fn read_blocks(&self, blocks: Vec<BlockId>) -> Result<Vec<u8>, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::ReadBlocks { blocks, reply })
            .map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Writes `data` (one `block_bytes` chunk per block, in order) into `blocks`, on the engine
    /// thread; false if the sizes do not match or a block id is out of range.
    pub async fn write_blocks(
        &self,
        blocks: Vec<BlockId>,
        data: Vec<u8>,
    ) -> Result<bool, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::WriteBlocks {
                blocks,
                data,
                reply,
            })
            .map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Current statistics.
    pub fn stats(&self) -> EngineStats {
        *self.shared.stats.lock().expect("stats lock")
    }

    /// KV events (blocks stored in / removed from the prefix cache) since the last call.
    pub fn take_kv_events(&self) -> Vec<KvEventRecord> {
        std::mem::take(&mut *self.shared.kv_events.lock().expect("events lock"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
