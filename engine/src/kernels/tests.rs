//! Kernel tests: every format × backend against an f64 reference, bit-identical results across
//! backends, batch sizes, tile remainders and thread counts, slicing, and error cases.

use cleave_text::gguf::ByteOwner;
use half::f16;
use proptest::prelude::*;

use super::*;

mod kquant;

/// Small deterministic xorshift generator (seeded, no extra dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 24) as u8
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random ggml-layout bytes of a `rows × cols` matrix.
fn random_raw(ty: WeightType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = Vec::with_capacity(ty.row_bytes(cols) * rows);
    if ty == WeightType::F32 {
        for _ in 0..rows * cols {
            v.extend_from_slice(&rng.f().to_le_bytes());
        }
        return v;
    }
    if ty.is_k() {
        for _ in 0..rows * cols / QK_K {
            kquant::random_superblock(ty, rng, &mut v);
        }
        return v;
    }
    for _ in 0..rows * cols / QK {
        let d = 0.001 + 0.05 * rng.f().abs();
        v.extend_from_slice(&f16_bytes(d));
        if matches!(ty, WeightType::Q4_1 | WeightType::Q5_1) {
            v.extend_from_slice(&f16_bytes(-8.0 * d * (1.0 + 0.3 * rng.f())));
        }
        let n = match ty {
            WeightType::Q8_0 => 32,
            WeightType::Q5_0 | WeightType::Q5_1 => 20,
            _ => 16,
        };
        v.extend((0..n).map(|_| rng.byte()));
    }
    v
}

/// Independent dequantization of ggml bytes, straight from the format definition.
fn ggml_dequant(ty: WeightType, rows: usize, cols: usize, raw: &[u8]) -> Vec<f32> {
    if ty == WeightType::F32 {
        return raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
    }
    let h = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    let mut out = Vec::with_capacity(rows * cols);
    for blk in raw.chunks_exact(ty.row_bytes(QK)) {
        let d = h(blk);
        match ty {
            WeightType::Q8_0 => out.extend(blk[2..].iter().map(|&q| d * (q as i8) as f32)),
            WeightType::Q4_0 => {
                let qs = &blk[2..];
                out.extend(qs.iter().map(|&q| d * ((q & 15) as f32 - 8.0)));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as f32 - 8.0)));
            }
            WeightType::Q4_1 => {
                let (m, qs) = (h(&blk[2..]), &blk[4..]);
                out.extend(qs.iter().map(|&q| d * (q & 15) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
            WeightType::IQ4_NL => {
                const K: [i8; 16] = [
                    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                ];
                let qs = &blk[2..];
                out.extend(qs.iter().map(|&q| d * K[(q & 15) as usize] as f32));
                out.extend(qs.iter().map(|&q| d * K[(q >> 4) as usize] as f32));
            }
            WeightType::Q5_0 | WeightType::Q5_1 => {
                let (m, rest) = match ty {
                    WeightType::Q5_1 => (Some(h(&blk[2..])), &blk[4..]),
                    _ => (None, &blk[2..]),
                };
                let qh = u32::from_le_bytes(rest[..4].try_into().unwrap());
                let qs = &rest[4..];
                for i in 0..32 {
                    let nib = if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 };
                    let q = (nib | ((((qh >> i) & 1) as u8) << 4)) as f32;
                    out.push(match m {
                        Some(m) => d * q + m,
                        None => d * (q - 16.0),
                    });
                }
            }
            WeightType::F32
            | WeightType::Q2_K
            | WeightType::Q3_K
            | WeightType::Q4_K
            | WeightType::Q5_K
            | WeightType::Q6_K => {
                unreachable!("checked against gguf-py in tests/kquant.rs")
            }
        }
    }
    out
}

fn random_x(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n * cols)
        .map(|i| rng.f() * if i % 7 == 0 { 3.0 } else { 1.0 })
        .collect()
}

fn acts(x: &[f32], n: usize, cols: usize) -> Activations {
    let mut a = Activations::new();
    a.set(x, n, cols);
    a
}

fn run(m: &QMatrix, isa: Isa, a: &Activations, threads: &Threads) -> Vec<f32> {
    let mut out = vec![f32::NAN; a.n_tokens() * m.rows()];
    m.matmul_with(isa, a, &mut out, threads);
    out
}

/// f64 reference: dequantized weights × the activations as the kernel sees them (quantized
/// for quantized weights). Returns the values and Σ|w·x| per output for the tolerance.
fn reference(m: &QMatrix, a: &Activations) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols, n) = (m.rows(), m.cols(), a.n_tokens());
    let mut xs = vec![0f64; n * cols];
    for t in 0..n {
        for c in 0..cols {
            xs[t * cols + c] = if m.ty().is_quantized() {
                a.q_row(t)[c] as f64 * a.d_row(t)[c / QK] as f64
            } else {
                a.x_row(t)[c] as f64
            };
        }
    }
    let (mut val, mut mag) = (vec![0f64; n * rows], vec![0f64; n * rows]);
    let mut w = vec![0f32; cols];
    for r in 0..rows {
        m.dequantize_row(r, &mut w);
        for t in 0..n {
            for c in 0..cols {
                let p = w[c] as f64 * xs[t * cols + c];
                val[t * rows + r] += p;
                mag[t * rows + r] += p.abs();
            }
        }
    }
    (val, mag)
}

/// The formats with 32-element blocks (K-quants: `tests/kquant.rs`).
const TYPES: [WeightType; 7] = [
    WeightType::F32,
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
    WeightType::IQ4_NL,
];

fn check_against_reference(ty: WeightType, rows: usize, cols: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    let m = QMatrix::from_raw(ty, rows, cols, &random_raw(ty, rows, cols, &mut rng)).unwrap();
    let a = acts(&random_x(n, cols, &mut rng), n, cols);
    let (want, mag) = reference(&m, &a);
    let single = Threads::single();
    let base = run(&m, Isa::Scalar, &a, &single);
    for isa in Isa::available() {
        let got = run(&m, isa, &a, &single);
        for i in 0..got.len() {
            let err = (got[i] as f64 - want[i]).abs();
            assert!(
                err <= 2e-6 * mag[i] + 1e-6,
                "{ty:?} {} [{i}]: got {} want {} (mag {})",
                isa.name(),
                got[i],
                want[i],
                mag[i]
            );
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&base),
            "{ty:?}: {} differs from scalar",
            isa.name()
        );
    }
}

#[test]
fn every_format_and_backend_matches_the_reference() {
    for ty in TYPES {
        for (rows, cols) in [(37, 96), (13, 576), (9, 1536), (5, 64)] {
            check_against_reference(ty, rows, cols, 5, 0x9e37 + rows as u64);
        }
        // A prefill-sized batch (the rows-in-lanes kernel on VNNI, 16-row groups plus leftover
        // rows, 8-token tiles plus leftover tokens).
        check_against_reference(ty, 37, 576, 43, 0x51 + ty as u64);
    }
    // F32 with widths that are not multiples of 8 or 32.
    check_against_reference(WeightType::F32, 11, 13, 6, 7);
    check_against_reference(WeightType::F32, 3, 7, 2, 8);
}

#[test]
fn quantized_activations_approximate_the_input() {
    let mut rng = Rng(3);
    let x = random_x(2, 64, &mut rng);
    let a = acts(&x, 2, 64);
    for t in 0..2 {
        for c in 0..64 {
            let d = a.d_row(t)[c / QK];
            let deq = a.q_row(t)[c] as f32 * d;
            assert!((deq - x[t * 64 + c]).abs() <= 0.51 * d + 1e-3 * d * 127.0);
        }
        for b in 0..2 {
            let sum: i32 = a.q_row(t)[b * QK..(b + 1) * QK]
                .iter()
                .map(|&q| q as i32)
                .sum();
            assert_eq!(a.s_row(t)[b], a.d_row(t)[b] * sum as f32);
        }
    }
    // All-zero blocks quantize to zero without NaNs.
    let a = acts(&[0.0; 32], 1, 32);
    assert_eq!(a.d_row(0)[0], 0.0);
    assert!(a.q_row(0).iter().all(|&q| q == 0));
}

/// Token t computed alone, inside batches of every size, on every backend and thread count,
/// gives the same bits.
fn check_batch_invariance(ty: WeightType, rows: usize, cols: usize, seed: u64) {
    let mut rng = Rng(seed);
    let m = QMatrix::from_raw(ty, rows, cols, &random_raw(ty, rows, cols, &mut rng)).unwrap();
    const N: usize = 36;
    let x = random_x(N, cols, &mut rng);
    let single = Threads::single();
    let two = Threads::new(2);
    let three = Threads::new(3);
    let alone: Vec<Vec<f32>> = (0..N)
        .map(|t| {
            run(
                &m,
                Isa::Scalar,
                &acts(&x[t * cols..(t + 1) * cols], 1, cols),
                &single,
            )
        })
        .collect();
    for isa in Isa::available() {
        // 8 to 36: 16- and 8-token tiles (512-bit pairs on VNNI) with 1, 4 and 8 leftovers.
        for n in [1, 3, 4, 5, 8, 9, 12, 16, 17, 28, 36] {
            // Batches starting at different tokens, so each token sits in several tile slots.
            for start in [0, N - n] {
                let a = acts(&x[start * cols..(start + n) * cols], n, cols);
                for th in [&single, &two, &three] {
                    let out = run(&m, isa, &a, th);
                    for t in 0..n {
                        let got = &out[t * rows..(t + 1) * rows];
                        let want = &alone[start + t];
                        assert!(
                            got.iter()
                                .zip(want)
                                .all(|(g, w)| g.to_bits() == w.to_bits()),
                            "{ty:?} {} n={n} start={start} threads={} token {t}",
                            isa.name(),
                            th.count()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn results_are_batch_backend_and_thread_invariant() {
    for ty in TYPES {
        check_batch_invariance(ty, 37, 96, 11);
    }
    // Enough rows for several row chunks per thread (chunking by ~24 KiB of weights).
    check_batch_invariance(WeightType::Q4_1, 203, 576, 12);
    check_batch_invariance(WeightType::Q8_0, 90, 1536, 13);
    check_batch_invariance(WeightType::F32, 21, 40, 14);
}

#[test]
fn from_raw_repacking_preserves_values() {
    let mut rng = Rng(21);
    for ty in TYPES {
        let (rows, cols) = (7, 160);
        let raw = random_raw(ty, rows, cols, &mut rng);
        let want = ggml_dequant(ty, rows, cols, &raw);
        let m = QMatrix::from_raw(ty, rows, cols, &raw).unwrap();
        assert_eq!((m.rows(), m.cols(), m.ty()), (rows, cols, ty));
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(row, want[r * cols..(r + 1) * cols], "{ty:?} row {r}");
        }
    }
}

#[test]
fn quantize_q8_0_is_close_to_the_input() {
    let mut rng = Rng(5);
    let x = random_x(3, 64, &mut rng);
    let m = QMatrix::quantize_q8_0(3, 64, &x).unwrap();
    assert_eq!(m.ty(), WeightType::Q8_0);
    let mut row = vec![0f32; 64];
    for r in 0..3 {
        m.dequantize_row(r, &mut row);
        for c in 0..64 {
            assert!((row[c] - x[r * 64 + c]).abs() <= 3.0 / 127.0 * 0.51 + 1e-3);
        }
    }
}

#[test]
fn slices_agree_with_the_full_matrix() {
    let mut rng = Rng(31);
    let (rows, cols, n) = (29, 192, 6);
    let single = Threads::single();
    for ty in TYPES {
        let m = QMatrix::from_raw(ty, rows, cols, &random_raw(ty, rows, cols, &mut rng)).unwrap();
        let x = random_x(n, cols, &mut rng);
        let a = acts(&x, n, cols);
        let full = m.matmul_vec(&a, &single);
        // Row slices give exactly the corresponding outputs.
        let s = m.slice_rows(5, 17);
        assert_eq!((s.rows(), s.cols()), (12, cols));
        let part = s.matmul_vec(&a, &single);
        for t in 0..n {
            assert_eq!(
                part[t * 12..(t + 1) * 12],
                full[t * rows + 5..t * rows + 17]
            );
        }
        // Column slices hold the same values, and their products sum close to the full one.
        let (l, r) = (
            m.slice_cols(0, 64).unwrap(),
            m.slice_cols(64, cols).unwrap(),
        );
        let (mut fr, mut lr, mut rr) = (vec![0f32; cols], vec![0f32; 64], vec![0f32; cols - 64]);
        for i in 0..rows {
            m.dequantize_row(i, &mut fr);
            l.dequantize_row(i, &mut lr);
            r.dequantize_row(i, &mut rr);
            assert_eq!(fr[..64], lr[..]);
            assert_eq!(fr[64..], rr[..]);
        }
        let lo = l.matmul_vec(&acts(&split_cols(&x, n, cols, 0, 64), n, 64), &single);
        let hi = r.matmul_vec(
            &acts(&split_cols(&x, n, cols, 64, cols), n, cols - 64),
            &single,
        );
        for t in 0..n {
            for i in 0..rows {
                let (f, p) = (full[t * rows + i], lo[t * rows + i] + hi[t * rows + i]);
                assert!(
                    (f - p).abs() <= 1e-4 * (1.0 + f.abs()),
                    "{ty:?}: {f} vs {p}"
                );
            }
        }
    }
}

fn split_cols(x: &[f32], n: usize, cols: usize, start: usize, end: usize) -> Vec<f32> {
    (0..n)
        .flat_map(|t| x[t * cols + start..t * cols + end].iter().copied())
        .collect()
}

impl QMatrix {
    fn matmul_vec(&self, a: &Activations, threads: &Threads) -> Vec<f32> {
        let mut out = vec![0f32; a.n_tokens() * self.rows()];
        self.matmul(a, &mut out, threads);
        out
    }
}

#[test]
fn bad_shapes_are_errors() {
    use KernelError::*;
    let ty = WeightType::Q4_1;
    assert!(matches!(
        QMatrix::from_raw(ty, 2, 64, &[0; 79]),
        Err(ByteLength {
            expected: 80,
            got: 79,
            ..
        })
    ));
    assert!(matches!(
        QMatrix::from_raw(ty, 2, 48, &[0; 60]),
        Err(ColsNotBlockAligned { .. })
    ));
    assert!(matches!(
        QMatrix::from_raw(WeightType::F32, 2, 3, &[0; 20]),
        Err(ByteLength { .. })
    ));
    assert!(QMatrix::from_raw(WeightType::F32, 2, 3, &[0; 24]).is_ok());
    assert!(matches!(
        QMatrix::from_f32(2, 3, vec![0.0; 5]),
        Err(ValueCount { .. })
    ));
    assert!(matches!(
        QMatrix::quantize_q8_0(1, 40, &[0.0; 40]),
        Err(ColsNotBlockAligned { .. })
    ));
    assert!(matches!(
        QMatrix::from_raw(WeightType::Q8_0, usize::MAX, 64, &[]),
        Err(TooLarge { .. })
    ));
    let m = QMatrix::from_raw(ty, 2, 64, &[0; 80]).unwrap();
    assert!(matches!(m.slice_cols(16, 64), Err(BadColumnRange { .. })));
    assert!(matches!(m.slice_cols(32, 96), Err(BadColumnRange { .. })));
    assert!(matches!(m.slice_cols(64, 32), Err(BadColumnRange { .. })));
    assert_eq!(m.slice_cols(32, 64).unwrap().cols(), 32);
    let f = QMatrix::from_f32(1, 5, vec![1.0; 5]).unwrap();
    assert_eq!(f.slice_cols(1, 4).unwrap().cols(), 3);
    assert!(!KernelError::BadColumnRange {
        ty,
        cols: 64,
        start: 16,
        end: 64
    }
    .to_string()
    .is_empty());
}

#[test]
fn activations_are_reused_and_simd_path_is_named() {
    let mut a = Activations::new();
    a.set(&[1.0; 64], 1, 64);
    a.set(&[2.0; 96], 3, 32);
    assert_eq!((a.n_tokens(), a.cols()), (3, 32));
    a.set(&[], 0, 64);
    let m = QMatrix::from_f32(2, 64, vec![1.0; 128]).unwrap();
    m.matmul(&a, &mut [], &Threads::single());
    assert!(["avx512vnni", "avx2", "scalar"].contains(&simd_path()));
    assert_eq!(Threads::new(1).count(), 1);
    assert_eq!(Threads::new(2).count(), 2);
}

#[test]
fn the_int8_peak_is_measured_on_the_backend_in_use() {
    match (simd_path(), int8_peak_gmacs(2)) {
        ("scalar", peak) => assert!(peak.is_none(), "{peak:?}"),
        (path, Some((gmacs, what))) => {
            assert!(gmacs.is_finite() && gmacs > 0.0, "{path}: {gmacs}");
            let instr = if path == "avx2" {
                "vpmaddubsw"
            } else {
                "vpdpbusd"
            };
            assert!(what.contains(instr), "{path}: {what}");
        }
        (path, None) => panic!("{path}: no int8 peak"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_shapes_match_reference_and_are_invariant(
        ty in prop::sample::select(TYPES.to_vec()),
        rows in 1usize..24,
        nb in 1usize..20,
        seed in 1u64..u64::MAX,
    ) {
        check_against_reference(ty, rows, nb * QK, 3, seed);
        check_batch_invariance(ty, rows, nb * QK, seed);
    }
}

#[test]
fn an_empty_matrix_is_refused_not_repacked() {
    // A corrupt GGUF can claim a 0-column tensor; repacking it divided by zero blocks
    // (`cleave fuzz --target gguf` found it).
    for (rows, cols) in [(4, 0), (0, 32)] {
        match QMatrix::from_raw(WeightType::Q4_0, rows, cols, &[]) {
            Err(KernelError::Empty { .. }) => {}
            other => panic!("{rows}x{cols}: expected Empty, got {:?}", other.err()),
        }
    }
}

/// A K-quant matrix made from shared bytes (the mapped model file) borrows them — its rows, and
/// the rows of a row slice, are the owner's bytes, not a copy — and multiplies exactly as the
/// copied matrix does; other types are repacked into memory of their own.
#[test]
fn shared_k_quants_borrow_the_file_and_match_the_copy() {
    let mut rng = Rng(47);
    let (rows, cols, n) = (12, 512, 5);
    let single = Threads::single();
    for ty in [WeightType::Q4_K, WeightType::Q6_K, WeightType::Q4_1] {
        let raw = random_raw(ty, rows, cols, &mut rng);
        // The tensor somewhere inside a larger owner, as in a file.
        let mut file = vec![7u8; 100];
        file.extend_from_slice(&raw);
        file.extend_from_slice(&[9u8; 28]);
        let owner: ByteOwner = std::sync::Arc::new(file);
        let base = (*owner).as_ref().as_ptr() as usize;
        let shared = SharedBytes::new(owner.clone(), 100..100 + raw.len());
        let m = QMatrix::from_shared(ty, rows, cols, shared).unwrap();
        let copy = QMatrix::from_raw(ty, rows, cols, &raw).unwrap();
        let a = acts(&random_x(n, cols, &mut rng), n, cols);
        assert_eq!(m.matmul_vec(&a, &single), copy.matmul_vec(&a, &single));
        let at = m.packed_bytes().as_ptr() as usize;
        if ty.is_k() {
            assert_eq!(at, base + 100, "{ty:?} was copied");
            let s = m.slice_rows(3, 9);
            let row = s.packed_bytes().as_ptr() as usize;
            assert_eq!(
                row,
                base + 100 + 3 * m.row_bytes,
                "{ty:?}: a row slice copied"
            );
            assert_eq!(
                s.matmul_vec(&a, &single),
                copy.slice_rows(3, 9).matmul_vec(&a, &single)
            );
        } else {
            assert!(
                at < base || at >= base + 228 + raw.len(),
                "{ty:?} was not repacked"
            );
        }
    }
    // A range outside its owner is refused.
    let owner: ByteOwner = std::sync::Arc::new(vec![0u8; 8]);
    let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        SharedBytes::new(owner, 4..12)
    }));
    assert!(past.is_err());
}
