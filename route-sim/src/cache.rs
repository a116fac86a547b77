//! A simulated worker's prefix cache: an LRU set of block hashes with a fixed capacity that
//! records its changes as KV events with ids +1 per event, as a real worker's block pool does.
//! Within one prompt the last block counts as the least recently used and the first as the
//! most: the engine hands a finished sequence's blocks back last to first, so its tail is
//! evicted before its prefix (`Scheduler::free_blocks`; vLLM and Dynamo do the same).

use std::collections::{BTreeMap, HashMap};

use cleave_kv_index::{BlockHash, KvEvent, KvEventRecord};

/// LRU cache of block hashes that logs `Stored` / `Removed` events.
#[derive(Debug)]
pub struct LruCache {
    capacity: usize,
    /// Hash → last-use tick.
    map: HashMap<BlockHash, u64>,
    /// Tick → hash, oldest first.
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
    next_event_id: u64,
    pending: Vec<KvEventRecord>,
}

impl LruCache {
    /// An empty cache of `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            next_event_id: 0,
            pending: Vec::new(),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Serves a prompt: returns how many leading blocks were cached, then marks every block of the
    /// prompt used (last block least recently), evicting least recently used blocks to make room
    /// for the missing ones (only the first `capacity` blocks of a longer prompt are kept). Logs
    /// `Removed` then `Stored`.
    pub fn serve(&mut self, hashes: &[BlockHash]) -> usize {
        let hits = hashes
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count();
        let hashes = &hashes[..hashes.len().min(self.capacity)];
        // Block `i` of the prompt gets tick `base + n - i`: newer than everything cached, the
        // first block newest.
        let base = self.tick;
        let n = hashes.len() as u64;
        self.tick += n;
        let tick_of = |i: usize| base + n - i as u64;
        // Touch what is present, so eviction below never takes this prompt's blocks.
        let mut missing = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            if let Some(t) = self.map.get_mut(h) {
                self.order.remove(t);
                *t = tick_of(i);
                self.order.insert(*t, *h);
            } else if !missing.iter().any(|&j: &usize| hashes[j] == *h) {
                missing.push(i);
            }
        }
        let overflow = (self.map.len() + missing.len()).saturating_sub(self.capacity);
        if overflow > 0 {
            let mut evicted = Vec::with_capacity(overflow);
            for _ in 0..overflow {
                let (_, h) = self.order.pop_first().expect("overflow ≤ len");
                self.map.remove(&h);
                evicted.push(h);
            }
            self.log(KvEvent::Removed { hashes: evicted });
        }
        // One Stored event per contiguous run of missing blocks.
        let mut run: Vec<BlockHash> = Vec::new();
        let mut parent = None;
        let mut prev = None;
        for &i in &missing {
            if prev.is_some_and(|p: usize| p + 1 != i) && !run.is_empty() {
                let blocks = std::mem::take(&mut run);
                self.log(KvEvent::Stored { parent, blocks });
            }
            if run.is_empty() {
                parent = i.checked_sub(1).map(|j| hashes[j]);
            }
            self.map.insert(hashes[i], tick_of(i));
            self.order.insert(tick_of(i), hashes[i]);
            run.push(hashes[i]);
            prev = Some(i);
        }
        if !run.is_empty() {
            self.log(KvEvent::Stored {
                parent,
                blocks: run,
            });
        }
        hits
    }

    /// Takes the events logged since the last drain, oldest first.
    pub fn drain_events(&mut self) -> Vec<KvEventRecord> {
        std::mem::take(&mut self.pending)
    }

    fn log(&mut self, event: KvEvent) {
        self.pending.push(KvEventRecord {
            id: self.next_event_id,
            event,
        });
        self.next_event_id += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(xs: &[u64]) -> Vec<BlockHash> {
        xs.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn lru_evicts_oldest_and_logs_events() {
        let mut c = LruCache::new(4);
        assert_eq!(c.serve(&hs(&[1, 2, 3])), 0);
        assert_eq!(c.serve(&hs(&[1, 2, 9])), 2);
        assert_eq!(c.len(), 4);
        // 3 is the least recently used: serving 1,5 evicts it.
        assert_eq!(c.serve(&hs(&[1, 5])), 1);
        assert_eq!(c.serve(&hs(&[1, 2, 3])), 2);
        let ev = c.drain_events();
        let ids: Vec<_> = ev.iter().map(|e| e.id).collect();
        assert_eq!(ids, (0..ids.len() as u64).collect::<Vec<_>>());
        assert_eq!(
            ev[0].event,
            KvEvent::Stored {
                parent: None,
                blocks: hs(&[1, 2, 3])
            }
        );
        assert_eq!(
            ev[1].event,
            KvEvent::Stored {
                parent: Some(BlockHash(2)),
                blocks: hs(&[9])
            }
        );
        assert_eq!(ev[2].event, KvEvent::Removed { hashes: hs(&[3]) });
    }

    #[test]
    fn a_prompt_loses_its_tail_before_its_prefix() {
        let mut c = LruCache::new(4);
        c.serve(&hs(&[1, 2, 3]));
        // Two new blocks need one slot: the evicted block is 3, the first prompt's tail.
        c.serve(&hs(&[7, 8]));
        let ev = c.drain_events();
        assert_eq!(ev[1].event, KvEvent::Removed { hashes: hs(&[3]) });
        assert_eq!(c.serve(&hs(&[1, 2, 3])), 2);
    }

    #[test]
    fn duplicate_hashes_in_one_prompt_are_stored_once() {
        let mut c = LruCache::new(8);
        c.serve(&hs(&[1, 1, 2]));
        assert_eq!(c.len(), 2);
    }
}
