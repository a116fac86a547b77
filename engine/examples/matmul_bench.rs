//! Matmul throughput bench (no criterion): `cargo run --release -p cleave-engine --example
//! matmul_bench [threads] [scale]`.
//!
//! With `decode`, batch-1 (and 2, 4, 8) products over the Llama-3.1-8B shape's matrices (Q4_K 14336×4096
//! gate/up, Q6_K 4096×14336 down, Q4_K 4096×4096 attention, Q6_K 16384×4096 as an eighth of the head), each
//! cycled through copies totalling ~1.5 GiB so every call streams its weights from DRAM: GB/s
//! of weights read, the figure batch-1 decode is bound by.
//!
//! With `scale`, only the K-quant matrices of the Llama-3.2-1B shape (hidden 2048, FFN 8192) at
//! prefill-sized batches: Q4_K 8192×2048 (gate/up), Q4_K and Q6_K 2048×8192 (down), GFLOP/s at
//! 1, 16, 64 and 256 tokens.
//!
//! For Q4_1 576×1536 and 1536×576, Q8_0, Q4_K, Q5_K and Q6_K 576×1536, and a Q8_0 49152×576
//! (LM head) random matrix, prints GFLOP/s (2·rows·cols·tokens / time) at 1, 4, 16 and 64
//! tokens and the per-token time ratio of batch 1 over batch 16. "hot" repeats one matrix (it stays in cache when small); "streamed" cycles
//! through copies totalling ~192 MiB, as decode streams every weight from memory once per step.
//! Finally it estimates whole-model SmolLM2-135M decode speed (30 layers of distinct Q4_1
//! matrices plus the Q8_0 LM head).

use std::hint::black_box;
use std::time::{Duration, Instant};

use cleave_engine::kernels::{simd_path, Activations, QMatrix, Threads, WeightType, QK};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};

/// A value uniform in [-1, 1) from a seeded generator (proptest's, a dev-dependency).
fn f(rng: &mut TestRng) -> f32 {
    rng.random_range(-1.0..1.0)
}

fn random_matrix(ty: WeightType, rows: usize, cols: usize, rng: &mut TestRng) -> QMatrix {
    if ty.is_k() {
        return random_k_matrix(ty, rows, cols, rng);
    }
    let mut raw = Vec::with_capacity(rows * ty.row_bytes(cols));
    for _ in 0..rows * cols / QK {
        let d = half::f16::from_f32(0.01 + 0.01 * f(rng));
        raw.extend_from_slice(&d.to_bits().to_le_bytes());
        if ty == WeightType::Q4_1 {
            raw.extend_from_slice(&half::f16::from_f32(-0.08).to_bits().to_le_bytes());
        }
        let n = if ty == WeightType::Q8_0 { 32 } else { 16 };
        raw.extend((0..n).map(|_| rng.random::<u8>()));
    }
    QMatrix::from_raw(ty, rows, cols, &raw).expect("valid random matrix")
}

/// Random K-quant super-blocks with sane f16 scales (`d`, and `dmin` for Q4_K/Q5_K).
fn random_k_matrix(ty: WeightType, rows: usize, cols: usize, rng: &mut TestRng) -> QMatrix {
    let bb = ty.row_bytes(256);
    let mut raw: Vec<u8> = (0..rows * ty.row_bytes(cols))
        .map(|_| rng.random())
        .collect();
    for blk in raw.chunks_exact_mut(bb) {
        let d = half::f16::from_f32(0.001 + 0.001 * f(rng))
            .to_bits()
            .to_le_bytes();
        match ty {
            WeightType::Q6_K => blk[bb - 2..].copy_from_slice(&d),
            _ => {
                blk[..2].copy_from_slice(&d);
                blk[2..4].copy_from_slice(&d);
            }
        }
    }
    QMatrix::from_raw(ty, rows, cols, &raw).expect("valid random matrix")
}

/// Seconds per matmul call, cycling through `mats`: the best of 5 rounds of at least ~80 ms
/// (the best round is the least disturbed by other processes on a shared machine).
fn time_per_call(mats: &[QMatrix], x: &Activations, out: &mut [f32], th: &Threads) -> f64 {
    for m in mats.iter().take(2) {
        m.matmul(x, out, th);
    }
    let mut best = f64::INFINITY;
    let mut calls = 0usize;
    for _ in 0..5 {
        let (mut n, start) = (0usize, Instant::now());
        while start.elapsed() < Duration::from_millis(80) || n < 2 {
            let m = &mats[calls % mats.len()];
            m.matmul(black_box(x), out, th);
            black_box(&mut *out);
            calls += 1;
            n += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / n as f64);
    }
    best
}

fn bench(label: &str, mats: &[QMatrix], th: &Threads, rng: &mut TestRng) {
    bench_at(label, mats, th, rng, &[1, 4, 16, 64]);
}

fn bench_at(label: &str, mats: &[QMatrix], th: &Threads, rng: &mut TestRng, batches: &[usize]) {
    let (rows, cols) = (mats[0].rows(), mats[0].cols());
    let mut per_token = Vec::new();
    print!("{label:<34}");
    for &n in batches {
        let xs: Vec<f32> = (0..n * cols).map(|_| f(rng)).collect();
        let mut x = Activations::new();
        x.set(&xs, n, cols);
        let mut out = vec![0f32; n * rows];
        let t = time_per_call(mats, &x, &mut out, th);
        let gflops = 2.0 * (rows * cols * n) as f64 / t / 1e9;
        print!("  n={n:<2} {gflops:6.1} GF/s");
        per_token.push(t / n as f64);
    }
    println!(
        "  | t1/t{} per token: {:.2}x",
        batches[2],
        per_token[0] / per_token[2]
    );
}

/// The 1B shape's K-quant matrices at prefill-sized batches.
fn scale_shapes(th: &Threads, rng: &mut TestRng) {
    for (ty, rows, cols) in [
        (WeightType::Q4_K, 8192, 2048),
        (WeightType::Q4_K, 2048, 8192),
        (WeightType::Q6_K, 2048, 8192),
    ] {
        let m = random_matrix(ty, rows, cols, rng);
        let label = format!("{ty:?} {rows}x{cols}");
        bench_at(&label, std::slice::from_ref(&m), th, rng, &[1, 16, 64, 256]);
    }
}

/// Batch-1 GB/s over the 8B shape's matrices, streamed from DRAM.
fn decode_shapes(th: &Threads, rng: &mut TestRng) {
    for (ty, rows, cols) in [
        (WeightType::Q4_K, 14336, 4096),
        (WeightType::Q6_K, 4096, 14336),
        (WeightType::Q4_K, 4096, 4096),
        (WeightType::Q6_K, 16384, 4096),
    ] {
        let m = random_matrix(ty, rows, cols, rng);
        let bytes = rows * ty.row_bytes(cols);
        let copies = ((1536usize << 20) / bytes).max(2);
        let mats: Vec<QMatrix> = (0..copies).map(|_| m.clone()).collect();
        for n in [1, 2, 4, 8] {
            let xs: Vec<f32> = (0..n * cols).map(|_| f(rng)).collect();
            let mut x = Activations::new();
            x.set(&xs, n, cols);
            let mut out = vec![0f32; n * rows];
            let t = time_per_call(&mats, &x, &mut out, th);
            println!(
                "{:<34}  {:6.2} GB/s of weights  ({:.2} ms per call, {copies} copies)",
                format!("{ty:?} {rows}x{cols} batch {n}"),
                bytes as f64 / t / 1e9,
                t * 1e3
            );
        }
    }
}

/// SmolLM2-135M linear layers: (rows, cols) of q, k, v, o, gate, up, down.
const LAYER: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];

fn model_tokens_per_s(layers: &[Vec<QMatrix>], head: &QMatrix, n: usize, th: &Threads) -> f64 {
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[99; 32]);
    let rng = &mut rng;
    let mut x576 = Activations::new();
    x576.set(&(0..n * 576).map(|_| f(rng)).collect::<Vec<_>>(), n, 576);
    let mut x1536 = Activations::new();
    x1536.set(&(0..n * 1536).map(|_| f(rng)).collect::<Vec<_>>(), n, 1536);
    let mut out = vec![0f32; n * 49152];
    let step = |out: &mut Vec<f32>| {
        for layer in layers {
            for m in layer {
                let x = if m.cols() == 576 { &x576 } else { &x1536 };
                m.matmul(x, &mut out[..n * m.rows()], th);
            }
        }
        head.matmul(&x576, &mut out[..n * 49152], th);
    };
    step(&mut out);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let (mut steps, start) = (0, Instant::now());
        while start.elapsed() < Duration::from_millis(300) || steps < 2 {
            step(&mut out);
            steps += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / steps as f64);
    }
    n as f64 / best
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let th = Threads::new(threads);
    let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    println!("simd path: {}, threads: {}", simd_path(), th.count());
    if std::env::args().nth(2).as_deref() == Some("decode") {
        decode_shapes(&th, &mut rng);
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("scale") {
        scale_shapes(&th, &mut rng);
        return;
    }

    let q41 = random_matrix(WeightType::Q4_1, 576, 1536, &mut rng);
    let copies = (192 << 20) / (576 * 1536 / QK * 20);
    let q41_many: Vec<QMatrix> = (0..copies).map(|_| q41.clone()).collect();
    bench(
        "Q4_1 576x1536 hot",
        std::slice::from_ref(&q41),
        &th,
        &mut rng,
    );
    bench(
        &format!("Q4_1 576x1536 streamed ({copies} copies)"),
        &q41_many,
        &th,
        &mut rng,
    );
    drop(q41_many);

    // Most of the model's matrices are 576 wide: 18 blocks per row, where per-tile costs
    // (scales every 8 blocks, the final reduction) weigh more than in 1536-wide rows.
    let gate = random_matrix(WeightType::Q4_1, 1536, 576, &mut rng);
    bench(
        "Q4_1 1536x576 hot",
        std::slice::from_ref(&gate),
        &th,
        &mut rng,
    );
    let q8 = random_matrix(WeightType::Q8_0, 576, 1536, &mut rng);
    bench(
        "Q8_0 576x1536 hot",
        std::slice::from_ref(&q8),
        &th,
        &mut rng,
    );
    for ty in [WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K] {
        let m = random_matrix(ty, 576, 1536, &mut rng);
        bench(
            &format!("{ty:?} 576x1536 hot"),
            std::slice::from_ref(&m),
            &th,
            &mut rng,
        );
    }
    let head = random_matrix(WeightType::Q8_0, 49152, 576, &mut rng);
    bench(
        "Q8_0 49152x576 (LM head)",
        std::slice::from_ref(&head),
        &th,
        &mut rng,
    );

    let layers: Vec<Vec<QMatrix>> = (0..30)
        .map(|_| {
            LAYER
                .iter()
                .map(|&(r, c)| random_matrix(WeightType::Q4_1, r, c, &mut rng))
                .collect()
        })
        .collect();
    for n in [1, 16, 64] {
        let tps = model_tokens_per_s(&layers, &head, n, &th);
        println!("SmolLM2-135M shapes (Q4_1 + Q8_0 head), batch {n:>2}: {tps:7.1} tokens/s");
    }
}
