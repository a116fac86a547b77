//! The compute thread: takes commands, plans a step, runs the model, samples, streams events.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};

use tokio::sync::mpsc::UnboundedSender;

use crate::kv::memory::KvCache;
use crate::model::{Logits, Model, SeqChunk, Workspace};
use crate::schedule::{Planned, Scheduler, SeqId, Sequence};
use crate::tokenizer::{StreamDecoder, Tokenizer};

use super::stop::StopMatcher;
use super::{Command, EngineConfig, EngineStats, FinishReason, SeqEvent, Shared, Usage};

/// Most KV events kept for a consumer that does not drain them.
const MAX_PENDING_KV_EVENTS: usize = 65_536;

struct Output {
    events: UnboundedSender<SeqEvent>,
    decoder: StreamDecoder,
    stop: StopMatcher,
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
}

impl Worker {
    pub(super) fn new(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        cache: KvCache,
        shared: Arc<Shared>,
    ) -> Self {
        let ctx = config.max_model_len.unwrap_or(model.config.context_length);
        let limit = ctx.min(cache.num_blocks() * config.scheduler.block_size);
        let sched = Scheduler::new(config.scheduler, cache.num_blocks());
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
        };
        w.publish();
        w
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if self.sched.is_idle() {
                match rx.recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            return self.shutdown();
                        }
                    }
                    Err(_) => return self.shutdown(),
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            return self.shutdown();
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            if !self.sched.is_idle() {
                self.step();
            }
            self.publish();
        }
    }

    /// Applies a command; false means shut down.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit { id, req, events } => {
                let stop = StopMatcher::new(req.params.stop.clone());
                self.outputs.insert(
                    id,
                    Output {
                        events,
                        decoder: StreamDecoder::new(),
                        stop,
                    },
                );
                self.sched
                    .add(Sequence::new(id, req.prompt, req.params, self.arrivals));
                self.arrivals += 1;
            }
            Command::Cancel(id) => {
                if let Some(s) = self.sched.remove(id) {
                    self.done(s, FinishReason::Cancelled, String::new());
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn shutdown(mut self) {
        let ids: Vec<SeqId> = self
            .sched
            .running
            .iter()
            .map(|s| s.id)
            .chain(self.sched.waiting.iter().map(|s| s.id))
            .collect();
        for id in ids {
            if let Some(s) = self.sched.remove(id) {
                self.done(s, FinishReason::Cancelled, String::new());
            }
        }
        self.publish();
    }

    fn step(&mut self) {
        let plan = self.sched.schedule();
        if plan.is_empty() {
            // Nothing fits even alone (cannot happen for requests that passed the length
            // check); fail the head of the queue rather than spin.
            if let Some(s) = self.sched.waiting.pop_front() {
                self.done(s, FinishReason::Length, String::new());
            }
            return;
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
        self.model.forward(&chunks, &mut self.cache, &mut self.ws);
        self.sched.computed(&plan);
        self.stats.steps += 1;
        let finished = self.sample(&plan);
        // Remove from the highest index down so lower indices stay valid.
        for (index, reason, text) in finished.into_iter().rev() {
            let s = self.sched.finish(index);
            self.done(s, reason, text);
        }
    }

    /// Samples a token for every chunk that reached its end; returns the sequences that ended.
    fn sample(&mut self, plan: &[Planned]) -> Vec<(usize, FinishReason, String)> {
        let vocab = self.model.config.vocab;
        let mut finished = Vec::new();
        let mut row = 0;
        for p in plan.iter().filter(|p| p.sample) {
            let logits = &self.ws.logits[row * vocab..(row + 1) * vocab];
            row += 1;
            let s = &mut self.sched.running[p.index];
            let (tok, logprob) = s.sampler.sample(logits, &s.params);
            s.tokens.push(tok);
            self.stats.generated_tokens += 1;
            let out = self
                .outputs
                .get_mut(&s.id)
                .expect("every sequence has an output");
            let end_token = (!s.params.ignore_eos && self.eog.contains(&tok))
                || s.params.stop_token_ids.contains(&tok);
            let (text, stop_string) = if end_token {
                (String::new(), false)
            } else {
                let piece = out.decoder.push(&self.tokenizer, tok);
                out.stop.push(&piece)
            };
            let reason = if end_token || stop_string {
                Some(FinishReason::Stop)
            } else if s.generated() >= s.params.max_tokens || s.tokens.len() >= self.limit {
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
                (_, false) => finished.push((p.index, FinishReason::Cancelled, String::new())),
                (Some(r), true) => {
                    let tail = if stop_string {
                        String::new()
                    } else {
                        let rest = out.decoder.finish();
                        let (t, hit) = out.stop.push(&rest);
                        if hit {
                            t
                        } else {
                            t + &out.stop.flush()
                        }
                    };
                    finished.push((p.index, r, tail));
                }
                (None, true) => {}
            }
        }
        finished
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
        self.stats.counters = self.sched.counters;
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
