//! Every collective against a simple reference, over real TCP between threads.

use crate::common;

use cleave_collective::{NetGroup, Transport};
use cleave_types::collective::Collective;
use common::{data, on_ranks_with};

const SIZES: [usize; 6] = [0, 1, 7, 16_385, 100_003, 1 << 20];

/// [`on_ranks_with`] over transport `t`, the rest of the configuration the default.
fn on_ranks_over<T: Send + 'static>(
    t: Transport,
    world: usize,
    f: impl Fn(NetGroup) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    on_ranks_with(world, move |c| c.transport = t, f)
}

/// The inputs of `world` ranks (`input(rank + 1)`) added element by element in rank order.
fn summed_in_rank_order(world: usize, input: impl Fn(u64) -> Vec<f32>) -> Vec<f32> {
    let mut sum = input(1);
    for r in 1..world {
        for (s, x) in sum.iter_mut().zip(input(r as u64 + 1)) {
            *s += x;
        }
    }
    sum
}

#[test]
fn all_reduce_matches_the_reference_and_is_bitwise_identical_across_ranks() {
    for t in common::transports() {
        for world in [2, 3, 4] {
            for n in SIZES {
                let got = on_ranks_over(t, world, move |g| {
                    let mut buf = data(g.rank() as u64 + 1, n);
                    g.all_reduce_sum(&mut buf).unwrap();
                    buf
                });
                let want = summed_in_rank_order(world, |seed| data(seed, n));
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(g.len(), n);
                    let same = g
                        .iter()
                        .zip(&got[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "world {world} n {n}: rank {r} differs from rank 0 bitwise"
                    );
                    for (i, (a, b)) in g.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5,
                            "world {world} n {n} [{i}]: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn all_reduce_of_integers_is_exact_on_both_paths() {
    for t in common::transports() {
        // Small-message path and ring path, with a threshold that puts 1000 floats on the ring.
        for small in [64 * 1024, 16] {
            let got = on_ranks_with(
                3,
                move |c| {
                    c.small_bytes = small;
                    c.transport = t;
                },
                |g| {
                    let mut buf: Vec<f32> =
                        (0..1000).map(|i| (i * (g.rank() + 1)) as f32).collect();
                    g.all_reduce_sum(&mut buf).unwrap();
                    buf
                },
            );
            let want: Vec<f32> = (0..1000).map(|i| (i * 6) as f32).collect();
            assert!(got.iter().all(|g| g == &want), "small_bytes {small}");
        }
    }
}

#[test]
fn all_gather_concatenates_in_rank_order() {
    for t in common::transports() {
        for world in [2, 3, 4] {
            for n in SIZES {
                let got = on_ranks_over(t, world, move |g| {
                    let mut out = vec![9.0; 3];
                    g.all_gather(&data(g.rank() as u64 + 7, n), &mut out)
                        .unwrap();
                    out
                });
                let want: Vec<f32> = (0..world).flat_map(|r| data(r as u64 + 7, n)).collect();
                for (r, g) in got.iter().enumerate() {
                    assert!(g == &want, "world {world} n {n}: rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_v_delivers_every_pair_with_any_sizes() {
    for t in common::transports() {
        // Rank `from` sends rank `to` a buffer whose length depends on both (0 included, and big).
        fn len(from: usize, to: usize) -> usize {
            [0, 1, 7, 300_001, 5][(from * 3 + to) % 5]
        }
        fn payload(from: usize, to: usize) -> Vec<f32> {
            data((from * 16 + to) as u64, len(from, to))
        }
        for world in [2, 3, 4] {
            let got = on_ranks_over(t, world, move |g| {
                let me = g.rank();
                let send: Vec<Vec<f32>> = (0..g.world()).map(|to| payload(me, to)).collect();
                let mut recv = vec![vec![1.0; 2]; 7];
                g.all_to_all_v(&send, &mut recv).unwrap();
                // Twice, so the second call reuses the buffers.
                g.all_to_all_v(&send, &mut recv).unwrap();
                recv
            });
            for (me, recv) in got.iter().enumerate() {
                assert_eq!(recv.len(), world);
                for (from, r) in recv.iter().enumerate() {
                    assert!(r == &payload(from, me), "world {world}: {from} -> {me}");
                }
            }
        }
    }
}

#[test]
fn broadcast_copies_the_roots_bytes_from_every_root() {
    for t in common::transports() {
        for world in [2, 3, 4] {
            for root in 0..world {
                for n in [0usize, 5, 1 << 20] {
                    let got = on_ranks_over(t, world, move |g| {
                        let mut buf = if g.rank() == root {
                            (0..n).map(|i| (i * 31 + root) as u8).collect()
                        } else {
                            vec![7u8; 11]
                        };
                        g.broadcast(root, &mut buf).unwrap();
                        buf
                    });
                    let want: Vec<u8> = (0..n).map(|i| (i * 31 + root) as u8).collect();
                    assert!(
                        got.iter().all(|b| b == &want),
                        "world {world} root {root} n {n}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_mixed_sequence_of_calls_stays_in_step() {
    for t in common::transports() {
        let got = on_ranks_over(t, 4, |g| {
            let mut sums = Vec::new();
            for step in 0..200 {
                let mut buf = vec![(g.rank() + step) as f32; 576 * (1 + step % 3)];
                g.all_reduce_sum(&mut buf).unwrap();
                sums.push(buf[0]);
                if step % 10 == 0 {
                    let mut b = if g.rank() == 0 {
                        vec![step as u8; 3]
                    } else {
                        Vec::new()
                    };
                    g.broadcast(0, &mut b).unwrap();
                    assert_eq!(b, vec![step as u8; 3]);
                    g.barrier().unwrap();
                }
            }
            sums
        });
        let want: Vec<f32> = (0..200).map(|s| (6 + 4 * s) as f32).collect();
        assert!(got.iter().all(|g| g == &want));
    }
}

#[test]
fn a_group_of_one_is_the_identity() {
    for t in common::transports() {
        let got = on_ranks_over(t, 1, |g| {
            let mut buf = vec![1.5, 2.5];
            g.all_reduce_sum(&mut buf).unwrap();
            let mut out = Vec::new();
            g.all_gather(&buf, &mut out).unwrap();
            let mut recv = Vec::new();
            g.all_to_all_v(&[vec![3.0]], &mut recv).unwrap();
            let mut b = b"x".to_vec();
            g.broadcast(0, &mut b).unwrap();
            g.barrier().unwrap();
            (buf, out, recv, b)
        });
        assert_eq!(
            got[0],
            (
                vec![1.5, 2.5],
                vec![1.5, 2.5],
                vec![vec![3.0]],
                b"x".to_vec()
            )
        );
    }
}

/// An element's all-reduce result does not depend on the message it travels in: for
/// messages of many sizes (direct exchange and segmented path, the element falling in
/// different segments), every element is exactly `((x0 + x1) + x2) + ...` in f32, the order the
/// engine's `LocalGroup` uses too. This is what makes a tensor-parallel step's per-token
/// results independent of the batch. The ring (`AllReduceOrder::Ring`) adds in another order
/// for some segments, which the same check catches.
#[test]
fn every_element_is_summed_in_rank_order_whatever_the_message_size() {
    use cleave_collective::AllReduceOrder;
    const N: usize = 10_007;
    const SIZES: [usize; 6] = [N, 5_000, 1_001, 333, 64, 7];
    for t in common::transports() {
        for world in [2, 3, 4] {
            for order in [AllReduceOrder::RankOrder, AllReduceOrder::Ring] {
                let got = on_ranks_with(
                    world,
                    move |c| {
                        c.transport = t;
                        c.small_bytes = 256;
                        c.all_reduce = order;
                    },
                    move |g| {
                        let full = full_mantissa(g.rank() as u64 + 1, N);
                        SIZES
                            .iter()
                            .map(|&n| {
                                let mut b = full[..n].to_vec();
                                g.all_reduce_sum(&mut b).unwrap();
                                b
                            })
                            .collect::<Vec<_>>()
                    },
                );
                let want = summed_in_rank_order(world, |seed| full_mantissa(seed, N));
                let mut differing = 0;
                for (rank, outs) in got.iter().enumerate() {
                    for (out, n) in outs.iter().zip(SIZES) {
                        assert_eq!(out.len(), n);
                        let bad = out
                            .iter()
                            .zip(&want)
                            .filter(|(a, b)| a.to_bits() != b.to_bits())
                            .count();
                        if order == AllReduceOrder::RankOrder {
                            assert_eq!(
                                bad, 0,
                                "{t:?} world {world} rank {rank} n {n}: {bad} elements not summed in rank order"
                            );
                        }
                        differing += bad;
                    }
                }
                if order == AllReduceOrder::Ring && world > 2 {
                    assert!(
                        differing > 0,
                        "{t:?} world {world}: the ring added in rank order"
                    );
                }
            }
        }
    }
}

/// [`data`] with every mantissa bit used (`data`'s values are multiples of 2^-23, so sums of a
/// few of them are exact in any order).
fn full_mantissa(seed: u64, n: usize) -> Vec<f32> {
    data(seed, n)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * (1.0 + i as f32 * 1e-3).sqrt())
        .collect()
}
