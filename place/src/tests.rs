//! Unit tests of the placement policies and the optimistic accounting.

use std::collections::HashMap;

use cleave_kv_index::{MatchEntry, Matches, WorkerId};

use super::*;

fn view(n: u64) -> WorkerView {
    let mut v = WorkerView::new();
    for i in 0..n {
        v.upsert(WorkerId(i), Role::Both);
    }
    v
}

/// `matched[i]` leading blocks cached on worker i (tree size = matched).
fn req(prompt_blocks: usize, matched: &[usize]) -> PlacementRequest {
    PlacementRequest {
        prompt_blocks,
        decode_blocks: 1,
        matches: Matches::from_entries(
            matched
                .iter()
                .enumerate()
                .map(|(i, &m)| MatchEntry {
                    worker: WorkerId(i as u64),
                    matched_blocks: m,
                    cached_blocks: m,
                })
                .collect(),
        ),
    }
}

fn local_only() -> PlaceConfig {
    PlaceConfig {
        disagg_min_uncached_blocks: usize::MAX,
        ..PlaceConfig::default()
    }
}

/// `local_only` with the weights the cost arithmetic in these tests is written for.
fn weights_48_3_16() -> PlaceConfig {
    PlaceConfig {
        prefill_weight: 48.0,
        queued_prefill_weight: 3.0,
        free_prefill_weight: 16.0,
        ..local_only()
    }
}

fn all_policies(config: &PlaceConfig) -> Vec<Box<dyn Policy>> {
    PolicyKind::ALL.iter().map(|k| k.build(config)).collect()
}

#[test]
fn prefix_affinity_wins_when_load_is_equal() {
    let p = PolicyKind::PrefixLoad.build(&local_only());
    let v = view(4);
    for _ in 0..20 {
        let got = p.place(&req(20, &[0, 0, 15, 3]), &v).unwrap();
        assert_eq!(got.decode, WorkerId(2));
        assert_eq!(got.prefill, None);
        assert_eq!(got.cached_blocks, 15);
    }
}

#[test]
fn load_wins_when_the_cached_worker_is_overloaded() {
    let p = PolicyKind::PrefixLoad.build(&local_only());
    let mut v = view(3);
    v.report(
        WorkerId(1),
        Load {
            prefill_blocks: 400,
            decode_blocks: 1600,
            queue_depth: 32,
            ..Load::default()
        },
    );
    let got = p.place(&req(20, &[0, 20, 0]), &v).unwrap();
    assert_ne!(got.decode, WorkerId(1));
    // With a light load, the cache wins again.
    v.report(
        WorkerId(1),
        Load {
            prefill_blocks: 0,
            decode_blocks: 10,
            queue_depth: 1,
            ..Load::default()
        },
    );
    assert_eq!(
        p.place(&req(20, &[0, 20, 0]), &v).unwrap().decode,
        WorkerId(1)
    );
}

#[test]
fn uncached_blocks_that_fit_in_free_kv_space_weigh_less() {
    // Worker 0 holds half of a 20-block prompt, has 120 prefill blocks queued and no free space
    // (48·10 + 3·120 = 840); worker 1 holds nothing and is idle (48·20 = 960 when full).
    let report = |v: &mut WorkerView, w: u64, prefill: u64, capacity: u64| {
        let l = Load {
            prefill_blocks: prefill,
            kv_capacity_blocks: capacity,
            ..Load::default()
        };
        v.report(WorkerId(w), l);
    };
    let place = |config: &PlaceConfig, worker1_capacity: u64| {
        let mut v = view(2);
        report(&mut v, 0, 120, 10 + 120);
        report(&mut v, 1, 0, worker1_capacity);
        let p = PolicyKind::PrefixLoad.build(config);
        p.place(&req(20, &[10, 0]), &v).unwrap().decode
    };
    let c = weights_48_3_16();
    assert_eq!(
        place(&c, 0),
        WorkerId(0),
        "capacity not reported: no free space"
    );
    assert_eq!(place(&c, 1000), WorkerId(1), "16·20 = 320");
    // Only the part that fits is discounted: 48·15 + 16·5 = 800 wins, 48·18 + 16·2 = 896 loses.
    assert_eq!(place(&c, 5), WorkerId(1));
    assert_eq!(place(&c, 2), WorkerId(0));
    let off = PlaceConfig {
        free_prefill_weight: c.prefill_weight,
        ..weights_48_3_16()
    };
    assert_eq!(
        place(&off, 1000),
        WorkerId(0),
        "the discount is what moved it"
    );
}

#[test]
fn a_burst_without_cache_spreads_with_optimistic_accounting() {
    for kind in [PolicyKind::PrefixLoad, PolicyKind::LeastLoad] {
        let p = kind.build(&local_only());
        let mut v = view(8);
        let mut per_worker: HashMap<WorkerId, usize> = HashMap::new();
        let mut charges = Vec::new();
        for _ in 0..64 {
            let r = req(10, &[0; 8]);
            let got = p.place(&r, &v).unwrap();
            *per_worker.entry(got.decode).or_default() += 1;
            charges.push(v.charge(&r, &got));
        }
        assert_eq!(per_worker.len(), 8, "{kind:?}: {per_worker:?}");
        assert!(
            per_worker.values().all(|&c| c == 8),
            "{kind:?}: {per_worker:?}"
        );
        for c in charges {
            v.release(c);
        }
        assert!(v.iter().all(|w| w.inflight == Load::default()));
    }
}

#[test]
fn ties_are_not_broken_by_list_order() {
    // No charging: every call sees the same idle view, so only the tie-break decides.
    let p = PolicyKind::PrefixLoad.build(&local_only());
    let v = view(4);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..100 {
        seen.insert(p.place(&req(10, &[0; 4]), &v).unwrap().decode);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}

#[test]
fn ties_prefer_the_smaller_cached_tree() {
    let p = PolicyKind::PrefixLoad.build(&local_only());
    let v = view(3);
    let mut r = req(10, &[0, 0, 0]);
    r.matches = Matches::from_entries(
        [(0, 50), (1, 5), (2, 70)]
            .into_iter()
            .map(|(w, tree)| MatchEntry {
                worker: WorkerId(w),
                matched_blocks: 0,
                cached_blocks: tree,
            })
            .collect(),
    );
    for _ in 0..20 {
        assert_eq!(p.place(&r, &v).unwrap().decode, WorkerId(1));
    }
}

#[test]
fn unhealthy_workers_are_never_chosen() {
    for p in all_policies(&PlaceConfig::default()) {
        let mut v = view(4);
        v.set_healthy(WorkerId(0), false);
        v.set_healthy(WorkerId(2), false);
        for _ in 0..50 {
            // Worker 0 holds the whole prompt: prefix-load would love it.
            let got = p.place(&req(64, &[64, 0, 0, 0]), &v).unwrap();
            assert!(
                [WorkerId(1), WorkerId(3)].contains(&got.decode),
                "{}",
                p.name()
            );
            if let Some(pf) = got.prefill {
                assert!([WorkerId(1), WorkerId(3)].contains(&pf), "{}", p.name());
            }
        }
        v.set_healthy(WorkerId(1), false);
        v.set_healthy(WorkerId(3), false);
        assert_eq!(
            p.place(&req(4, &[0; 4]), &v),
            Err(PlaceError::NoDecodeWorker)
        );
    }
}

#[test]
fn conditional_disaggregation_threshold() {
    let config = PlaceConfig {
        disagg_min_uncached_blocks: 8,
        ..PlaceConfig::default()
    };
    let mut v = WorkerView::new();
    v.upsert(WorkerId(0), Role::Prefill);
    v.upsert(WorkerId(1), Role::Decode);
    v.upsert(WorkerId(2), Role::Prefill);
    for p in all_policies(&config) {
        // 10 prompt blocks, 4 cached on the decode worker: 6 uncached < 8 → local prefill.
        let got = p.place(&req(10, &[0, 4, 0]), &v).unwrap();
        assert_eq!(
            (got.prefill, got.decode),
            (None, WorkerId(1)),
            "{}",
            p.name()
        );
        assert_eq!(got.cached_blocks, 4);
        // 2 cached: 8 uncached ≥ 8 → a prefill worker.
        let got = p.place(&req(10, &[0, 2, 0]), &v).unwrap();
        assert_eq!(got.decode, WorkerId(1), "{}", p.name());
        assert!(matches!(got.prefill, Some(WorkerId(0 | 2))), "{}", p.name());
    }
    // prefix-load sends the prefill where the prompt is cached.
    let p = PolicyKind::PrefixLoad.build(&config);
    let got = p.place(&req(40, &[0, 0, 30]), &v).unwrap();
    assert_eq!(got.prefill, Some(WorkerId(2)));
    assert_eq!(got.cached_blocks, 30);
    // No prefill-capable worker: local.
    let mut v = WorkerView::new();
    v.upsert(WorkerId(1), Role::Decode);
    assert_eq!(p.place(&req(40, &[0, 0, 0]), &v).unwrap().prefill, None);
}

#[test]
fn charges_follow_prefill_and_release() {
    let mut v = view(2);
    let r = req(10, &[0, 0]);
    let placement = Placement {
        prefill: Some(WorkerId(0)),
        decode: WorkerId(1),
        cached_blocks: 3,
    };
    let mut c = v.charge(&r, &placement);
    assert_eq!(v.get(WorkerId(0)).unwrap().load().prefill_blocks, 7);
    assert_eq!(v.get(WorkerId(1)).unwrap().load().decode_blocks, 11);
    assert_eq!(v.get(WorkerId(1)).unwrap().load().queue_depth, 1);
    v.prefill_done(&mut c);
    v.prefill_done(&mut c);
    assert_eq!(v.get(WorkerId(0)).unwrap().load().prefill_blocks, 0);
    // A report larger than the router's own charges wins.
    v.report(
        WorkerId(1),
        Load {
            prefill_blocks: 0,
            decode_blocks: 50,
            queue_depth: 3,
            ..Load::default()
        },
    );
    assert_eq!(v.get(WorkerId(1)).unwrap().load().decode_blocks, 50);
    v.release(c);
    assert_eq!(v.get(WorkerId(1)).unwrap().inflight, Load::default());
}

#[test]
fn round_robin_cycles_and_random_is_seeded() {
    let v = view(3);
    let rr = PolicyKind::RoundRobin.build(&local_only());
    let got: Vec<_> = (0..6)
        .map(|_| rr.place(&req(1, &[0; 3]), &v).unwrap().decode.0)
        .collect();
    assert_eq!(got, [0, 1, 2, 0, 1, 2]);
    let a = PolicyKind::Random.build(&local_only());
    let b = PolicyKind::Random.build(&local_only());
    let pa: Vec<_> = (0..20)
        .map(|_| a.place(&req(1, &[0; 3]), &v).unwrap().decode)
        .collect();
    let pb: Vec<_> = (0..20)
        .map(|_| b.place(&req(1, &[0; 3]), &v).unwrap().decode)
        .collect();
    assert_eq!(pa, pb);
}

#[test]
fn policy_kind_names_are_kebab_case() {
    for k in PolicyKind::ALL {
        assert_eq!(
            serde_json::to_string(&k).unwrap(),
            format!("\"{}\"", k.name())
        );
        assert_eq!(k.build(&PlaceConfig::default()).name(), k.name());
        assert_eq!(
            <PolicyKind as clap::ValueEnum>::from_str(k.name(), false),
            Ok(k)
        );
    }
}

fn load(v: &mut WorkerView, w: u64, prefill: u64, decode: u64, queue: u64) {
    v.report(
        WorkerId(w),
        Load {
            prefill_blocks: prefill,
            decode_blocks: decode,
            queue_depth: queue,
            ..Load::default()
        },
    );
}

#[test]
fn sglang_follows_the_cache_above_the_threshold_only() {
    let p = PolicyKind::SglangCacheAware.build(&local_only());
    let mut v = view(3);
    load(&mut v, 0, 0, 0, 5);
    load(&mut v, 1, 0, 0, 9);
    load(&mut v, 2, 0, 0, 1);
    // 4/10 > 0.3: the longest match wins although its queue is the longest.
    assert_eq!(
        p.place(&req(10, &[2, 4, 0]), &v).unwrap().decode,
        WorkerId(1)
    );
    // 3/10 is not above 0.3: the shortest queue.
    assert_eq!(
        p.place(&req(10, &[2, 3, 0]), &v).unwrap().decode,
        WorkerId(2)
    );
}

#[test]
fn sglang_balances_only_when_both_thresholds_are_exceeded() {
    let sg = sglang_cache_aware::SglangConfig::default();
    use sglang_cache_aware::SglangCacheAware as S;
    assert!(!S::imbalanced(&sg, 64, 0), "difference 64 is not above 64");
    assert!(S::imbalanced(&sg, 65, 0));
    assert!(
        !S::imbalanced(&sg, 200, 134),
        "200 ≤ 1.5·134: balanced though far apart"
    );
    assert!(S::imbalanced(&sg, 200, 133));
    let p = PolicyKind::SglangCacheAware.build(&local_only());
    let mut v = view(2);
    load(&mut v, 0, 0, 0, 100);
    load(&mut v, 1, 0, 0, 10);
    // Imbalanced: the full match on worker 0 is ignored.
    assert_eq!(p.place(&req(10, &[10, 0]), &v).unwrap().decode, WorkerId(1));
    load(&mut v, 0, 0, 0, 70);
    assert_eq!(p.place(&req(10, &[10, 0]), &v).unwrap().decode, WorkerId(0));
}

#[test]
fn dynamo_cost_is_weighted_prefill_plus_decode_blocks() {
    let p = PolicyKind::DynamoCost.build(&local_only());
    let mut v = view(3);
    // costs: w0 = 1·(0 + 10) + 0 = 10; w1 = 1·(4 + 2) + 3 = 9; w2 = 1·(0 + 10) + 0 = 10.
    load(&mut v, 1, 4, 3, 1);
    assert_eq!(
        p.place(&req(10, &[0, 8, 0]), &v).unwrap().decode,
        WorkerId(1)
    );
    // Two more decode blocks on w1 make it 11 > 10: an idle worker wins, either of them.
    load(&mut v, 1, 4, 5, 1);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..50 {
        seen.insert(p.place(&req(10, &[0, 8, 0]), &v).unwrap().decode);
    }
    assert_eq!(
        seen,
        [WorkerId(0), WorkerId(2)].into_iter().collect(),
        "ties at random, never by list order"
    );
    // A larger overlap weight makes the cached worker worth its load again.
    let mut config = local_only();
    config.dynamo.overlap_score_weight = 2.0;
    let p = PolicyKind::DynamoCost.build(&config);
    assert_eq!(
        p.place(&req(10, &[0, 8, 0]), &v).unwrap().decode,
        WorkerId(1)
    );
}

#[test]
fn recent_prefill_work_decays_per_placement_and_outlives_the_charge() {
    let mut v = view(2);
    let recent = |v: &WorkerView, i| v.get(WorkerId(i)).unwrap().recent_prefill_blocks;
    let on = |w, cached_blocks| Placement {
        prefill: None,
        decode: WorkerId(w),
        cached_blocks,
    };
    let first = v.charge(&req(10, &[0, 0]), &on(0, 0));
    assert_eq!(recent(&v, 0), 10.0);
    v.release(first);
    assert_eq!(
        recent(&v, 0),
        10.0,
        "releasing the charge keeps the history"
    );
    // One half-life: RECENT_HALF_LIFE_PER_WORKER placements per worker, here fully cached ones
    // on the other worker (they add nothing).
    let half_life = (view::RECENT_HALF_LIFE_PER_WORKER * 2.0) as usize;
    for _ in 0..half_life {
        let c = v.charge(&req(10, &[0, 10]), &on(1, 10));
        v.release(c);
    }
    assert!((recent(&v, 0) - 5.0).abs() < 1e-9, "{}", recent(&v, 0));
    assert_eq!(recent(&v, 1), 0.0);
}

#[test]
fn work_nobody_holds_spreads_by_recent_prefill_work() {
    // A stream of prompts no worker holds, each finished before the next arrives: queues are
    // always empty, so only the recent prefill work tells the workers apart.
    let spread = |recent_prefill_weight| {
        let p = PolicyKind::PrefixLoad.build(&PlaceConfig {
            recent_prefill_weight,
            ..local_only()
        });
        let mut v = view(4);
        let mut per_worker = [0usize; 4];
        for _ in 0..400 {
            let r = req(10, &[0; 4]);
            let got = p.place(&r, &v).unwrap();
            per_worker[got.decode.0 as usize] += 1;
            let c = v.charge(&r, &got);
            v.release(c);
        }
        per_worker
    };
    assert_eq!(spread(2.0), [100; 4], "each worker in turn");
    let blind = spread(0.0);
    assert!(
        blind.iter().max().unwrap() - blind.iter().min().unwrap() > 4,
        "without the term the ties fall at random: {blind:?}"
    );
}

#[test]
fn measured_prefill_corrects_the_recent_work_once() {
    let mut v = view(2);
    let recent = |v: &WorkerView| v.get(WorkerId(0)).unwrap().recent_prefill_blocks;
    let on0 = |cached_blocks| Placement {
        prefill: None,
        decode: WorkerId(0),
        cached_blocks,
    };
    // The index said 6 of 10 blocks were cached; the worker had none of them.
    let mut c = v.charge(&req(10, &[6, 0]), &on0(6));
    assert_eq!(recent(&v), 4.0);
    v.prefill_measured(&mut c, 0);
    assert_eq!(recent(&v), 10.0, "corrected to the 10 blocks it computed");
    v.prefill_measured(&mut c, 10);
    assert_eq!(recent(&v), 10.0, "once per charge");
    v.release(c);
    assert_eq!(recent(&v), 10.0, "releasing keeps the history");
    // A worker that had more cached than the index knew computed less; never below zero.
    let mut v = view(2);
    let mut c = v.charge(&req(10, &[0, 0]), &on0(0));
    v.prefill_measured(&mut c, 10);
    assert_eq!(recent(&v), 0.0);
    v.release(c);
}

#[test]
fn a_worker_missing_what_the_index_says_it_holds_gets_less_other_work() {
    // Worker 0 keeps being sent a prefix the index says it holds but it has evicted (its
    // events lag): every such request is a whole prefill there (until, measured, its recent
    // work outweighs the prefix it is said to hold). Interleaved with prompts
    // nobody holds, each finished before the next arrives.
    let others_on_0 = |measured: bool| {
        let p = PolicyKind::PrefixLoad.build(&local_only());
        let mut v = view(4);
        let mut on_0 = 0;
        for _ in 0..200 {
            let stale = req(10, &[10, 0, 0, 0]);
            let got = p.place(&stale, &v).unwrap();
            let mut c = v.charge(&stale, &got);
            if measured {
                v.prefill_measured(&mut c, 0);
            }
            v.release(c);
            let cold = req(10, &[0; 4]);
            let got = p.place(&cold, &v).unwrap();
            on_0 += usize::from(got.decode == WorkerId(0));
            let mut c = v.charge(&cold, &got);
            if measured {
                v.prefill_measured(&mut c, 0);
            }
            v.release(c);
        }
        on_0
    };
    let blind = others_on_0(false);
    let measured = others_on_0(true);
    assert!(
        blind >= 45,
        "unmeasured, worker 0 looks idle: {blind} of 200"
    );
    assert!(
        measured * 4 < blind,
        "measured, it takes less: {measured} against {blind} of 200"
    );
}
