//! One pod's batches into the prefix index: sequence checks and the index records.
//!
//! vLLM numbers batches 0, 1, 2, … per publisher. [`PodFeed::check`] says what a batch's
//! number means: the next one ([`SeqStep::Next`]), a gap the caller may close from the
//! replay endpoint ([`SeqStep::Gap`]), or a number below the expected one, which only a
//! restarted publisher sends ([`SeqStep::Restart`]: the engine's cache started empty, so the
//! pod's entries are dropped). A gap that cannot be closed is counted and the feed goes on:
//! vLLM has no snapshot to resync from, and what was lost only makes the index miss blocks
//! stored in it (under-report) or keep blocks removed in it until they are stored and removed
//! again or the cache is cleared.
//!
//! The index gets the pod's events as the router's own records (`Stored` / `Removed` /
//! `Cleared` of router hashes, ids counted here), so it keeps its usual invariants.

use cleave_kv_index::{KvEvent, KvEventRecord, PrefixIndex, WorkerId};

use super::chain::{ChainConfig, PodChains, Skipped};
use super::wire::{Batch, EngineEvent};

/// What a batch's sequence number means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStep {
    /// The first batch seen from this publisher.
    First,
    /// The expected next batch.
    Next,
    /// Batches `from..seq` are missing.
    Gap {
        /// The first missing sequence number.
        from: u64,
    },
    /// The number went backwards: the publisher restarted.
    Restart,
}

/// Counters of one pod's feed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// Batches applied (live and replayed).
    pub batches: u64,
    /// Batches applied from the replay endpoint.
    pub replayed: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Batches missed and not recovered.
    pub lost: u64,
    /// Publisher restarts seen.
    pub restarts: u64,
    /// Messages that could not be decoded.
    pub bad: u64,
    /// Events of unknown kinds ignored.
    pub unknown_events: u64,
    /// Blocks not indexed, by reason.
    pub skipped: Skipped,
    /// Router hashes the pod holds now.
    pub held: u64,
    /// The sequence number of the last batch applied.
    pub last_seq: Option<u64>,
}

/// One pod's feed into the index.
#[derive(Debug)]
pub struct PodFeed {
    worker: WorkerId,
    chains: PodChains,
    next_id: u64,
    expected: Option<u64>,
    stats: FeedStats,
}

impl PodFeed {
    /// A feed for `worker`, which the index must know from id 0 (a fresh worker).
    pub fn new(worker: WorkerId, config: ChainConfig) -> Self {
        Self {
            worker,
            chains: PodChains::new(config),
            next_id: 0,
            expected: None,
            stats: FeedStats::default(),
        }
    }

    /// The worker fed.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The counters.
    pub fn stats(&self) -> FeedStats {
        FeedStats {
            skipped: self.chains.skipped,
            held: self.chains.held() as u64,
            ..self.stats
        }
    }

    /// The sequence number expected next (`None` before the first batch).
    pub fn expected(&self) -> Option<u64> {
        self.expected
    }

    /// What `seq` means, given the batches applied so far.
    pub fn check(&self, seq: u64) -> SeqStep {
        match self.expected {
            None => SeqStep::First,
            Some(e) if seq == e => SeqStep::Next,
            Some(e) if seq > e => SeqStep::Gap { from: e },
            Some(_) => SeqStep::Restart,
        }
    }

    /// Counts a gap; `lost` of its batches were not recovered.
    pub fn note_gap(&mut self, lost: u64) {
        self.stats.gaps += 1;
        self.stats.lost += lost;
    }

    /// Counts a message that could not be decoded.
    pub fn note_bad(&mut self) {
        self.stats.bad += 1;
    }

    /// The publisher restarted: forget the pod's blocks and accept any number next.
    pub fn restart(&mut self, index: &mut PrefixIndex) {
        self.stats.restarts += 1;
        self.chains.clear();
        self.push(index, KvEvent::Cleared);
        self.expected = None;
    }

    /// Applies batch `seq` (replayed or live) and expects `seq + 1` next.
    pub fn apply(&mut self, index: &mut PrefixIndex, seq: u64, batch: &Batch, replayed: bool) {
        for ev in &batch.events {
            match ev {
                EngineEvent::BlockStored(s) => {
                    let blocks = self.chains.stored(s);
                    if !blocks.is_empty() {
                        self.push(
                            index,
                            KvEvent::Stored {
                                parent: None,
                                blocks,
                            },
                        );
                    }
                }
                EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                } => {
                    let hashes = self
                        .chains
                        .removed(block_hashes, medium.as_deref(), *group_idx);
                    if !hashes.is_empty() {
                        self.push(index, KvEvent::Removed { hashes });
                    }
                }
                EngineEvent::AllBlocksCleared => {
                    self.chains.clear();
                    self.push(index, KvEvent::Cleared);
                }
                EngineEvent::Unknown(_) => self.stats.unknown_events += 1,
            }
        }
        self.expected = Some(seq + 1);
        self.stats.batches += 1;
        self.stats.replayed += u64::from(replayed);
        self.stats.last_seq = Some(seq);
    }

    fn push(&mut self, index: &mut PrefixIndex, event: KvEvent) {
        let record = KvEventRecord {
            id: self.next_id,
            event,
        };
        self.next_id += 1;
        if index.apply(self.worker, &record).is_err() {
            // The index lost track of the worker (it was removed and added again): the pod's
            // whole state (this event included, the chains have it already) replaces it.
            index.apply_snapshot(self.worker, self.chains.held_hashes(), Some(record.id + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use cleave_types::kv::block_hashes;

    use super::*;
    use crate::events::wire::{BlockStored, EngineHash};

    fn stored(hash: u64, parent: Option<u64>, tokens: std::ops::Range<u32>) -> EngineEvent {
        EngineEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash::Int(hash)],
            parent: parent.map(EngineHash::Int),
            token_ids: tokens.collect(),
            block_size: 16,
            ..Default::default()
        })
    }

    fn batch(events: Vec<EngineEvent>) -> Batch {
        Batch {
            ts: 0.0,
            events,
            dp_rank: None,
        }
    }

    #[test]
    fn sequence_numbers_classify_and_batches_reach_the_index() {
        let w = WorkerId(3);
        let mut index = PrefixIndex::default();
        index.add_worker(w);
        let mut feed = PodFeed::new(w, ChainConfig::default());
        assert_eq!(feed.check(5), SeqStep::First);
        feed.apply(&mut index, 5, &batch(vec![stored(1, None, 0..16)]), false);
        assert_eq!(feed.check(6), SeqStep::Next);
        assert_eq!(feed.check(9), SeqStep::Gap { from: 6 });
        assert_eq!(feed.check(2), SeqStep::Restart);
        feed.apply(
            &mut index,
            6,
            &batch(vec![stored(2, Some(1), 16..32)]),
            false,
        );
        let want = block_hashes(&(0..40).collect::<Vec<_>>(), 16, 0);
        assert_eq!(index.find_matches(&want).matched(w), 2);

        let removed = EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash::Int(2)],
            medium: None,
            group_idx: None,
        };
        feed.apply(&mut index, 7, &batch(vec![removed]), false);
        assert_eq!(index.find_matches(&want).matched(w), 1);
        feed.restart(&mut index);
        assert_eq!(index.worker_blocks(w), 0);
        assert_eq!(feed.check(0), SeqStep::First);
        let stats = feed.stats();
        assert_eq!(
            (stats.batches, stats.restarts, stats.last_seq),
            (3, 1, Some(7))
        );
    }

    #[test]
    fn a_worker_readded_to_the_index_gets_the_pods_whole_state() {
        let w = WorkerId(1);
        let mut index = PrefixIndex::default();
        let mut feed = PodFeed::new(w, ChainConfig::default());
        feed.apply(&mut index, 0, &batch(vec![stored(1, None, 0..16)]), false);
        index.remove_worker(w);
        index.add_worker(w);
        feed.apply(
            &mut index,
            1,
            &batch(vec![stored(2, Some(1), 16..32)]),
            false,
        );
        assert_eq!(index.worker_blocks(w), 2);
        feed.apply(
            &mut index,
            2,
            &batch(vec![EngineEvent::AllBlocksCleared]),
            false,
        );
        assert_eq!(index.worker_blocks(w), 0);
    }
}
