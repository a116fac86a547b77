//! Continuous batching: which sequences compute which tokens in the next step.
//!
//! Sequences wait in arrival order and run while they have KV blocks. Each step has a token
//! budget: running decodes (one token each) are served first, then prefill chunks fill the rest,
//! so a long prompt never stalls the running batch. When blocks run out, the most recently
//! arrived running sequence is preempted (its blocks are freed, and it is recomputed later from
//! its tokens — the prefix cache usually makes that cheap). Full blocks are hashed and committed
//! to the pool's prefix cache as soon as their KV is written.

use std::collections::VecDeque;

use crate::kv::tiers::Tiers;
use crate::kv::{next_block_hash, BlockHash, BlockId, BlockPool};
use cleave_text::sample::{Sampler, SamplingParams};

/// Where a sequence's prompt KV comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillMode {
    /// Computed here, then decoded here (one process does everything).
    #[default]
    Local,
    /// Computed here for another process (a prefill worker): all prompt blocks are allocated at
    /// admission and never preempted, announced as they fill, and held after the first token
    /// is sampled until the caller has copied them out.
    Export,
    /// Written here by another process (a decode worker): all prompt blocks are allocated at
    /// admission (reusing this engine's own cached prefix), then the sequence is parked until
    /// the caller reports that the KV has arrived (with the first token) or failed.
    Import,
}

/// Identifies a request inside one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Scheduling limits.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// Most sequences in the running batch.
    pub max_running: usize,
    /// Most tokens computed in one step (decodes + prefill chunks).
    pub step_tokens: usize,
    /// Most prompt tokens computed in a step that also decodes (0: no cap beyond
    /// `step_tokens`). A step's time grows with its prefill tokens, and every running stream
    /// waits for the step, so this bounds the inter-token latency a new prompt adds to the
    /// running batch, at the cost of that prompt's time to first token under load.
    pub prefill_tokens_while_decoding: usize,
    /// Reuse cached prefix blocks.
    pub prefix_caching: bool,
    /// Model/adapter salt mixed into block hashes.
    pub salt: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_size: crate::kv::DEFAULT_BLOCK_SIZE,
            max_running: 64,
            step_tokens: 256,
            prefill_tokens_while_decoding: 0,
            prefix_caching: true,
            salt: 0,
        }
    }
}

/// One request's state.
pub struct Sequence {
    /// Its id.
    pub id: SeqId,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Length of the prompt.
    pub prompt_len: usize,
    /// Leading tokens whose KV is in this sequence's blocks.
    pub computed: usize,
    /// Block table.
    pub blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks that are committed to (or were found in) the cache.
    pub hashes: Vec<BlockHash>,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Sampling and stopping rules.
    pub params: SamplingParams,
    /// RNG state.
    pub sampler: Sampler,
    /// Admission order (lower = older = higher priority).
    pub arrival: u64,
    /// Where its prompt KV comes from.
    pub mode: PrefillMode,
    /// Leading blocks already announced to the caller (export mode).
    pub announced: usize,
    /// Whether it has been admitted before (for `cached_tokens`).
    admitted_once: bool,
}

impl Sequence {
    /// Whether its next step is one decode token (its prompt and every generated token but the
    /// last are computed), rather than a prompt chunk or a recomputation.
    fn decoding(&self) -> bool {
        self.mode != PrefillMode::Export
            && self.computed >= self.prompt_len
            && self.tokens.len() - self.computed == 1
    }

    /// A new sequence for `prompt`.
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        arrival: u64,
        mode: PrefillMode,
    ) -> Self {
        let seed = params.seed.unwrap_or(id.0 ^ 0x5EED);
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            cached_tokens: 0,
            sampler: Sampler::new(seed),
            params,
            arrival,
            mode,
            announced: 0,
            admitted_once: false,
        }
    }

    /// Continues after `tokens` generated elsewhere (a migrated request): they join the
    /// sequence as generated tokens still to be computed, like a sequence preempted by
    /// recomputation, and the sampler's RNG skips the draws they used.
    pub fn resume(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        if self.params.draws() {
            self.sampler.skip(tokens.len() as u64);
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// What one sequence computes in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Index into [`Scheduler::running`].
    pub index: usize,
    /// First position computed.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
    /// Whether the chunk reaches the last known token (so the next token is sampled).
    pub sample: bool,
}

impl Planned {
    /// Sequence `index` computes positions `start..start + len` of its `total` known tokens.
    fn chunk(index: usize, start: usize, len: usize, total: usize) -> Planned {
        Planned {
            index,
            start,
            len,
            sample: start + len == total,
        }
    }
}

/// Counters the engine exports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    /// Prompt tokens whose KV came from the prefix cache (compute skipped).
    pub prefix_hit_tokens: u64,
    /// Tokens looked up in the prefix cache at admission (the hit ratio's denominator).
    pub prefix_query_tokens: u64,
    /// Tokens run through the model.
    pub computed_tokens: u64,
    /// Sequences preempted for lack of blocks.
    pub preemptions: u64,
}

/// Waiting and running queues over one block pool.
pub struct Scheduler {
    /// Limits.
    pub config: SchedulerConfig,
    /// The KV block pool.
    pub pool: BlockPool,
    /// Sequences waiting for admission, oldest first.
    pub waiting: VecDeque<Sequence>,
    /// The running batch, oldest first.
    pub running: Vec<Sequence>,
    /// Import-mode sequences holding their blocks while their KV arrives from elsewhere.
    pub parked: Vec<Sequence>,
    /// Sequences parked by `schedule` calls since the caller last took this list.
    pub newly_parked: Vec<SeqId>,
    /// Counters.
    pub counters: SchedulerCounters,
    /// The KV tiers below the pool, if any.
    pub tiers: Option<Tiers>,
}

impl Scheduler {
    /// A scheduler over `num_blocks` KV blocks.
    pub fn new(config: SchedulerConfig, num_blocks: usize) -> Self {
        Scheduler {
            config,
            pool: BlockPool::new(num_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            parked: Vec::new(),
            newly_parked: Vec::new(),
            counters: SchedulerCounters::default(),
            tiers: None,
        }
    }

    /// Keeps evicted blocks in `tiers` and restores prefixes from them; what they already hold
    /// (a disk tier found again) is announced.
    pub fn set_tiers(&mut self, tiers: Tiers) {
        self.pool.keep_evicted();
        for (hash, parent) in tiers.held() {
            self.pool.announce(hash, parent);
        }
        self.tiers = Some(tiers);
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    /// Queues a sequence.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Removes a sequence wherever it is and frees its blocks at once.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let mut s = self.waiting.remove(i)?;
            self.free_blocks(&mut s);
            return Some(s);
        }
        if let Some(i) = self.parked.iter().position(|s| s.id == id) {
            let mut s = self.parked.remove(i);
            self.free_blocks(&mut s);
            return Some(s);
        }
        let i = self.running.iter().position(|s| s.id == id)?;
        let mut s = self.running.remove(i);
        self.free_blocks(&mut s);
        Some(s)
    }

    /// Takes a finished export-mode sequence out WITHOUT releasing its blocks: the caller owns
    /// them (it copies them out, then calls [`Scheduler::release_blocks`]).
    pub fn finish_holding(&mut self, index: usize) -> Sequence {
        self.running.remove(index)
    }

    /// Releases blocks handed out by [`Scheduler::finish_holding`], last to first (tail evicted
    /// first, as [`Scheduler::finish`] does).
    pub fn release_blocks(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.pool.release(b);
        }
    }

    /// The KV of a parked sequence has arrived, with the first generated token: it joins the
    /// running batch. Returns its index in `running`.
    pub fn unpark(&mut self, id: SeqId, first_token: u32) -> Option<usize> {
        let i = self.parked.iter().position(|s| s.id == id)?;
        let mut s = self.parked.remove(i);
        s.computed = s.prompt_len;
        commit_full_blocks(&mut self.pool, &self.config, &mut s);
        s.tokens.push(first_token);
        // The prefill worker drew the first token with the same seed: the next draw here is
        // the second, as in a locally prefilled run (and a migration's skip counts every token).
        if s.params.draws() {
            s.sampler.skip(1);
        }
        self.running.push(s);
        Some(self.running.len() - 1)
    }

    /// The KV of a parked sequence will not arrive: it computes its prompt here instead,
    /// keeping its blocks (those past its own cached prefix are simply overwritten).
    pub fn unpark_local(&mut self, id: SeqId) -> bool {
        let Some(i) = self.parked.iter().position(|s| s.id == id) else {
            return false;
        };
        let mut s = self.parked.remove(i);
        s.mode = PrefillMode::Local;
        s.computed = s.hashes.len() * self.config.block_size;
        self.running.push(s);
        true
    }

    /// Takes a finished running sequence out, freeing its blocks (committed ones stay cached).
    pub fn finish(&mut self, index: usize) -> Sequence {
        let mut s = self.running.remove(index);
        self.free_blocks(&mut s);
        s
    }

    /// Releases `s`'s blocks last to first, so its tail goes to the least recently released end
    /// of the LRU and is evicted before its prefix: a prefix's later blocks are only found
    /// through its first ones, and what other requests share is the head, not the tail (vLLM
    /// and Dynamo free in the same order).
    fn free_blocks(&mut self, s: &mut Sequence) {
        for b in s.blocks.drain(..).rev() {
            self.pool.release(b);
        }
        s.hashes.clear();
        s.computed = 0;
    }

    /// Gives `running[index]` blocks for `upto` tokens; false when the pool ran dry (the blocks
    /// it did get stay with it).
    fn grow(&mut self, index: usize, upto: usize) -> bool {
        let need = self.blocks_for(upto);
        while self.running[index].blocks.len() < need {
            match self.pool.allocate() {
                Some(b) => self.running[index].blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Preempts the newest running sequence if it is newer than `running[protect]`; returns its
    /// old index, or `None` when there is no such sequence.
    fn preempt_newest(&mut self, protect: usize) -> Option<usize> {
        let victim = (0..self.running.len())
            .filter(|&i| i != protect && self.running[i].mode != PrefillMode::Export)
            .max_by_key(|&i| self.running[i].arrival)?;
        if self.running[victim].arrival < self.running[protect].arrival {
            return None;
        }
        let mut s = self.running.remove(victim);
        self.free_blocks(&mut s);
        self.counters.preemptions += 1;
        // Back to the front of the queue: it is older than anything still waiting.
        self.waiting.push_front(s);
        Some(victim)
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> Vec<Planned> {
        let mut budget = self.config.step_tokens;
        // Prompt tokens this step may still take: capped when some sequence decodes in it.
        let cap = self.config.prefill_tokens_while_decoding;
        let mut prefill_left = if cap > 0 && self.running.iter().any(Sequence::decoding) {
            cap
        } else {
            usize::MAX
        };
        let mut plan: Vec<Planned> = Vec::new();
        let preemptions_before = self.counters.preemptions;
        // Running sequences, oldest first; a sequence that cannot get a block preempts newer ones.
        self.running.sort_by_key(|s| s.arrival);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, total) = (self.running[i].computed, self.running[i].tokens.len());
            let prefilling = !self.running[i].decoding();
            if prefilling && prefill_left == 0 {
                i += 1;
                continue;
            }
            let mut len = (total - computed).min(budget);
            if prefilling {
                len = len.min(prefill_left);
            }
            let mut got = self.grow(i, computed + len);
            while !got {
                match self.preempt_newest(i) {
                    Some(_) => got = self.grow(i, computed + len),
                    None => break,
                }
            }
            let have = self.running[i].blocks.len() * self.config.block_size - computed;
            let len = len.min(have);
            if len == 0 {
                // Not even one slot: this sequence itself goes back to waiting.
                let mut s = self.running.remove(i);
                self.free_blocks(&mut s);
                self.counters.preemptions += 1;
                self.waiting.push_front(s);
                continue;
            }
            plan.push(Planned::chunk(i, computed, len, total));
            budget -= len;
            if prefilling {
                prefill_left -= len;
            }
            i += 1;
        }
        // (Victims are always newer than the sequence that needed blocks, so they sit later in
        // `running` and the indices already planned stay valid.)
        // After a preemption the pool is short: admitting now would only thrash.
        let preempted = self.counters.preemptions != preemptions_before;
        while !preempted
            && budget > 0
            && prefill_left > 0
            && self.running.len() < self.config.max_running
        {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.admit_prefix(&mut s);
            if s.mode != PrefillMode::Local {
                // Every prompt block up front: KV moves between processes by block.
                let need = self.blocks_for(s.prompt_len).saturating_sub(s.blocks.len());
                if self.pool.available() < need {
                    self.free_blocks(&mut s);
                    self.waiting.push_front(s);
                    break;
                }
                for _ in 0..need {
                    s.blocks
                        .push(self.pool.allocate().expect("checked available"));
                }
                if s.mode == PrefillMode::Import {
                    self.counters.prefix_hit_tokens += s.computed as u64;
                    self.newly_parked.push(s.id);
                    self.parked.push(s);
                    continue;
                }
            }
            let (computed, total) = (s.computed, s.tokens.len());
            let len = (total - computed).min(budget).min(prefill_left);
            self.running.push(s);
            let idx = self.running.len() - 1;
            let ok = self.grow(idx, computed + len);
            let have = self.running[idx].blocks.len() * self.config.block_size - computed;
            let len = len.min(have);
            if !ok && len == 0 {
                let mut s = self.running.pop().expect("just pushed");
                self.free_blocks(&mut s);
                self.waiting.push_front(s);
                break;
            }
            self.counters.prefix_hit_tokens += computed as u64;
            plan.push(Planned::chunk(idx, computed, len, total));
            budget -= len;
            prefill_left = prefill_left.saturating_sub(len);
            if !ok {
                break;
            }
        }
        plan
    }

    /// Reuses the longest cached prefix of `s`'s tokens, leaving at least one token to compute.
    fn admit_prefix(&mut self, s: &mut Sequence) {
        if !self.config.prefix_caching || !s.blocks.is_empty() {
            return;
        }
        let bs = self.config.block_size;
        let full = (s.tokens.len() - 1) / bs;
        let mut hashes = Vec::with_capacity(full);
        let mut parent = None;
        for b in 0..full {
            let h = next_block_hash(parent, &s.tokens[b * bs..(b + 1) * bs], self.config.salt);
            hashes.push(h);
            parent = Some(h);
        }
        let mut matched = self.pool.match_prefix(&hashes);
        self.restore_from_tiers(&hashes, &mut matched);
        self.counters.prefix_query_tokens += s.tokens.len() as u64;
        s.computed = matched.len() * bs;
        s.hashes = hashes[..matched.len()].to_vec();
        s.blocks = matched;
        if !s.admitted_once {
            s.cached_tokens = s.computed.min(s.prompt_len);
            s.admitted_once = true;
        }
    }

    /// Extends `matched` (the pool's run of `hashes`) with blocks the tiers hold: each gets a
    /// pool block now and its bytes before the next forward pass (`BlockPool::drain_moves`).
    fn restore_from_tiers(&mut self, hashes: &[BlockHash], matched: &mut Vec<BlockId>) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        while let Some(&hash) = hashes.get(matched.len()) {
            if !tiers.contains(hash) {
                break;
            }
            let Some(block) = self.pool.allocate() else {
                break;
            };
            let parent = matched.len().checked_sub(1).map(|i| hashes[i]);
            let restored = match tiers.take(hash) {
                Some(data) => self.pool.restore(block, hash, parent, data),
                None => false,
            };
            if !restored {
                self.pool.release(block);
                break;
            }
            matched.push(block);
        }
    }

    /// Records that the planned chunks were computed: advances `computed` and commits every
    /// block that became full to the prefix cache.
    pub fn computed(&mut self, plan: &[Planned]) {
        for p in plan {
            self.counters.computed_tokens += p.len as u64;
            let s = &mut self.running[p.index];
            s.computed = p.start + p.len;
            commit_full_blocks(&mut self.pool, &self.config, s);
        }
    }
}

/// Hashes every block of `s` that became full and commits it to the prefix cache.
fn commit_full_blocks(pool: &mut BlockPool, config: &SchedulerConfig, s: &mut Sequence) {
    let bs = config.block_size;
    while (s.hashes.len() + 1) * bs <= s.computed {
        let b = s.hashes.len();
        let parent = s.hashes.last().copied();
        let h = next_block_hash(parent, &s.tokens[b * bs..(b + 1) * bs], config.salt);
        if config.prefix_caching {
            pool.commit(s.blocks[b], h, parent);
        }
        s.hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, len: usize, arrival: u64) -> Sequence {
        let prompt = (0..len as u32).map(|t| t + 1000 * id as u32).collect();
        Sequence::new(
            SeqId(id),
            prompt,
            SamplingParams::default(),
            arrival,
            PrefillMode::Local,
        )
    }

    /// Pretends every sampled step appended one token.
    fn run_step(s: &mut Scheduler) -> Vec<Planned> {
        let plan = s.schedule();
        s.computed(&plan);
        for p in &plan {
            if p.sample {
                s.running[p.index].tokens.push(7);
            }
        }
        plan
    }

    #[test]
    fn chunked_prefill_respects_the_token_budget_and_serves_decodes_first() {
        let cfg = SchedulerConfig {
            step_tokens: 32,
            ..Default::default()
        };
        let mut s = Scheduler::new(cfg, 64);
        s.add(seq(1, 10, 0));
        let p = run_step(&mut s);
        assert_eq!(
            p,
            vec![Planned {
                index: 0,
                start: 0,
                len: 10,
                sample: true
            }]
        );
        s.add(seq(2, 100, 1));
        let p = run_step(&mut s);
        // The decode of seq 1 (1 token) first, then 31 tokens of seq 2's prompt.
        assert_eq!(p[0].len, 1);
        assert_eq!((p[1].start, p[1].len, p[1].sample), (0, 31, false));
        let p = run_step(&mut s);
        assert_eq!((p[1].start, p[1].len), (31, 31));
        s.pool.check_invariants();
    }

    #[test]
    fn prompt_tokens_are_capped_only_in_steps_that_decode() {
        let cfg = SchedulerConfig {
            step_tokens: 64,
            prefill_tokens_while_decoding: 8,
            ..Default::default()
        };
        let mut s = Scheduler::new(cfg, 64);
        // Nothing decodes yet: the first prompt takes the whole budget.
        s.add(seq(1, 100, 0));
        let p = run_step(&mut s);
        assert_eq!((p[0].start, p[0].len), (0, 64));
        // Two prompts, one mid-prefill: still no decode, so no cap.
        s.add(seq(2, 30, 1));
        let p = run_step(&mut s);
        assert_eq!(p.iter().map(|p| p.len).collect::<Vec<_>>(), vec![36, 28]);
        let p = run_step(&mut s);
        assert_eq!(p.iter().map(|p| p.len).collect::<Vec<_>>(), vec![1, 2]);
        assert!(p[1].sample, "seq 2's prompt is done");
        // Both decode now; a new prompt gets 8 tokens a step beside them, as would a
        // recomputation.
        s.add(seq(3, 20, 2));
        for start in [0, 8] {
            let p = run_step(&mut s);
            let lens: Vec<_> = p.iter().map(|p| p.len).collect();
            assert_eq!(lens, vec![1, 1, 8], "at {start}");
            assert_eq!(p[2].start, start);
        }
        let p = run_step(&mut s);
        assert_eq!((p[2].start, p[2].len, p[2].sample), (16, 4, true));
        s.pool.check_invariants();
    }

    #[test]
    fn preemption_frees_blocks_and_requeues_the_newest() {
        let cfg = SchedulerConfig {
            step_tokens: 256,
            prefix_caching: false,
            ..Default::default()
        };
        // 4 blocks = 64 slots; two sequences of 30 tokens each take 2 blocks.
        let mut s = Scheduler::new(cfg, 4);
        s.add(seq(1, 30, 0));
        s.add(seq(2, 30, 1));
        run_step(&mut s);
        assert_eq!(s.running.len(), 2);
        // Both now hold 31 tokens; computing position 32 needs a third block each.
        run_step(&mut s);
        run_step(&mut s);
        assert_eq!(s.counters.preemptions, 0);
        run_step(&mut s);
        assert_eq!(s.counters.preemptions, 1);
        assert_eq!(s.running.len(), 1);
        assert_eq!(s.running[0].id, SeqId(1));
        assert_eq!(s.waiting.front().map(|w| w.id), Some(SeqId(2)));
        // Finish seq 1: seq 2 is readmitted and recomputes its prompt plus generated tokens.
        let done = s.finish(0);
        assert_eq!(done.id, SeqId(1));
        let p = run_step(&mut s);
        assert_eq!(p[0].start, 0);
        // 30 prompt tokens plus the 3 it had generated before preemption.
        assert_eq!(p[0].len, 33);
        s.remove(SeqId(2));
        assert_eq!(s.pool.available(), 4);
        s.pool.check_invariants();
    }

    #[test]
    fn prefix_blocks_are_reused_and_counted() {
        let mut s = Scheduler::new(SchedulerConfig::default(), 32);
        s.add(seq(1, 40, 0));
        run_step(&mut s);
        let first = s.finish(0);
        assert_eq!(first.cached_tokens, 0);
        // Same 40-token prompt: two full blocks (32 tokens) come from the cache.
        s.add(seq(1, 40, 1));
        let p = run_step(&mut s);
        assert_eq!((p[0].start, p[0].len), (32, 8));
        assert_eq!(s.running[0].cached_tokens, 32);
        assert_eq!(s.counters.prefix_hit_tokens, 32);
        s.finish(0);
        // A prompt of exactly 32 cached tokens still computes its last block's tokens.
        s.add(seq(1, 32, 2));
        let p = run_step(&mut s);
        assert_eq!((p[0].start, p[0].len), (16, 16));
        s.finish(0);
        assert_eq!(s.pool.available(), 32);
        s.pool.check_invariants();
    }

    #[test]
    fn a_finished_sequence_loses_its_tail_before_its_prefix() {
        // 4 blocks of 16 tokens: seq 1's 48-token prompt commits 3 and leaves 1 free; seq 2's
        // 32 distinct tokens take the free block and evict one of seq 1's.
        let mut s = Scheduler::new(SchedulerConfig::default(), 4);
        s.add(seq(1, 48, 0));
        run_step(&mut s);
        s.finish(0);
        s.add(seq(2, 32, 1));
        run_step(&mut s);
        s.finish(0);
        // Seq 1's prefix survived: only its tail was evicted.
        s.add(seq(1, 48, 2));
        run_step(&mut s);
        assert_eq!(s.running[0].cached_tokens, 32);
        s.pool.check_invariants();
    }
}
