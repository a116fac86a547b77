//! Unit tests and property tests of [`PrefixIndex`] against a reference model.

use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;

use super::*;

fn h(x: u64) -> BlockHash {
    BlockHash(x)
}

fn stored(id: u64, blocks: &[u64]) -> KvEventRecord {
    KvEventRecord {
        id,
        event: KvEvent::Stored {
            parent: None,
            blocks: blocks.iter().copied().map(h).collect(),
        },
    }
}

fn removed(id: u64, hashes: &[u64]) -> KvEventRecord {
    KvEventRecord {
        id,
        event: KvEvent::Removed {
            hashes: hashes.iter().copied().map(h).collect(),
        },
    }
}

#[test]
fn leading_matches_stop_at_first_miss() {
    let mut idx = PrefixIndex::default();
    idx.apply(WorkerId(1), &stored(0, &[1, 2, 3, 4])).unwrap();
    idx.apply(WorkerId(2), &stored(0, &[1, 2, 9])).unwrap();
    idx.apply(WorkerId(3), &stored(0, &[2, 3, 4])).unwrap();
    let m = idx.find_matches(&[h(1), h(2), h(3), h(4), h(5)]);
    assert_eq!(m.matched(WorkerId(1)), 4);
    assert_eq!(m.matched(WorkerId(2)), 2);
    assert_eq!(
        m.matched(WorkerId(3)),
        0,
        "holding later blocks is not a prefix"
    );
    assert_eq!(m.get(WorkerId(3)).unwrap().cached_blocks, 3);
    assert_eq!(m.longest(), 4);
    idx.apply(WorkerId(1), &removed(1, &[2])).unwrap();
    assert_eq!(
        idx.find_matches(&[h(1), h(2), h(3)]).matched(WorkerId(1)),
        1
    );
}

#[test]
fn a_dead_entry_in_a_chain_is_skipped_for_the_hash_stored_again_elsewhere() {
    let mut idx = PrefixIndex::default();
    let (a, b) = (WorkerId(1), WorkerId(2));
    // Entries 0, 1, 2 hold 1, 2, 3 in chain order; removing 2 leaves entry 1 dead.
    idx.apply(a, &stored(0, &[1, 2, 3])).unwrap();
    idx.apply(a, &removed(1, &[2])).unwrap();
    let q = [h(1), h(2), h(3)];
    assert_eq!(idx.find_matches(&q).matched(a), 1);
    // 2 comes back in a new entry after 3: the walk must find it there, not read the dead one.
    idx.apply(b, &stored(0, &[2])).unwrap();
    idx.apply(a, &stored(2, &[2])).unwrap();
    let m = idx.find_matches(&q);
    assert_eq!(m.matched(a), 3);
    assert_eq!(m.matched(b), 0);
    assert_eq!(idx.blocks.counts(), (3, 1));
}

#[test]
fn compaction_keeps_every_match() {
    let mut idx = PrefixIndex::default();
    let (a, b) = (WorkerId(1), WorkerId(2));
    let chain: Vec<u64> = (0..3000).collect();
    idx.apply(a, &stored(0, &chain)).unwrap();
    idx.apply(b, &stored(0, &chain[..100])).unwrap();
    // Removing a's blocks from 200 on kills 2,800 entries: more than the live ones, so the table
    // compacts, and the chain must still match through the moved entries.
    idx.apply(a, &removed(1, &chain[200..])).unwrap();
    let (live, dead) = idx.blocks.counts();
    assert_eq!(live, 200);
    assert!(live + dead < 3000, "compacted: {dead} dead entries left");
    idx.apply(a, &stored(2, &chain[200..400])).unwrap();
    let q: Vec<BlockHash> = chain.iter().copied().map(h).collect();
    let m = idx.find_matches(&q);
    assert_eq!((m.matched(a), m.matched(b)), (400, 100));
    assert_eq!(idx.entries(), 500);
    assert_eq!(idx.distinct_blocks(), 400);
}

#[test]
fn gap_is_reported_and_not_applied_then_snapshot_resyncs() {
    let mut idx = PrefixIndex::default();
    let w = WorkerId(7);
    assert_eq!(
        idx.apply(w, &stored(3, &[1])),
        Err(Gap {
            worker: w,
            expected: 0,
            got: 3
        }),
        "a stream seen mid-way must be snapshotted first"
    );
    idx.apply(w, &stored(0, &[1])).unwrap();
    assert_eq!(
        idx.apply(w, &stored(2, &[2])),
        Err(Gap {
            worker: w,
            expected: 1,
            got: 2
        })
    );
    assert!(!idx.contains(w, h(2)));
    idx.apply_snapshot(w, [h(1), h(2), h(5)], Some(10));
    assert!(idx.contains(w, h(5)));
    assert!(idx.apply(w, &stored(9, &[3])).is_err());
    idx.apply(w, &stored(10, &[3])).unwrap();
    idx.reset_worker(w);
    assert_eq!(idx.worker_blocks(w), 0);
    idx.apply(w, &stored(42, &[4])).unwrap();
    idx.apply(w, &stored(43, &[4])).unwrap();
    assert_eq!(idx.worker_blocks(w), 1);
}

#[test]
fn cleared_and_remove_worker_drop_everything() {
    let mut idx = PrefixIndex::default();
    idx.apply(WorkerId(1), &stored(0, &[1, 2])).unwrap();
    idx.apply(WorkerId(2), &stored(0, &[1, 2])).unwrap();
    idx.apply(
        WorkerId(1),
        &KvEventRecord {
            id: 1,
            event: KvEvent::Cleared,
        },
    )
    .unwrap();
    assert_eq!(idx.worker_blocks(WorkerId(1)), 0);
    assert_eq!(idx.entries(), 2);
    idx.remove_worker(WorkerId(2));
    assert_eq!(idx.entries(), 0);
    assert_eq!(idx.distinct_blocks(), 0);
    assert!(idx.find_matches(&[h(1)]).get(WorkerId(2)).is_none());
    // The freed slot is reused without leaking the old worker's bits.
    idx.apply(WorkerId(3), &stored(0, &[2])).unwrap();
    assert_eq!(idx.find_matches(&[h(1)]).matched(WorkerId(3)), 0);
}

#[test]
fn cap_evicts_oldest_of_largest_worker() {
    let mut idx = PrefixIndex::new(5);
    idx.apply(WorkerId(1), &stored(0, &[1, 2, 3, 4])).unwrap();
    idx.apply(WorkerId(2), &stored(0, &[10])).unwrap();
    // Re-storing 1 refreshes it, so 2 becomes worker 1's oldest.
    idx.apply(WorkerId(1), &stored(1, &[1, 5])).unwrap();
    assert_eq!(idx.entries(), 5);
    assert!(!idx.contains(WorkerId(1), h(2)));
    assert!(idx.contains(WorkerId(1), h(1)));
    assert!(idx.contains(WorkerId(2), h(10)));
}

#[test]
fn many_workers_span_several_words() {
    let mut idx = PrefixIndex::default();
    for w in 0..200u64 {
        let blocks: Vec<u64> = (0..(w % 7)).collect();
        idx.apply(WorkerId(w), &stored(0, &blocks)).unwrap();
    }
    let q: Vec<_> = (0..10).map(h).collect();
    let m = idx.find_matches(&q);
    assert_eq!(m.entries().len(), 200);
    for w in 0..200u64 {
        assert_eq!(m.matched(WorkerId(w)), (w % 7) as usize);
    }
}

/// Reference model: per worker, a set of hashes and the next expected id.
#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerId, (HashSet<BlockHash>, Option<u64>)>,
}

impl Model {
    fn apply(&mut self, w: WorkerId, r: &KvEventRecord) -> Result<(), Gap> {
        let (set, exp) = self
            .workers
            .entry(w)
            .or_insert_with(|| (HashSet::new(), Some(0)));
        if let Some(e) = *exp {
            if e != r.id {
                return Err(Gap {
                    worker: w,
                    expected: e,
                    got: r.id,
                });
            }
        }
        *exp = Some(r.id + 1);
        match &r.event {
            KvEvent::Stored { blocks, .. } => set.extend(blocks.iter().copied()),
            KvEvent::Removed { hashes } => hashes.iter().for_each(|x| {
                set.remove(x);
            }),
            KvEvent::Cleared => set.clear(),
        }
        Ok(())
    }

    fn matched(&self, q: &[BlockHash]) -> Vec<(WorkerId, usize, usize)> {
        self.workers
            .iter()
            .map(|(w, (set, _))| {
                let n = q.iter().take_while(|x| set.contains(x)).count();
                (*w, n, set.len())
            })
            .collect()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Event {
        worker: u64,
        skip: bool,
        event: KvEvent,
    },
    Snapshot {
        worker: u64,
        hashes: Vec<u64>,
    },
    RemoveWorker(u64),
    Query(Vec<u64>),
}

fn hashes(max_len: usize) -> impl Strategy<Value = Vec<BlockHash>> {
    prop::collection::vec((0u64..24).prop_map(BlockHash), 0..max_len)
}

fn op() -> impl Strategy<Value = Op> {
    let event = prop_oneof![
        4 => (prop::option::of((0u64..24).prop_map(BlockHash)), hashes(8))
            .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
        2 => hashes(6).prop_map(|hashes| KvEvent::Removed { hashes }),
        1 => Just(KvEvent::Cleared),
    ];
    prop_oneof![
        8 => (0u64..70, prop::bool::weighted(0.05), event)
            .prop_map(|(worker, skip, event)| Op::Event { worker, skip, event }),
        1 => (0u64..70, prop::collection::vec(0u64..24, 0..10))
            .prop_map(|(worker, hashes)| Op::Snapshot { worker, hashes }),
        1 => (0u64..70).prop_map(Op::RemoveWorker),
        4 => prop::collection::vec(0u64..24, 0..12).prop_map(Op::Query),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn matches_reference_model(ops in prop::collection::vec(op(), 1..200)) {
        let mut idx = PrefixIndex::default();
        let mut model = Model::default();
        // Worker ids up to 70 so the bitset spans two words.
        for op in ops {
            match op {
                Op::Event { worker, skip, event } => {
                    let w = WorkerId(worker);
                    let next = model.workers.get(&w).and_then(|(_, e)| *e).unwrap_or(0);
                    let r = KvEventRecord { id: if skip { next + 2 } else { next }, event };
                    prop_assert_eq!(idx.apply(w, &r), model.apply(w, &r));
                }
                Op::Snapshot { worker, hashes } => {
                    let w = WorkerId(worker);
                    let hs: Vec<_> = hashes.into_iter().map(BlockHash).collect();
                    idx.apply_snapshot(w, hs.iter().copied(), Some(5));
                    model.workers.insert(w, (hs.into_iter().collect(), Some(5)));
                }
                Op::RemoveWorker(worker) => {
                    idx.remove_worker(WorkerId(worker));
                    model.workers.remove(&WorkerId(worker));
                }
                Op::Query(q) => {
                    let q: Vec<_> = q.into_iter().map(BlockHash).collect();
                    let got: Vec<_> = idx
                        .find_matches(&q)
                        .entries()
                        .iter()
                        .map(|e| (e.worker, e.matched_blocks, e.cached_blocks))
                        .collect();
                    prop_assert_eq!(got, model.matched(&q));
                }
            }
            let total: usize = model.workers.values().map(|(s, _)| s.len()).sum();
            prop_assert_eq!(idx.entries(), total);
        }
    }

    #[test]
    fn cap_is_never_exceeded(
        cap in 1usize..40,
        events in prop::collection::vec((0u64..5, hashes(10)), 1..60),
    ) {
        let mut idx = PrefixIndex::new(cap);
        let mut next = [0u64; 5];
        for (w, blocks) in events {
            let r = KvEventRecord { id: next[w as usize], event: KvEvent::Stored { parent: None, blocks } };
            next[w as usize] += 1;
            idx.apply(WorkerId(w), &r).unwrap();
            prop_assert!(idx.entries() <= cap);
            let per_worker: usize = (0..5).map(|w| idx.worker_blocks(WorkerId(w))).sum();
            prop_assert_eq!(per_worker, idx.entries());
        }
    }
}

#[test]
fn workers_beyond_the_inline_limit_match() {
    // Slots ≥ 65,535 cannot sit in a block's inline list; their blocks spill at once.
    let mut idx = PrefixIndex::default();
    let n = 65_600u64;
    for w in 0..n {
        idx.add_worker(WorkerId(w));
    }
    idx.apply(WorkerId(n - 1), &stored(0, &[1, 2, 3])).unwrap();
    idx.apply(WorkerId(0), &stored(0, &[1, 2])).unwrap();
    let m = idx.find_matches(&[h(1), h(2), h(3), h(4)]);
    assert_eq!(m.entries().len(), n as usize);
    assert_eq!(m.matched(WorkerId(n - 1)), 3);
    assert_eq!(m.matched(WorkerId(0)), 2);
    assert_eq!(m.matched(WorkerId(1)), 0);
    idx.apply(WorkerId(n - 1), &removed(1, &[2])).unwrap();
    let m = idx.find_matches(&[h(1), h(2), h(3)]);
    assert_eq!(m.matched(WorkerId(n - 1)), 1);
    assert_eq!(m.matched(WorkerId(0)), 2);
}

#[test]
fn results_come_in_worker_order_whatever_the_slot_order() {
    let mut idx = PrefixIndex::default();
    for w in [9u64, 3, 7, 1] {
        idx.apply(WorkerId(w), &stored(0, &[1, 2, w + 10])).unwrap();
    }
    idx.remove_worker(WorkerId(3));
    idx.apply(WorkerId(5), &stored(0, &[1])).unwrap(); // reuses 3's slot
    let m = idx.find_matches(&[h(1), h(2), h(8)]);
    let got: Vec<_> = m
        .entries()
        .iter()
        .map(|e| (e.worker.0, e.matched_blocks, e.cached_blocks))
        .collect();
    assert_eq!(got, [(1, 2, 3), (5, 1, 1), (7, 2, 3), (9, 2, 3)]);
}

fn wide_op() -> impl Strategy<Value = Op> {
    // Few hashes over many workers: blocks spill to bitsets and shrink back as workers drop them.
    let event = prop_oneof![
        4 => prop::collection::vec((0u64..10).prop_map(BlockHash), 0..8)
            .prop_map(|blocks| KvEvent::Stored { parent: None, blocks }),
        3 => prop::collection::vec((0u64..10).prop_map(BlockHash), 0..8)
            .prop_map(|hashes| KvEvent::Removed { hashes }),
        1 => Just(KvEvent::Cleared),
    ];
    prop_oneof![
        10 => (0u64..600, Just(false), event)
            .prop_map(|(worker, skip, event)| Op::Event { worker, skip, event }),
        1 => (0u64..600).prop_map(Op::RemoveWorker),
        3 => prop::collection::vec(0u64..10, 0..10).prop_map(Op::Query),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Up to 600 workers (a 10-word bitset) and 10 hashes, so most blocks have many holders;
    /// lookups reuse one result buffer.
    #[test]
    fn many_holders_match_reference_model(ops in prop::collection::vec(wide_op(), 1..600)) {
        let mut idx = PrefixIndex::default();
        let mut model = Model::default();
        let mut out = Matches::default();
        for op in ops {
            match op {
                Op::Event { worker, event, .. } => {
                    let w = WorkerId(worker);
                    let next = model.workers.get(&w).and_then(|(_, e)| *e).unwrap_or(0);
                    let r = KvEventRecord { id: next, event };
                    prop_assert_eq!(idx.apply(w, &r), model.apply(w, &r));
                }
                Op::RemoveWorker(worker) => {
                    idx.remove_worker(WorkerId(worker));
                    model.workers.remove(&WorkerId(worker));
                }
                Op::Query(q) => {
                    let q: Vec<_> = q.into_iter().map(BlockHash).collect();
                    idx.find_matches_into(&q, &mut out);
                    let got: Vec<_> = out
                        .entries()
                        .iter()
                        .map(|e| (e.worker, e.matched_blocks, e.cached_blocks))
                        .collect();
                    prop_assert_eq!(got, model.matched(&q));
                }
                Op::Snapshot { .. } => unreachable!("not generated"),
            }
            let distinct: HashSet<BlockHash> =
                model.workers.values().flat_map(|(s, _)| s.iter().copied()).collect();
            prop_assert_eq!(idx.distinct_blocks(), distinct.len());
        }
    }
}
