//! The compute thread: takes commands, plans a step, runs the model, samples, streams events.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};

use tokio::sync::mpsc::UnboundedSender;

use crate::kv::memory::KvCache;
use crate::kv::tiers::Tiers;
use crate::kv::BlockId;
use crate::model::{Logits, Model, SeqChunk, Workspace};
use crate::schedule::{Planned, PrefillMode, Scheduler, SeqId, Sequence};
use cleave_text::constrain::{ConstraintState, Progress};
use cleave_text::tokenizer::{StreamDecoder, Tokenizer};
use cleave_types::collective::CollectiveError;

mod blocks;
mod lockstep;

use super::group::{encode_step, GroupLink};
use super::stop::StopMatcher;
use super::{
    BlockLease, Command, EngineConfig, EngineStats, FinishReason, RelayError, SeqEvent, Shared,
    Usage,
};

/// Most KV events kept for a consumer that does not drain them.
const MAX_PENDING_KV_EVENTS: usize = 65_536;

struct Output {
    events: UnboundedSender<SeqEvent>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// The request's grammar, when its output is constrained.
    constraint: Option<Box<ConstraintState>>,
}

impl Output {
    /// Brings the output state to where it was after `tokens` were generated and streamed (a
    /// migrated request): the text they spelled is dropped (the client has it) except what the
    /// decoder or the stop matcher still holds back, which is streamed with the next tokens as
    /// it would have been. The grammar takes them too.
    fn resume(&mut self, tok: &Tokenizer, tokens: &[u32]) {
        for &t in tokens {
            if let Some(c) = self.constraint.as_deref_mut() {
                if let Err(e) = c.consume(t) {
                    tracing::warn!(error = %e, "resumed tokens do not match the grammar");
                }
            }
            let piece = self.decoder.push(tok, t);
            let _ = self.stop.push(&piece);
        }
    }

    /// The text still held back (by the decoder or the stop matcher) when a sequence ends.
    fn tail(&mut self) -> String {
        let rest = self.decoder.finish();
        let (t, hit) = self.stop.push(&rest);
        if hit {
            t
        } else {
            t + &self.stop.flush()
        }
    }
}

pub(super) struct Worker {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    sched: Scheduler,
    cache: KvCache,
    ws: Workspace,
    shared: Arc<Shared>,
    outputs: HashMap<SeqId, Output>,
    eog: Vec<u32>,
    limit: usize,
    arrivals: u64,
    stats: EngineStats,
    /// Blocks of exported sequences, leased to the caller.
    held: HashMap<SeqId, Vec<BlockId>>,
    /// The last step could schedule nothing until parked or held blocks come back.
    stalled: bool,
    /// For leases to send their release.
    tx: mpsc::Sender<Command>,
    /// The other ranks of this worker's group (this thread is the leader), if any.
    group: Option<GroupLink>,
    /// The step message being broadcast (reused).
    msg: Vec<u8>,
    /// When the followers last heard from this leader (a step or a heartbeat).
    last_sync: std::time::Instant,
    /// A collective failed while handling a command (a relay): the engine must stop.
    broken: Option<CollectiveError>,
    /// Steps are on hold ([`super::Engine::hold`]).
    held_steps: bool,
}

impl Worker {
    pub(super) fn new(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        cache: KvCache,
        shared: Arc<Shared>,
        tx: mpsc::Sender<Command>,
        group: Option<GroupLink>,
    ) -> Self {
        let ctx = config.max_model_len.unwrap_or(model.config.context_length);
        let limit = ctx.min(cache.num_blocks() * config.scheduler.block_size);
        let mut sched = Scheduler::new(config.scheduler.clone(), cache.num_blocks());
        if config.tiers.enabled() {
            let group = group.as_ref().filter(|g| g.collective.world() > 1);
            match (group, Tiers::open(&config.tiers, cache.layout(), 0, 1)) {
                (Some(_), _) => tracing::error!("KV tiers are not supported in worker groups yet"),
                (None, Ok(t)) => sched.set_tiers(t),
                (None, Err(e)) => tracing::error!("KV tiers are off: {e}"),
            }
        }
        let eog = tokenizer.eog_ids();
        let mut w = Worker {
            model,
            tokenizer,
            sched,
            cache,
            ws: Workspace::new(),
            shared,
            outputs: HashMap::new(),
            eog,
            limit,
            arrivals: 0,
            stats: EngineStats::default(),
            held: HashMap::new(),
            stalled: false,
            tx,
            group: group.filter(|g| g.collective.world() > 1),
            msg: Vec::new(),
            last_sync: std::time::Instant::now(),
            broken: None,
            held_steps: false,
        };
        w.publish();
        w
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Idle, or stalled until a command frees blocks: block on the next command.
            if self.sched.is_idle() || self.held_steps || std::mem::take(&mut self.stalled) {
                let next = match &self.group {
                    None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                    // A heartbeat at least every `heartbeat`, even while commands keep coming.
                    Some(g) => {
                        rx.recv_timeout(g.heartbeat.saturating_sub(self.last_sync.elapsed()))
                    }
                };
                match next {
                    Ok(c) => {
                        if !self.handle(c) {
                            return self.shutdown();
                        }
                        if let Some(e) = self.broken.take() {
                            return self.fail(e);
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if let Err(e) = self.heartbeat() {
                            return self.fail(e);
                        }
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return self.shutdown(),
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            return self.shutdown();
                        }
                        if let Some(e) = self.broken.take() {
                            return self.fail(e);
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            if !self.sched.is_idle() && !self.held_steps {
                if let Err(e) = self.step() {
                    return self.fail(e);
                }
            }
            self.publish();
        }
    }

    /// Applies a command; false means shut down.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit {
                id,
                req,
                constraint,
                events,
            } => {
                let stop = StopMatcher::new(req.params.stop.clone());
                let mut out = Output {
                    events,
                    decoder: StreamDecoder::new(),
                    stop,
                    constraint,
                };
                let req = *req;
                let mut seq = Sequence::new(id, req.prompt, req.params, self.arrivals, req.mode);
                if !req.resume.is_empty() {
                    out.resume(&self.tokenizer, &req.resume);
                    seq.resume(&req.resume);
                }
                self.outputs.insert(id, out);
                self.sched.add(seq);
                self.arrivals += 1;
            }
            Command::Cancel(id) => {
                if let Some(s) = self.sched.remove(id) {
                    self.done(s, FinishReason::Cancelled, String::new());
                }
            }
            Command::KvImported {
                id,
                first_token,
                logprob,
            } => {
                if let Some(index) = self.sched.unpark(id, first_token) {
                    let end = self.accept(index, first_token, logprob);
                    if let Some((reason, text)) = end {
                        let s = self.sched.finish(index);
                        self.done(s, reason, text);
                    }
                }
            }
            Command::KvImportFailed { id, fallback_local } => {
                if fallback_local {
                    self.sched.unpark_local(id);
                } else if let Some(s) = self.sched.remove(id) {
                    self.done(s, FinishReason::Aborted, String::new());
                }
            }
            Command::ReleaseHeld(id) => {
                if let Some(blocks) = self.held.remove(&id) {
                    self.sched.release_blocks(&blocks);
                }
            }
            Command::Relay {
                payload,
                reply,
                done,
            } => {
                let r = self.relay(&payload, reply);
                let _ = done.send(r.clone().map_err(RelayError::from));
                if let Err(e) = r {
                    self.broken = Some(e);
                }
            }
            Command::ReadBlocks { blocks, reply } => {
                let _ = reply.send(blocks::read(&self.cache, &blocks));
            }
            Command::WriteBlocks {
                blocks,
                data,
                reply,
            } => {
                let _ = reply.send(blocks::write(&mut self.cache, &blocks, &data));
            }
            Command::Hold(on) => self.held_steps = on,
            Command::Shutdown => return false,
        }
        true
    }

    /// Ends every request with `reason`, frees all blocks and publishes the final state.
    fn shutdown_with(mut self, reason: FinishReason) {
        let ids: Vec<SeqId> = self
            .sched
            .running
            .iter()
            .map(|s| s.id)
            .chain(self.sched.waiting.iter().map(|s| s.id))
            .collect();
        let parked: Vec<SeqId> = self.sched.parked.iter().map(|s| s.id).collect();
        for id in ids.into_iter().chain(parked) {
            if let Some(s) = self.sched.remove(id) {
                self.done(s, reason, String::new());
            }
        }
        for (_, blocks) in std::mem::take(&mut self.held) {
            self.sched.release_blocks(&blocks);
        }
        self.publish();
    }

    fn step(&mut self) -> Result<(), CollectiveError> {
        let plan = self.sched.schedule();
        blocks::run_moves(&mut self.sched, &mut self.cache);
        for id in std::mem::take(&mut self.sched.newly_parked) {
            let Some(s) = self.sched.parked.iter().find(|s| s.id == id) else {
                continue;
            };
            let event = SeqEvent::KvNeeded {
                blocks: s.blocks.clone(),
                cached_tokens: s.computed,
            };
            let gone = self
                .outputs
                .get(&id)
                .is_none_or(|o| o.events.send(event).is_err());
            if gone {
                if let Some(s) = self.sched.remove(id) {
                    self.done(s, FinishReason::Cancelled, String::new());
                }
            }
        }
        if plan.is_empty() {
            // Nothing can run now. When parked sequences (waiting for their KV) or exports
            // (waiting for their transfer) hold blocks, a command will give them back: wait for
            // it instead of failing the queue. Only a request that cannot fit even into an
            // otherwise empty pool fails (the length check keeps those out); never spin.
            let fits =
                self.sched.waiting.front().is_some_and(|s| {
                    self.sched.blocks_for(s.tokens.len()) <= self.sched.pool.total()
                });
            let blocks_will_return = !self.sched.parked.is_empty() || !self.held.is_empty();
            if fits && blocks_will_return && self.sched.running.is_empty() {
                self.stalled = true;
                return Ok(());
            }
            if let Some(s) = self.sched.waiting.pop_front() {
                self.done(s, FinishReason::Length, String::new());
            }
            return Ok(());
        }
        let chunks: Vec<SeqChunk> = plan
            .iter()
            .map(|p| {
                let s = &self.sched.running[p.index];
                SeqChunk {
                    tokens: &s.tokens[p.start..p.start + p.len],
                    start_pos: p.start,
                    blocks: &s.blocks,
                    logits: if p.sample { Logits::Last } else { Logits::None },
                }
            })
            .collect();
        if let Some(g) = &self.group {
            encode_step(&chunks, self.sched.config.block_size, &mut self.msg);
            g.collective.broadcast(0, &mut self.msg)?;
            self.last_sync = std::time::Instant::now();
        }
        // The token masks of the constrained sequences about to sample are computed on another
        // thread while the forward pass runs (their grammars already consumed every token).
        // Unconstrained batches skip this (one pass over the outputs, no allocation).
        let mut masks: Vec<&mut ConstraintState> = Vec::new();
        if self.outputs.values().any(|o| o.constraint.is_some()) {
            let sampling: Vec<SeqId> = plan
                .iter()
                .filter(|p| p.sample)
                .map(|p| self.sched.running[p.index].id)
                .collect();
            masks.extend(
                self.outputs
                    .iter_mut()
                    .filter(|(id, _)| sampling.contains(id))
                    .filter_map(|(_, o)| o.constraint.as_deref_mut()),
            );
        }
        let (model, cache, ws) = (&self.model, &mut self.cache, &mut self.ws);
        let forward = if masks.is_empty() {
            model.forward(&chunks, cache, ws)
        } else {
            std::thread::scope(|scope| {
                scope.spawn(|| masks.iter_mut().for_each(|c| c.prepare_mask()));
                model.forward(&chunks, cache, ws)
            })
        };
        forward?;
        self.sched.computed(&plan);
        self.stats.steps += 1;
        self.announce_full_blocks(&plan);
        let finished = self.sample(&plan);
        // Remove from the highest index down so lower indices stay valid.
        for (index, reason, text) in finished.into_iter().rev() {
            if self.sched.running[index].mode == PrefillMode::Export {
                let s = self.sched.finish_holding(index);
                self.hand_over(s, reason, text);
            } else {
                let s = self.sched.finish(index);
                self.done(s, reason, text);
            }
        }
        Ok(())
    }

    /// Export mode: tells the caller which blocks became full in this step.
    fn announce_full_blocks(&mut self, plan: &[Planned]) {
        let bs = self.sched.config.block_size;
        for p in plan {
            let s = &mut self.sched.running[p.index];
            if s.mode != PrefillMode::Export || s.computed / bs <= s.announced {
                continue;
            }
            let upto = s.computed / bs;
            let blocks = (s.announced..upto).map(|i| (i, s.blocks[i])).collect();
            s.announced = upto;
            if let Some(o) = self.outputs.get(&s.id) {
                let _ = o.events.send(SeqEvent::KvReady { blocks });
            }
        }
    }

    /// Export mode: the first token is out; the rest of the blocks are announced and leased.
    fn hand_over(&mut self, s: Sequence, reason: FinishReason, text: String) {
        if let Some(o) = self.outputs.get(&s.id) {
            let rest: Vec<(usize, BlockId)> = (s.announced..s.blocks.len())
                .map(|i| (i, s.blocks[i]))
                .collect();
            if !rest.is_empty() {
                let _ = o.events.send(SeqEvent::KvReady { blocks: rest });
            }
            let lease = BlockLease {
                id: s.id,
                blocks: s.blocks.clone(),
                tx: self.tx.clone(),
            };
            self.held.insert(s.id, s.blocks.clone());
            // If the stream is gone the lease comes straight back and releases the blocks.
            let _ = o.events.send(SeqEvent::Held(lease));
        } else {
            self.sched.release_blocks(&s.blocks);
        }
        self.done(s, reason, text);
    }

    /// Samples a token for every chunk that reached its end; returns the sequences that ended.
    fn sample(&mut self, plan: &[Planned]) -> Vec<(usize, FinishReason, String)> {
        let vocab = self.model.config.vocab;
        let mut finished = Vec::new();
        for (row, p) in plan.iter().filter(|p| p.sample).enumerate() {
            let logits = &self.ws.logits[row * vocab..(row + 1) * vocab];
            let s = &mut self.sched.running[p.index];
            let out = self
                .outputs
                .get_mut(&s.id)
                .expect("every sequence has an output");
            let mask = match out.constraint.as_deref_mut().map(|c| c.take_mask()) {
                None => None,
                Some(Ok(m)) => Some(m),
                Some(Err(e)) => {
                    // Only this sequence ends (aborted: its output cannot be completed under
                    // its grammar); the rest of the batch goes on.
                    tracing::warn!(seq = s.id.0, error = %e, "constrained sequence cannot go on");
                    finished.push((p.index, FinishReason::Aborted, out.tail()));
                    continue;
                }
            };
            let (tok, logprob) = s.sampler.sample_masked(logits, &s.params, mask.as_ref());
            s.tokens.push(tok);
            if let Some((reason, text)) = self.accept(p.index, tok, logprob) {
                finished.push((p.index, reason, text));
            }
        }
        finished
    }

    /// Streams a token just appended to `running[index]` and decides whether the sequence ends
    /// (returning why, and the text still held back).
    fn accept(
        &mut self,
        index: usize,
        tok: u32,
        logprob: Option<cleave_text::sample::TokenLogprob>,
    ) -> Option<(FinishReason, String)> {
        self.stats.generated_tokens += 1;
        let s = &self.sched.running[index];
        let out = self
            .outputs
            .get_mut(&s.id)
            .expect("every sequence has an output");
        let end_token = (!s.params.ignore_eos && self.eog.contains(&tok))
            || s.params.stop_token_ids.contains(&tok);
        // The grammar takes every token but the end token it allowed. A token it refuses (a
        // disaggregated first token from a prefill worker that ignored the constraint) aborts
        // this sequence only.
        let (grammar_done, grammar_broken) = match out.constraint.as_deref_mut() {
            Some(c) if !end_token => match c.consume(tok) {
                Ok(p) => (p == Progress::Finished, false),
                Err(e) => {
                    tracing::warn!(seq = s.id.0, error = %e, "constrained sequence cannot go on");
                    (false, true)
                }
            },
            _ => (false, false),
        };
        let (text, stop_string) = if end_token {
            (String::new(), false)
        } else {
            let piece = out.decoder.push(&self.tokenizer, tok);
            out.stop.push(&piece)
        };
        let reason = if grammar_broken {
            Some(FinishReason::Aborted)
        } else if end_token || stop_string || grammar_done {
            Some(FinishReason::Stop)
        } else if s.generated() >= s.params.max_tokens
            || s.tokens.len() >= self.limit
            || s.mode == PrefillMode::Export
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        let sent = out.events.send(SeqEvent::Token {
            id: tok,
            text,
            logprob,
        });
        match (reason, sent.is_ok()) {
            (_, false) => Some((FinishReason::Cancelled, String::new())),
            (Some(r), true) => {
                let tail = if stop_string {
                    String::new()
                } else {
                    out.tail()
                };
                Some((r, tail))
            }
            (None, true) => None,
        }
    }

    fn done(&mut self, s: Sequence, reason: FinishReason, text: String) {
        self.stats.finished += 1;
        if let Some(out) = self.outputs.remove(&s.id) {
            let usage = Usage {
                prompt_tokens: s.prompt_len,
                completion_tokens: s.generated(),
                cached_tokens: s.cached_tokens,
            };
            let _ = out.events.send(SeqEvent::Done {
                reason,
                usage,
                text,
            });
        }
    }

    fn publish(&mut self) {
        self.stats.pool = self.sched.pool.stats();
        self.stats.running = self.sched.running.len();
        self.stats.waiting = self.sched.waiting.len();
        self.stats.parked = self.sched.parked.len();
        self.stats.held = self.held.len();
        self.stats.counters = self.sched.counters;
        self.stats.tiers = self
            .sched
            .tiers
            .as_ref()
            .map(Tiers::stats)
            .unwrap_or_default();
        *self.shared.stats.lock().expect("stats lock") = self.stats;
        let events = self.sched.pool.drain_events();
        if !events.is_empty() {
            let mut q = self.shared.kv_events.lock().expect("events lock");
            q.extend(events);
            let excess = q.len().saturating_sub(MAX_PENDING_KV_EVENTS);
            q.drain(..excess);
        }
    }
}
