//! One token (batch-1 decode) of a Q4_K or Q6_K matrix on AVX512-VNNI: rows one after
//! another, each super-block's 256 quants in the byte lanes of four registers.
//!
//! Batch-1 decode reads every weight once per step, so it is bound by DRAM bandwidth only when
//! the arithmetic per weight byte is small. The rows-in-lanes kernel (`lanes.rs`) transposes 16
//! rows in registers before its dots; at one token nothing amortises that work, and it ran
//! Q4_K at about half of one core's read bandwidth. Here a row is one sequential stream and a
//! super-block costs a few 64-byte loads, nibble masks, four `vpdpbusd` and a reduction.
//!
//! The float work is `kquant::dot`'s, eight lanes wide: 32-element block `j` of every
//! super-block is lane `j` of one `__m256` accumulator, which gets (Q4_K) `fma(mw_j, s_b, acc)`
//! and then `fma(L_j, dw_j · dx_b, acc)`, or (Q6_K) `fma(L_j, d · dx_b, acc)`, and `hsum`'s
//! tree ends the row, so the result is bit-identical to the scalar backend and to the other
//! kernels.
//!
//! Q4_K: the low nibbles of `qs[0..64]` are sub-blocks 0 and 2 (one per 256-bit half), the
//! high ones 1 and 3, and `qs[64..128]` likewise holds 4–7. The token's quantized activations
//! are rearranged once per call to the same order (sub-blocks 0, 2, 1, 3, 4, 6, 5, 7 of each
//! super-block), so each 64-byte activation load pairs with one nibble register.
//!
//! Q6_K: the low nibbles of `ql[0..64]` are blocks 0 and 1, the high ones 2 and 3, and
//! `ql[64..128]` holds 4–7 likewise; the two high bits come from `qh[0..32]` (blocks 0–3, two
//! bits each) and `qh[32..64]` (4–7), so the activations stay in their order. The integer dots
//! of the unsigned 6-bit quants are reduced per 16-element half, `32 · Σx` of the half is taken
//! off (`q − 32`) and the half's `i8` scale multiplied in, all in exact integers.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::super::{Activations, OutPtr, QMatrix, WeightType, QK, QK_K};
use super::super::{hsum, PREFETCH_DIST};

/// Bytes of a Q4_K super-block, and the offset of its quants.
const BLOCK: usize = 144;
const QS: usize = 16;

/// Bytes of a Q6_K super-block.
const BLOCK6: usize = 210;

/// Whether [`rows`] computes this product: one token of a Q4_K or Q6_K matrix.
pub(in crate::kernels) fn fits(ty: WeightType, n_tokens: usize) -> bool {
    matches!(ty, WeightType::Q4_K | WeightType::Q6_K) && n_tokens == 1
}

/// The sub-blocks of each super-block of `q` in the order the nibble registers hold them.
fn pair_order(q: &[i8]) -> Vec<i8> {
    const ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];
    let mut out = Vec::with_capacity(q.len());
    for sb in q.chunks_exact(QK_K) {
        for j in ORDER {
            out.extend_from_slice(&sb[QK * j..QK * (j + 1)]);
        }
    }
    out
}

/// Computes `rows` of the single token of `x` (see [`fits`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(in crate::kernels) fn rows(m: &QMatrix, x: &Activations, out: OutPtr, rows: Range<usize>) {
    assert!(fits(m.ty, x.n_tokens) && m.cols.is_multiple_of(QK_K));
    let ns = m.cols / QK_K;
    let (xd, xs) = (&x.d_row(0)[..8 * ns], &x.s_row(0)[..8 * ns]);
    let bytes = m.packed_bytes();
    let row = |r: usize| &bytes[r * m.row_bytes..(r + 1) * m.row_bytes];
    if m.ty == WeightType::Q6_K {
        assert_eq!(m.row_bytes, ns * BLOCK6);
        let xq = &x.q_row(0)[..m.cols];
        // `32 · Σx` per 16-element half.
        let corr: Vec<i32> = xq
            .chunks_exact(16)
            .map(|h| 32 * h.iter().map(|&v| v as i32).sum::<i32>())
            .collect();
        for r in rows {
            out.write(r, row_dot6(row(r), xq, xd, &corr));
        }
        return;
    }
    assert_eq!(m.row_bytes, ns * BLOCK);
    let xq = pair_order(&x.q_row(0)[..m.cols]);
    for r in rows {
        out.write(r, row_dot(row(r), &xq, xd, xs));
    }
}

/// One Q6_K row's dot product with the token (`corr`: `32 · Σx` per 16-element half).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn row_dot6(row: &[u8], xq: &[i8], xd: &[f32], corr: &[i32]) -> f32 {
    let ns = row.len() / BLOCK6;
    assert!(xq.len() >= ns * QK_K && xd.len() >= 8 * ns && corr.len() >= 16 * ns);
    let mut acc = _mm256_setzero_ps();
    for s in 0..ns {
        let blk = &row[s * BLOCK6..(s + 1) * BLOCK6];
        prefetch(blk);
        let l = int_dots6(
            blk,
            &xq[s * QK_K..(s + 1) * QK_K],
            &corr[16 * s..16 * (s + 1)],
        );
        // SAFETY: `8s + 8 <= 8·ns <= xd.len()` (asserted above); `blk[208..210]` is `d`.
        let (d8, d) = unsafe {
            let d = blk.as_ptr().add(208).cast::<u16>().read_unaligned();
            (
                _mm256_loadu_ps(xd.as_ptr().add(8 * s)),
                _mm256_cvtph_ps(_mm_set1_epi16(d as i16)),
            )
        };
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_mul_ps(d, d8), acc);
    }
    hsum(acc)
}

/// The eight 32-element blocks' integer dots `L_j = Σ_h sc_{2j+h} · Σ (q − 32)·x` (lane `j`)
/// of one Q6_K super-block with its 256 activations.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn int_dots6(blk: &[u8], xq: &[i8], corr: &[i32]) -> __m256i {
    assert!(blk.len() == BLOCK6 && xq.len() == QK_K && corr.len() == 16);
    let nib = _mm512_set1_epi8(15);
    let two = _mm512_set1_epi8(0x30);
    // SAFETY: `ql = blk[..128]`, `qh = blk[128..192]`, the scales `blk[192..208]`, `xq[..256]`
    // and `corr[..16]` are in bounds (asserted); unaligned loads.
    let (a, b, h, sc, x, c) = unsafe {
        let p = blk.as_ptr();
        let x = xq.as_ptr();
        (
            _mm512_loadu_si512(p.cast()),
            _mm512_loadu_si512(p.add(64).cast()),
            _mm512_loadu_si512(p.add(128).cast()),
            _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192).cast())),
            [0, 64, 128, 192].map(|o| _mm512_loadu_si512(x.add(o).cast())),
            _mm512_loadu_si512(corr.as_ptr().cast()),
        )
    };
    // `qh[0..32]` (blocks 0–3) and `qh[32..64]` (4–7) in both halves; the two bits of block
    // `4n + g` are bits `2g, 2g + 1` of those bytes, moved to bits 4 and 5.
    let h0 = _mm512_shuffle_i64x2::<0b01_00_01_00>(h, h);
    let h1 = _mm512_shuffle_i64x2::<0b11_10_11_10>(h, h);
    let left = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    let right = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    let low = |q, h| {
        let hb = _mm512_and_si512(_mm512_sllv_epi64(h, left), two);
        _mm512_or_si512(_mm512_and_si512(q, nib), hb)
    };
    let high = |q, h| {
        let hb = _mm512_and_si512(_mm512_srlv_epi64(h, right), two);
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(q), nib), hb)
    };
    let z = _mm512_setzero_si512();
    // Blocks 0 / 1, 2 / 3, 4 / 5 and 6 / 7; each 16-element half is four lanes.
    let v0 = _mm512_dpbusd_epi32(z, low(a, h0), x[0]);
    let v1 = _mm512_dpbusd_epi32(z, high(a, h0), x[1]);
    let v2 = _mm512_dpbusd_epi32(z, low(b, h1), x[2]);
    let v3 = _mm512_dpbusd_epi32(z, high(b, h1), x[3]);
    // Half sums: lane `4c + k` holds half `4k + c` (`c` the 128-bit chunk, `k` the vector).
    let pair = |u, v| _mm512_add_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v));
    let (p, q) = (pair(v0, v1), pair(v2, v3));
    let r = _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
    let halves = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
        r,
    );
    let scaled = _mm512_mullo_epi32(_mm512_sub_epi32(halves, c), sc);
    // Block `j` = halves `2j` and `2j + 1`.
    let both = _mm512_add_epi32(scaled, _mm512_shuffle_epi32::<0b10_11_00_01>(scaled));
    let idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, both))
}

/// One row's dot product with the token (`xq` in [`pair_order`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn row_dot(row: &[u8], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
    let ns = row.len() / BLOCK;
    assert!(xq.len() >= ns * QK_K && xd.len() >= 8 * ns && xs.len() >= 8 * ns);
    let mut acc = _mm256_setzero_ps();
    for s in 0..ns {
        let blk = &row[s * BLOCK..(s + 1) * BLOCK];
        prefetch(blk);
        let l = int_dots(blk, &xq[s * QK_K..(s + 1) * QK_K]);
        let (dw, mw) = scales(blk);
        // SAFETY: `8s + 8 <= 8·ns <= len` for both (asserted above); unaligned loads.
        let (d8, s8) = unsafe {
            (
                _mm256_loadu_ps(xd.as_ptr().add(8 * s)),
                _mm256_loadu_ps(xs.as_ptr().add(8 * s)),
            )
        };
        acc = _mm256_fmadd_ps(mw, s8, acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_mul_ps(dw, d8), acc);
    }
    hsum(acc)
}

/// Prefetches the lines `PREFETCH_DIST` bytes past the start of super-block `blk` (rows are
/// contiguous, so a thread's rows are one stream).
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch(blk: &[u8]) {
    let p = blk.as_ptr().wrapping_add(PREFETCH_DIST);
    // Prefetches never fault, so lines past the matrix's end are harmless.
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64).cast());
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128).cast());
}

/// The eight sub-blocks' integer dots `L_j` (lane `j`) of one super-block with its 256
/// activations (in [`pair_order`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn int_dots(blk: &[u8], xq: &[i8]) -> __m256i {
    assert!(blk.len() == BLOCK && xq.len() == QK_K);
    let nib = _mm512_set1_epi8(15);
    // SAFETY: `blk[QS..QS + 128]` and `xq[..256]` are in bounds (asserted); unaligned loads.
    let (a, b, x) = unsafe {
        let q = blk.as_ptr().add(QS);
        let x = xq.as_ptr();
        (
            _mm512_loadu_si512(q.cast()),
            _mm512_loadu_si512(q.add(64).cast()),
            [0, 64, 128, 192].map(|o| _mm512_loadu_si512(x.add(o).cast())),
        )
    };
    let z = _mm512_setzero_si512();
    let lo = |v| _mm512_and_si512(v, nib);
    let hi = |v| _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
    // Lanes 0–7 / 8–15: sub-blocks 0 / 2, 1 / 3, 4 / 6 and 5 / 7.
    let d0 = _mm512_dpbusd_epi32(z, lo(a), x[0]);
    let d1 = _mm512_dpbusd_epi32(z, hi(a), x[1]);
    let d2 = _mm512_dpbusd_epi32(z, lo(b), x[2]);
    let d3 = _mm512_dpbusd_epi32(z, hi(b), x[3]);
    reduce(d0, d1, d2, d3)
}

/// Sums each group of eight lanes: `d0` holds sub-blocks 0 and 2, `d1` 1 and 3, `d2` 4 and 6,
/// `d3` 5 and 7; the result holds sub-block `j` in lane `j` (integer sums, so exact).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn reduce(d0: __m512i, d1: __m512i, d2: __m512i, d3: __m512i) -> __m256i {
    // 128-bit chunks [0, 2, 1, 3] / [4, 6, 5, 7] of sub-blocks, four partial lanes each.
    let half = |a, b| {
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(a, b),
            _mm512_shuffle_i32x4::<0xDD>(a, b),
        )
    };
    let (p, q) = (half(d0, d1), half(d2, d3));
    // Chunk c: [p_c (2 partials), q_c (2 partials)].
    let t = _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
    // Chunk c: [p_c, p_c, q_c, q_c] whole.
    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b10_11_00_01>(t));
    // p's chunks are sub-blocks 0, 2, 1, 3 and q's 4, 6, 5, 7.
    let idx = _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, t))
}

/// The sub-blocks' scales `dw_j = d·sc_j` and offset weights `mw_j = −(dmin·m_j)` (lane `j`),
/// as `kquant::k45_block_scales` computes them (products of an f16 and a 6-bit integer: exact).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn scales(blk: &[u8]) -> (__m256, __m256) {
    assert!(blk.len() == BLOCK);
    // SAFETY: bytes 0..4 (d, dmin) and 4..20 are in bounds of the 144-byte block; unaligned.
    let (dm, v) = unsafe {
        let p = blk.as_ptr();
        (
            _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned())),
            _mm_loadu_si128(p.add(4).cast()),
        )
    };
    // The 12 scale bytes as u32 words u0, u1, u2: sc[0..4] = u0 & 63, m[0..4] = u1 & 63,
    // sc[4..8] = (u2 & 15) | (u0 >> 6) << 4 and m[4..8] = (u2 >> 4) | (u1 >> 6) << 4, per byte.
    let a = _mm_shuffle_epi32::<0b10_01_10_00>(v); // [u0, u2, u1, u2]
    let b = _mm_shuffle_epi32::<0b01_01_00_00>(v); // [u0, u0, u1, u1]
    let low = _mm_and_si128(
        _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
        _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f),
    );
    let high = _mm_and_si128(
        _mm_srli_epi32::<6>(b),
        _mm_setr_epi32(0, 0x03030303, 0, 0x03030303),
    );
    let sm = _mm_or_si128(low, _mm_slli_epi32::<4>(high)); // bytes: sc[0..8], m[0..8]
    let sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm));
    // [d × 8 | −dmin × 8]; −dmin·m = −(dmin·m) exactly.
    let dm = _mm_xor_ps(dm, _mm_setr_ps(0.0, -0.0, 0.0, 0.0));
    let idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let prod = _mm512_mul_ps(sm, _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(dm)));
    let dw = _mm512_castps512_ps256(prod);
    let mw = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(prod)));
    (dw, mw)
}
