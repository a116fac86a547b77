//! Criterion benchmarks of the prefix index at 64 and 512 workers × 1,000-block prompts, plus a
//! timing loop that prints the p99 of single lookups (criterion reports means).

use std::hint::black_box;
use std::time::Instant;

use cleave_kv_index::{BlockHash, KvEvent, KvEventRecord, Matches, PrefixIndex, WorkerId};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

const BLOCKS: u64 = 1_000;

fn prompt(seed: u64, shared: u64) -> Vec<BlockHash> {
    // The first `shared` blocks are common to all prompts; the rest are unique to `seed`.
    (0..BLOCKS)
        .map(|i| BlockHash(if i < shared { i } else { (seed << 32) | i }))
        .collect()
}

fn stored(id: u64, blocks: Vec<BlockHash>) -> KvEventRecord {
    KvEventRecord {
        id,
        event: KvEvent::Stored {
            parent: None,
            blocks,
        },
    }
}

/// Every worker `w` holds a 1,000-block prompt sharing its first `w * 1000 / workers` blocks
/// with the query, so workers drop out of the walk one by one and the longest match is
/// `(workers - 1) * 1000 / workers` blocks.
fn populated(workers: u64) -> (PrefixIndex, Vec<BlockHash>) {
    let mut idx = PrefixIndex::default();
    for w in 0..workers {
        let r = stored(0, prompt(w + 1, w * BLOCKS / workers));
        idx.apply(WorkerId(w), &r).unwrap();
    }
    (idx, prompt(1_000_000, BLOCKS))
}

/// Every worker holds the same 1,000 blocks: the query matches all of them on every worker.
fn all_hit(workers: u64) -> (PrefixIndex, Vec<BlockHash>) {
    let mut idx = PrefixIndex::default();
    for w in 0..workers {
        idx.apply(WorkerId(w), &stored(0, prompt(0, BLOCKS)))
            .unwrap();
    }
    (idx, prompt(0, BLOCKS))
}

fn bench(c: &mut Criterion) {
    for workers in [64u64, 512] {
        let (idx, query) = populated(workers);
        assert_eq!(
            idx.find_matches(&query).longest() as u64,
            (workers - 1) * BLOCKS / workers
        );
        let mut out = Matches::default();
        c.bench_function(&format!("find_matches {workers}w x 1000 blocks"), |b| {
            b.iter(|| {
                idx.find_matches_into(black_box(&query), &mut out);
                black_box(&out);
            })
        });
        let (full_idx, full) = all_hit(workers);
        c.bench_function(
            &format!("find_matches {workers}w all hold all 1000 blocks"),
            |b| {
                b.iter(|| {
                    full_idx.find_matches_into(black_box(&full), &mut out);
                    black_box(&out);
                })
            },
        );
        c.bench_function(
            &format!("apply Stored 1000 blocks into {workers}w index"),
            |b| {
                b.iter_batched(
                    || (populated(workers).0, prompt(5_000_000, 0)),
                    |(mut idx, blocks)| {
                        idx.apply(WorkerId(3), &stored(1, blocks)).unwrap();
                        idx
                    },
                    BatchSize::LargeInput,
                )
            },
        );

        // p99 of single lookups (both shapes), measured one call at a time.
        for (name, idx, q) in [("partial", &idx, &query), ("all-hit", &full_idx, &full)] {
            let mut samples: Vec<u128> = (0..20_000)
                .map(|_| {
                    let t = Instant::now();
                    idx.find_matches_into(black_box(q), &mut out);
                    black_box(&out);
                    t.elapsed().as_nanos()
                })
                .collect();
            samples.sort_unstable();
            let p = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize] as f64 / 1e3;
            println!(
                "find_matches {name} {workers}w x 1000 blocks: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
                p(0.5),
                p(0.99),
                p(1.0)
            );
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
