//! K-quant (and Q5) tests: dequantization equals gguf-py's bit for bit, every backend's dot
//! products equal the scalar reference bit for bit (and approximate the f64 reference), batch,
//! tile and thread invariance, slicing, extreme blocks and error cases.

use super::*;

const K_TYPES: [WeightType; 5] = [
    WeightType::Q2_K,
    WeightType::Q3_K,
    WeightType::Q4_K,
    WeightType::Q5_K,
    WeightType::Q6_K,
];

/// Appends one random super-block in ggml's layout: random quant and scale bytes, sane f16
/// scales (weights of magnitude up to about 2).
pub(super) fn random_superblock(ty: WeightType, rng: &mut Rng, v: &mut Vec<u8>) {
    match ty {
        WeightType::Q4_K | WeightType::Q5_K => {
            v.extend_from_slice(&f16_bytes(1e-4 + 1e-3 * rng.f().abs()));
            v.extend_from_slice(&f16_bytes(1e-4 + 1e-3 * rng.f().abs()));
            let rest = ty.row_bytes(QK_K) - 4;
            v.extend((0..rest).map(|_| rng.byte()));
        }
        WeightType::Q6_K => {
            v.extend((0..128 + 64 + 16).map(|_| rng.byte()));
            v.extend_from_slice(&f16_bytes(1e-5 + 5e-4 * rng.f()));
        }
        WeightType::Q2_K => {
            v.extend((0..16 + 64).map(|_| rng.byte()));
            v.extend_from_slice(&f16_bytes(1e-4 + 1e-3 * rng.f().abs()));
            v.extend_from_slice(&f16_bytes(1e-4 + 1e-3 * rng.f().abs()));
        }
        WeightType::Q3_K => {
            v.extend((0..32 + 64 + 12).map(|_| rng.byte()));
            v.extend_from_slice(&f16_bytes(1e-5 + 1e-3 * rng.f()));
        }
        other => unreachable!("{other:?} is not a K-quant"),
    }
}

/// The reference files written by `testdata/make_reference.py` with gguf-py: 1024 elements of
/// random blocks, then gguf-py's dequantization of them as little-endian f32.
fn reference_files() -> [(WeightType, &'static [u8]); 11] {
    [
        (WeightType::Q4_0, include_bytes!("../testdata/q4_0.bin")),
        (WeightType::Q4_1, include_bytes!("../testdata/q4_1.bin")),
        (WeightType::Q5_0, include_bytes!("../testdata/q5_0.bin")),
        (WeightType::Q5_1, include_bytes!("../testdata/q5_1.bin")),
        (WeightType::Q8_0, include_bytes!("../testdata/q8_0.bin")),
        (WeightType::Q4_K, include_bytes!("../testdata/q4_k.bin")),
        (WeightType::Q5_K, include_bytes!("../testdata/q5_k.bin")),
        (WeightType::Q6_K, include_bytes!("../testdata/q6_k.bin")),
        (WeightType::IQ4_NL, include_bytes!("../testdata/iq4_nl.bin")),
        (WeightType::Q2_K, include_bytes!("../testdata/q2_k.bin")),
        (WeightType::Q3_K, include_bytes!("../testdata/q3_k.bin")),
    ]
}

#[test]
fn dequantization_equals_gguf_py() {
    const N: usize = 1024;
    let (rows, cols) = (2, N / 2);
    for (ty, file) in reference_files() {
        let raw_len = rows * ty.row_bytes(cols);
        assert_eq!(file.len(), raw_len + 4 * N, "{ty:?} reference file size");
        let (raw, values) = file.split_at(raw_len);
        let want: Vec<u32> = values
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let m = QMatrix::from_raw(ty, rows, cols, raw).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            for (c, (got, want)) in row.iter().zip(&want[r * cols..]).enumerate() {
                assert_eq!(
                    got.to_bits(),
                    *want,
                    "{ty:?} row {r} col {c}: {got} vs gguf-py {}",
                    f32::from_bits(*want)
                );
            }
        }
        // The random blocks exercise the whole quant range, not a constant.
        let distinct: std::collections::BTreeSet<u32> = want.iter().copied().collect();
        assert!(distinct.len() > 100, "{ty:?}: {} distinct", distinct.len());
    }
}

#[test]
fn k_quants_match_the_reference_on_every_backend() {
    for ty in K_TYPES {
        for (rows, cols) in [(37, 256), (13, 512), (9, 1536), (5, 2304)] {
            check_against_reference(ty, rows, cols, 5, 0x51 + rows as u64);
        }
    }
}

#[test]
fn k_quants_are_batch_backend_and_thread_invariant() {
    for ty in K_TYPES {
        check_batch_invariance(ty, 37, 512, 41);
    }
    // Several row chunks per thread.
    check_batch_invariance(WeightType::Q4_K, 150, 1536, 42);
    check_batch_invariance(WeightType::Q6_K, 70, 1536, 43);
}

/// Blocks at the ends of every range (all quant bits set or clear, largest scales) against
/// activations at ±127: an `i16` saturation in a SIMD path would show here.
#[test]
fn extreme_blocks_agree_across_backends() {
    let cols = 512;
    for ty in K_TYPES
        .into_iter()
        .chain([WeightType::Q5_0, WeightType::Q5_1])
    {
        for fill in [0x00u8, 0xff, 0x80, 0x7f, 0x55] {
            let mut raw = vec![fill; 4 * ty.row_bytes(cols)];
            // Sane f16 scales where the format has them.
            let fields: &[usize] = match ty {
                WeightType::Q4_K | WeightType::Q5_K => &[0, 2],
                WeightType::Q6_K => &[208],
                WeightType::Q2_K => &[80, 82],
                WeightType::Q3_K => &[108],
                _ => &[0],
            };
            let bb = ty.row_bytes(ty.block());
            for blk in raw.chunks_exact_mut(bb) {
                for &at in fields {
                    blk[at..at + 2].copy_from_slice(&f16_bytes(0.01));
                }
                if ty == WeightType::Q5_1 {
                    blk[2..4].copy_from_slice(&f16_bytes(-0.1));
                }
            }
            let m = QMatrix::from_raw(ty, 4, cols, &raw).unwrap();
            let x: Vec<f32> = (0..6 * cols)
                .map(|i| match (i / cols) % 3 {
                    0 => 1.0,
                    1 => -1.0,
                    _ => {
                        if i % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                })
                .collect();
            let a = acts(&x, 6, cols);
            let single = Threads::single();
            let base = run(&m, Isa::Scalar, &a, &single);
            let (want, mag) = reference(&m, &a);
            for (i, (&b, w)) in base.iter().zip(&want).enumerate() {
                assert!(
                    (b as f64 - w).abs() <= 2e-6 * mag[i] + 1e-6,
                    "{ty:?} fill {fill:#x} [{i}]: {b} vs {w}"
                );
            }
            for isa in Isa::available() {
                let got = run(&m, isa, &a, &single);
                assert!(
                    got.iter()
                        .zip(&base)
                        .all(|(g, b)| g.to_bits() == b.to_bits()),
                    "{ty:?} fill {fill:#x}: {} differs from scalar",
                    isa.name()
                );
                // One token at a time: the batch-1 kernels.
                for t in 0..6 {
                    let one = acts(&x[t * cols..(t + 1) * cols], 1, cols);
                    let got = run(&m, isa, &one, &single);
                    assert!(
                        got.iter()
                            .zip(&base[t * 4..(t + 1) * 4])
                            .all(|(g, b)| g.to_bits() == b.to_bits()),
                        "{ty:?} fill {fill:#x} token {t} alone: {} differs from scalar",
                        isa.name()
                    );
                }
            }
        }
    }
}

#[test]
fn k_quant_slices_agree_with_the_full_matrix() {
    let mut rng = Rng(77);
    let (rows, cols, n) = (29, 768, 5);
    let single = Threads::single();
    for ty in K_TYPES {
        let m = QMatrix::from_raw(ty, rows, cols, &random_raw(ty, rows, cols, &mut rng)).unwrap();
        let x = random_x(n, cols, &mut rng);
        let full = m.matmul_vec(&acts(&x, n, cols), &single);
        let s = m.slice_rows(3, 20);
        let part = s.matmul_vec(&acts(&x, n, cols), &single);
        for t in 0..n {
            assert_eq!(
                part[t * 17..(t + 1) * 17],
                full[t * rows + 3..t * rows + 20]
            );
        }
        let (l, r) = (
            m.slice_cols(0, 256).unwrap(),
            m.slice_cols(256, cols).unwrap(),
        );
        let (mut fr, mut lr, mut rr) = (vec![0f32; cols], vec![0f32; 256], vec![0f32; 512]);
        for i in 0..rows {
            m.dequantize_row(i, &mut fr);
            l.dequantize_row(i, &mut lr);
            r.dequantize_row(i, &mut rr);
            assert_eq!(fr[..256], lr[..]);
            assert_eq!(fr[256..], rr[..]);
        }
        let lo = l.matmul_vec(&acts(&split_cols(&x, n, cols, 0, 256), n, 256), &single);
        let hi = r.matmul_vec(&acts(&split_cols(&x, n, cols, 256, cols), n, 512), &single);
        for i in 0..n * rows {
            let (f, p) = (full[i], lo[i] + hi[i]);
            assert!(
                (f - p).abs() <= 1e-4 * (1.0 + f.abs()),
                "{ty:?}: {f} vs {p}"
            );
        }
        // Column splits must fall on super-block boundaries.
        assert!(matches!(
            m.slice_cols(32, 256),
            Err(KernelError::BadColumnRange { .. })
        ));
    }
}

#[test]
fn k_quant_bad_shapes_are_errors() {
    for ty in K_TYPES {
        // 288 columns: whole 32-blocks but not whole super-blocks.
        let err = QMatrix::from_raw(ty, 1, 288, &[0; 1000]).unwrap_err();
        assert!(
            matches!(err, KernelError::ColsNotBlockAligned { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("multiple of 256"), "{err}");
        let need = 2 * ty.row_bytes(512);
        assert!(matches!(
            QMatrix::from_raw(ty, 2, 512, &vec![0; need - 1]),
            Err(KernelError::ByteLength { expected, got, .. }) if expected == need && got == need - 1
        ));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn random_k_quant_shapes_match_reference_and_are_invariant(
        ty in prop::sample::select(K_TYPES.to_vec()),
        rows in 1usize..20,
        nsb in 1usize..7,
        seed in 1u64..u64::MAX,
    ) {
        check_against_reference(ty, rows, nsb * QK_K, 3, seed);
        check_batch_invariance(ty, rows, nsb * QK_K, seed);
    }
}
