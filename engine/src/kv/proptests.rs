//! Property tests: random operation sequences on a [`BlockPool`] against a naive reference model
//! (vectors and linear scans), comparing every observable after every operation.

use proptest::prelude::*;

use super::*;

/// Hashes are drawn from `0..UNIVERSE` so that matches and duplicates are frequent.
const UNIVERSE: u64 = 8;

#[derive(Clone, Debug)]
enum Op {
    Allocate,
    /// Retain the `n % len`-th block that is used or cached idle.
    Retain(usize),
    /// Release the `n % len`-th used block.
    Release(usize),
    MatchPrefix(Vec<u64>),
    CountPrefix(Vec<u64>),
    /// Commit the `n % len`-th used block under `hash` (under its own hash if it has one).
    Commit(usize, u64, Option<u64>),
    ClearCache,
    Drain,
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = || proptest::collection::vec(0..UNIVERSE, 0..5);
    prop_oneof![
        4 => Just(Op::Allocate),
        2 => any::<usize>().prop_map(Op::Retain),
        4 => any::<usize>().prop_map(Op::Release),
        3 => hashes().prop_map(Op::MatchPrefix),
        1 => hashes().prop_map(Op::CountPrefix),
        4 => (any::<usize>(), 0..UNIVERSE, proptest::option::of(0..UNIVERSE))
            .prop_map(|(n, h, p)| Op::Commit(n, h, p)),
        1 => Just(Op::ClearCache),
        1 => Just(Op::Drain),
    ]
}

/// The reference model: the same state as the pool, kept the dumb way.
struct Model {
    refcount: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// Free blocks, in no particular order.
    free: Vec<u32>,
    /// Idle cached blocks, least recently released first.
    lru: Vec<u32>,
    events: Vec<KvEvent>,
    hits: u64,
    queried: u64,
}

impl Model {
    fn new(n: usize) -> Self {
        Self {
            refcount: vec![0; n],
            hash: vec![None; n],
            free: (0..n as u32).collect(),
            lru: Vec::new(),
            events: Vec::new(),
            hits: 0,
            queried: 0,
        }
    }

    fn block_of(&self, h: BlockHash) -> Option<u32> {
        (0..self.hash.len() as u32).find(|&i| self.hash[i as usize] == Some(h))
    }

    fn used(&self) -> Vec<u32> {
        (0..self.refcount.len() as u32)
            .filter(|&i| self.refcount[i as usize] > 0)
            .collect()
    }

    fn retain(&mut self, i: u32) {
        if self.refcount[i as usize] == 0 {
            let pos = self
                .lru
                .iter()
                .position(|&x| x == i)
                .expect("retain of a free block");
            self.lru.remove(pos);
        }
        self.refcount[i as usize] += 1;
    }

    fn release(&mut self, i: u32) {
        self.refcount[i as usize] -= 1;
        if self.refcount[i as usize] == 0 {
            if self.hash[i as usize].is_some() {
                self.lru.push(i);
            } else {
                self.free.push(i);
            }
        }
    }

    /// Applies an allocation that returned `got`, checking it was a legal choice.
    fn allocate(&mut self, got: Option<BlockId>) -> Result<(), TestCaseError> {
        if !self.free.is_empty() {
            let id = got.ok_or_else(|| TestCaseError::fail("allocate: None with free blocks"))?;
            let pos = self.free.iter().position(|&x| x == id.0);
            prop_assert!(pos.is_some(), "allocate returned non-free block {}", id.0);
            self.free.swap_remove(pos.unwrap());
            self.refcount[id.0 as usize] = 1;
        } else if !self.lru.is_empty() {
            let victim = self.lru.remove(0);
            prop_assert_eq!(
                got,
                Some(BlockId(victim)),
                "allocate must evict the LRU head"
            );
            let h = self.hash[victim as usize].take().unwrap();
            self.events.push(KvEvent::Removed { hashes: vec![h] });
            self.refcount[victim as usize] = 1;
        } else {
            prop_assert_eq!(got, None);
        }
        Ok(())
    }

    fn prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|&h| self.block_of(h).map(BlockId))
            .collect()
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.refcount.len(),
            free: self.free.len(),
            cached_idle: self.lru.len(),
            used: self.used().len(),
        }
    }
}

/// Compares every observable of `pool` with `model`.
fn compare(pool: &BlockPool, model: &Model) -> Result<(), TestCaseError> {
    pool.check_invariants();
    prop_assert_eq!(pool.stats(), model.stats());
    prop_assert_eq!(pool.available(), model.free.len() + model.lru.len());
    for i in 0..model.refcount.len() {
        let id = BlockId(i as u32);
        prop_assert_eq!(pool.refcount(id), model.refcount[i], "refcount of {}", i);
        prop_assert_eq!(pool.hash_of(id), model.hash[i], "hash of {}", i);
    }
    for u in 0..UNIVERSE {
        let cached = model.block_of(BlockHash(u)).is_some();
        prop_assert_eq!(
            pool.count_prefix(&[BlockHash(u)]),
            cached as usize,
            "hash {}",
            u
        );
    }
    prop_assert_eq!((pool.hits(), pool.queried()), (model.hits, model.queried));
    Ok(())
}

fn run(num_blocks: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut pool = BlockPool::new(num_blocks);
    let mut model = Model::new(num_blocks);
    let mut drained: Vec<KvEventRecord> = Vec::new();
    for op in ops {
        match op {
            Op::Allocate => {
                let got = pool.allocate();
                model.allocate(got)?;
            }
            Op::Retain(n) => {
                let mut cands = model.used();
                cands.extend(&model.lru);
                cands.sort_unstable();
                if !cands.is_empty() {
                    let i = cands[n % cands.len()];
                    pool.retain(BlockId(i));
                    model.retain(i);
                }
            }
            Op::Release(n) => {
                let used = model.used();
                if !used.is_empty() {
                    let i = used[n % used.len()];
                    pool.release(BlockId(i));
                    model.release(i);
                }
            }
            Op::MatchPrefix(hs) => {
                let hs: Vec<BlockHash> = hs.into_iter().map(BlockHash).collect();
                let expected = model.prefix(&hs);
                let got = pool.match_prefix(&hs);
                prop_assert_eq!(&got, &expected);
                for id in &got {
                    model.retain(id.0);
                }
                model.queried += hs.len() as u64;
                model.hits += got.len() as u64;
            }
            Op::CountPrefix(hs) => {
                let hs: Vec<BlockHash> = hs.into_iter().map(BlockHash).collect();
                prop_assert_eq!(pool.count_prefix(&hs), model.prefix(&hs).len());
            }
            Op::Commit(n, h, parent) => {
                let used = model.used();
                if !used.is_empty() {
                    let i = used[n % used.len()];
                    let parent = parent.map(BlockHash);
                    match model.hash[i as usize] {
                        Some(own) => prop_assert!(pool.commit(BlockId(i), own, parent)),
                        None => {
                            let h = BlockHash(h);
                            let expected = model.block_of(h).is_none();
                            prop_assert_eq!(pool.commit(BlockId(i), h, parent), expected);
                            if expected {
                                model.hash[i as usize] = Some(h);
                                model.events.push(KvEvent::Stored {
                                    parent,
                                    blocks: vec![h],
                                });
                            }
                        }
                    }
                }
            }
            Op::ClearCache => {
                pool.clear_cache();
                model.hash.iter_mut().for_each(|h| *h = None);
                let idle = std::mem::take(&mut model.lru);
                model.free.extend(idle);
                model.events.push(KvEvent::Cleared);
            }
            Op::Drain => drained.extend(pool.drain_events()),
        }
        compare(&pool, &model)?;
    }

    // Allocating everything now evicts the idle blocks in LRU order.
    let mut extra = Vec::new();
    loop {
        let got = pool.allocate();
        model.allocate(got)?;
        compare(&pool, &model)?;
        match got {
            Some(id) => extra.push(id),
            None => break,
        }
    }
    prop_assert_eq!(pool.available(), 0);

    // Events: contiguous ids from 0, exactly the model's events.
    drained.extend(pool.drain_events());
    let ids: Vec<u64> = drained.iter().map(|r| r.id).collect();
    prop_assert_eq!(ids, (0..model.events.len() as u64).collect::<Vec<_>>());
    let got: Vec<KvEvent> = drained.into_iter().map(|r| r.event).collect();
    prop_assert_eq!(got, model.events.clone());

    // Releasing every reference returns the pool to fully available: no leak.
    for i in 0..num_blocks as u32 {
        while pool.refcount(BlockId(i)) > 0 {
            pool.release(BlockId(i));
            model.release(i);
        }
    }
    compare(&pool, &model)?;
    prop_assert_eq!(pool.available(), pool.total());
    prop_assert_eq!(pool.stats().used, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn pool_matches_reference_model(
        num_blocks in 0usize..9,
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        run(num_blocks, ops)?;
    }
}
