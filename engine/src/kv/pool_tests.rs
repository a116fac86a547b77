//! Unit tests of [`BlockPool`] through its public API.

use super::*;

fn h(x: u64) -> BlockHash {
    BlockHash(x)
}

fn events(pool: &mut BlockPool) -> Vec<KvEvent> {
    pool.drain_events().into_iter().map(|r| r.event).collect()
}

#[test]
fn allocate_until_empty() {
    let mut pool = BlockPool::new(4);
    assert_eq!(pool.total(), 4);
    assert_eq!(pool.available(), 4);
    let ids: Vec<_> = (0..4).map(|_| pool.allocate().unwrap()).collect();
    assert_eq!(ids, vec![BlockId(0), BlockId(1), BlockId(2), BlockId(3)]);
    assert_eq!(pool.allocate(), None);
    assert_eq!(pool.available(), 0);
    assert_eq!(
        pool.stats(),
        PoolStats {
            total: 4,
            free: 0,
            cached_idle: 0,
            used: 4
        }
    );
    pool.check_invariants();
    for id in ids {
        assert_eq!(pool.refcount(id), 1);
        pool.release(id);
        assert_eq!(pool.refcount(id), 0);
    }
    assert_eq!(pool.available(), 4);
    assert!(pool.drain_events().is_empty());
    pool.check_invariants();
}

#[test]
fn empty_pool() {
    let mut pool = BlockPool::new(0);
    assert_eq!(pool.allocate(), None);
    assert_eq!(pool.stats(), PoolStats::default());
    pool.clear_cache();
    pool.check_invariants();
}

#[test]
fn lru_evicts_least_recently_released_first() {
    let mut pool = BlockPool::new(3);
    let ids: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    for (k, &id) in ids.iter().enumerate() {
        assert!(pool.commit(id, h(10 + k as u64), None));
    }
    // Release in the order 1, 0, 2: eviction must follow that order.
    pool.release(ids[1]);
    pool.release(ids[0]);
    pool.release(ids[2]);
    assert_eq!(pool.stats().cached_idle, 3);
    assert_eq!(pool.available(), 3);
    pool.drain_events();
    assert_eq!(pool.allocate(), Some(ids[1]));
    assert_eq!(pool.hash_of(ids[1]), None);
    assert_eq!(
        events(&mut pool),
        vec![KvEvent::Removed {
            hashes: vec![h(11)]
        }]
    );
    // Touching block 0 (match + release) makes it the most recent: block 2 goes next.
    assert_eq!(pool.match_prefix(&[h(10)]), vec![ids[0]]);
    pool.release(ids[0]);
    assert_eq!(pool.allocate(), Some(ids[2]));
    assert_eq!(pool.allocate(), Some(ids[0]));
    assert_eq!(pool.allocate(), None);
    assert_eq!(
        events(&mut pool),
        vec![
            KvEvent::Removed {
                hashes: vec![h(12)]
            },
            KvEvent::Removed {
                hashes: vec![h(10)]
            },
        ]
    );
    pool.check_invariants();
}

#[test]
fn free_blocks_go_before_cached_ones() {
    let mut pool = BlockPool::new(2);
    let a = pool.allocate().unwrap();
    assert!(pool.commit(a, h(1), None));
    pool.release(a);
    let b = pool.allocate().unwrap();
    assert_ne!(a, b);
    assert_eq!(pool.hash_of(a), Some(h(1)));
    assert_eq!(pool.count_prefix(&[h(1)]), 1);
    pool.check_invariants();
}

#[test]
fn match_prefix_shares_and_stops_at_first_miss() {
    let mut pool = BlockPool::new(4);
    let ids: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    assert!(pool.commit(ids[0], h(1), None));
    assert!(pool.commit(ids[1], h(2), Some(h(1))));
    assert!(pool.commit(ids[2], h(3), Some(h(2))));
    assert_eq!(pool.count_prefix(&[h(1), h(2), h(9), h(3)]), 2);
    assert_eq!(pool.queried(), 0);
    let m = pool.match_prefix(&[h(1), h(2), h(9), h(3)]);
    assert_eq!(m, vec![ids[0], ids[1]]);
    assert_eq!(pool.refcount(ids[0]), 2);
    assert_eq!(pool.refcount(ids[2]), 1);
    assert_eq!((pool.hits(), pool.queried()), (2, 4));
    assert!(pool.match_prefix(&[h(9), h(1)]).is_empty());
    assert_eq!((pool.hits(), pool.queried()), (2, 6));
    pool.check_invariants();

    // Release everything: cached blocks become idle, nothing is free-listed twice.
    for &id in &m {
        pool.release(id);
    }
    for &id in &ids {
        pool.release(id);
    }
    assert_eq!(
        pool.stats(),
        PoolStats {
            total: 4,
            free: 1,
            cached_idle: 3,
            used: 0
        }
    );
    // An idle block is found again and becomes used.
    assert_eq!(pool.match_prefix(&[h(1)]), vec![ids[0]]);
    assert_eq!(pool.stats().cached_idle, 2);
    assert_eq!(pool.stats().used, 1);
    pool.check_invariants();
}

#[test]
fn parent_evicted_before_child() {
    let mut pool = BlockPool::new(2);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert!(pool.commit(a, h(1), None));
    assert!(pool.commit(b, h(2), Some(h(1))));
    pool.release(a);
    pool.release(b);
    let c = pool.allocate().unwrap();
    assert_eq!(c, a);
    assert_eq!(pool.count_prefix(&[h(1), h(2)]), 0);
    assert_eq!(pool.count_prefix(&[h(2)]), 1);
    pool.check_invariants();
}

#[test]
fn commit_duplicate_hash_returns_false() {
    let mut pool = BlockPool::new(3);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert!(pool.commit(a, h(7), None));
    assert!(!pool.commit(b, h(7), None));
    assert_eq!(pool.hash_of(b), None);
    // Re-committing the same block under the same hash is a no-op that succeeds.
    assert!(pool.commit(a, h(7), None));
    assert_eq!(
        events(&mut pool),
        vec![KvEvent::Stored {
            parent: None,
            blocks: vec![h(7)]
        }]
    );
    // The uncached duplicate goes to the free list on release, the original stays cached.
    pool.release(b);
    pool.release(a);
    assert_eq!(
        pool.stats(),
        PoolStats {
            total: 3,
            free: 2,
            cached_idle: 1,
            used: 0
        }
    );
    pool.check_invariants();
}

#[test]
fn shared_block_survives_one_release() {
    let mut pool = BlockPool::new(1);
    let a = pool.allocate().unwrap();
    pool.retain(a);
    assert_eq!(pool.refcount(a), 2);
    pool.release(a);
    assert_eq!(pool.available(), 0);
    pool.release(a);
    assert_eq!(pool.available(), 1);
    pool.check_invariants();
}

#[test]
fn clear_cache_uncaches_everything_and_emits_cleared() {
    let mut pool = BlockPool::new(3);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert!(pool.commit(a, h(1), None));
    assert!(pool.commit(b, h(2), Some(h(1))));
    pool.release(a);
    pool.drain_events();
    pool.clear_cache();
    assert_eq!(events(&mut pool), vec![KvEvent::Cleared]);
    assert_eq!(pool.count_prefix(&[h(1)]), 0);
    assert_eq!(pool.count_prefix(&[h(2)]), 0);
    assert_eq!(pool.hash_of(b), None);
    assert_eq!(pool.refcount(b), 1);
    assert_eq!(
        pool.stats(),
        PoolStats {
            total: 3,
            free: 2,
            cached_idle: 0,
            used: 1
        }
    );
    pool.check_invariants();
    pool.release(b);
    assert_eq!(pool.stats().free, 3);
    // Always emitted, even with nothing cached.
    pool.clear_cache();
    assert_eq!(events(&mut pool), vec![KvEvent::Cleared]);
    pool.check_invariants();
}

#[test]
fn event_ids_are_contiguous() {
    let mut pool = BlockPool::new(2);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    pool.commit(a, h(1), None);
    pool.commit(b, h(2), Some(h(1)));
    let first = pool.drain_events();
    pool.release(a);
    pool.release(b);
    pool.allocate().unwrap(); // evicts h(1)
    pool.clear_cache(); // drops h(2)
    let second = pool.drain_events();
    let ids: Vec<u64> = first.iter().chain(&second).map(|r| r.id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3]);
    assert_eq!(
        second.into_iter().map(|r| r.event).collect::<Vec<_>>(),
        vec![KvEvent::Removed { hashes: vec![h(1)] }, KvEvent::Cleared]
    );
}

#[test]
fn undrained_events_are_bounded() {
    let mut pool = BlockPool::with_event_capacity(1, 4);
    for _ in 0..10 {
        pool.clear_cache();
    }
    assert_eq!(pool.dropped_events(), 6);
    let ids: Vec<u64> = pool.drain_events().iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![6, 7, 8, 9]);
}

#[test]
fn out_of_range_queries() {
    let pool = BlockPool::new(2);
    assert_eq!(pool.refcount(BlockId(5)), 0);
    assert_eq!(pool.hash_of(BlockId(5)), None);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "has refcount 0")]
fn double_release_is_caught_in_debug() {
    let mut pool = BlockPool::new(1);
    let a = pool.allocate().unwrap();
    pool.release(a);
    pool.release(a);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "is free")]
fn retain_of_free_block_is_caught_in_debug() {
    let mut pool = BlockPool::new(1);
    pool.retain(BlockId(0));
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "not held")]
fn commit_of_unheld_block_is_caught_in_debug() {
    let mut pool = BlockPool::new(1);
    pool.commit(BlockId(0), h(1), None);
}
