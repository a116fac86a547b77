//! Reduction and store of the 512-bit token-pair accumulators of a tile, eight accumulators
//! (sixteen results) at a time.
//!
//! Every result is `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))` of its eight lanes, as in
//! `scalar::hsum`: three rounds of "pick matching lanes of two vectors, add" give the sums of
//! lane pairs, then of pairs of pairs, then the total, so the additions and their order are
//! exactly those of the reference. Doing it across eight accumulators at once, then storing
//! each token's consecutive rows with one 64- or 128-bit store, takes about a fifth of the
//! instructions of reducing every (row, token) on its own, which matters for the short rows of
//! small models (18 blocks per row in SmolLM2-135M).

use std::arch::x86_64::*;

use super::super::super::OutPtr;

/// Per 128-bit lane, `[a0 a1 b0 b1] + [a2 a3 b2 b3]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn pairs_of_lanes(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(a, b),
        _mm512_shuffle_ps::<0xEE>(a, b),
    )
}

/// `[x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3]` over 128-bit lanes `L`.
#[target_feature(enable = "avx512f")]
#[inline]
fn pairs_of_quads(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(x, y),
        _mm512_shuffle_f32x4::<0xDD>(x, y),
    )
}

/// Reduces eight accumulators `a[0..8]` (each two tokens' lanes interleaved): 128-bit lane `k`
/// of the result is `[hsum(a[2k]) of t, … of t + 1, hsum(a[2k + 1]) of t, … of t + 1]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce8(a: [__m512; 8]) -> __m512 {
    let x = pairs_of_quads(pairs_of_lanes(a[0], a[1]), pairs_of_lanes(a[2], a[3]));
    let y = pairs_of_quads(pairs_of_lanes(a[4], a[5]), pairs_of_lanes(a[6], a[7]));
    pairs_of_quads(x, y)
}

/// The integer counterpart of [`reduce8`] for the per-lane partial dots of eight blocks
/// `l[0..8]` of a token pair: lane `2j + s` of the result is block `j`'s whole dot for token
/// `t + s`, the layout of the accumulators. Integer sums are exact, so only the lanes that are
/// added matter, not the order.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn block_sums(l: &[__m512i; 8]) -> __m512i {
    let lanes = |a: __m512i, b: __m512i| {
        let (a, b) = (_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
        _mm512_add_epi32(
            _mm512_castps_si512(_mm512_shuffle_ps::<0x44>(a, b)),
            _mm512_castps_si512(_mm512_shuffle_ps::<0xEE>(a, b)),
        )
    };
    let quads = |x: __m512i, y: __m512i| {
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(x, y),
            _mm512_shuffle_i32x4::<0xDD>(x, y),
        )
    };
    let x = quads(lanes(l[0], l[1]), lanes(l[2], l[3]));
    let y = quads(lanes(l[4], l[5]), lanes(l[6], l[7]));
    quads(x, y)
}

/// Writes the tile of rows `r0..r0 + R` × tokens `t0..t0 + 2·TP` (`R` is 2 or 4 and `R·TP` a
/// multiple of 8).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn finish<const R: usize, const TP: usize>(
    acc: &[[__m512; TP]; R],
    rows: usize,
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    assert!((R == 2 || R == 4) && (R * TP).is_multiple_of(8));
    // Pairs covered by one group of eight accumulators.
    let gp = 8 / R;
    let mut v = [0f32; 16];
    for g in 0..TP / gp {
        let mut a = [_mm512_setzero_ps(); 8];
        for i in 0..gp {
            for r in 0..R {
                a[i * R + r] = acc[r][g * gp + i];
            }
        }
        let s = reduce8(a);
        if R == 2 {
            // Lane k: [r0 t, r0 t+1, r1 t, r1 t+1] of pair g·gp + k → [r0 t, r1 t, r0 t+1, r1 t+1].
            let s = _mm512_permute_ps::<0xD8>(s);
            // SAFETY: room for 16 f32s; unaligned store.
            unsafe { _mm512_storeu_ps(v.as_mut_ptr(), s) };
            for k in 0..4 {
                let t = t0 + 2 * (g * gp + k);
                out.write_n(t * rows + r0, [v[4 * k], v[4 * k + 1]]);
                out.write_n((t + 1) * rows + r0, [v[4 * k + 2], v[4 * k + 3]]);
            }
        } else {
            // Lanes 2k, 2k + 1: [r0 t, r0 t+1, r1 t, r1 t+1], [r2 t, …] of pair g·gp + k → the
            // four rows of token t, then of token t + 1.
            let idx = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            let s = _mm512_permutexvar_ps(idx, s);
            // SAFETY: room for 16 f32s; unaligned store.
            unsafe { _mm512_storeu_ps(v.as_mut_ptr(), s) };
            for k in 0..2 {
                let t = t0 + 2 * (g * gp + k);
                let q = |i: usize| [v[i], v[i + 1], v[i + 2], v[i + 3]];
                out.write_n(t * rows + r0, q(8 * k));
                out.write_n((t + 1) * rows + r0, q(8 * k + 4));
            }
        }
    }
}
