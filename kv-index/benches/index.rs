//! Criterion benchmarks of the prefix index at 64 workers × 1,000-block prompts, plus a timing
//! loop that prints the p99 of single lookups (criterion reports means).

use std::hint::black_box;
use std::time::Instant;

use cleave_kv_index::{BlockHash, KvEvent, KvEventRecord, PrefixIndex, WorkerId};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

const WORKERS: u64 = 64;
const BLOCKS: u64 = 1_000;

fn prompt(seed: u64, shared: u64) -> Vec<BlockHash> {
    // The first `shared` blocks are common to all prompts; the rest are unique to `seed`.
    (0..BLOCKS)
        .map(|i| BlockHash(if i < shared { i } else { (seed << 32) | i }))
        .collect()
}

/// Every worker holds a 1,000-block prompt sharing its first `w * 15` blocks with the query, so
/// workers drop out of the walk one by one and the longest match is ~945 blocks.
fn populated() -> (PrefixIndex, Vec<BlockHash>) {
    let mut idx = PrefixIndex::default();
    for w in 0..WORKERS {
        let blocks = prompt(w + 1, w * 15);
        let r = KvEventRecord {
            id: 0,
            event: KvEvent::Stored {
                parent: None,
                blocks,
            },
        };
        idx.apply(WorkerId(w), &r).unwrap();
    }
    (idx, prompt(1_000, BLOCKS))
}

fn bench(c: &mut Criterion) {
    let (idx, query) = populated();
    let m = idx.find_matches(&query);
    assert_eq!(m.longest(), 945);
    c.bench_function("find_matches 64w x 1000 blocks", |b| {
        b.iter(|| black_box(idx.find_matches(black_box(&query))))
    });
    let all_hit = {
        let mut idx = PrefixIndex::default();
        for w in 0..WORKERS {
            let r = KvEventRecord {
                id: 0,
                event: KvEvent::Stored {
                    parent: None,
                    blocks: prompt(0, BLOCKS),
                },
            };
            idx.apply(WorkerId(w), &r).unwrap();
        }
        idx
    };
    let full = prompt(0, BLOCKS);
    c.bench_function("find_matches 64w all hold all 1000 blocks", |b| {
        b.iter(|| black_box(all_hit.find_matches(black_box(&full))))
    });
    c.bench_function("apply Stored 1000 blocks into 64w index", |b| {
        b.iter_batched(
            || (populated().0, prompt(5_000, 0)),
            |(mut idx, blocks)| {
                let r = KvEventRecord {
                    id: 1,
                    event: KvEvent::Stored {
                        parent: None,
                        blocks,
                    },
                };
                idx.apply(WorkerId(3), &r).unwrap();
                idx
            },
            BatchSize::LargeInput,
        )
    });

    // p99 of single lookups (both shapes), measured one call at a time.
    for (name, idx, q) in [("partial", &idx, &query), ("all-hit", &all_hit, &full)] {
        let mut samples: Vec<u128> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(idx.find_matches(black_box(q)));
                t.elapsed().as_nanos()
            })
            .collect();
        samples.sort_unstable();
        let p = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize] as f64 / 1e3;
        println!(
            "find_matches {name} 64w x 1000 blocks: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            p(0.5),
            p(0.99),
            p(1.0)
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
